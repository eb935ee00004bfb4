"""Device experiment (call P): one launch each of the kernels to profile under Nsight Compute (ncu
--profile-from-start off): autotuned and warmed up first, then profiled between cudaProfilerStart/Stop.
The int4 and int8 M = 1 GEMVs and cuBLAS bf16 at 14336 x 4096, decode attention at 8K, the fused q/k/v GEMV."""

import torch

from llmlab.kernels.decode_attention import decode_attention
from llmlab.kernels.dequant_matmul import int4_matmul, int8_matmul, quantize_int4, quantize_int8
from llmlab.kernels.fused_gemv import fused_gemv
from ncu_util import profile_once  # tools/ is the script's folder: on sys.path

dev, dt = "cuda", torch.bfloat16
W = torch.randn(14336, 4096, device=dev, dtype=dt)
x = torch.randn(1, 4096, device=dev, dtype=dt)
w4, s4 = quantize_int4(W, 128)
w8, s8 = quantize_int8(W)
q = torch.randn(1, 32, 128, device=dev, dtype=dt)
k = torch.randn(1, 8, 8192, 128, device=dev, dtype=dt)
v = torch.randn_like(k)
Wq = torch.randn(3072, 2048, device=dev, dtype=dt) * 0.02
xq, nw = torch.randn(1, 2048, device=dev, dtype=dt), torch.ones(2048, device=dev, dtype=dt)
calls = [lambda: int4_matmul(x, w4, s4), lambda: int8_matmul(x, w8, s8), lambda: x @ W.T,
         lambda: decode_attention(q, k, v), lambda: fused_gemv(xq, Wq, norm_weight=nw)]
profile_once(calls)
