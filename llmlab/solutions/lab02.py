"""Lab 02 reference answers (the arithmetic intensity of a decode step, the batch at which it reaches the ridge
point) and the checks the notebook runs on the student's versions, which name the common mistakes."""

from __future__ import annotations

import math
import numbers

from llmlab.measure import roofline
from llmlab.config import PRESETS, ModelConfig
from llmlab.solutions.lab00 import call_answer, check_cases, close


def decode_intensity(config: ModelConfig, batch: int, context_len: float, bytes_per_param: float = 2,
                     kv_bytes_per_elem: float = 2) -> float:
    """FLOP per byte of one decode step (batch sequences, each attending to context_len cached tokens).

    FLOPs: batch x (2 x matmul weights + 4 x layers x heads x head_dim x context_len).
    Bytes: the weights once (every parameter but an untied input embedding) + batch x context_len x
    (2 x layers x KV heads x head_dim x kv_bytes_per_elem).
    """
    matmul = (config.n_layers * (config.dim * config.n_heads * config.head_dim
                                 + 2 * config.dim * config.n_kv_heads * config.head_dim
                                 + config.n_heads * config.head_dim * config.dim
                                 + 3 * config.dim * config.intermediate_size)
              + config.vocab_size * config.dim)
    flops = batch * (2 * matmul + 4 * config.n_layers * config.n_heads * config.head_dim * context_len)
    weights = config.num_params(include_embedding=config.tie_embeddings) * bytes_per_param
    kv = batch * context_len * 2 * config.n_layers * config.n_kv_heads * config.head_dim * kv_bytes_per_elem
    return flops / (weights + kv)


def critical_batch(config: ModelConfig, ridge_flop_per_byte: float, context_len: float, bytes_per_param: float = 2,
                   kv_bytes_per_elem: float = 2, max_batch: int = 1 << 16) -> int | None:
    """The smallest batch whose decode step reaches the ridge point (is compute-bound), or None if none up to
    max_batch does — at long contexts the KV cache, read once per sequence, grows with the batch as fast as the
    FLOPs do, so the intensity levels off below the ridge."""
    for b in range(1, max_batch + 1):
        if decode_intensity(config, b, context_len, bytes_per_param, kv_bytes_per_elem) >= ridge_flop_per_byte:
            return b
    return None


# -- checks -------------------------------------------------------------------------------------------------------


def _intensity(c: ModelConfig, batch: int, ctx: float, bpp: float, *, flop_weights: str = "matmul",
               attention: str = "heads", batch_flops: bool = True, embedding: bool | None = None,
               weights_per_seq: bool = False, kv_heads: str = "kv", kv_factor: int = 2, kv_elem: str = "bf16",
               kv_per_seq: bool = True) -> float:
    """decode_intensity with one mistake switched on (the keyword that differs from its default)."""
    weights = {"matmul": roofline.matmul_params(c), "read": roofline.weight_params_read(c),
               "all": c.num_params(include_embedding=True)}[flop_weights]
    att_heads = {"heads": c.n_heads, "kv": c.n_kv_heads, "none": 0}[attention]
    flops = (batch if batch_flops else 1) * (2 * weights + 4 * c.n_layers * att_heads * c.head_dim * ctx)
    include = c.tie_embeddings if embedding is None else embedding
    weight_bytes = c.num_params(include_embedding=include) * bpp * (batch if weights_per_seq else 1)
    heads = c.n_kv_heads if kv_heads == "kv" else c.n_heads
    elem = 2 if kv_elem == "bf16" else bpp
    kv = (batch if kv_per_seq else 1) * ctx * kv_factor * c.n_layers * heads * c.head_dim * elem
    return flops / (weight_bytes + kv)


# (the reference with one mistake, what it misses), tried in order when an answer differs from the reference
_INTENSITY_MISTAKES: tuple[tuple[dict, str], ...] = (
    (dict(flop_weights="read"),
     "FLOPs: count 2 per weight of a MATRIX MULTIPLY only (q, k, v, o, gate, up, down and the lm_head): the norm "
     "weights and biases are read, but each is used once per token, not multiplied against a whole input vector"),
    (dict(flop_weights="all"),
     "FLOPs: the embedding lookup multiplies nothing; count 2 per weight of the matrix multiplies (q, k, v, o, "
     "gate, up, down and the lm_head)"),
    (dict(attention="none"),
     "FLOPs: add attention over the cached tokens, 4 x layers x heads x head_dim x context_len per token (q.K and "
     "the weighted sum of V, 2 FLOPs each per element)"),
    (dict(attention="kv"),
     "FLOPs: every QUERY head attends to the cache: 4 x layers x config.n_heads (not n_kv_heads) x head_dim x "
     "context_len per token"),
    (dict(batch_flops=False),
     "FLOPs: every sequence of the batch does its own matmuls and attention: multiply the FLOPs per token by the "
     "batch"),
    (dict(embedding=True),
     "bytes: an untied model's input embedding table is only looked up (one row per token), not read whole: "
     "count config.num_params(include_embedding=config.tie_embeddings) weights"),
    (dict(embedding=False),
     "bytes: this model's embedding is tied to the lm_head, which reads all of it every step: count "
     "config.num_params(include_embedding=config.tie_embeddings) weights"),
    (dict(weights_per_seq=True),
     "bytes: the weights are read ONCE per step, shared by the whole batch (that is why batching raises the "
     "intensity)"),
    (dict(kv_heads="heads"),
     "bytes: the KV cache holds a key and a value vector per KV HEAD (config.n_kv_heads), not per query head"),
    (dict(kv_factor=1),
     "bytes: the KV cache holds a key AND a value per layer and KV head: 2 x layers x KV heads x head_dim x 2 "
     "bytes per token"),
    (dict(kv_elem="weights"),
     "bytes: the KV cache stays bf16 (2 bytes per element) whatever bytes_per_param the weights have"),
    (dict(kv_per_seq=False),
     "bytes: every sequence reads its own KV cache: batch x context_len x KV bytes per token"),
)

# (preset, batch, context_len): a tied and an untied model, empty and long caches, batches, a bias-carrying model
_CASES = [("llama-3.2-1b", 1, 0), ("llama-3.1-8b", 1, 0), ("llama-3.2-1b", 16, 1024), ("llama-3.1-8b", 64, 4096),
          ("qwen2.5-0.5b", 8, 300), ("llama-2-7b", 4, 2048)]


def check_decode_intensity(fn) -> None:
    """Compare `fn(config, batch, context_len, bytes_per_param)` with llmlab.measure.roofline.arithmetic_intensity
    on tied and untied presets, empty and long caches, batches 1-64, bf16 and int4 weights, to a relative 1e-6.

    Raises:
        AssertionError: the first case that disagrees, with the expected FLOP/byte and, where the answer matches a
            common mistake (norm or embedding weights counted as FLOPs, attention left out or counted per KV head,
            FLOPs not multiplied by the batch, the embedding rule, weights read per sequence, query heads for KV
            heads, K without V, the cache in the weights' format, one cache for the batch), what it misses. A stub
            still raising NotImplementedError is reported as not written.
    """
    names, cases = {}, []
    for name, batch, ctx in _CASES:
        cfg = ModelConfig.from_preset(name)
        names[id(cfg)] = name
        cases += [(cfg, batch, ctx, bpp) for bpp in (2, 0.5)]

    def describe(case, want, got):
        cfg, batch, ctx, bpp = case
        what = (f"{names[id(cfg)]} ({'tied' if cfg.tie_embeddings else 'untied'} embedding, {cfg.n_kv_heads} KV heads "
                f"of {cfg.n_heads}), batch {batch}, context {ctx}, {bpp} bytes/weight: expected {want!r} FLOP/byte, "
                f"got {got!r}")
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            return f"{what}; return FLOPs / bytes (a number)"
        return f"{what} ({(got - want) / want:+.2e} relative)"

    mistakes = [(lambda c, b, ctx, bpp, kw=kw: _intensity(c, b, ctx, bpp, **kw), why)
                for kw, why in _INTENSITY_MISTAKES]
    check_cases("decode_intensity", fn, cases, roofline.arithmetic_intensity, mistakes, describe, close,
                otherwise="a small miss is not rounding: FLOPs = batch x (2 x the weights of every matrix multiply + "
                          "4 x layers x heads x head_dim x context_len); bytes = every weight read once + each "
                          "sequence's bf16 KV cache")


def _level(cfg: ModelConfig, ctx: float) -> float:
    """The intensity a decode step approaches as the batch grows: FLOPs per sequence / KV bytes per sequence (inf
    for an empty cache)."""
    kv = roofline.kv_cache_bytes(cfg, 1, ctx)
    flops = 2 * roofline.matmul_params(cfg) + roofline.attention_flops_per_token(cfg, ctx)
    return flops / kv if kv else math.inf


def _critical(cfg: ModelConfig, ridge: float, ctx: float, limit: int = 1 << 16) -> int | None:
    """critical_batch by search; None at once when the intensity levels off at or below the ridge."""
    if _level(cfg, ctx) <= ridge:
        return None
    return next((b for b in range(1, limit + 1) if roofline.arithmetic_intensity(cfg, b, ctx) >= ridge), None)


def check_critical_batch(fn) -> None:
    """Compare `fn(config, ridge, context_len)` with a search over llmlab.measure.roofline's intensity: the H200's
    datasheet ridge (~206 FLOP/byte) at short and long contexts (where no batch reaches it: the answer is None),
    and a CPU-like ridge of 8.

    Raises:
        AssertionError: the first case that disagrees, saying whether the answer is one off (the last batch below
            the ridge, or one past the first at it), a batch where None was due, or None where a batch exists.
    """
    h200 = roofline.ridge_point(989, 4800)  # H200 datasheet, ~206 FLOP/byte
    for name, ridge, ctx in (("llama-3.2-1b", h200, 0), ("llama-3.1-8b", h200, 128), ("llama-3.1-8b", h200, 2048),
                             ("qwen2.5-0.5b", h200, 128), ("llama-2-7b", h200, 128), ("smollm2-135m", 8.0, 1024)):
        cfg = ModelConfig.from_preset(name)
        want = _critical(cfg, ridge, ctx)
        got = call_answer(fn, "critical_batch", cfg, ridge, ctx)
        if got == want:
            continue
        what = f"{name} ({cfg.n_kv_heads} KV heads of {cfg.n_heads}), ridge {ridge:.1f} FLOP/byte, context {ctx}"
        if want is None:
            level = _level(cfg, ctx)
            raise AssertionError(
                f"{what}: expected None, got {got!r}. Every sequence brings its own KV cache, so as the batch grows "
                f"the intensity levels off at (FLOPs per sequence) / (KV bytes per sequence) = {level:.1f} FLOP/byte, "
                f"below the ridge: no batch reaches it, return None (stop the search at a bound)")
        at = roofline.arithmetic_intensity(cfg, want, ctx)
        if got is None:
            raise AssertionError(f"{what}: expected batch {want} (intensity {at:.2f} >= {ridge:.2f}), got None: search "
                                 f"further (batches up to a few thousand)")
        if got == want - 1:
            raise AssertionError(f"{what}: expected {want}, got {got}, one short: batch {got} has intensity "
                                 f"{roofline.arithmetic_intensity(cfg, got, ctx):.2f}, still below the ridge; return "
                                 f"the smallest batch whose intensity is >= the ridge")
        if got == want + 1:
            raise AssertionError(f"{what}: expected {want}, got {got}, one past: batch {want} already has intensity "
                                 f"{at:.2f} >= the ridge")
        raise AssertionError(f"{what}: expected batch {want} (intensity {at:.2f} >= the ridge), got {got!r}")


def preset_names() -> list[str]:
    return sorted(PRESETS)
