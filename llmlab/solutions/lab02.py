"""Lab 02 reference answers and the checks the notebook runs on the student's versions."""

from __future__ import annotations

import math

from llmlab.measure import roofline
from llmlab.config import PRESETS, ModelConfig


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

_CASES = [("llama-3.2-1b", 1, 0), ("llama-3.2-1b", 16, 1024), ("llama-3.1-8b", 64, 4096), ("qwen2.5-0.5b", 8, 300)]


def check_decode_intensity(fn) -> None:
    """Compare `fn(config, batch, context_len, bytes_per_param)` with llmlab.measure.roofline on a few presets."""
    for name, batch, ctx in _CASES:
        cfg = ModelConfig.from_preset(name)
        for bpp in (2, 0.5):
            want = roofline.arithmetic_intensity(cfg, batch, ctx, bpp)
            got = fn(cfg, batch, ctx, bpp)
            off = "" if got is None or not want else f" ({(got - want) / want:+.2e} relative)"
            assert got is not None and math.isclose(got, want, rel_tol=1e-6), (
                f"{name}, batch {batch}, context {ctx}, {bpp} bytes/weight: expected {want!r} FLOP/byte, "
                f"got {got!r}{off}. A small miss is not rounding: count 2 FLOPs per token for each weight of a matrix multiply (q, k, v, o, "
                f"gate, up, down, lm_head: not the norm weights, biases or the embedding lookup) plus attention over "
                f"the cached tokens; bytes: every weight read once, plus each sequence's KV cache")


def check_critical_batch(fn) -> None:
    """Compare `fn(config, ridge, context_len)` with a brute-force search over llmlab.measure.roofline."""
    ridge = roofline.ridge_point(989, 4800)  # H200 datasheet, ~206 FLOP/byte
    for name, ctx in (("llama-3.2-1b", 0), ("llama-3.1-8b", 128), ("llama-3.1-8b", 2048)):
        cfg = ModelConfig.from_preset(name)
        want = None
        for b in range(1, 1 << 12):
            if roofline.arithmetic_intensity(cfg, b, ctx) >= ridge:
                want = b
                break
        got = fn(cfg, ridge, ctx)
        assert got == want, f"{name} at context {ctx}: expected {want}, got {got}"


def preset_names() -> list[str]:
    return sorted(PRESETS)
