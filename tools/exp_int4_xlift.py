"""Device experiment (session 11, call BI): the package's M = 1 int4 GEMV with x's per-field work done BEFORE x is
moved into the weight tile's layout.

Why: offline (triton.compile for sm_90, TTGIR + SASS), the package kernel lifts each field's x (`_lift`, an FMUL)
and sums each word's x (`sx`, FADDs) AFTER the shared-memory conversion of the split x, in the weight tile's
layout, where every x element is held by the 8 threads that share its columns: 40 FMUL + 28 FADD of the loop's 452
instructions per thread per 128 weights. Call BH showed what x work costs when it is replicated (the chunk-order
kernel: 20.7 vs 14.8 us). Here the (J, 8) x tile is multiplied by the 8 lifts (one (1, 8) constant) and summed
along its 8 fields in its own layout (4 elements per thread of a one-warp program at J = 16), then split and
converted as before.

Prediction: ~60 fewer instructions per 452 (-13%), the GEMV (issue-bound at 0.58 IPC, call BH's ncu) ~10% faster:
14336 x 4096 from 14.8 to ~13.3 us (2.1x -> 2.3x bf16). Not the 3x of issue 5 by itself.

    python tools/exp_int4_xlift.py out.json       # on the GPU: the sweep against the package kernel
    TRITON_INTERPRET=1 python tools/exp_int4_xlift.py --check      # on a CPU
    python tools/exp_int4_xlift.py --asm          # on a CPU: the loop's instruction count for sm_90
"""

from __future__ import annotations

import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import int4_gemv_sweep  # noqa: E402
from llmlab.kernels import dequant_matmul as dq  # noqa: E402
from llmlab.kernels.dequant_matmul import X_EXP, _field, _split8  # noqa: E402
from llmlab.kernels.split_k import split_k_range, split_k_store  # noqa: E402


@triton.jit
def _int4_gemv_xlift(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_xk, stride_wn, stride_sn, stride_sg, stride_yn, stride_ws,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    J: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    ri = tl.arange(0, 8)
    n_mask = rn < N
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    # the lift of field i: 2^(149 - SHIFT_i - X_EXP), SHIFT = 0, 4, 8, 12, 16 (in w), 8, 12, 16 (in w >> 12)
    shift = tl.where(ri < 5, 4 * ri, 4 * ri - 12)
    lift = ((-shift + (149 - X_EXP + 127)) << 23).to(tl.float32, bitcast=True)[None, :]  # (1, 8): the bits of
    # 2^(149 - X_EXP - SHIFT), exact
    k_start, k_end = split_k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_N, J], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :], mask=n_mask[:, None], other=0)
        top = w >> 12
        x = tl.load(x_ptr + (k0 + 8 * rj[:, None] + ri[None, :]) * stride_xk).to(tl.float32)  # (J, 8)
        sx = tl.sum(x, axis=1) * (8.0 * 2.0 ** -X_EXP)  # (J,), in x's layout
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x * lift)  # lifted in x's layout, then split
        part = _field(w, 0, 4) * x0[None, :] - sx[None, :]
        part += _field(w, 4, 4) * x1[None, :]
        part += _field(w, 8, 4) * x2[None, :]
        part += _field(w, 12, 4) * x3[None, :]
        part += _field(w, 16, 4) * x4[None, :]
        part += _field(top, 8, 4) * x5[None, :]
        part += _field(top, 12, 4) * x6[None, :]
        part += _field(top, 16, 4) * x7[None, :]
        s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * (s * 2.0 ** (X_EXP // 2))[:, None]
    y = tl.sum(acc, axis=1) * 2.0 ** (X_EXP - X_EXP // 2)
    split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)


launch = int4_gemv_sweep.launcher(_int4_gemv_xlift)  # cfg: BLOCK_N, BLOCK_K, SPLIT_K, STAGES, num_warps


def check_small() -> None:
    int4_gemv_sweep.check_small(launch, [
        (37, 256, 64, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, STAGES=1)),
        (37, 256, 64, dict(BLOCK_N=8, BLOCK_K=64, SPLIT_K=3, STAGES=2)),
        (64, 512, 128, dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, STAGES=1)),
        (5, 96, 32, dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=2, STAGES=1))])


def asm(fn=None, cfg: dict | None = None) -> None:
    """The K loop of `fn` (default: this kernel) compiled for sm_90: instructions per weight and the opcode mix."""
    cfg = cfg or dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, STAGES=4, num_warps=1)
    meta = {k: v for k, v in cfg.items() if k != "num_warps"}
    int4_gemv_sweep.loop_instructions(fn or _int4_gemv_xlift, dict(stride_xk=1, stride_sg=1, stride_yn=1, GROUP=128,
                                                                   **meta),
                                      cfg["num_warps"], cfg["BLOCK_N"] * cfg["BLOCK_K"] // (32 * cfg["num_warps"]))


SWEEP = dq._GEMV1_SHAPES  # the package's configs: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, STAGES)


def sweep(out_path: str) -> None:
    int4_gemv_sweep.sweep(out_path, "xlift", launch,
                          [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=sk, STAGES=st, num_warps=nw)
                           for n, k, sk, nw, st in SWEEP],
                          keep=lambda N, K, c: 128 % c["BLOCK_K"] == 0)


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        check_small()
    elif sys.argv[1:2] == ["--asm"]:
        asm()
        asm(dq._int4_gemv_kernel.fn)
    else:
        sweep(sys.argv[1])
