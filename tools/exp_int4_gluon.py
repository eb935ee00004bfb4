"""Device experiment (session 19): the input-stationary int4 GEMV with its per-chunk row sums written out in Gluon.

Issue 5 asks for an int4 GEMV at >= 3x cuBLAS's bf16 GEMV (M = 1, Llama-3.1-8B layer shapes, group 128). The
package's Triton kernel (`_int4_gemv_is_kernel` in kernels/dequant_matmul.py) reaches 2.28-2.50x; the CUDA C++ build
of the same design (`tools/exp_int4_xstat.cu`) 2.7-3.0x in the same calls. Reading the two side by side (session 18),
the difference is the per-chunk reduction: Triton 3.6 sums each of the R rows with a 5-step butterfly in every warp,
then through shared memory twice (3 barriers); the CUDA kernel transposes R rows across lanes so each step halves the
values a lane holds, and crosses warps through one double-buffered shared array (1 barrier).

Gluon (`triton.experimental.gluon`, shipped with Triton 3.6) lets a kernel name its layouts. Here:
- the weights are an (R, 4Q) tile of int32 words in registers, rows in each thread, 16 bytes of a row per thread
  (slot q = s * 32 * NW + warp * 32 + lane owns k in [32q, 32q + 32)), and x's 32 lifted values per slot are put in
  the same distribution (the conversions are checked trivial: no data moves);
- per chunk, the (R, Q) sums are viewed as (R, Q // 32, 32) and converted to a layout where rows sit on lanes and
  32 / R lane-values sit in registers (an in-warp transpose), summed in the thread and over the remaining lanes,
  then crossed over warps through two shared arrays used alternately (the loop runs two chunks per turn), so each
  chunk has one barrier.
The math per weight is the package kernel's (`_field`, `_lift`: a mask and an FMA per weight, the codes' offset of 8
taken off once per row as 8 x the slot's x sum).

    /tmp/t36/bin/python tools/exp_int4_gluon.py --inspect      # compile for sm_90a on a CPU machine (Triton 3.6)
    python3 tools/exp_int4_gluon.py OUT.json [libxstat.so]      # on the GPU: sweep against the package and CUDA
"""

import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# The pieces shared with the package's kernel (kernels/int4_gemv_gluon.py, which this experiment led to): the math
# per word, x's lifted partners, a chunk's loads, its in-warp row sums and the cross-warp step. (Calls CN-CR ran this
# file at the commits named in data/runs/2026-12-02_h200_session19.md, when it still carried its own copies.)
from llmlab.kernels.int4_gemv_gluon import _chunk, _pdl, _slots, _x_once  # noqa: E402
from llmlab.kernels.int4_gemv_gluon import _chunk_sums as _row_sums  # noqa: E402
from llmlab.kernels.int4_gemv_gluon import _layouts as layouts  # noqa: E402
from llmlab.kernels.int4_gemv_gluon import _store_rows as _finish  # noqa: E402


@gluon.jit
def int4_gemv_gluon_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    N, K,
    stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_sg, stride_yn,
    GROUP: gl.constexpr, R: gl.constexpr, Q: gl.constexpr, PDL: gl.constexpr, ONE: gl.constexpr,
    LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr, LT: gl.constexpr,
):
    LQ: gl.constexpr = gl.SliceLayout(0, LA)
    SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    buf0 = gl.allocate_shared_memory(gl.float32, [R, Q // 32], SH)
    buf1 = gl.allocate_shared_memory(gl.float32, [R, Q // 32], SH)

    rw, q_ok, grp = _slots(K, GROUP, Q, LW, LQ)
    w_words = w_ptr.to(gl.pointer_type(gl.int32))
    n_chunks = (N + R - 1) // R
    c = gl.program_id(0)
    step = gl.num_programs(0)
    if PDL:
        _pdl(False)
    wa, sa = _chunk(w_words, s_ptr, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PDL:
        _pdl(True)
    off, a0, a1, a2, a3 = _x_once(x_ptr, K, stride_xk, Q, LX, LQ)
    if ONE:  # one chunk per turn, the two shared arrays picked by the turn's parity
        buf = gl.allocate_shared_memory(gl.float32, [2, R, Q // 32], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        it = 0
        for c in range(c, n_chunks, step):
            wb, sb = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
            p = _row_sums(wa, sa, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            _finish(p, buf.index(it % 2), y_ptr, c, N, stride_yn, LT, R)
            wa = wb
            sa = sb
            it += 1
    else:
        for c in range(c, n_chunks, 2 * step):
            wb, sb = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
            p = _row_sums(wa, sa, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            _finish(p, buf0, y_ptr, c, N, stride_yn, LT, R)
            wa, sa = _chunk(w_words, s_ptr, c + 2 * step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW,
                            LA)
            if c + step < n_chunks:  # the same for the whole program: its barrier is reached by all threads or none
                p = _row_sums(wb, sb, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
                _finish(p, buf1, y_ptr, c + step, N, stride_yn, LT, R)


def launch(x, packed, scales, y, R=8, programs=None, pdl=True, warps=None, one=False, maxnreg=None):
    """x (1, K) bf16/fp16/fp32, packed (N, K // 2) uint8, scales (N, K // G) fp32 -> y (1, N). programs: a count,
    or "balanced": the fewest programs that keep the most chunks per program what one resident wave gives."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    Q = max(32, triton.next_power_of_2(K // 32))
    NW = warps or min(16, Q // 32)
    S = Q // (32 * NW)
    chunks = triton.cdiv(N, R)
    kw = {"launch_pdl": True} if pdl else {}
    if maxnreg:
        kw["maxnreg"] = maxnreg
    args = (x, packed, scales, y, N, K, x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1),
            y.stride(1))
    meta = dict(GROUP=G, R=R, PDL=pdl, ONE=one, num_warps=NW, **layouts(R, NW, S), **kw)
    if programs is None or programs == "balanced":
        wave = occupancy(args, meta, NW) * torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = triton.cdiv(chunks, triton.cdiv(chunks, wave)) if programs == "balanced" else wave
    int4_gemv_gluon_kernel[(max(1, min(programs, chunks)),)](*args, **meta)
    return y


_OCC = {}


def occupancy(args, meta, NW) -> int:
    """Programs of this compiled kernel that fit one SM at once (registers and warps; its shared memory is small)."""
    key = (tuple(a.shape if hasattr(a, "shape") else a for a in args[4:6]), tuple(sorted(
        (k, str(v)) for k, v in meta.items())))
    if key not in _OCC:
        k = int4_gemv_gluon_kernel.warmup(*args, grid=(1,), **meta)
        k._init_handles()  # loads the binary, which sets n_regs
        regs = max(k.n_regs, 1)
        _OCC[key] = max(1, min(65536 // (regs * 32 * NW), 64 // NW, 32))
    return _OCC[key]


def inspect() -> None:
    """Compile for sm_90a without a GPU; print registers, spills and the SASS opcode mix of the loop."""
    import collections
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = int4_gemv_gluon_kernel
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16"}
    cases = [(4096, 8, 4, 1), (4096, 4, 4, 1), (4096, 8, 2, 2), (4096, 4, 2, 2), (14336, 4, 16, 1), (14336, 4, 8, 2)]
    if os.environ.get("CASES"):  # e.g. CASES="14336,4,4,4;14336,2,4,4": K, R, warps, slots per thread
        cases = [tuple(int(v) for v in c.split(",")) for c in os.environ["CASES"].split(";")]
    for K, R, NW, S in cases:
        constexprs = {"GROUP": 128, "R": R, "PDL": True, "ONE": bool(os.environ.get("ONE")), "stride_xk": 1, "stride_sg": 1, "stride_yn": 1,
                      "stride_wn": K // 8, "stride_sn": K // 128,
                      **layouts(R, NW, S)}
        sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if sig[a] != "constexpr" and a != "N"}
        try:
            k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": NW, "num_stages": 1, **({"maxnreg": int(os.environ["MAXNREG"])} if os.environ.get("MAXNREG") else {})})
        except Exception as e:  # noqa: BLE001
            print(f"K={K} R={R} NW={NW} S={S}: FAILED {str(e)[-1500:]}")
            continue
        cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([cuobj, "-sass", f.name], capture_output=True, text=True).stdout
            res = subprocess.run([cuobj, "-res-usage", f.name], capture_output=True, text=True).stdout
        if os.environ.get("DUMP"):
            open(f"/tmp/gluon_{K}_{R}_{NW}.sass", "w").write(sass)
            open(f"/tmp/gluon_{K}_{R}_{NW}.ttgir", "w").write(k.asm["ttgir"])
        lines = sass.splitlines()
        ops = [re.search(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln) for ln in lines]
        info = ""
        for line in lines:
            m = re.search(r"/\*([0-9a-f]{4})\*/.*BRA (0x[0-9a-f]+)", line)
            if m and int(m.group(2), 16) < int(m.group(1), 16):
                lo, hi = int(m.group(2), 16), int(m.group(1), 16)
                loop = collections.Counter(o.group(2) for o in ops if o and lo <= int(o.group(1), 16) <= hi)
                n = sum(loop.values())
                info += f"\n  loop: {n} instructions, {n / (2 * R * 32 * S):.2f} per weight: " + ", ".join(
                    f"{k} {v}" for k, v in sorted(loop.items(), key=lambda t: -t[1])[:24])
        print(f"K={K} R={R} NW={NW} S={S}:", " ".join(re.findall(r"REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+", res)),
              info, flush=True)


def check_gpu() -> float:
    """The Gluon kernel against x @ dequant(W)^T (fp32) over odd shapes; returns the worst relative error."""
    from llmlab.kernels.dequant_matmul import dequant_matmul_reference, dequantize_int4, quantize_int4
    torch.manual_seed(0)
    worst = 0.0
    for N, K, G, R, NW, progs, dt in ((17, 64, 32, 4, None, 3, torch.float32), (1001, 4096, 128, 8, None, 7, torch.bfloat16),
                                      (999, 14336, 128, 4, None, 5, torch.float16), (64, 96, 32, 8, None, 2, torch.float32),
                                      (300, 4096, 256, 8, 2, 9, torch.bfloat16), (4095, 8192, 64, 4, None, 264, torch.bfloat16),
                                      (7, 1024, 128, 8, None, 1, torch.float16), (129, 2048, 32, 4, 2, 1000, torch.float32)):
        w4, s4 = quantize_int4(torch.randn(N, K, device="cuda"), G)
        x = (torch.randn(1, K, device="cuda") * 3).to(dt)
        ref = dequant_matmul_reference(x.float(), dequantize_int4(w4, s4))
        for one, progs_ in ((False, progs), (True, progs), (False, "balanced")):
            y = torch.full((1, N), float("nan"), device="cuda", dtype=dt)
            launch(x, w4, s4, y, R=R, programs=progs_, warps=NW, one=one)
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            worst = max(worst, err)
            print(f"check N={N} K={K} G={G} R={R} NW={NW} programs={progs_} one={one} {dt}: max rel err {err:.1e}",
                  flush=True)
    return worst


def main() -> None:
    """Time the Gluon kernel's configs beside int4_matmul as shipped, the package's Triton input-stationary kernel
    at a few configs, and the CUDA build (`tools/exp_int4_xstat.cu`), by CUDA-graph replay as bench_kernels does."""
    import ctypes
    import subprocess

    from llmlab.kernels import dequant_matmul as dq
    from llmlab.kernels.bench_kernels import _copies, _graph_ms
    from llmlab.kernels.dequant_matmul import dequant_matmul_reference, dequantize_int4, int4_matmul, quantize_int4
    out_path = sys.argv[1]
    so = sys.argv[2] if len(sys.argv) > 2 else "/tmp/libxstat.so"
    here = os.path.dirname(os.path.abspath(__file__))
    lib = None
    if os.environ.get("SWEEP") not in ("cq", "cr"):  # those sweeps time no CUDA build
        if not os.path.exists(so):
            subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared",
                            "-Xcompiler", "-fPIC", "-o", so, os.path.join(here, "exp_int4_xstat.cu")], check=True)
        lib = ctypes.CDLL(so)
        lib.int4_gemv_xstat_cuda.restype = ctypes.c_int
        lib.int4_gemv_xstat_cuda.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 7 + [ctypes.c_void_p]
        lib.int4_gemv_xstat_occupancy.restype = ctypes.c_int
        lib.int4_gemv_xstat_occupancy.argtypes = [ctypes.c_int] * 3
    dev, G = "cuda", 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("LLMLAB_COMMIT", ""), "rows": []}
    res["check_worst_rel_err"] = check_gpu()
    torch.manual_seed(0)

    def cuda_gemv(x, w, s, y, rows, blocks):
        err = lib.int4_gemv_xstat_cuda(w.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0],
                                       x.shape[-1], G, rows, 1, blocks, 1, torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"int4_gemv_xstat_cuda returned {err}")
        return y

    shapes = ((4096, 14336), (8192, 7168), (16384, 3584)) if os.environ.get("SWEEP") == "cr" else (
        (14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096), (2048, 8192))
    for N, K in shapes:
        W = torch.randn(N, K, device=dev)
        w4, s4 = quantize_int4(W, G)
        del W
        wbytes = w4.numel() + s4.numel() * 4
        n = _copies(wbytes, dev)
        sets = [(torch.randn(1, K, device=dev, dtype=torch.bfloat16), w4.clone(), s4.clone(),
                 torch.empty(1, N, device=dev, dtype=torch.bfloat16)) for _ in range(n)]
        ref = dequant_matmul_reference(sets[0][0], dequantize_int4(w4, s4)).float().view(-1)
        dense = [(torch.randn(1, K, device=dev, dtype=torch.bfloat16),
                  torch.randn(N, K, device=dev, dtype=torch.bfloat16)) for _ in range(_copies(N * K * 2, dev))]
        t_dense = _graph_ms([lambda x=x, W=W: x @ W.T for x, W in dense])
        del dense
        torch.cuda.empty_cache()
        print(f"{N} x {K}: bf16 x @ W.T {t_dense * 1e3:6.2f} us", flush=True)

        def record(name, call, **extra):
            try:
                y = call(*sets[0]).float().view(-1)
                torch.cuda.synchronize()
                err = float((y - ref).abs().max() / ref.abs().max())
                t = _graph_ms([lambda s=s: call(*s) for s in sets])
            except Exception as e:  # noqa: BLE001
                print(f"{N} x {K} {name} {extra}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                return
            row = dict(N=N, K=K, variant=name, time_us=t * 1e3, dense_us=t_dense * 1e3, speedup_vs_bf16=t_dense / t,
                       GBps=wbytes / t / 1e6, max_rel_err=err, **extra)
            res["rows"].append(row)
            print(f"{N} x {K} {name:12s} {t * 1e3:6.2f} us {row['speedup_vs_bf16']:.2f}x bf16 err {err:.1e} {extra}",
                  flush=True)

        record("package", lambda x, w, s, y: int4_matmul(x, w, s))  # as shipped at this commit
        Q = max(32, triton.next_power_of_2(K // 32))
        if os.environ.get("SWEEP") in ("cq", "cr"):  # calls CQ, CR: the one-chunk loop only
            cfgs = {4096: [(8, 4, None), (4, 4, None), (4, 2, None), (8, 4, 128)],
                    8192: [(4, 8, None), (2, 8, None), (8, 8, None)],
                    14336: [(4, 16, None), (2, 16, None), (8, 16, None), (4, 8, None), (2, 16, 64),
                            (4, 16, 64)]}[K] if os.environ["SWEEP"] == "cq" else {
                    # call CR: would rows of 14336 run faster split in halves or quarters (more, smaller programs)?
                    # The same bytes as a (8192, 7168) or (16384, 3584) GEMV, without the join of the parts
                    14336: [(4, 16, None)], 7168: [(4, 8, None), (8, 8, None), (4, 4, None)],
                    3584: [(8, 4, None), (4, 4, None), (4, 2, None)]}[K]
            for rows, nw, maxnreg in cfgs:
                tag = dict(rows=rows, warps=nw, slots=Q // (32 * nw), one=True, maxnreg=maxnreg)
                for pps in (1, 2, 3, 4, "balanced", "wave"):
                    record("gluon", lambda x, w, s, y, rows=rows, nw=nw, pps=pps, mr=maxnreg:
                           launch(x, w, s, y, R=rows, programs=None if pps == "wave" else pps if pps == "balanced"
                                  else pps * sms, warps=nw, one=True, maxnreg=mr), pps=pps, **tag)
            best = sorted((r for r in res["rows"] if (r["N"], r["K"]) == (N, K)), key=lambda r: r["time_us"])[:6]
            print(f"{N} x {K} best: " + "; ".join(f"{r['variant']} {r['time_us']:.2f} us {r['speedup_vs_bf16']:.2f}x "
                                                    f"{ {k: v for k, v in r.items() if k in ('rows', 'warps', 'pps', 'maxnreg')} }"
                                                    for r in best), flush=True)
            del sets
            torch.cuda.empty_cache()
            with open(out_path, "w") as f:
                json.dump(res, f, indent=1)
            continue
        for rows in (4, 8):
            occ = lib.int4_gemv_xstat_occupancy(K, rows, 1)
            record("cuda_xstat", lambda x, w, s, y, rows=rows, b=occ * sms: cuda_gemv(x, w, s, y.view(-1), rows, b),
                   rows=rows, blocks=occ * sms)
        Q = max(32, triton.next_power_of_2(K // 32))
        if K <= 8192:
            for rows, pps in ((8, 2), (8, 4), (4, 3), (4, 6)):
                record("triton_is", lambda x, w, s, y, rows=rows, pps=pps:
                       dq._is_launch(x, w, s, y, N, K, G, R=rows, programs=min(pps * sms, triton.cdiv(N, rows))) or y,
                       rows=rows, pps=pps)
        cfgs = {4096: [(8, 4), (4, 2), (4, 4)], 8192: [(4, 8), (8, 8), (4, 4)], 14336: [(4, 16), (8, 16)]}[K]
        for rows, nw in cfgs:
            for one, maxnreg in ((False, None), (False, 128), (True, None)):
                if (one or maxnreg) and (rows, nw) != cfgs[0]:
                    continue  # the side variants on each K's first config only
                tag = dict(rows=rows, warps=nw, slots=Q // (32 * nw), one=one, maxnreg=maxnreg)
                for pps in (1, 2, 3, 4, 5, 6, "balanced"):
                    record("gluon", lambda x, w, s, y, rows=rows, nw=nw, pps=pps, one=one, mr=maxnreg:
                           launch(x, w, s, y, R=rows, programs=pps if pps == "balanced" else pps * sms, warps=nw,
                                  one=one, maxnreg=mr), pps=pps, **tag)
        best = sorted((r for r in res["rows"] if (r["N"], r["K"]) == (N, K)), key=lambda r: r["time_us"])[:6]
        print(f"{N} x {K} best: " + "; ".join(f"{r['variant']} {r['time_us']:.2f} us {r['speedup_vs_bf16']:.2f}x "
                                                f"{ {k: v for k, v in r.items() if k in ('rows', 'warps', 'pps', 'one', 'maxnreg')} }"
                                                for r in best), flush=True)
        del sets
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--inspect"]:
        inspect()
    elif sys.argv[1:] == ["--check"]:
        check_gpu()
    else:
        main()
