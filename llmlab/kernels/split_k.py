"""Split-K for a GEMV, finished in the same launch: the "serial split-K" fixup.

A GEMV y = W x with few output rows (N) and a long K gives too few programs to fill the GPU if each program owns
whole rows. Split K too: SPLIT_K programs share a row block's K range (grid cdiv(N, BLOCK_N) x SPLIT_K), each
writes its partial sums to a scratch row, counts itself done on an atomic counter, and the LAST one to finish
adds the partials in split order (so the result does not depend on timing) and writes y — no second "reduce"
launch. This is the serial split-K of CUTLASS's GEMMs and the fixup step of Stream-K (Osama et al. 2023,
https://arxiv.org/abs/2301.03598). Used by the M = 1 int4/int8 GEMVs (`dequant_matmul.py`, `int4_mma_gemv.py`).
(The bf16 one-token GEMVs, `fused_gemv.py`, do not use it: no split config beat their unsplit ones; docs/results.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLIT_K = 8  # the scratch buffers hold this many partial rows
_scratch_buffers: dict = {}


@triton.jit
def split_k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[k_start, k_end) of this program's split (program_id(1)): whole K tiles, as even as they come (the last may
    be short or empty)."""
    tiles = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_start = tl.program_id(1) * tiles * BLOCK_K
    return k_start, tl.minimum(k_start + tiles * BLOCK_K, K)


@triton.jit
def _plus_residual(y, y_ptr, res_ptr, rn, n_mask, HAS_RES: tl.constexpr):
    """y (fp32) plus the residual at rows rn, with y first rounded to the output's dtype as the unfused add sees
    it; y itself without HAS_RES."""
    if HAS_RES:
        r = tl.load(res_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + r
    return y


@triton.jit
def split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K: tl.constexpr,
                  res_ptr=None, HAS_RES: tl.constexpr = False):
    """Write this program's (BLOCK_N,) fp32 sums y: straight to the output with one split; else as partial row
    `split` of the scratch, then count this split done, and if it was the last of its row block, add the SPLIT_K
    partials in split order and write the output, then zero the counter for the next launch. HAS_RES: the output
    is residual + the sums (the residual at `res_ptr`, rows rn), added once, by whoever writes the output.

    Memory order: the barrier makes every thread's partial store come before the counter's update, which is an
    acq_rel atomic (release: the stores are visible to whoever reads the count after it; acquire: the last program
    sees the other splits' stores); the last program reads the partials with .cg loads (from L2, not a stale L1)."""
    if SPLIT_K == 1:
        y = _plus_residual(y, y_ptr, res_ptr, rn, n_mask, HAS_RES)
        tl.store(y_ptr + rn * stride_yn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        pid_n = tl.program_id(0)
        tl.store(ws_ptr + tl.program_id(1) * stride_ws + rn, y, mask=n_mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")  # how many splits finished before this one
        if done == SPLIT_K - 1:
            total = tl.load(ws_ptr + rn, mask=n_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws_ptr + s * stride_ws + rn, mask=n_mask, other=0.0, cache_modifier=".cg")
            total = _plus_residual(total, y_ptr, res_ptr, rn, n_mask, HAS_RES)
            tl.store(y_ptr + rn * stride_yn, total.to(y_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def scratch(device: torch.device, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K scratch for outputs of size N on `device`: partial sums (MAX_SPLIT_K, N) fp32 and one counter per
    row block (N,) int32, zero between launches (each launch's last split zeroes its counters).

    Kept for the life of the process, one pair per (device, N) — a CUDA graph that captured a launch keeps using
    these addresses, so they are never freed or replaced. Shared by every launch with that key: launches on one
    stream (in order, from any host thread) are safe; two streams running GEMVs of one N at the same moment are
    not, nor are several host threads running them at once in the CPU interpreter (where a launch runs in its
    caller's thread — and the interpreter itself is not thread-safe).
    """
    key = (device, N)
    if key not in _scratch_buffers:
        _scratch_buffers[key] = (torch.empty(MAX_SPLIT_K, N, dtype=torch.float32, device=device),
                                 torch.zeros(N, dtype=torch.int32, device=device))
    return _scratch_buffers[key]
