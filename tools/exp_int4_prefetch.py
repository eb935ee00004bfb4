"""Device experiment (session 8, call AQ): an M = 1 int4 GEMV whose loop keeps the NEXT K tile's loads in flight
in registers (a hand-written double buffer) instead of Triton's software pipeline, against the package's
`_int4_gemv_kernel` at Llama-3.1-8B's shapes.

Why: Triton pipelines `tl.range(num_stages=...)` loops with cp.async copies into shared memory, then reads the tile
back from shared memory before the LOP3/FMA chain (call AG, Nsight Compute at 14336 x 4096: 6 warps per SM, an
instruction issued on 58% of cycles, stalls on those shared-memory loads); and the pipeline syncs a program's warps
every step, which is why one-warp programs won the sweeps. Here the loads of tile t + 1 go straight to registers
while tile t is summed: no shared-memory round trip and no per-step barrier, so programs of 2-4 warps need not
stall on each other. Prediction: the same bytes in flight with fewer instructions and no barrier -> the issue rate
up, int4 from ~2.1x toward 2.5-3x bf16 at 14336 x 4096. Same arithmetic as the package kernel (`_int4_word_sums`)
and the same split-K fixup (`split_k_store`).

    python tools/exp_int4_prefetch.py out.json        # on the GPU: the sweep, each config checked first
    TRITON_INTERPRET=1 python tools/exp_int4_prefetch.py --check    # on a CPU: correctness at small sizes
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl

import int4_gemv_sweep
from llmlab.kernels import dequant_matmul as dq
from llmlab.kernels.dequant_matmul import X_EXP, _int4_word_sums
from llmlab.kernels.split_k import split_k_range, split_k_store


@triton.jit
def _tile(w_words, x_ptr, s_ptr, rn, n_mask, rj, ri, k0, k_end, stride_xk, stride_wn, stride_sn, stride_sg,
          GROUP: tl.constexpr, EVICT: tl.constexpr):
    """The loads of the K tile at k0: words (BLOCK_N, J) int32, x (J, 8) fp32, scales (BLOCK_N,) fp32; zeros where
    k0 >= k_end (the prefetch past the split's last tile)."""
    live = (rj * 8 + k0) < k_end  # (J,): the tile is whole or absent (BLOCK_K divides K)
    if EVICT:
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :], mask=n_mask[:, None] & live[None, :],
                    other=0, eviction_policy="evict_first")
    else:
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :], mask=n_mask[:, None] & live[None, :],
                    other=0)
    x = tl.load(x_ptr + (k0 + 8 * rj[:, None] + ri[None, :]) * stride_xk, mask=live[:, None], other=0.0)
    s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask & (rn * 0 + k0 < k_end), other=0.0)
    return w, x.to(tl.float32), s.to(tl.float32)


@triton.jit
def _int4_gemv_prefetch(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_xk, stride_wn, stride_sn, stride_sg, stride_yn, stride_ws,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVICT: tl.constexpr,
):
    """Program (row block, split): the package kernel's sums over the split's K tiles, tile t + 1's loads issued
    before tile t's arithmetic (loop-carried registers, no pipelining by the compiler)."""
    J: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    ri = tl.arange(0, 8)
    n_mask = rn < N
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    k_start, k_end = split_k_range(K, BLOCK_K, SPLIT_K)
    w, x, s = _tile(w_words, x_ptr, s_ptr, rn, n_mask, rj, ri, k_start, k_end, stride_xk, stride_wn, stride_sn,
                    stride_sg, GROUP, EVICT)
    acc = tl.zeros([BLOCK_N, J], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=1):
        w_n, x_n, s_n = _tile(w_words, x_ptr, s_ptr, rn, n_mask, rj, ri, k0 + BLOCK_K, k_end, stride_xk,
                              stride_wn, stride_sn, stride_sg, GROUP, EVICT)
        part = _int4_word_sums(w, w >> 12, x)  # (BLOCK_N, J), the package kernel's arithmetic
        acc += part * (s * 2.0 ** (X_EXP // 2))[:, None]
        w, x, s = w_n, x_n, s_n
    y = tl.sum(acc, axis=1) * 2.0 ** (X_EXP - X_EXP // 2)
    split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)


def launch(x, packed, scales, y, cfg: dict):
    """y (1, N) = x (1, K) @ dequant(packed, scales)^T with the prefetching kernel; cfg: BLOCK_N, BLOCK_K (divides
    the group size), SPLIT_K, EVICT, num_warps. Returns a no-argument callable that launches it."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    ws, cnt = dq._scratch(x.device, N)
    meta = {k: v for k, v in cfg.items() if k != "num_warps"}
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    return lambda: _int4_gemv_prefetch[grid](
        x, packed, scales, y, ws, cnt, N, K,
        x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1), y.stride(1), ws.stride(0),
        GROUP=G, num_warps=cfg["num_warps"], **meta)


def check_small() -> None:
    """The CPU interpreter: one split, several, a short last split, N not a multiple of BLOCK_N."""
    int4_gemv_sweep.check_small(launch, [
        (37, 256, 64, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, EVICT=0)),
        (37, 256, 64, dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=3, EVICT=1)),
        (64, 512, 128, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, EVICT=0)),
        (5, 96, 32, dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=2, EVICT=0))])


SWEEP = [(n, 128, sk, nw, ev) for n in (16, 32, 64) for nw in (1, 2, 4) for sk in (1, 2, 4, 8) for ev in (0,)
         if n * 16 // (32 * nw) >= 4] + [(32, 128, 4, 1, 1), (32, 128, 8, 1, 1), (64, 128, 4, 2, 1),
                                         (32, 64, 8, 1, 0), (64, 64, 4, 1, 0), (128, 64, 4, 2, 0)]


def sweep(out_path: str) -> None:
    int4_gemv_sweep.sweep(out_path, "prefetch", launch, [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=sk, EVICT=ev, num_warps=nw)
                                                         for n, k, sk, nw, ev in SWEEP])


if __name__ == "__main__":
    check_small() if sys.argv[1:] == ["--check"] else sweep(sys.argv[1])
