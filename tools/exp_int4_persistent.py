"""Device experiment (session 7, call AP): a PERSISTENT M = 1 int4 GEMV — each program walks several (row block,
K split) items in one software-pipelined loop, so its loads for the next item are in flight while it finishes the
current one — against the package's `_int4_gemv_kernel` (one item per program) at Llama-3.1-8B's shapes.

Why (call AG, Nsight Compute at 14336 x 4096): the package kernel runs 6 warps per SM, one instruction issued on 58%
of cycles: each one-warp program lives for ~4 K tiles, and its pipeline fills and drains once per program. Here the
fill and drain happen once per PROGRAM LIFETIME of ITEMS items. Same arithmetic as the package kernel (`_field`,
`_lift`, the codes' offset, the split-K fixup by the last split to finish).

    python tools/exp_int4_persistent.py out.json        # on the GPU: the sweep, each config checked first
    TRITON_INTERPRET=1 python tools/exp_int4_persistent.py --check    # on a CPU: correctness at small sizes
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl

import int4_gemv_sweep
from llmlab.kernels import dequant_matmul as dq
from llmlab.kernels.dequant_matmul import X_EXP, _int4_word_sums


@triton.jit
def _int4_gemv_persistent(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_xk, stride_wn, stride_sn, stride_sg, stride_yn, stride_ws,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr, ITEMS: tl.constexpr,
):
    """Program p: items p, p + P, ..., p + (ITEMS - 1) P of the cdiv(N, BLOCK_N) x SPLIT_K items (item = row block
    * SPLIT_K + split), T K tiles each, as ONE loop of ITEMS * T steps. BLOCK_K divides GROUP and K."""
    J: tl.constexpr = BLOCK_K // 8
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_items = tl.cdiv(N, BLOCK_N) * SPLIT_K
    T = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # K tiles per split
    rj = tl.arange(0, J)
    ri = tl.arange(0, 8)
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_N, J], tl.float32)
    for it in tl.range(0, ITEMS * T, num_stages=STAGES):
        item = pid + (it // T) * P
        kt = it % T
        rb = item // SPLIT_K
        sp = item % SPLIT_K
        k0 = (sp * T + kt) * BLOCK_K
        rn = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        live = (k0 < K) & (item < n_items)  # a past-the-end tile of the last split, or a program's spare item
        n_mask = (rn < N) & (rn * 0 + live.to(tl.int32) > 0)
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :], mask=n_mask[:, None], other=0)
        top = w >> 12
        kk = k0 + 8 * rj[:, None] + ri[None, :]
        x = tl.load(x_ptr + kk * stride_xk, mask=(kk < K) & (kk * 0 + live.to(tl.int32) > 0),
                    other=0.0).to(tl.float32)  # (J, 8); zero on a dead tile, so its offset term is zero too
        part = _int4_word_sums(w, top, x)  # the package kernel's arithmetic
        s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * (s * 2.0 ** (X_EXP // 2))[:, None]
        if (kt == T - 1) & (item < n_items):  # the item's last tile: its sums out, then start the next item
            y = tl.sum(acc, axis=1) * 2.0 ** (X_EXP - X_EXP // 2)
            out_mask = rn < N
            if SPLIT_K == 1:
                tl.store(y_ptr + rn * stride_yn, y.to(y_ptr.dtype.element_ty), mask=out_mask)
            else:  # the split-K fixup with one counter per ROW: each row's partial store, count and (last split)
                # sum run in the thread that owns that row, so no barrier is needed — a barrier in the loop stops
                # Triton from software-pipelining it (checked offline: no cp.async with one)
                tl.store(ws_ptr + sp * stride_ws + rn, y, mask=out_mask)
                done = tl.atomic_add(cnt_ptr + rn, 1, mask=out_mask, sem="acq_rel")  # (BLOCK_N,) splits before
                last = out_mask & (done == SPLIT_K - 1)
                total = tl.load(ws_ptr + rn, mask=last, other=0.0, cache_modifier=".cg")
                for s2 in tl.static_range(1, SPLIT_K):
                    total += tl.load(ws_ptr + s2 * stride_ws + rn, mask=last, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + rn * stride_yn, total.to(y_ptr.dtype.element_ty), mask=last)
                tl.atomic_xchg(cnt_ptr + rn, tl.zeros_like(done), mask=last)
            acc = tl.zeros([BLOCK_N, J], tl.float32)


def launch(x, packed, scales, y, cfg: dict):
    """y (1, N) = x (1, K) @ dequant(packed, scales)^T with the persistent kernel; cfg: BLOCK_N, BLOCK_K, SPLIT_K,
    STAGES, ITEMS, num_warps. Returns a no-argument callable that launches it."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    ws, cnt = dq._scratch(x.device, N)
    n_items = triton.cdiv(N, cfg["BLOCK_N"]) * cfg["SPLIT_K"]
    grid = (triton.cdiv(n_items, cfg["ITEMS"]),)
    meta = {k: v for k, v in cfg.items() if k != "num_warps"}
    return lambda: _int4_gemv_persistent[grid](
        x, packed, scales, y, ws, cnt, N, K,
        x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1), y.stride(1), ws.stride(0),
        GROUP=G, num_warps=cfg["num_warps"], **meta)


def check_small() -> None:
    """The CPU interpreter: every item layout (spare items, short last split, N not a multiple of BLOCK_N)."""
    int4_gemv_sweep.check_small(launch, [
        (37, 256, 64, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, STAGES=1, ITEMS=2)),
        (37, 256, 64, dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=3, STAGES=1, ITEMS=4)),
        (64, 512, 128, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, STAGES=1, ITEMS=3)),
        (5, 96, 32, dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=2, STAGES=1, ITEMS=5))])


SWEEP = [  # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, STAGES, ITEMS)
    (32, 128, 8, 1, 4, 2), (32, 128, 8, 1, 4, 4), (32, 128, 4, 1, 4, 2), (32, 128, 4, 1, 4, 4),
    (32, 128, 2, 1, 4, 4), (32, 128, 4, 1, 6, 4), (16, 128, 4, 1, 4, 4), (16, 128, 8, 1, 4, 4),
    (32, 128, 8, 1, 4, 8), (64, 128, 4, 2, 4, 2)]


def sweep(out_path: str) -> None:
    int4_gemv_sweep.sweep(out_path, "persistent", launch,
                          [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=sk, STAGES=st, ITEMS=items, num_warps=nw)
                           for n, k, sk, nw, st, items in SWEEP])


if __name__ == "__main__":
    check_small() if sys.argv[1:] == ["--check"] else sweep(sys.argv[1])
