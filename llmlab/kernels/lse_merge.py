"""The merge step of split (flash-decoding) attention: partial outputs of the splits combined by their log-sum-exp.

Each split s of a (sequence, head) writes o_s, its attention output normalized by its own softmax sum, and lse_s, the
log-sum-exp of its scores. The full output is sum_s exp(lse_s) o_s / sum_s exp(lse_s), computed with a running max
(the same online rescaling as the splits' softmax), so any split count fits in registers (Dao et al.,
"Flash-Decoding for long-context inference", 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html).

Two forms, used by `decode_attention.py` and `paged_decode_attention.py`:

  * `merge_into`: a merge kernel launched after the split kernel, one program per (sequence, head);
  * `merge_last`: called inside the split kernel by the last split of each (sequence, KV head) to finish, which
    counts itself done on a counter (`split_counters`): no second launch.

Shapes: partials o (B, H, splits, hd) fp32 and lse (B, H, splits) fp32 (split index contiguous); output (B, H, hd).
An empty split (past a sequence's length) has lse = -inf and weighs 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import pdl_kwargs

MERGE_TILE = 8192  # fp32 partials one merge program holds at a time (BLOCK_S x BLOCK_D): 64 registers a thread
FUSED_MERGE_TILE = 4096  # the same for the split kernel's own merge (BLOCK_HM x BLOCK_S x BLOCK_D)
_counters: dict = {}


@triton.jit
def merge_last(o_base, lse_base, out_base, kvh, N_REP, HD, num_splits,
                stride_oh, stride_os, stride_lh, stride_outh,
                BLOCK_HM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merge of `_merge_kernel` for the n_rep query heads of one KV head at once, run by the split
    kernel's last program: (BLOCK_HM heads, BLOCK_S splits, BLOCK_D) tiles with a running max per head. Reads the
    partials with .cg loads (L2: other SMs wrote them in this launch)."""
    hm = tl.arange(0, BLOCK_HM)
    heads = kvh * N_REP + hm
    hmask = hm < N_REP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HD
    m_i = tl.full([BLOCK_HM], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_HM], tl.float32)
    acc = tl.zeros([BLOCK_HM, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        hs_mask = hmask[:, None] & (sp < num_splits)[None, :]
        lse = tl.load(lse_base + heads[:, None] * stride_lh + sp[None, :], mask=hs_mask, other=float("-inf"),
                      cache_modifier=".cg")  # (BLOCK_HM, BLOCK_S)
        o = tl.load(o_base + heads[:, None, None] * stride_oh + sp[None, :, None] * stride_os + d[None, None, :],
                    mask=hs_mask[:, :, None] & dmask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(lse, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding heads (hm >= n_rep) stay all -inf
        alpha = tl.exp(m_i - m_safe)  # 0 at the first chunk
        w = tl.exp(lse - m_safe[:, None])  # an empty split (lse = -inf) weighs 0
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        l_i = l_i * alpha + tl.sum(w, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_base + heads[:, None] * stride_outh + d[None, :], out.to(out_base.dtype.element_ty),
             mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _merge_kernel(
    # pointers
    o_ptr, lse_ptr, out_ptr,
    # sizes
    H, HD, num_splits,
    # strides (elements); the split index of lse is contiguous
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    # meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr = False,
):
    """Program b * H + h: out[b, h] = sum_s exp(lse_s) o_s / sum_s exp(lse_s), over the first num_splits splits,
    BLOCK_S splits at a time with a running max (the same online rescaling as the split kernel's softmax), so any
    split count fits in registers. TRIGGER (with PDL): let the next kernel launch at this one's start (see
    `decode_attention`'s trigger_next)."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    d = tl.arange(0, BLOCK_D)
    dmask = d < HD
    o_base = o_ptr + b * stride_ob + h * stride_oh
    lse_base = lse_ptr + b * stride_lb + h * stride_lh
    if PDL:  # launched before the split kernel ended: wait until it has, and its partials are visible
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    m_i = tl.full([], float("-inf"), tl.float32)  # running max of the lse: finite after the first chunk
    l_i = tl.zeros([], tl.float32)  # running sum of exp(lse - m_i)
    acc = tl.zeros([BLOCK_D], tl.float32)  # running sum of exp(lse - m_i) * o
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < num_splits
        lse = tl.load(lse_base + s, mask=smask, other=float("-inf"))
        o = tl.load(o_base + s[:, None] * stride_os + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse, axis=0))  # split 0 is never empty, so this is finite
        alpha = tl.exp(m_i - m_new)  # rescales the chunks summed so far (0 at the first chunk)
        w = tl.exp(lse - m_new)  # an empty split (lse = -inf) weighs 0
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        l_i = l_i * alpha + tl.sum(w, axis=0)
        m_i = m_new
    tl.store(out_ptr + b * stride_outb + h * stride_outh + d, (acc / l_i).to(out_ptr.dtype.element_ty), mask=dmask)


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """(n,) int32 zeros: one "splits done" counter per (sequence, KV head) for the fused merge; each launch's last
    split zeroes its own. Kept for the process's life per (device, n): a captured CUDA graph keeps their address.
    Launches on one stream are ordered; two streams running decode attention of one size at once are not safe."""
    key = (device, n)
    if key not in _counters:
        _counters[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _counters[key]


def merge_into(o_part: torch.Tensor, lse: torch.Tensor, splits: int, out: torch.Tensor, trigger_next: bool = False,
               pdl: dict | None = None) -> None:
    """Merge the first `splits` partials of o_part (B, H, >= splits, hd) fp32 and lse (B, H, >= splits) fp32
    (split index contiguous) into out (B, H, hd), any float dtype. One launch, B * H programs. trigger_next: as
    `decode_attention`'s. pdl: the kernel's PDL meta-parameter and launch option (default `pdl_kwargs`)."""
    B, H, _, hd = o_part.shape
    BLOCK_D = triton.next_power_of_2(hd)
    _merge_kernel[(B * H,)](
        o_part, lse, out,
        H, hd, splits,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_S=min(triton.next_power_of_2(splits), max(1, MERGE_TILE // BLOCK_D)), BLOCK_D=BLOCK_D,
        TRIGGER=trigger_next, **(pdl_kwargs(out.device) if pdl is None else pdl),
    )
