"""Device experiment (session 11, call BL): what the split-K fixup at the end of the M = 1 int4 GEMV costs.

Why: call BK's Nsight Compute samples of the package kernel (14336 x 4096, split 2) put 15% of all warp samples on
two instructions of the fixup (`split_k.split_k_store`): the release fence's ERRBAR (7.3%: the partial store must be
acknowledged before the counter's update) and the CCTL.IVALL after the acq_rel atomic (7.3%: waiting for the atomic
to return, then invalidating L1 for the acquire). Only the last program of a row block needs the acquire.

The package kernel's loop with three endings (MODE), timed by the same harness:
  0  the package's: partial store, barrier, acq_rel atomic, the last program sums the partials (.cg loads);
  1  release-only atomic; the last program alone then acquires (a second, acquire-only atomic read of the counter)
     before its .cg loads — formally what the memory model asks, with the L1 invalidation in one program only;
  2  no fixup: every split stores its partial and exits (WRONG output for SPLIT_K > 1: a lower bound on the
     fixup's cost, not a candidate);
Prediction: MODE 1 within ~3% of MODE 0 (every program still waits for its atomic's return); MODE 2 ~1.5-2 us
faster (the tail's three dependent trips to L2).

    python tools/exp_splitk_tail.py out.json      # on the GPU
    TRITON_INTERPRET=1 python tools/exp_splitk_tail.py --check
"""

from __future__ import annotations

import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import int4_gemv_sweep  # noqa: E402
from llmlab.kernels.dequant_matmul import X_EXP, _int4_word_sums  # noqa: E402
from llmlab.kernels.split_k import split_k_range, split_k_store  # noqa: E402


@triton.jit
def _store_release(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K: tl.constexpr):
    """MODE 1: as `split_k_store`, the counter updated with release only; the last program acquires alone."""
    if SPLIT_K == 1:
        tl.store(y_ptr + rn * stride_yn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        pid_n = tl.program_id(0)
        tl.store(ws_ptr + tl.program_id(1) * stride_ws + rn, y, mask=n_mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="release")
        if done == SPLIT_K - 1:
            tl.atomic_add(cnt_ptr + pid_n, 0, sem="acquire")  # reads the last value of the release sequence
            total = tl.load(ws_ptr + rn, mask=n_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws_ptr + s * stride_ws + rn, mask=n_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rn * stride_yn, total.to(y_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _int4_gemv_tail(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_xk, stride_wn, stride_sn, stride_sg, stride_yn, stride_ws,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr, MODE: tl.constexpr,
):
    """The package's `_int4_gemv_kernel` loop, unchanged; MODE picks the ending (see the module docstring)."""
    J: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    ri = tl.arange(0, 8)
    n_mask = rn < N
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    k_start, k_end = split_k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_N, J], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :], mask=n_mask[:, None], other=0)
        top = w >> 12
        x = tl.load(x_ptr + (k0 + 8 * rj[:, None] + ri[None, :]) * stride_xk).to(tl.float32)
        part = _int4_word_sums(w, top, x)
        s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * (s * 2.0 ** (X_EXP // 2))[:, None]
    y = tl.sum(acc, axis=1) * 2.0 ** (X_EXP - X_EXP // 2)
    if MODE == 0:
        split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)
    elif MODE == 1:
        _store_release(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)
    else:
        tl.store(ws_ptr + tl.program_id(1) * stride_ws + rn, y, mask=n_mask)


launch = int4_gemv_sweep.launcher(_int4_gemv_tail)  # cfg: BLOCK_N, BLOCK_K, SPLIT_K, STAGES, MODE, num_warps


def check_small() -> None:
    for mode in (0, 1):
        int4_gemv_sweep.check_small(launch, [
            (37, 256, 64, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, STAGES=1, MODE=mode)),
            (37, 256, 64, dict(BLOCK_N=8, BLOCK_K=64, SPLIT_K=3, STAGES=2, MODE=mode)),
            (5, 96, 32, dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=2, STAGES=1, MODE=mode))])


CONFIGS = [(32, 128, 2, 1, 4), (32, 128, 4, 1, 4), (32, 128, 8, 1, 4), (16, 128, 1, 1, 4), (32, 128, 1, 1, 4)]


def sweep(out_path: str) -> None:
    int4_gemv_sweep.sweep(out_path, "tail", launch,
                          [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=sk, STAGES=st, num_warps=nw, MODE=m)
                           for m in (0, 1, 2) for n, k, sk, nw, st in CONFIGS if m < 2 or sk > 1])


if __name__ == "__main__":
    check_small() if sys.argv[1:] == ["--check"] else sweep(sys.argv[1])
