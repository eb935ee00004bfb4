"""One decode step's RoPE, KV-cache write and attention on a static cache, in the attention's own launch.

The decode step's attention used to take two launches before its merge: `rope_cache.py` (rotate q and k, write k
and v into the cache) and the split kernel (`split_attention.py`). At a chat turn's short context each launch costs
a few microseconds of ramp and drain, about what the attention's K/V reads take. Here the split kernel does RoPE's
work itself (its ROPE meta-parameter):

    every program     rotates the n_rep q heads it attends with (a few hundred values: cheaper than a launch)
    every program     takes the new token's key (rotated) and value from the projection, not from the cache
    one program       (the split that holds the new slot) writes that key and value into the cache

So nothing before the attention writes the cache any more, and each program may read its first cached K/V tile
before it waits for the q/k/v projection (`decode_attention`'s prefetch_kv). The angles are RoPE's from the
inverse frequencies (`rope_cache.rope_angles`, as `RotaryEmbedding` computes them); the new token's position is
its cache slot, seq_lens - 1, as in the static cache (`llmlab.cache.static_cache`).
"""

from __future__ import annotations

import math

import torch

from ._util import check_flag, check_tensors
from .decode_attention import DTYPES, _check_split_config, _decode, decode_attention_reference
from .rope_cache import rope_and_cache_reference


def rope_cache_attention_reference(qkv: torch.Tensor, inv_freq: torch.Tensor, seq_lens: torch.Tensor,
                                   k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The ops one at a time: cos/sin as `RotaryEmbedding` computes them, RoPE and the cache write
    (`rope_and_cache_reference`, which rotates qkv's q heads in place and writes the caches), then SDPA over each
    row's filled slots (`decode_attention_reference`). Shapes as `rope_cache_attention`; returns (B, H, hd)."""
    B, _, hd = qkv.shape
    pos = seq_lens.long() - 1
    angles = pos.float()[:, None] * inv_freq  # (B, hd/2)
    angles = torch.cat([angles, angles], dim=-1)
    rope_and_cache_reference(qkv, angles.cos().to(qkv.dtype), angles.sin().to(qkv.dtype), pos, k_cache, v_cache,
                             n_heads)
    return decode_attention_reference(qkv[:, :n_heads], k_cache, v_cache, seq_lens)


def rope_cache_attention(qkv: torch.Tensor, inv_freq: torch.Tensor, seq_lens: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, n_heads: int, config=None, trigger_next: bool = False,
                         prefetch_kv: bool = True) -> torch.Tensor:
    """RoPE, the new token's K/V write and GQA decode attention over a static cache, flash-decoding style, in the
    attention's launch (plus the merge's, where the split config has one).

    Args:
        qkv: (B, H + 2 * Hkv, hd) the new token's fused q/k/v projection per row (q heads, k heads, v heads), not
            yet rotated; last dimension contiguous. Not modified.
        inv_freq: (hd/2,) fp32 RoPE inverse frequencies (`RotaryEmbedding.inv_freq`) on qkv's device.
        seq_lens: (B,) int32/int64 on the device: row b's new token sits at slot (and position) seq_lens[b] - 1
            and attends to slots 0..seq_lens[b] - 1; each in 1..S. Not checked on the device (as
            `decode_attention(check_lens=False)`: the caller checks positions on the host).
        k_cache, v_cache: (B, Hkv, S, hd) one layer of a static cache, last dimension contiguous, qkv's dtype.
            Slot seq_lens[b] - 1 of each row is written.
        n_heads: H, the query heads (a multiple of Hkv).
        config, trigger_next: as `decode_attention`.
        prefetch_kv: with PDL, each program reads its first cached K/V tile before it waits for the kernel before
            (nothing before this launch writes the cache). False waits first.

    Returns:
        (B, H, hd) in qkv's dtype.

    Raises:
        ValueError: shapes that do not fit together, an odd hd, a non-contiguous last dimension, inv_freq not a
            (hd/2,) fp32 tensor on qkv's device, seq_lens not a (B,) int tensor there.
        TypeError: unsupported or mismatched dtypes; a config that is not a split config; flags not True/False.
    """
    check_tensors("rope_cache_attention", DTYPES, qkv=qkv, k_cache=k_cache, v_cache=v_cache)
    if not qkv.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(f"rope_cache_attention: qkv and the caches must share one dtype, got {qkv.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if qkv.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"rope_cache_attention: qkv must be (B, H + 2*Hkv, hd) and the caches (B, Hkv, S, hd), got "
                         f"{tuple(qkv.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, heads, hd = qkv.shape
    Hkv = k_cache.shape[1]
    if (heads != n_heads + 2 * Hkv or n_heads < 1 or n_heads % Hkv or k_cache.shape[0] != B
            or k_cache.shape[3] != hd or hd % 2 or k_cache.shape[2] < 1):
        raise ValueError(f"rope_cache_attention: qkv {tuple(qkv.shape)} does not hold {n_heads} q heads + 2 x {Hkv} "
                         f"k/v heads of the cache {tuple(k_cache.shape)} (H a multiple of Hkv, hd even, S >= 1)")
    if (not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float32 or inv_freq.device != qkv.device
            or inv_freq.shape != (hd // 2,)):
        raise ValueError(f"rope_cache_attention: inv_freq must be a ({hd // 2},) fp32 tensor on {qkv.device} "
                         f"(RotaryEmbedding.inv_freq), got {getattr(inv_freq, 'shape', inv_freq)!r}")
    if (not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != (B,) or seq_lens.device != qkv.device
            or seq_lens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"rope_cache_attention: seq_lens must be a ({B},) int32/int64 tensor on {qkv.device}, got "
                         f"{getattr(seq_lens, 'shape', seq_lens)!r}")
    for name, t in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_cache_attention: {name}'s last dimension must be contiguous, strides "
                             f"{t.stride()}")
    if config is not None:
        _check_split_config(config)
    return _decode(qkv[:, :n_heads], k_cache, v_cache, seq_lens.contiguous(), 1.0 / math.sqrt(hd), config=config,
                   trigger_next=check_flag("rope_cache_attention", "trigger_next", trigger_next),
                   prefetch_kv=check_flag("rope_cache_attention", "prefetch_kv", prefetch_kv),
                   rope_freq=inv_freq.contiguous())
