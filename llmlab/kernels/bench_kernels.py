"""Micro-benchmarks of the Triton kernels against their PyTorch references, written as an llmlab bench file.

    python -m llmlab.kernels.bench_kernels --out results/        # on a CUDA GPU: bf16, realistic sizes
    python -m llmlab.kernels.bench_kernels --smoke --out /tmp/x  # anywhere: tiny sizes, checks the file's shape

Each row is `llmlab.measure.bench_file.result_row(workload=<op>, step="triton" | "pytorch", ...)` with
`bw_fraction` = achieved GB/s / measured copy GB/s (bytes the op must move: its inputs read once, outputs written
once — the same count for both implementations, so the fraction compares them fairly), and for the weight-only
matmuls `speedup_vs_bf16` = time of `x @ W.T` in bf16 / time of the kernel.

On a GPU `time_ms` is the GPU time per call from CUDA-graph replay. On a CPU (Triton's interpreter, which needs
TRITON_INTERPRET=1 set before triton is imported; without it the command prints what to set and exits with
status 2) it is the wall-clock time of a few calls, everything runs in fp32 — the dense baseline of
`speedup_vs_bf16` too, the key keeps its name — and the numbers say nothing about speed: the file's `notes` say so.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _graph_ms(fns, reps: int = 20) -> float:
    """GPU time of one call (ms): every fn in `fns` (the same op on distinct buffers) captured in one CUDA graph,
    the graph replayed `reps` times, the time divided by reps x len(fns).

    This is how the kernels run inside a decode step (`llmlab.runtime.cuda_graphs`): with the host's launch cost gone, the
    time is the kernel's own. The distinct buffers add up to 4x the L2 cache (at most 64 of them, so an op under
    1/16 of L2 stays smaller), so each large call reads from HBM as a model's layers do (one layer's K/V or
    weights are not the next layer's).
    """
    for fn in fns:  # compile (and autotune) outside the capture
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / len(fns)


def _eager_ms(fn) -> float:
    """Time of one call launched from Python (ms, median of triton's do_bench): host launch cost included."""
    from triton.testing import do_bench

    return do_bench(fn)


def _cpu_ms(fn, reps: int = 3) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def _check(kernel, reference, tol: float = 2e-2) -> float:
    """max |kernel - reference| / max |reference|; raises AssertionError above `tol` (a benchmark of a wrong
    kernel is worthless: the tuned configs are checked here, where they are chosen)."""
    got, want = kernel().float(), reference().float()
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
    if not err <= tol:  # also catches NaN
        raise AssertionError(f"kernel differs from its reference: max relative error {err:.3g} > {tol}")
    return err


def _copies(nbytes: int, device: str) -> int:
    """How many distinct buffers make the working set >= 4 x L2, at most 64 (1 on a CPU): an op under 1/16 of L2
    runs from a working set below 4 x L2, partly from the L2."""
    if device != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(64, -(-4 * l2 // max(nbytes, 1))))


def run(device: str, smoke: bool, ops: str = "all") -> list[dict]:
    """The rows of the bench file. ops: "all", or a comma list of "elementwise", "attention", "matmul", "gemv"."""
    want = {"elementwise", "attention", "matmul", "gemv"} if ops == "all" else set(ops.split(","))
    from llmlab.measure.bench_file import result_row

    from llmlab.sampling import argmax_rows

    from .argmax import argmax
    from .decode_attention import decode_attention, decode_attention_reference
    from .fused_gemv import fused_gemv, fused_gemv_reference
    from .int4_matmul import gluon_gemv_status, int4_matmul
    from .int8_matmul import int8_matmul
    from .rmsnorm import rmsnorm, rmsnorm_reference
    from .rope import rope_, rope_reference
    from .swiglu import swiglu, swiglu_reference
    from .weight_quant import dequant_matmul_reference, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

    gpu = device == "cuda"
    dt = torch.bfloat16 if gpu else torch.float32
    label = "fp32" if dt == torch.float32 else "bf16"
    es = torch.empty((), dtype=dt).element_size()
    rows = []

    def timed(make, nbytes):
        """make() -> (triton_fn, torch_fn) on fresh buffers. Returns {impl: (graph ms, eager ms)}."""
        if not gpu:
            t, p = make()
            return {"triton": (_cpu_ms(t), None), "pytorch": (_cpu_ms(p), None)}
        sets = [make() for _ in range(_copies(nbytes, device))]
        out = {impl: (_graph_ms([s[i] for s in sets]), _eager_ms(sets[0][i]))
               for i, impl in enumerate(("triton", "pytorch"))}
        del sets
        torch.cuda.empty_cache()
        return out

    def add(op, shape, nbytes, make, **extra):
        for step, (t, t_eager) in timed(make, nbytes).items():
            rows.append(result_row(workload=op, model="-", step=step, batch_size=None, weights=label,
                                   time_ms=t, time_ms_eager=t_eager, GBps=nbytes / t / 1e6, bytes=nbytes,
                                   shape=shape, **extra))

    def rand(*shape, dtype=dt):
        return torch.randn(*shape, device=device, dtype=dtype)

    D, N, H, Hkv, hd = (64, 96, 4, 2, 16) if smoke else (4096, 14336, 32, 8, 128)  # Llama-3.1-8B's shapes
    for n_rows in ((1, 4) if smoke else (1, 16, 16384)) if "elementwise" in want else ():
        def make_norm(n_rows=n_rows):
            x, w = rand(n_rows, D), rand(D)
            return (lambda: rmsnorm(x, w)), (lambda: rmsnorm_reference(x, w))
        add("rmsnorm", [n_rows, D], (2 * n_rows * D + D) * es, make_norm)

        def make_swiglu(n_rows=n_rows):
            g, u = rand(n_rows, N), rand(n_rows, N)
            return (lambda: swiglu(g, u)), (lambda: swiglu_reference(g, u))
        add("swiglu", [n_rows, N], 3 * n_rows * N * es, make_swiglu)
    V = 1000 if smoke else 128256  # Llama 3's vocabulary: the greedy token after the LM head
    for n_rows in ((1,) if smoke else (1, 64)) if "elementwise" in want else ():
        def make_argmax(n_rows=n_rows):
            x = rand(n_rows, V)
            return (lambda: argmax(x)), (lambda: argmax_rows(x))  # the PyTorch path of llmlab.sampling
        add("argmax", [n_rows, V], n_rows * V * es, make_argmax)
        rows[-2]["max_rel_err"] = _check(*make_argmax(), tol=0.0)  # the same indices
    for T in ((1, 8) if smoke else (1, 16384)) if "elementwise" in want else ():
        def make_rope(T=T):
            q, k = rand(1, T, H, hd).transpose(1, 2), rand(1, T, Hkv, hd).transpose(1, 2)
            ang = torch.randn(T, hd // 2, device=device).repeat(1, 2)
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            return (lambda: rope_(q, k, cos, sin)), (lambda: (rope_reference(q, cos, sin), rope_reference(k, cos, sin)))
        add("rope", [1, H, T, hd], (2 * T * (H + Hkv) * hd + 2 * T * hd) * es, make_rope)
    for S in ((40,) if smoke else (1024, 8192, 16384, 32768)) if "attention" in want else ():
        def make_attn(S=S):
            q, k, v = rand(1, H, hd), rand(1, Hkv, S, hd), rand(1, Hkv, S, hd)
            return (lambda: decode_attention(q, k, v)), (lambda: decode_attention_reference(q, k, v))
        add("decode_attention", [1, H, Hkv, S, hd], 2 * Hkv * S * hd * es, make_attn)
        rows[-2]["max_rel_err"] = _check(*make_attn())  # the autotuned kernel, against SDPA

    # the batch-1 decode GEMVs of Llama-3.2-1B with their fused prologue/epilogue, against the unfused ops (cuBLAS)
    gemvs = [(96, 64, "norm")] if smoke else [(3072, 2048, "norm"), (2048, 2048, "residual"),
                                              (16384, 2048, "norm+swiglu_out"), (2048, 8192, "residual")]
    for Ng, Kg, fusion in gemvs if "gemv" in want else ():
        def make_gemv(Ng=Ng, Kg=Kg, fusion=fusion):
            w, x = rand(Ng, Kg) * Kg ** -0.5, rand(1, 2 * Kg if "swiglu+" in fusion else Kg)
            kw = dict(norm_weight=rand(Kg) if "norm" in fusion else None, swiglu="swiglu+" in fusion,
                      residual=rand(1, Ng) if "residual" in fusion else None, swiglu_out="swiglu_out" in fusion)
            return (lambda: fused_gemv(x, w, **kw)), (lambda: fused_gemv_reference(x, w, **kw))
        add("fused_gemv", [1, Ng, Kg], Ng * Kg * es, make_gemv, fusion=fusion)
        rows[-2]["max_rel_err"] = _check(*make_gemv())

    # weight-only matmuls at decode (M = 1..16): Llama-3.1-8B's layer shapes (N, K), group size 128
    shapes = [(96, 128)] if smoke else [(14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]
    group = 32 if smoke else 128
    for Nw, Kw in shapes if "matmul" in want else ():
        for M in ((1,) if smoke or (Nw, Kw) != (14336, 4096) else (1, 4, 16)):
            W = rand(Nw, Kw)
            w8, s8 = quantize_int8(W)
            w4, s4 = quantize_int4(W, group)
            del W
            variants = {"dense_matmul": (Nw * Kw * es, label),
                        "int8_matmul": (w8.numel() + s8.numel() * 4, "int8"),
                        "int4_matmul": (w4.numel() + s4.numel() * 4, "int4")}
            times = {}
            for op, (wbytes, wlabel) in variants.items():
                def make(op=op):
                    x = rand(M, Kw)
                    if op == "dense_matmul":
                        Wd = rand(Nw, Kw)
                        fn = lambda: x @ Wd.T  # noqa: E731
                    elif op == "int8_matmul":
                        a, b = w8.clone(), s8.clone()
                        fn = lambda: int8_matmul(x, a, b)  # noqa: E731
                    else:
                        a, b = w4.clone(), s4.clone()
                        fn = lambda: int4_matmul(x, a, b)  # noqa: E731
                    return fn, fn
                t, t_eager = timed(make, wbytes)["triton"]
                times[op] = t
                rows.append(result_row(workload=op, model="-", step="pytorch" if op == "dense_matmul" else "triton",
                                       batch_size=M, weights=wlabel, time_ms=t, time_ms_eager=t_eager,
                                       GBps=wbytes / t / 1e6, bytes=wbytes, shape=[M, Nw, Kw],
                                       group_size=group if op == "int4_matmul" else None))
                if op == "int4_matmul" and M == 1:  # which GEMV int4_matmul ran (see int4_matmul.USE_GLUON)
                    rows[-1]["kernel"] = "gluon" if gluon_gemv_status(device) == "gluon" else "triton"
            for r in rows[-3:]:
                r["speedup_vs_bf16"] = times["dense_matmul"] / r["time_ms"]
            x = rand(M, Kw)  # the autotuned kernels, against x @ dequant(W)^T in fp32
            rows[-2]["max_rel_err"] = _check(lambda: int8_matmul(x, w8, s8),
                                             lambda: dequant_matmul_reference(x, dequantize_int8(w8, s8)))
            rows[-1]["max_rel_err"] = _check(lambda: int4_matmul(x, w4, s4),
                                             lambda: dequant_matmul_reference(x, dequantize_int4(w4, s4)))
    return rows


def notes_for(device: str, smoke: bool) -> list[str]:
    """The bench file's notes: what was measured, and how, on this device."""
    notes = ["kernel micro-benchmarks (llmlab.kernels.bench_kernels); bw_fraction = GBps / peaks.copy_GBps, bytes "
             "= inputs read once + outputs written once; speedup_vs_bf16 = dense x @ W.T time / kernel time"]
    if device == "cuda":
        notes.append("time_ms: GPU time per call from CUDA-graph replay (as inside a captured decode step), over "
                     "distinct buffers adding up to >= 4x the L2 cache (at most 64 buffers: ops under 1/16 of L2 "
                     "stay below it); time_ms_eager: the same call launched from "
                     "Python (triton.testing.do_bench), host launch cost included")
    else:
        notes.append("CPU run: time_ms is the wall-clock time per call (mean of 3 calls after a warm-up), the Triton "
                     "kernels in Triton's interpreter (TRITON_INTERPRET=1, numpy) and the PyTorch references eagerly, "
                     "all in fp32; time_ms_eager is not measured; the numbers say nothing about the kernels' speed")
        notes.append("on a CPU the dense baseline of speedup_vs_bf16 is fp32, not bf16 (the key keeps its name)")
    if smoke:
        notes.append("smoke run: tiny sizes, numbers meaningless")
    return notes


def main(argv=None) -> int:
    """The command; returns the exit status (2, with a one-line error, where the kernels cannot run here)."""
    from llmlab.measure.bench_file import bench_document, bench_filename, peaks_dict, save_bench

    from ._util import interpret_mode, triton_status

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results", help="folder for the bench JSON file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (seconds, also on a CPU via the interpreter: set TRITON_INTERPRET=1)")
    p.add_argument("--copy-gbps", type=float, default=None,
                   help="copy bandwidth to compare with (GB/s); default: measured (llmlab.measure.peaks)")
    p.add_argument("--ops", default="all", help="all, or a comma list of elementwise, attention, matmul, gemv")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok, why = triton_status()
    if not ok:
        if device == "cpu" and not interpret_mode():
            why = ("no CUDA GPU here and TRITON_INTERPRET is not set: run the kernels in Triton's CPU interpreter "
                   "with `TRITON_INTERPRET=1 python -m llmlab.kernels.bench_kernels --smoke` (slow, fp32, the times "
                   "say nothing about speed)")
        print(f"bench_kernels: error: {why}", file=sys.stderr)
        return 2
    rows = run(device, a.smoke, a.ops)
    if a.copy_gbps is not None:
        peaks = {"copy_GBps": a.copy_gbps, "bf16_TFLOPs": 0.0, "note": "copy_GBps given on the command line"}
    else:
        peaks = peaks_dict(torch.device(device))
    for r in rows:
        r["bw_fraction"] = r["GBps"] / peaks["copy_GBps"] if peaks["copy_GBps"] else None
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    doc = bench_document(rows, device=name, peaks=peaks, notes=notes_for(device, a.smoke))
    path = save_bench(doc, f"{a.out}/{bench_filename(name, 'kernels', 'micro')}")
    for r in rows:
        eager = f" (eager {r['time_ms_eager'] * 1e3:6.1f})" if r.get("time_ms_eager") else ""
        print(f"{r['workload']:17s} {r['step']:8s} {str(r['shape']):24s} {r['time_ms'] * 1e3:9.1f} us{eager} "
              f"{r['GBps']:8.1f} GB/s  bw_fraction {r['bw_fraction'] or 0:.2f}"
              + (f"  x{r['speedup_vs_bf16']:.2f} vs {'bf16' if device == 'cuda' else 'fp32'}"
                 if r.get("speedup_vs_bf16") else ""))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
