"""Device experiment (call X): raw launches of the M = 1 int4/int8 GEMVs at 14336 x 4096 with chosen configs, for
Nsight Compute (`ncu --profile-from-start off`): each warmed up, then launched once between cudaProfilerStart/Stop.
A record of call X (commit e195c46): its X_DIRECT variant and the kernels' `magic` argument are gone since, so it
does not run at later commits; `ncu_int4_mma.py` profiles the current GEMV."""

import torch
import triton

from llmlab.kernels import dequant_matmul as dq
from ncu_util import profile_once  # tools/ is the script's folder: on sys.path

dev, dt = "cuda", torch.bfloat16
N, K = 14336, 4096
W = torch.randn(N, K, device=dev, dtype=dt)
x = torch.randn(1, K, device=dev, dtype=dt)
w4, s4 = dq.quantize_int4(W, 128)
w8, s8 = dq.quantize_int8(W)
ws, cnt = dq._scratch(x.device, N)
y = torch.empty(1, N, device=dev, dtype=dt)


def int4(BN, BK, SK, warps, ST, XD):
    return lambda: dq._int4_gemv_kernel.fn[(triton.cdiv(N, BN), SK)](
        x, w4, s4, y, ws, cnt, N, K, 1, w4.stride(0) // 4, s4.stride(0), 1, 1, ws.stride(0), dq.MAGIC, GROUP=128,
        BLOCK_N=BN, BLOCK_K=BK, SPLIT_K=SK, STAGES=ST, X_DIRECT=XD, num_warps=warps)


def int8(BN, BK, SK, warps, ST, XD):
    return lambda: dq._int8_gemv_kernel.fn[(triton.cdiv(N, BN), SK)](
        x, w8, s8, y, ws, cnt, N, K, 1, w8.stride(0) // 4, 1, ws.stride(0), dq.MAGIC,
        BLOCK_N=BN, BLOCK_K=BK, SPLIT_K=SK, STAGES=ST, X_DIRECT=XD, num_warps=warps)


calls = [int4(16, 128, 1, 1, 4, False), int4(16, 128, 1, 1, 4, True), int4(64, 128, 1, 4, 3, False),
         int8(32, 256, 1, 2, 3, False)]
profile_once(calls)
