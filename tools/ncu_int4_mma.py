"""Device experiment (call AG): Nsight Compute on the tensor-core int4 GEMV (`int4_mma_gemv`, call AF: 25 us at
14336 x 4096, 1.7x SLOWER than the CUDA-core GEMV's 14.7 us despite fewer instructions) next to the CUDA-core GEMV,
one launch each between cudaProfilerStart/Stop (`ncu --profile-from-start off`). Then (no profiler) the shapes whose
GPU test failed in call AF (N = 48, K = 192, group 64) under explicit configs: the relative error of each."""

import torch
import triton

from llmlab.kernels import dequant_matmul as dq
from llmlab.kernels import int4_mma_gemv as mm
from ncu_util import profile_once  # tools/ is the script's folder: on sys.path

dev, dt = "cuda", torch.bfloat16


def mma(x, w, s, N, K, G, RB, KQ, SK, warps, ST):
    ws, cnt = dq._scratch(x.device, N)
    y = torch.full((1, N), float("nan"), device=dev, dtype=x.dtype)
    mm._int4_mma_gemv_kernel.fn[(triton.cdiv(N // 16, RB), SK)](
        x, w, s, y, ws, cnt, N, K, s.stride(0), s.stride(1), ws.stride(0), GROUP=G, BF16=x.dtype == torch.bfloat16,
        RB=RB, KQ=KQ, SPLIT_K=SK, STAGES=ST, num_warps=warps)
    return y


def cuda_core(x, w, s, N, K, BN, BK, SK, warps, ST):
    ws, cnt = dq._scratch(x.device, N)
    y = torch.empty(1, N, device=dev, dtype=x.dtype)
    dq._int4_gemv_kernel.fn[(triton.cdiv(N, BN), SK)](
        x, w, s, y, ws, cnt, N, K, 1, w.stride(0) // 4, s.stride(0), s.stride(1), 1, ws.stride(0), GROUP=128,
        BLOCK_N=BN, BLOCK_K=BK, SPLIT_K=SK, STAGES=ST, num_warps=warps)
    return y


N, K = 14336, 4096
W = torch.randn(N, K, device=dev, dtype=dt)
x = torch.randn(1, K, device=dev, dtype=dt)
packed, sc = dq.quantize_int4(W, 128)
w_mma = mm.repack_int4_mma(packed)
calls = [lambda: cuda_core(x, packed, sc, N, K, 32, 128, 2, 1, 4),
         lambda: mma(x, w_mma, sc, N, K, 128, 2, 2, 1, 1, 4),
         lambda: mma(x, w_mma, sc, N, K, 128, 4, 2, 1, 2, 4)]
profile_once(calls)

for N, K, G in [(48, 192, 64), (48, 4096, 64), (1024, 192, 64), (16, 192, 64), (48, 256, 128), (48, 192, 192)]:
    w = torch.randn(N, K, device=dev)
    packed, sc = dq.quantize_int4(w, G)
    w_mma = mm.repack_int4_mma(packed)
    for dtype in (torch.bfloat16,):
        x = torch.randn(1, K, device=dev, dtype=dtype)
        ref = dq.dequant_matmul_reference(x.float(), dq.dequantize_int4(packed, sc))
        for cfg in [(1, 1, 1, 1, 1), (1, 1, 1, 1, 2), (1, 1, 1, 1, 4), (2, 1, 1, 1, 4), (1, 1, 2, 1, 4),
                    (1, 2, 1, 1, 4), (3, 1, 1, 1, 1)]:
            if G % (64 * cfg[1]):
                continue
            y = mma(x, w_mma, sc, N, K, G, *cfg)
            err = ((y.float() - ref).abs() > 0.05 * ref.abs().max()).squeeze(0)
            bad = err.nonzero().flatten().tolist()
            print(f"N={N} K={K} G={G} {dtype} RB,KQ,SK,warps,ST={cfg}: {len(bad)} wrong rows {bad[:12]}")
