"""Decode attention over a PAGED KV cache: flash-decoding that finds each token's K/V through a block table.

Cache layout (as `llmlab.cache.paged_cache.PagedKVCache`): one pool per layer, k_pool / v_pool of shape
(num_blocks, Hkv, block_size, hd); token p of sequence b lives in block `block_tables[b, p // block_size]` at
offset `p % block_size` (Kwon et al. 2023, PagedAttention, https://arxiv.org/abs/2309.06180).

Same two-kernel scheme as `decode_attention.py` (split the sequence across programs, merge the partials by
log-sum-exp); the only change is the address of a K/V tile: one program reads one BLOCK of the pool at a time,
in place — no gather into a contiguous copy.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from ._util import check_flag, check_tensors, demo_needs_cuda, interpret_mode
from .decode_attention import decode_attention_reference, merge_splits

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def paged_decode_attention_reference(q, k_pool, v_pool, block_tables, seq_lens):
    """Gather each sequence's blocks into a contiguous (1, Hkv, S, hd) copy, then SDPA (`decode_attention_reference`).

    Bytes: the gather reads and writes 2 x ceil(S / bs) x bs x Hkv x hd x elem per sequence before attention reads
    it again; the kernel reads the blocks once, in place.
    """
    N, Hkv, bs, hd = k_pool.shape
    outs = []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        blocks = block_tables[b, : -(-n // bs)].long()
        k = k_pool[blocks].permute(1, 0, 2, 3).reshape(1, Hkv, -1, hd)[:, :, :n]  # (1, Hkv, n, hd)
        v = v_pool[blocks].permute(1, 0, 2, 3).reshape(1, Hkv, -1, hd)[:, :, :n]
        outs.append(decode_attention_reference(q[b:b + 1], k, v))
    return torch.cat(outs)


@triton.jit
def _paged_split_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, o_ptr, lse_ptr,
    # sizes
    Hkv, N_REP, HD, BS, blocks_per_split, scale,
    # strides (elements)
    stride_qb, stride_qh,
    stride_kn, stride_kh, stride_ks,
    stride_vn, stride_vh, stride_vs,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    # meta-parameters
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // Hkv
    kvh = pid % Hkv
    split = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, BS))  # table entries past the length: never read

    hi = tl.arange(0, BLOCK_H)
    hmask = hi < N_REP
    heads = kvh * N_REP + hi
    d = tl.arange(0, BLOCK_D)
    dmask = d < HD
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    off = tl.arange(0, BLOCK_N)  # slot within a block (BLOCK_N >= BS, padded to a power of 2 >= 16)
    for i in range(first, last):
        blk = tl.load(table_ptr + b * stride_tb + i).to(tl.int64)
        n = i * BS + off
        nmask = (off < BS) & (n < seq_len)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + blk * stride_kn + kvh * stride_kh + off[:, None] * stride_ks + d[None, :],
                    mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk * stride_vn + kvh * stride_vh + off[:, None] * stride_vs + d[None, :],
                    mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], o,
             mask=hmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None, num_splits: int | None = None,
                           check_lens: bool = True) -> torch.Tensor:
    """One decode step of GQA attention reading K/V in place through block tables.

    Args:
        q: (B, H, hd) or (B, H, 1, hd).
        k_pool, v_pool: (num_blocks, Hkv, block_size, hd), same dtype as q, last dimension contiguous.
        block_tables: (B, max_blocks) int32/int64 block ids; entries past a sequence's length are never read.
        seq_lens: (B,) int tensor, each in 1..max_blocks x block_size.
        scale: default 1/sqrt(hd). num_splits: programs per (sequence, KV head) along the sequence.
        check_lens: read seq_lens on the host to check them (a sync; off inside a decode step).

    Returns:
        like q, in q's dtype.

    Raises:
        ValueError: shape mismatches, H not a multiple of Hkv, num_splits < 1; with check_lens, seq_lens out of
            range or block ids (within the lengths) outside the pool. TypeError: dtypes, non-tensor tables/lengths.
    """
    check_tensors("paged_decode_attention", DTYPES, q=q, k_pool=k_pool, v_pool=v_pool)
    if not (q.dtype == k_pool.dtype == v_pool.dtype):
        raise TypeError(f"paged_decode_attention: q, k_pool, v_pool must share one dtype, got {q.dtype}, "
                        f"{k_pool.dtype}, {v_pool.dtype}")
    q_shape = q.shape
    if q.dim() == 4 and q.shape[2] == 1:
        q = q[:, :, 0]
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"paged_decode_attention: q must be (B, H, hd), pools (num_blocks, Hkv, block_size, hd); "
                         f"got {tuple(q_shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    B, H, hd = q.shape
    _, Hkv, bs, _ = k_pool.shape
    if k_pool.shape[3] != hd:
        raise ValueError(f"paged_decode_attention: head_dim of q ({hd}) and of the pools ({k_pool.shape[3]}) differ")
    if min(B, H, Hkv, hd, bs) < 1:
        raise ValueError(f"paged_decode_attention: batch, heads, KV heads, head_dim and block size must be >= 1, "
                         f"got q {tuple(q_shape)} and pools {tuple(k_pool.shape)}")
    if H % Hkv:
        raise ValueError(f"paged_decode_attention: {H} query heads are not a multiple of {Hkv} KV heads")
    if not isinstance(block_tables, torch.Tensor) or not isinstance(seq_lens, torch.Tensor):
        raise TypeError(f"paged_decode_attention: block_tables and seq_lens must be int tensors on {q.device}, got "
                        f"{type(block_tables).__name__} and {type(seq_lens).__name__}; pass torch.tensor(...)")
    if (block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.is_floating_point()
            or block_tables.dtype == torch.bool):
        raise ValueError(f"paged_decode_attention: block_tables must be a (B={B}, max_blocks) int tensor, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if seq_lens.shape != (B,) or seq_lens.is_floating_point() or seq_lens.dtype == torch.bool:
        raise ValueError(f"paged_decode_attention: seq_lens must be a ({B},) int tensor")
    for t in (block_tables, seq_lens):
        if t.device != q.device:
            raise ValueError(f"paged_decode_attention: block_tables and seq_lens must be on {q.device}")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_decode_attention: {name}'s last dimension must be contiguous")
    check_lens = check_flag("paged_decode_attention", "check_lens", check_lens)
    if block_tables.shape[1] == 0:
        raise ValueError("paged_decode_attention: block_tables has no columns: each sequence needs at least one "
                         "block id (a (B, max_blocks) table with max_blocks >= 1)")
    max_len = block_tables.shape[1] * bs
    if check_lens and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > max_len):
        raise ValueError(f"paged_decode_attention: seq_lens must lie in 1..{max_len} (max_blocks x block_size), "
                         f"got {seq_lens.tolist()}")
    if check_lens:  # the block ids a sequence reads (its first cdiv(len, block_size) entries) must be in the pool
        n_used = (seq_lens.long() + bs - 1) // bs  # in int64: a small int dtype would wrap
        used = torch.arange(block_tables.shape[1], device=q.device)[None, :] < n_used[:, None]
        ids = block_tables[used]
        if int(ids.min()) < 0 or int(ids.max()) >= k_pool.shape[0]:
            raise ValueError(f"paged_decode_attention: block_tables hold ids outside the pool's "
                             f"{k_pool.shape[0]} blocks (0..{k_pool.shape[0] - 1}) within the sequences' lengths: "
                             f"min {int(ids.min())}, max {int(ids.max())}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                   or num_splits < 1):
        raise ValueError(f"paged_decode_attention: num_splits must be a whole number >= 1 (or None), got "
                         f"{num_splits!r}")
    # the kernel reads block_tables[b, j] at b * stride(0) + j and seq_lens[b] at b: make both dense
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"paged_decode_attention: scale must be a number (the softmax scale, default 1/sqrt(hd)), "
                        f"got {scale!r}")
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)

    n_blocks = block_tables.shape[1]
    if num_splits is None:
        if interpret_mode() or q.device.type != "cuda":
            num_splits = 4
        else:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            num_splits = max(1, min(triton.cdiv(2 * sms, B * Hkv), 128))
    blocks_per_split = triton.cdiv(n_blocks, max(1, min(num_splits, n_blocks)))
    splits = triton.cdiv(n_blocks, blocks_per_split)
    n_rep = H // Hkv
    BLOCK_D = max(16, triton.next_power_of_2(hd))
    o_part = torch.empty(B, H, splits, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    _paged_split_kernel[(B * Hkv, splits)](
        q, k_pool, v_pool, block_tables, seq_lens, o_part, lse,
        Hkv, n_rep, hd, bs, blocks_per_split, scale,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1),
        BLOCK_H=max(16, triton.next_power_of_2(n_rep)), BLOCK_D=BLOCK_D,
        BLOCK_N=max(16, triton.next_power_of_2(bs)), IEEE=q.dtype == torch.float32,
    )
    return merge_splits(o_part, lse, q.dtype).view(q_shape)


if __name__ == "__main__":
    demo_needs_cuda("paged_decode_attention")
    from triton.testing import do_bench

    B, H, Hkv, hd, bs = 8, 32, 8, 128, 16
    for S in (512, 4096):
        nb = S // bs
        k_pool = torch.randn(B * nb, Hkv, bs, hd, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        tables = torch.randperm(B * nb, device="cuda").view(B, nb).int()
        lens = torch.full((B,), S, device="cuda", dtype=torch.int32)
        q = torch.randn(B, H, hd, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * k_pool.numel() * k_pool.element_size()
        ms_t = do_bench(lambda: paged_decode_attention(q, k_pool, v_pool, tables, lens, check_lens=False))
        ms_p = do_bench(lambda: paged_decode_attention_reference(q, k_pool, v_pool, tables, lens))
        print(f"B={B} S={S:5d}: triton {nbytes / ms_t / 1e6:7.1f} GB/s   gather+SDPA {nbytes / ms_p / 1e6:7.1f} GB/s")
