"""Micro-benchmarks of the Triton kernels against their PyTorch references, written as an llmlab bench file.

    python -m llmlab.kernels.bench_kernels --out results/        # on a CUDA GPU: bf16, realistic sizes
    python -m llmlab.kernels.bench_kernels --smoke --out /tmp/x  # anywhere: tiny sizes, checks the file's shape

Each row is `llmlab.bench.result_row(workload=<op>, step="triton" | "pytorch", ...)` with
`bw_fraction` = achieved GB/s / measured copy GB/s (bytes the op must move: its inputs read once, outputs written
once — the same count for both implementations, so the fraction compares them fairly), and for the weight-only
matmuls `speedup_vs_bf16` = time of `x @ W.T` in bf16 / time of the kernel.
"""

from __future__ import annotations

import argparse
import time

import torch


def _timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn)  # ms, median
    def cpu(fn, reps=3):
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3
    return cpu


def run(device: str, smoke: bool) -> list[dict]:
    from llmlab.bench import result_row

    from .decode_attention import decode_attention, decode_attention_reference
    from .dequant_matmul import int4_matmul, int8_matmul, quantize_int4, quantize_int8
    from .rmsnorm import rmsnorm, rmsnorm_reference
    from .rope import rope_, rope_reference
    from .swiglu import swiglu, swiglu_reference

    ms = _timer(device)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    label = "fp32" if dt == torch.float32 else "bf16"
    es = torch.empty((), dtype=dt).element_size()
    rows = []

    def add(op, shape, nbytes, t_triton, t_torch, **extra):
        for step, t in (("triton", t_triton), ("pytorch", t_torch)):
            rows.append(result_row(workload=op, model="-", step=step, batch_size=None, weights=label,
                                   time_ms=t, GBps=nbytes / t / 1e6, shape=shape, **extra.get(step, {})))

    D, N, H, Hkv, hd = (64, 96, 4, 2, 16) if smoke else (4096, 14336, 32, 8, 128)
    for rows_ in ((1, 4) if smoke else (1, 16, 4096)):
        x = torch.randn(rows_, D, device=device, dtype=dt)
        w = torch.randn(D, device=device, dtype=dt)
        add("rmsnorm", [rows_, D], 2 * x.numel() * es + D * es, ms(lambda: rmsnorm(x, w)),
            ms(lambda: rmsnorm_reference(x, w)))
        g, u = torch.randn(rows_, N, device=device, dtype=dt), torch.randn(rows_, N, device=device, dtype=dt)
        add("swiglu", [rows_, N], 3 * g.numel() * es, ms(lambda: swiglu(g, u)), ms(lambda: swiglu_reference(g, u)))
    for T in ((1, 8) if smoke else (1, 4096)):
        q = torch.randn(1, T, H, hd, device=device, dtype=dt).transpose(1, 2)
        k = torch.randn(1, T, Hkv, hd, device=device, dtype=dt).transpose(1, 2)
        ang = torch.randn(T, hd // 2, device=device).repeat(1, 2)
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        nbytes = 2 * (q.numel() + k.numel()) * es + cos.numel() * es
        add("rope", [1, H, T, hd], nbytes, ms(lambda: rope_(q, k, cos, sin)),
            ms(lambda: (rope_reference(q, cos, sin), rope_reference(k, cos, sin))))
    for S in ((40,) if smoke else (1024, 8192, 32768)):
        q = torch.randn(1, H, hd, device=device, dtype=dt)
        k = torch.randn(1, Hkv, S, hd, device=device, dtype=dt)
        v = torch.randn_like(k)
        add("decode_attention", [1, H, Hkv, S, hd], 2 * k.numel() * es, ms(lambda: decode_attention(q, k, v)),
            ms(lambda: decode_attention_reference(q, k, v)))
    Nw, Kw = (96, 128) if smoke else (14336, 4096)
    W = torch.randn(Nw, Kw, device=device, dtype=dt)
    w8, s8 = quantize_int8(W)
    w4, s4 = quantize_int4(W, 128 if not smoke else 32)
    for M in ((1,) if smoke else (1, 4, 16)):
        x = torch.randn(M, Kw, device=device, dtype=dt)
        t_dense = ms(lambda: x @ W.T)
        for op, fn, wbytes in (("int8_matmul", lambda: int8_matmul(x, w8, s8), w8.numel() + s8.numel() * 4),
                               ("int4_matmul", lambda: int4_matmul(x, w4, s4), w4.numel() + s4.numel() * 4)):
            t = fn_t = ms(fn)
            rows.append(result_row(workload=op, model="-", step="triton", batch_size=M, weights=op[:4],
                                   time_ms=fn_t, GBps=wbytes / t / 1e6, speedup_vs_bf16=t_dense / t,
                                   shape=[M, Nw, Kw]))
        rows.append(result_row(workload="dense_matmul", model="-", step="pytorch", batch_size=M, weights=label,
                               time_ms=t_dense, GBps=W.numel() * es / t_dense / 1e6, speedup_vs_bf16=1.0,
                               shape=[M, Nw, Kw]))
    return rows


def main(argv=None) -> None:
    from llmlab.bench import bench_document, bench_filename, peaks_dict, save_bench

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results", help="folder for the bench JSON file")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds, also on a CPU via the interpreter)")
    p.add_argument("--copy-gbps", type=float, default=None,
                   help="copy bandwidth to compare with (GB/s); default: measured (llmlab.peaks)")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run(device, a.smoke)
    if a.copy_gbps is not None:
        peaks = {"copy_GBps": a.copy_gbps, "bf16_TFLOPs": 0.0, "note": "copy_GBps given on the command line"}
    else:
        peaks = peaks_dict(torch.device(device))
    for r in rows:
        r["bw_fraction"] = r["GBps"] / peaks["copy_GBps"] if peaks["copy_GBps"] else None
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    notes = ["kernel micro-benchmarks (llmlab.kernels.bench_kernels); bw_fraction = GBps / peaks.copy_GBps, bytes "
             "= inputs read once + outputs written once; speedup_vs_bf16 = dense x @ W.T time / kernel time"]
    if a.smoke:
        notes.append("smoke run: tiny sizes, numbers meaningless")
    doc = bench_document(rows, device=name, peaks=peaks, notes=notes)
    path = save_bench(doc, f"{a.out}/{bench_filename(name, 'kernels', 'micro')}")
    for r in rows:
        print(f"{r['workload']:17s} {r['step']:8s} {str(r['shape']):24s} {r['time_ms'] * 1e3:9.1f} us "
              f"{r['GBps']:8.1f} GB/s  bw_fraction {r['bw_fraction'] or 0:.2f}"
              + (f"  x{r['speedup_vs_bf16']:.2f} vs bf16" if r.get("speedup_vs_bf16") else ""))
    print("wrote", path)


if __name__ == "__main__":
    main()
