"""Decode attention for grouped-query attention over a contiguous KV cache, flash-decoding style.

At decode time each sequence has ONE new query token per head, but thousands of cached keys. One program per
(sequence, head) would leave most of a GPU's SMs idle at batch 1, so the sequence is split across programs
(Dao et al., "Flash-Decoding for long-context inference", 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html):

    1. `_decode_split_kernel`, grid (B * Hkv, num_splits): each program reads the K/V of one KV head for one slice
       of the sequence, ONCE, for all n_rep query heads that share it (GQA, Ainslie et al. 2023,
       https://arxiv.org/abs/2305.13245), and writes a partial output normalized by its own softmax sum plus the
       log-sum-exp of its scores;
    2. `_decode_merge_kernel`, grid (B * H,): rescales the partials by exp(lse_s - max lse) and sums them.

Cache layout: (B, Hkv, S, hd), as `llmlab.kv_cache.KVCache` (any strides with a contiguous last dimension, so the
cache's `[:B, :, :end]` views go in without a copy).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._util import autotune_configs, check_tensors, interpret_mode

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over repeat_kv'd K/V, one sequence at a time (each attends to its first seq_lens[b] tokens).

    q: (B, H, hd); k, v: (B, Hkv, S, hd) -> (B, H, hd). Bytes: the kernel reads K and V once (2 x B x Hkv x S x hd x
    elem); eager PyTorch's repeat_kv first copies them n_rep times (write + read of H/Hkv times as many bytes).
    """
    from llmlab.model import repeat_kv

    B, H, hd = q.shape
    n_rep = H // k.shape[1]
    outs = []
    for b in range(B):
        S = k.shape[2] if seq_lens is None else int(seq_lens[b])
        kb, vb = repeat_kv(k[b:b + 1, :, :S], n_rep), repeat_kv(v[b:b + 1, :, :S], n_rep)  # (1, H, S, hd)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[b:b + 1, :, None], kb, vb)[:, :, 0])
    return torch.cat(outs)  # (B, H, hd)


# Autotuned per (cache length bucket, head_dim): the K/V tile length and the pipelining. S_BUCKET (S rounded up to
# a power of 2) is the key, so a cache that grows by one token per step is not re-tuned every step. One config in
# the interpreter (see `autotune_configs`). The split count is not tuned: it sets the grid, chosen in the wrapper to fill the GPU.
_ATTN_CONFIGS = autotune_configs([triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                                  for n, w, st in ((32, 4, 3), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 8, 3),
                                                   (128, 4, 2))],
                                 default=triton.Config({"BLOCK_N": 32}))


@triton.autotune(configs=_ATTN_CONFIGS, key=["S_BUCKET", "HD", "N_REP"])
@triton.jit
def _decode_split_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, lse_ptr,
    # sizes
    Hkv, N_REP, HD, S, S_BUCKET, scale,
    # strides (elements)
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    # meta-parameters
    HAS_LENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // Hkv
    kvh = pid % Hkv
    split = tl.program_id(1)
    if HAS_LENS:
        seq_len = tl.load(lens_ptr + b)
    else:  # every sequence attends to all S slots
        seq_len = S
    # whole BLOCK_N tiles per split; with the rounding, the last splits may be empty (they weigh 0 in the merge)
    split_size = tl.cdiv(tl.cdiv(S, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)

    hi = tl.arange(0, BLOCK_H)
    heads = kvh * N_REP + hi  # the query heads that read this KV head
    hmask = hi < N_REP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HD
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)  # (BLOCK_H, BLOCK_D)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + n[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))  # (BLOCK_H, BLOCK_N); masked keys weigh 0
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0  # an empty split (past this sequence's end) writes o = 0, lse = -inf: it weighs 0 in the merge
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], o,
             mask=hmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(
    # pointers
    o_ptr, lse_ptr, out_ptr,
    # sizes
    H, HD, num_splits,
    # strides (elements)
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    # meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    dmask = d < HD
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))  # split 0 is never empty, so the max is finite; -inf -> weight 0
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


PROGRAMS_PER_SM = 4  # enough (sequence, KV head, split) programs in flight to keep every SM's loads going


def _default_splits(B: int, Hkv: int, S: int) -> int:
    """Splits along S so that B x Hkv x splits ~ PROGRAMS_PER_SM x SMs; at least 32 keys per split, at most 256."""
    if interpret_mode() or not torch.cuda.is_available():
        return min(4, triton.cdiv(S, 32))
    sms = _sm_count(torch.cuda.current_device())
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, B * Hkv), triton.cdiv(S, 32), 256))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None,
                     scale: float | None = None, num_splits: int | None = None,
                     check_lens: bool = True) -> torch.Tensor:
    """One decode step of GQA attention, flash-decoding style (split over the sequence, merged by log-sum-exp).

    Args:
        q: (B, H, hd) or (B, H, 1, hd), the new token's queries (after RoPE).
        k, v: (B, Hkv, S, hd) cache views, H % Hkv == 0; last dimension contiguous; same dtype as q.
        seq_lens: optional (B,) int tensor on q's device: sequence b attends to k[b, :, :seq_lens[b]]; each in
            1..S. Default: all S tokens.
        scale: softmax scale, default 1/sqrt(hd) (as SDPA).
        num_splits: programs per (sequence, KV head) along S; default fills the GPU.
        check_lens: read seq_lens on the host to check they lie in 1..S (a GPU -> CPU sync; skipped during CUDA
            graph capture). The model's decode step passes False: its lengths come from the cache positions.

    Returns:
        (B, H, hd) or (B, H, 1, hd) like q, in q's dtype.

    Raises:
        ValueError: shape mismatches, H not a multiple of Hkv, S == 0, seq_lens out of 1..S, a non-contiguous
            last dimension. TypeError: unsupported or mismatched dtypes.
    """
    check_tensors("decode_attention", DTYPES, q=q, k=k, v=v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"decode_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    q_shape = q.shape
    if q.dim() == 4:
        if q.shape[2] != 1:
            raise ValueError(f"decode_attention: one query token per sequence (decode), got q {tuple(q.shape)}; "
                             f"use scaled_dot_product_attention for prefill")
        q = q[:, :, 0]
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"decode_attention: q must be (B, H, hd), k and v (B, Hkv, S, hd); got "
                         f"{tuple(q_shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, hd = q.shape
    _, Hkv, S, _ = k.shape
    if k.shape[0] != B or k.shape[3] != hd:
        raise ValueError(f"decode_attention: k/v {tuple(k.shape)} do not match q {tuple(q_shape)} in B or hd")
    if H % Hkv:
        raise ValueError(f"decode_attention: {H} query heads are not a multiple of {Hkv} KV heads")
    if S == 0:
        raise ValueError("decode_attention: the KV cache is empty (S = 0)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name}'s last dimension must be contiguous, strides {t.stride()}")
    if seq_lens is not None:
        if seq_lens.shape != (B,) or seq_lens.device != q.device or seq_lens.is_floating_point():
            raise ValueError(f"decode_attention: seq_lens must be a ({B},) int tensor on {q.device}")
        capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if check_lens and not capturing and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > S):
            raise ValueError(f"decode_attention: seq_lens must lie in 1..{S}, got {seq_lens.tolist()}")
        if seq_lens.dtype not in (torch.int32, torch.int64):
            seq_lens = seq_lens.to(torch.int32)
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)

    BLOCK_D = max(16, triton.next_power_of_2(hd))
    n_rep = H // Hkv
    BLOCK_H = max(16, triton.next_power_of_2(n_rep))  # tl.dot needs >= 16 rows; the padding rows are masked
    splits = max(1, min(num_splits or _default_splits(B, Hkv, S), S))

    o_part = torch.empty(B, H, splits, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B * Hkv, splits)](
        q, k, v, q if seq_lens is None else seq_lens, o_part, lse,  # no lengths: q stands in, never read
        Hkv, n_rep, hd, S, triton.next_power_of_2(S), scale,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1),
        HAS_LENS=seq_lens is not None, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, IEEE=q.dtype == torch.float32,
    )
    return merge_splits(o_part, lse, q.dtype).view(q_shape)


def merge_splits(o_part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Combine the splits' partial outputs (B, H, splits, hd) fp32 and log-sum-exps (B, H, splits) fp32 into the
    attention output (B, H, hd) in `dtype` (one launch). Shared with the paged kernel (`paged_decode_attention`)."""
    B, H, splits, hd = o_part.shape
    out = torch.empty(B, H, hd, dtype=dtype, device=o_part.device)
    _decode_merge_kernel[(B * H,)](
        o_part, lse, out,
        H, hd, splits,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(hd),
    )
    return out

if __name__ == "__main__":
    from triton.testing import do_bench

    B, H, Hkv, hd = 1, 32, 8, 128
    for S in (512, 4096, 32768):
        q = torch.randn(B, H, hd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, hd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nbytes = 2 * k.numel() * k.element_size()
        ms_t = do_bench(lambda: decode_attention(q, k, v))
        ms_p = do_bench(lambda: decode_attention_reference(q, k, v))
        print(f"S={S:6d}: triton {nbytes / ms_t / 1e6:7.1f} GB/s   SDPA+repeat_kv {nbytes / ms_p / 1e6:7.1f} GB/s")
