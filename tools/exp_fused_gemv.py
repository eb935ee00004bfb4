"""Device experiment (call Z): every config of the fused one-token GEMV (kernels/fused_gemv.py) at the 1B model's
decode shapes, timed by CUDA-graph replay (distinct weight copies, several times the L2), against cuBLAS bf16 and
against the config the autotuner picks (`tune_bench`). Prints tables; writes JSON to argv[1]. (Call AQ ran it at
commit f3ff082 with split-K candidates too, `... out.json splitk`: none beat the unsplit configs, and the kernel
no longer has the split.)"""

import json
import sys

import torch
import triton

from llmlab.kernels import fused_gemv as fg
from llmlab.kernels.bench_kernels import _graph_ms

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
out = []
configs = fg.CONFIGS
# (N, K, fusion) of one Llama-3.2-1B layer's four GEMVs and the LM head
SHAPES = [(3072, 2048, "norm"), (2048, 2048, "res"), (16384, 2048, "norm"), (2048, 8192, "swiglu"),
          (128256, 2048, "norm")]
for N, K, kind in SHAPES:
    copies = max(2, (256 << 20) // (N * K * 2))
    Ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    x = torch.randn(1, 2 * K if kind == "swiglu" else K, device=dev, dtype=dt)
    nw = torch.ones(K, device=dev, dtype=dt) if kind == "norm" else None
    res = torch.randn(1, N, device=dev, dtype=dt) if kind in ("res", "swiglu") else None
    prologue = fg.SWIGLU if kind == "swiglu" else fg.RMSNORM if kind == "norm" else fg.NONE
    t_bf16 = _graph_ms([lambda W=W: x[:, :K] @ W.T for W in Ws])
    t_tuned = _graph_ms([lambda W=W: fg.fused_gemv(x, W, norm_weight=nw, swiglu=kind == "swiglu", residual=res)
                         for W in Ws])
    tuned = str(fg._fused_gemv_kernel.best_config)
    ref = fg.fused_gemv_reference(x, Ws[0], norm_weight=nw, swiglu=kind == "swiglu", residual=res).float()
    rows = []
    for cfg in configs:
        meta = dict(cfg.all_kwargs())

        def launch(W, y, meta=meta):
            return lambda: fg._fused_gemv_kernel.fn[(triton.cdiv(N, meta["BLOCK_N"]),)](
                x, W, x if nw is None else nw, x if res is None else res, y, N, K, 1e-5, W.stride(0),
                PROLOGUE=prologue, HAS_RES=res is not None, PDL=False, **meta)
        y = torch.full((1, N), float("nan"), device=dev, dtype=dt)
        launch(Ws[0], y)()
        torch.cuda.synchronize()
        err = float((y.float() - ref).norm() / ref.norm())
        t = _graph_ms([launch(W, torch.empty(1, N, device=dev, dtype=dt)) for W in Ws])
        rows.append(dict(N=N, K=K, kind=kind, config=str(cfg), time_us=t * 1e3, GBps=N * K * 2 / t / 1e6,
                         rel_err=err))
    rows.sort(key=lambda r: r["time_us"])
    print(f"\n{N}x{K} {kind}: cuBLAS {t_bf16 * 1e3:.1f} us ({N * K * 2 / t_bf16 / 1e6:.0f} GB/s); tuned "
          f"{t_tuned * 1e3:.1f} us ({N * K * 2 / t_tuned / 1e6:.0f} GB/s) {tuned}")
    for r in rows[:8]:
        print(f"  {r['time_us']:7.1f} us {r['GBps']:6.0f} GB/s err {r['rel_err']:.1e} {r['config']}")
    out.append(dict(N=N, K=K, kind=kind, cublas_us=t_bf16 * 1e3, tuned_us=t_tuned * 1e3, tuned=tuned, configs=rows))
    del Ws
json.dump(out, open(sys.argv[1], "w"), indent=1)
