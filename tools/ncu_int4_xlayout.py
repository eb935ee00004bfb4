"""Device experiment (session 11, call BH): Nsight Compute on the chunk-order int4 GEMV (`exp_int4_xlayout.py`) next
to the package's CUDA-core GEMV at 14336 x 4096, one launch each between cudaProfilerStart/Stop
(`ncu --profile-from-start off`): issue activity, warps per SM, stall reasons."""

import torch
import triton

import exp_int4_xlayout as xl
from llmlab.kernels import dequant_matmul as dq
from ncu_util import profile_once  # tools/ is the script's folder: on sys.path

N, K = 14336, 4096
W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
packed, sc = dq.quantize_int4(W, 128)
own = xl.repack_chunk32(packed)
y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
ws, cnt = dq._scratch(x.device, N)


def package(BN, BK, SK, warps, ST):
    return lambda: dq._int4_gemv_kernel.fn[(triton.cdiv(N, BN), SK)](
        x, packed, sc, y, ws, cnt, N, K, 1, packed.stride(0) // 4, sc.stride(0), sc.stride(1), 1, ws.stride(0),
        GROUP=128, BLOCK_N=BN, BLOCK_K=BK, SPLIT_K=SK, STAGES=ST, num_warps=warps)


profile_once([package(32, 128, 4, 1, 4),
              xl.launch(x, own, sc, y, dict(BLOCK_N=256, SPLIT_K=8, STAGES=1, num_warps=1)),
              xl.launch(x, own, sc, y, dict(BLOCK_N=128, SPLIT_K=8, STAGES=2, num_warps=1))])
