"""Lab 01: the reference tokens/s ceiling of a decode from the bytes it must read per step, and the check the notebook
runs on the student's version (`check_tokens_per_s_ceiling`), which names the common mistakes."""

from __future__ import annotations

import numbers
from typing import Callable

from llmlab.config import ModelConfig
from llmlab.measure import roofline
from llmlab.solutions.lab00 import check_cases, close

__all__ = ["tokens_per_s_ceiling", "check_tokens_per_s_ceiling"]


def tokens_per_s_ceiling(config: ModelConfig, bandwidth_gb_s: float, bytes_per_param: float = 2,
                         context_len: float = 0, batch: int = 1, kv_bytes_per_elem: float = 2) -> float:
    """The fastest a decode can go if every step must read all weights once plus each sequence's KV cache.

    bytes per step = weights read (every parameter except an untied model's input embedding table, which is only
    looked up; a tied matrix counts once, for the lm_head) x bytes_per_param
                   + batch x context_len x (2 x layers x KV heads x head_dim x kv_bytes_per_elem)
    tokens/s = batch x bandwidth / bytes per step, bandwidth in GB/s (1e9 bytes/s).
    """
    weights = config.num_params(include_embedding=config.tie_embeddings) * bytes_per_param
    kv_per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim * kv_bytes_per_elem
    step_bytes = weights + batch * context_len * kv_per_token
    return batch * bandwidth_gb_s * 1e9 / step_bytes


def _ceiling(c: ModelConfig, bw: float, bpp: float, ctx: float, batch: int, kv_elem: float, *,
             embedding: bool | None = None, kv_heads: int | None = None, kv_factor: int = 2, kv_per_seq: bool = True,
             per_seq_tokens: bool = True, weights_per_seq: bool = False, giga: float = 1e9) -> float:
    """tokens_per_s_ceiling with one mistake switched on (the keyword that differs from its default)."""
    include = c.tie_embeddings if embedding is None else embedding
    weights = c.num_params(include_embedding=include) * bpp * (batch if weights_per_seq else 1)
    kv_per_token = kv_factor * c.n_layers * (kv_heads or c.n_kv_heads) * c.head_dim * kv_elem
    kv = kv_per_token * ctx * (batch if kv_per_seq else 1)
    return (batch if per_seq_tokens else 1) * bw * giga / (weights + kv)


_KV_ELEM = ("the KV cache's element size is kv_bytes_per_elem (2 for a bf16 cache, 1 for int8 or fp8), not a fixed 2 "
            "or the weights' bytes_per_param")

# (the reference with one mistake, what it misses), tried in order when an answer differs from the reference
_MISTAKES: tuple[tuple[Callable[..., float], str], ...] = (
    (lambda *a: _ceiling(*a, embedding=True),
     "you counted the input embedding table of an untied model: a step only looks up one row of it per token, so "
     "it is not read whole (num_params(include_embedding=config.tie_embeddings))"),
    (lambda *a: _ceiling(*a, embedding=False),
     "this model's embedding is tied to the output layer (config.tie_embeddings): the lm_head reads the whole "
     "matrix every step, so count it (num_params(include_embedding=config.tie_embeddings))"),
    (lambda *a: _ceiling(*a, giga=2 ** 30),
     "GB/s means 1e9 bytes per second, not 2**30"),
    (lambda c, bw, bpp, *a: _ceiling(c, bw, 2, *a),
     "use bytes_per_param for the weights (1 for int8, 0.5 for int4), not a fixed 2"),
    (lambda c, bw, bpp, ctx, b, kv: _ceiling(c, bw, bpp, ctx, b, bpp), _KV_ELEM),
    (lambda c, bw, bpp, ctx, b, kv: _ceiling(c, bw, bpp, ctx, b, 2), _KV_ELEM),
    (lambda c, *a: _ceiling(c, *a, kv_heads=c.n_heads),
     "a token's KV cache holds a key and a value vector per KV HEAD (config.n_kv_heads), not per query head "
     "(config.n_heads): grouped-query attention shares each KV head among several query heads"),
    (lambda *a: _ceiling(*a, kv_factor=1),
     "a token's KV cache holds a key AND a value vector per layer and KV head: 2 x layers x KV heads x head_dim x "
     "bytes per element"),
    (lambda *a: _ceiling(*a, kv_per_seq=False),
     "every sequence of the batch has its own KV cache, read every step: batch x context_len x KV bytes per token"),
    (lambda *a: _ceiling(*a, per_seq_tokens=False),
     "a step makes one token for EACH sequence of the batch: tokens/s = batch x bandwidth / bytes per step"),
    (lambda *a: _ceiling(*a, weights_per_seq=True),
     "the weights are read once per step and shared by the whole batch: do not multiply them by the batch"),
)

# (preset, bandwidth GB/s, bytes_per_param, context_len, batch, kv_bytes_per_elem): weights alone first (untied
# and tied), then the KV cache, then batches; a fractional context as the notebook passes (a decode's mean)
_CASES = (("llama-3.1-8b", 4185, 2, 0, 1, 2), ("llama-3.2-1b", 4185, 2, 0, 1, 2), ("qwen2.5-0.5b", 3350, 1, 0, 1, 2),
          ("llama-3.1-8b", 4185, 0.5, 0, 1, 2), ("llama-3.2-1b", 4185, 2, 192, 1, 2),
          ("llama-3.1-8b", 4185, 2, 4096, 1, 1), ("llama-2-7b", 2039, 2, 1000.5, 1, 2),
          ("llama-3.2-1b", 4185, 2, 2048, 64, 2), ("llama-3.1-8b", 4185, 1, 192, 8, 2),
          ("qwen2.5-0.5b", 4185, 2, 2048, 64, 1))


def _roofline(c: ModelConfig, bw: float, bpp: float, ctx: float, batch: int, kv: float) -> float:
    return roofline.roofline_tokens_per_s(c, bw, batch=batch, context_len=ctx, weight_bytes_per_param=bpp,
                                          kv_bytes_per_elem=kv)


def check_tokens_per_s_ceiling(fn: Callable[..., float]) -> None:
    """Compare `fn(config, bandwidth_gb_s, bytes_per_param=, context_len=, batch=, kv_bytes_per_elem=)` (keywords, as
    the notebook calls it) with llmlab.measure.roofline.roofline_tokens_per_s on untied and tied models, int8 / int4
    weights, long contexts, an int8 cache and batches, to a relative 1e-6.

    Raises:
        AssertionError: the first case that disagrees, with the expected tokens/s and, where the answer matches a
            common mistake (the embedding rule, GiB for GB, a fixed or borrowed element size, query heads for KV
            heads, K without V, one cache for the batch, tokens not multiplied by the batch, weights read per
            sequence), what it misses. A stub still raising NotImplementedError is reported as not written.
    """
    names = {}
    cases = []
    for name, *rest in _CASES:
        c = ModelConfig.from_preset(name)
        names[id(c)] = name
        cases.append((c, *rest))

    def call(f, case):
        c, bw, bpp, ctx, batch, kv = case
        return f(c, bw, bytes_per_param=bpp, context_len=ctx, batch=batch, kv_bytes_per_elem=kv)

    def describe(case, want, got):
        c, bw, bpp, ctx, batch, kv = case
        what = (f"{names[id(c)]} ({'tied' if c.tie_embeddings else 'untied'} embedding, {c.n_kv_heads} KV heads of "
                f"{c.n_heads}) at {bw} GB/s, {bpp} bytes/param, context {ctx}, batch {batch}, {kv} bytes per KV "
                f"element: expected {want:.6g} tokens/s, got {got!r}")
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            return f"{what}; return the tokens/s (a number)"
        return f"{what} ({(got - want) / want:+.2%})"

    check_cases("tokens_per_s_ceiling", fn, cases, _roofline, _MISTAKES, describe, close, call,
                otherwise="bytes per step = weights read x bytes_per_param + batch x context_len x KV bytes per "
                          "token, and tokens/s = batch x bandwidth x 1e9 / bytes per step")
