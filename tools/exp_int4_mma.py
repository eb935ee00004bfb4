"""Device experiment (call AF, session 6): the tensor-core int4 GEMV (`kernels/int4_mma_gemv.py`, weights in the
mma fragment order) against cuBLAS bf16 and the CUDA-core int4 GEMV (`int4_matmul`, autotuned), M = 1, group 128,
at Llama-3.1-8B's shapes: every config timed by CUDA-graph replay over 8 weight copies (> 4x the L2), each checked
against x @ dequant(W)^T; then the autotuned wrapper. Prints the layout Triton gave the inline asm's operands (the
kernel needs lane l to hold words 4l..4l+3). Writes JSON to argv[1]."""

import json
import re
import sys

import torch
import triton

from llmlab.kernels import dequant_matmul as dq
from llmlab.kernels import int4_mma_gemv as mm
from llmlab.kernels.bench_kernels import _graph_ms

torch.manual_seed(0)
dev = "cuda"
SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096)]
COPIES = 8
out = {"rows": [], "layout": None}


def raw(x, w, s, y, cfg, N, K):
    ws, cnt = dq._scratch(x.device, N)
    meta = dict(cfg.all_kwargs())
    grid = (triton.cdiv(N // 16, meta["RB"]), meta["SPLIT_K"])
    return lambda: mm._int4_mma_gemv_kernel.fn[grid](x, w, s, y, ws, cnt, N, K, s.stride(0), s.stride(1),
                                                     ws.stride(0), GROUP=128, BF16=x.dtype == torch.bfloat16, **meta)


for N, K in SHAPES:
    W = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    dense = [W.clone() for _ in range(COPIES)]
    t_bf16 = _graph_ms([lambda Wd=Wd: x @ Wd.T for Wd in dense])
    del dense
    packed, sc = dq.quantize_int4(W, 128)
    ref = dq.dequant_matmul_reference(x.float(), dq.dequantize_int4(packed, sc)).float()
    sets = [(packed.clone(), sc.clone()) for _ in range(COPIES)]
    t_cc = _graph_ms([lambda a=a, b=b: dq.int4_matmul(x, a, b) for a, b in sets])
    msets = [(mm.repack_int4_mma(a), b) for a, b in sets]
    nbytes = packed.numel() + sc.numel() * 4
    print(f"\n{N}x{K}: bf16 cuBLAS {t_bf16 * 1e3:.1f} us; CUDA-core int4 GEMV {t_cc * 1e3:.1f} us "
          f"(x{t_bf16 / t_cc:.2f})")
    rows = []
    for cfg in mm._prune(mm.MMA_CONFIGS, {"K": K}, GROUP=128):
        try:
            y = torch.full((1, N), float("nan"), device=dev, dtype=torch.bfloat16)
            ck = raw(x, msets[0][0], msets[0][1], y, cfg, N, K)()
            torch.cuda.synchronize()
            if out["layout"] is None and hasattr(ck, "asm"):
                out["layout"] = [ln.strip()[-160:] for ln in ck.asm["ttgir"].splitlines()
                                 if re.match(r"#blocked\d* =", ln.strip())]
                print("layouts:", *out["layout"], sep="\n  ")
            err = float((y.float() - ref).norm() / ref.norm())
            t = _graph_ms([raw(x, a, b, torch.empty(1, N, device=dev, dtype=torch.bfloat16), cfg, N, K)
                           for a, b in msets])
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(dict(N=N, K=K, config=str(cfg), time_us=t * 1e3, GBps=nbytes / t / 1e6,
                         speedup_vs_bf16=t_bf16 / t, vs_cuda_core=t_cc / t, rel_err=err))
    rows.sort(key=lambda r: r["time_us"])
    for r in rows:
        print(f"  {r['time_us']:6.1f} us {r['GBps']:6.0f} GB/s x{r['speedup_vs_bf16']:.2f} bf16 "
              f"x{r['vs_cuda_core']:.2f} CUDA-core err {r['rel_err']:.1e}  {r['config'].split(', num_ctas')[0]}")
    mm._int4_mma_gemv_kernel.cache.clear()
    y = mm.int4_mma_gemv(x, msets[0][0], msets[0][1])
    err = float((y.float() - ref).norm() / ref.norm())
    t = _graph_ms([lambda a=a, b=b: mm.int4_mma_gemv(x, a, b) for a, b in msets])
    print(f"  autotuned wrapper: {t * 1e3:.1f} us x{t_bf16 / t:.2f} bf16, err {err:.1e}, "
          f"{str(mm._int4_mma_gemv_kernel.best_config).split(', num_ctas')[0]}")
    out["rows"] += rows
    out["rows"].append(dict(N=N, K=K, config="autotuned", time_us=t * 1e3, speedup_vs_bf16=t_bf16 / t,
                            vs_cuda_core=t_cc / t, rel_err=err, bf16_us=t_bf16 * 1e3, cuda_core_us=t_cc * 1e3))
    del W, sets, msets
out["versions"] = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
json.dump(out, open(sys.argv[1], "w"), indent=1)
