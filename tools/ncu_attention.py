"""Device experiment (call BD, session 10): Nsight Compute on decode attention's split kernel at 8K keys (Llama-3.1-8B:
32 heads, 8 KV heads, hd 128, bf16) against a plain read of the same 33.5 MB (`exp_attention_tail._read_kernel`)
and the merge kernel — one launch each between cudaProfilerStart/Stop, no PDL. Call BB timed the split kernel alone
at 11.9 us in a CUDA-graph chain and the plain read at 10.8 (128 programs) / 9.5 us (256): is the split kernel
waiting on memory latency (too few bytes in flight) or on something else?"""

import torch
import triton

from llmlab.kernels import decode_attention as da
from ncu_util import profile_once  # tools/ is the script's folder: on sys.path

import exp_attention_tail as tail  # noqa: E402  (its module-level runs are skipped: see NO_RUN there)

dev = "cuda"
B, H, Hkv, hd, S = 1, 32, 8, 128, 8192
q = torch.randn(B, H, hd, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16)
v = torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16)
x = torch.randn(2 * Hkv * S * hd, device=dev, dtype=torch.bfloat16)
out = torch.empty(512, device=dev)
scale = hd ** -0.5
da.USE_PDL = False


def split_only(bn, split_n, warps, stages):
    cfg = triton.Config({"BLOCK_N": bn, "SPLIT_N": split_n, "FUSED_MERGE": False}, num_warps=warps, num_stages=stages)

    def fn():
        real = da._merge_into
        da._merge_into = lambda *a, **kw: None
        try:
            da._decode(q, k, v, None, scale, config=cfg)
        finally:
            da._merge_into = real
    return fn


def read(programs, block, warps, stages):
    chunk = x.numel() // programs
    return lambda: tail._read_kernel[(programs,)](x, out, chunk, PDL=False, BLOCK=block, STAGES=stages,
                                                  num_warps=warps)


o_part = torch.randn(B, H, 16, hd, device=dev)
lse = torch.randn(B, H, 16, device=dev)
merged = torch.empty(B, H, hd, device=dev, dtype=torch.bfloat16)
calls = [split_only(128, 512, 4, 3), split_only(128, 512, 8, 3), split_only(64, 256, 4, 3), read(128, 8192, 8, 3),
         read(256, 4096, 8, 4), lambda: da._merge_into(o_part, lse, 16, merged)]
profile_once(calls)
