"""The split step of split (flash-decoding) attention: one program's attention over one slice of the cached keys.

`decode_attention.py` launches `_decode_split_kernel` on a grid (B * Hkv, splits). Program (b * Hkv + KV head,
split) loads the K/V of one KV head for its slice of keys ONCE and attends all n_rep query heads that share that KV
head to it (GQA: Ainslie et al. 2023, https://arxiv.org/abs/2305.13245), tile by tile with an online softmax: a
running max and a running sum, the output rescaled as each tile raises the max (`_tile_scores`, `_tile_output`;
Milakov and Gimelshein 2018, https://arxiv.org/abs/1805.02867). It writes its output normalized by its own softmax
sum and the log-sum-exp of its scores, which the merge (`lse_merge.py`) combines — or, alone in the grid, the
final output; or, with FUSED_MERGE, the slice finished last merges the others itself (`lse_merge.merge_last`).
Source of the split: Dao et al., "Flash-Decoding for long-context inference", 2023,
https://crfm.stanford.edu/2023/10/12/flashdecoding.html.

Arguments, in the Triton tutorials' order: pointers, sizes, strides (in elements), meta-parameters. The cache is
(B, Hkv, S, hd) with any strides but a contiguous last dimension; q (B, H, hd); the partials o (B, H, splits, hd)
fp32 and lse (B, H, splits) fp32; the output (B, H, hd) in the caller's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .lse_merge import merge_last
from .rope_cache import rope_angles


@triton.jit(do_not_specialize=["S_BUCKET", "BHKV_BUCKET"])  # only the autotuner reads them: no recompiles
def _decode_split_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, lse_ptr, out_ptr, cnt_ptr, freq_ptr,
    # sizes (S_BUCKET and BHKV_BUCKET only key the autotuner: S and B * Hkv rounded up to powers of 2)
    Hkv, N_REP, HD, S, S_BUCKET, BHKV_BUCKET, scale,
    # strides (elements)
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    # meta-parameters
    HAS_LENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, PDL: tl.constexpr,
    FUSED_MERGE: tl.constexpr, BLOCK_HM: tl.constexpr, BLOCK_S: tl.constexpr, PREFETCH: tl.constexpr = False,
    ROPE: tl.constexpr = False,
):
    """Program (b * Hkv + kv head, split): attention of the n_rep query heads of one KV head over keys
    [split * SPLIT_N, (split + 1) * SPLIT_N) of sequence b. With one split in the grid it writes the final output
    (out_ptr, the output dtype); otherwise a partial output o (fp32, normalized by its own softmax sum) and the
    log-sum-exp of its scores, for the merge (`lse_merge.py`). SPLIT_N = 0: S shared out evenly over the grid's
    programs in whole BLOCK_N tiles (an explicit num_splits; the last splits may then be empty). With lengths
    (HAS_LENS: a static cache replayed by a CUDA graph at every length) each row's filled length is shared out over
    the grid's cdiv(S, SPLIT_N) splits instead, so a short row is not all in its first split.
    FUSED_MERGE: the last split of each (sequence, KV head) to finish merges the partials itself (`merge_last`),
    so there is no merge kernel to launch.
    PREFETCH (with lengths; `decode_attention`'s prefetch_kv): the program's first K/V tile is loaded BEFORE the
    wait for the kernel before — which may write only each row's newest key and value (slot seq_len - 1), read
    again after the wait.
    ROPE (with lengths): q_ptr is the fused q/k/v projection of the new token, (B, H + 2 Hkv, hd) with the q heads
    first, not yet rotated, and freq_ptr RoPE's inverse frequencies (hd/2,) fp32: each program rotates its q heads
    itself, takes the newest key (rotated) and value (slot seq_len - 1, the token's position) from the projection
    instead of the cache, and the program whose split holds that slot writes them into the cache — what
    `rope_cache.py`'s launch did before this one. Nothing before this kernel then writes the cache, so with
    PREFETCH every cached tile may be read before the wait."""
    if PDL:  # the next kernel may start now (it waits for this grid's end before reading); before reading
        tl.extra.cuda.gdc_launch_dependents()  # anything, wait for the kernel before this one to complete
        if not PREFETCH:
            tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    b = (pid // Hkv).to(tl.int64)  # 64-bit row offsets: a large batch's cache passes 2**31 elements
    kvh = pid % Hkv
    split = tl.program_id(1)
    if HAS_LENS:
        seq_len = tl.minimum(tl.load(lens_ptr + b), S)  # never past the cache, whatever the lengths say
    else:  # every sequence attends to all S slots
        seq_len = S
    if HAS_LENS:  # a static cache: the FILLED length shared out over the grid's splits, at any length
        split_size = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    elif SPLIT_N > 0:
        split_size = SPLIT_N
    else:
        split_size = tl.cdiv(tl.cdiv(S, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)  # past a sequence's length: an empty split (weighs 0 in the merge)

    hi = tl.arange(0, BLOCK_H)
    heads = kvh * N_REP + hi  # the query heads that read this KV head
    hmask = hi < N_REP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HD
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    first = start
    if PREFETCH:  # the first tile, then the wait, then the newest key/value (written by the kernel before, or ROPE)
        n = start + tl.arange(0, BLOCK_N)
        kv_mask = (n < end)[:, None] & dmask[None, :]
        k = tl.load(k_base + n[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + n[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
    q_mask = hmask[:, None] & dmask[None, :]
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)  # (BLOCK_H, BLOCK_D), after any wait
    if ROPE:  # rotate q, and take the newest key (rotated) and value from the projection; write them to the cache
        half = HD // 2
        partner = tl.where(d < half, d + half, d - half)  # "rotate half": pairs (i, i + hd/2)
        sign = tl.where(d < half, -1.0, 1.0)
        c, s = rope_angles(seq_len - 1, freq_ptr, d % half, dmask, q)  # (BLOCK_D,) fp32: the new token's angles
        q_pair = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q = (q.to(tl.float32) * c[None, :] + sign[None, :] * q_pair * s[None, :]).to(q.dtype)
        k_row = q_ptr + b * stride_qb + (Hkv * N_REP + kvh) * stride_qh  # the new token's k head, then its v head
        k_new = tl.load(k_row + d, mask=dmask, other=0.0).to(tl.float32)
        k_pair = tl.load(k_row + partner, mask=dmask, other=0.0).to(tl.float32)
        k_new = (k_new * c + sign * k_pair * s).to(k_ptr.dtype.element_ty)
        v_new = tl.load(k_row + Hkv * stride_qh + d, mask=dmask, other=0.0).to(v_ptr.dtype.element_ty)
        slot = seq_len - 1 + 0 * d  # the newest slot on every lane: does this program's split hold it?
        owner = dmask & (slot >= start) & (slot < end)
        tl.store(k_base + (seq_len - 1) * stride_ks + d, k_new, mask=owner)
        tl.store(v_base + (seq_len - 1) * stride_vs + d, v_new, mask=owner)
    elif PREFETCH:  # the newest key/value again, from the cache the kernel before wrote
        slot = seq_len - 1 + 0 * d  # the newest slot on every lane: is it in this tile?
        new_mask = dmask & (slot >= start) & (slot < start + BLOCK_N) & (slot < end)
        k_new = tl.load(k_base + (seq_len - 1) * stride_ks + d, mask=new_mask, other=0.0, cache_modifier=".cg")
        v_new = tl.load(v_base + (seq_len - 1) * stride_vs + d, mask=new_mask, other=0.0, cache_modifier=".cg")
    if PREFETCH:  # the prefetched tile, its newest slot replaced, attended first
        newest = (n == seq_len - 1) & (n < end)  # at most one lane
        k = tl.where(newest[:, None], k_new[None, :], k)
        v = tl.where(newest[:, None], v_new[None, :], v)
        if start < end:
            p, alpha, m_i, l_i = _tile_scores(q, k, n < end, m_i, l_i, scale, IEEE)
            acc = _tile_output(p, v, alpha, acc, IEEE)
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + n[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        if ROPE:  # the newest slot from the projection: this program's own store need not be visible yet
            k = tl.where((n == seq_len - 1)[:, None], k_new[None, :], k)
        p, alpha, m_i, l_i = _tile_scores(q, k, nmask, m_i, l_i, scale, IEEE)
        v = tl.load(v_base + n[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        if ROPE:
            v = tl.where((n == seq_len - 1)[:, None], v_new[None, :], v)
        acc = _tile_output(p, v, alpha, acc, IEEE)

    has = l_i > 0  # an empty split (past this sequence's end) writes o = 0, lse = -inf: it weighs 0 in the merge
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    out_mask = hmask[:, None] & dmask[None, :]
    if tl.num_programs(1) == 1:  # the only split (never empty: seq_len >= 1): o IS the answer, no merge to come
        tl.store(out_ptr + b * stride_outb + heads[:, None] * stride_outh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], o,
                 mask=out_mask)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)
        if FUSED_MERGE:  # count this split done; the last one merges (memory order: see split_k.py's
            tl.debug_barrier()  # `split_k_store`, the same pattern)
            done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
            if done == tl.num_programs(1) - 1:
                merge_last(o_ptr + b * stride_ob, lse_ptr + b * stride_lb, out_ptr + b * stride_outb, kvh, N_REP,
                            HD, tl.num_programs(1), stride_oh, stride_os, stride_lh, stride_outh,
                            BLOCK_HM, BLOCK_S, BLOCK_D)
                tl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next launch


@triton.jit
def _tile_scores(q, k, nmask, m_i, l_i, scale, IEEE: tl.constexpr):
    """The online softmax's first half for one K tile: q (BLOCK_H, BLOCK_D) against k (BLOCK_N, BLOCK_D), keys
    where nmask. Returns p = exp(s - m_new) (BLOCK_H, BLOCK_N), alpha = exp(m_i - m_new) (the rescale of what was
    summed before), the new running max and the new running sum (BLOCK_H,), all fp32."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(nmask[None, :], s * scale, float("-inf"))  # (BLOCK_H, BLOCK_N); masked keys weigh 0
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _tile_output(p, v, alpha, acc, IEEE: tl.constexpr):
    """The second half: acc * alpha + p @ v, (BLOCK_H, BLOCK_D) fp32."""
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv
