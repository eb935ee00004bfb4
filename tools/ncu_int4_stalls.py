"""Device diagnosis (session 11, call BK): where the package's M = 1 int4 GEMV waits. One launch of
`_int4_gemv_kernel` at 14336 x 4096 with the fastest config of calls BH/BI (32 rows x 128, split 2, one warp, 4
stages) under Nsight Compute (`--set full`: stall reasons sampled per instruction), for the next int4 idea to start
from measured stalls rather than offline instruction counts (which predicted calls BH and BI wrongly)."""

import torch
import triton

from llmlab.kernels import dequant_matmul as dq
from ncu_util import profile_once  # tools/ is the script's folder: on sys.path

N, K = 14336, 4096
W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
packed, sc = dq.quantize_int4(W, 128)
y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
ws, cnt = dq._scratch(x.device, N)
profile_once([lambda: dq._int4_gemv_kernel.fn[(triton.cdiv(N, 32), 2)](
    x, packed, sc, y, ws, cnt, N, K, 1, packed.stride(0) // 4, sc.stride(0), sc.stride(1), 1, ws.stride(0),
    GROUP=128, BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, STAGES=4, num_warps=1)])
