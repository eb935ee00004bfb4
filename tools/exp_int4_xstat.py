"""Device experiment (session 17): an "x-stationary" int4 GEMV for issue 5's missed figure (>= 3x the bf16 GEMV at
M = 1, Llama-3.1-8B layer shapes, group 128; the package's Triton kernel: 1.89-2.31x).

The idea (`tools/exp_int4_xstat.cu` says it at length): a program spans a whole row, each thread owns 32 k of it for
the program's lifetime, so x is loaded and pre-scaled once per program and rows stream past R at a time, each row
read in one contiguous piece; the row sums are reduced across the program. The GEMVs measured so far walk a few
rows along K instead, re-reading x every step and each row in 512-byte pieces at different times.

Prediction (session 17): per 16 bytes of weights a thread spends 32 AND + 4 SHF on the integer pipe (half the FMA
pipe's rate on Hopper) and 32 FMAs: ~4 us of issue at 14336 x 4096, under the 8.6-9.0 us a plain read of the
packed bytes takes (call CE). If the old kernels were held back by their x traffic and scattered row pieces, this
one lands at 9.5-11 us at 14336 x 4096 (2.9-3.3x against cuBLAS's ~31.7 us); if the one-row-at-a-time walk was
not the limit, it ties them (~14.6 us).

Timed as `kernels/bench_kernels.py` times (CUDA-graph replay of a chain of calls on distinct buffers >= 4x L2),
next to `x @ W.T` in bf16 and the package's `int4_matmul`, in one process. Errors: max |y - ref| / max |ref|
against x @ dequant(W)^T in fp32.

Call CF (commit 0c5d657): the CUDA C++ build held the prediction — 10.46 us at 14336 x 4096 (3.09x), 4.38 us at
4096 x 4096 (3.05x), 5.55 at 6144 x 4096 (2.95x), 11.78 at 4096 x 14336 (2.82x) — while a first Triton form of it
(a (R, Q, 4) tile summed over its last axis, this file at 0c5d657) took 18.4 us: its loads were consumed as soon as
issued, each word's sum started with a multiply, and the four words were summed by a reduction. Call CG times the
package's Triton kernel that followed (`_int4_gemv_is_kernel` in kernels/dequant_matmul.py: the words split in
registers into one FMA chain, the next chunk requested before this one's math, the first before the PDL wait)
over explicit configs, beside call CF's best CUDA configs and the autotuned `int4_matmul`.

Call CH (after the x prologue became one load): 13.77 us at 14336 x 4096 (2.30x), 18.44 at 4096 x 14336 (1.75x;
the K-walking GEMV 13.98), the CUDA build 10.50. Its PTX (compiled for sm_90a on a CPU machine) showed why: per
chunk of R rows, one barrier for the cross-warp row sums and two more for moving the R sums into a store layout
through shared memory; at K = 14336 (Q = 512, 16 warps, ~105 registers) one program fits an SM. Call CI (session
18) times the kernel after the sums are stored straight from their layout by slot 0 (one barrier fewer per chunk
in the loop; `ptxas -v`: 96 registers at R = 4), beside the autotuned K-walking GEMV (`package_kwalk`), to set
where int4_matmul switches from one to the other (IS_MAX_K).

Call CI: slower (16.2 us at R = 4 against CH's 13.8; R = 8 at 170+ us). The device runs Triton 3.6, the PTX above
came from 3.9: compiled with 3.6 on the CPU machine (`pip install triton==3.6.0` in a side venv; strides of 1
passed as constants, as the JIT specializes them), the kernel had put rows along the lanes — its (R, Q, 4) weight
tile and (R, Q) scale tile are contiguous along neither of their first two axes and 3.6 breaks that tie the other
way — 4 slots per thread, 243 registers, and the sums were moved through shared memory before the reduction.
Call CJ times the kernel after its weights became an (R, 4Q) tile contiguous along its rows and its scales and
stores a flat (row, slot) index reshaped to (R, Q): 3.6's PTX then has no layout move in the loop, 3 barriers per
chunk (the reduction's own), 92 registers at R = 4 and 110 at R = 8.

    python3 tools/exp_int4_xstat.py OUT.json [path/to/libxstat.so]   # builds the .so with nvcc if absent
    TRITON_INTERPRET=1 python3 tools/exp_int4_xstat.py --check          # the Triton kernel against the reference, CPU
"""

import ctypes
import json
import os
import subprocess
import sys

import torch
import triton

from llmlab.kernels import dequant_matmul as dq

HERE = os.path.dirname(os.path.abspath(__file__))


def package_gemv(x, packed, scales, R, pps, pdl, sms):
    """The package's `_int4_gemv_is_kernel` (the Triton form of this idea) with R rows per chunk and `pps` persistent
    programs per SM (0: one program per chunk), no autotuning."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    chunks = triton.cdiv(N, R)
    dq._is_launch(x, packed, scales, y, N, K, K // scales.shape[1], R=R,
                  programs=chunks if pps == 0 else min(chunks, pps * sms), pdl=pdl)
    return y


def check_cpu() -> None:
    """The package kernel with this harness's explicit configs against x @ dequant(W)^T in the interpreter (fp32)."""
    from llmlab.kernels.dequant_matmul import dequant_matmul_reference, dequantize_int4, quantize_int4
    torch.manual_seed(0)
    for N, K, G, R, pps in ((17, 64, 32, 4, 0), (16, 256, 128, 8, 1), (33, 96, 32, 2, 1), (8, 1024, 256, 8, 0)):
        w4, s4 = quantize_int4(torch.randn(N, K), G)
        x = torch.randn(1, K) * 3
        ref = dequant_matmul_reference(x, dequantize_int4(w4, s4))
        y = package_gemv(x, w4, s4, R, pps, False, sms=2)
        err = float((y - ref).abs().max() / ref.abs().max())
        print(f"N={N} K={K} G={G} R={R} pps={pps}: max rel err {err:.1e}")
        assert err < 1e-5, err


def main() -> None:
    from llmlab.kernels.bench_kernels import _copies, _graph_ms
    from llmlab.kernels.dequant_matmul import (dequant_matmul_reference, dequantize_int4, int4_matmul,
                                               quantize_int4)
    out_path = sys.argv[1]
    so = sys.argv[2] if len(sys.argv) > 2 else "/tmp/libxstat.so"
    if not os.path.exists(so):
        subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler",
                        "-fPIC", "-o", so, os.path.join(HERE, "exp_int4_xstat.cu")], check=True)
    lib = ctypes.CDLL(so)
    lib.int4_gemv_xstat_cuda.restype = ctypes.c_int
    lib.int4_gemv_xstat_cuda.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 7 + [ctypes.c_void_p]
    lib.int4_gemv_xstat_occupancy.restype = ctypes.c_int
    lib.int4_gemv_xstat_occupancy.argtypes = [ctypes.c_int] * 3
    sys.path.insert(0, HERE)
    import exp_attention_tail as floor  # a plain read of the packed weights' bytes (nothing runs on import)
    dev, G = "cuda", 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("LLMLAB_COMMIT", ""), "rows": []}

    def cuda_gemv(x, w, s, y, rows, prefetch, blocks, pdl):
        err = lib.int4_gemv_xstat_cuda(w.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0],
                                       x.shape[-1], G, rows, prefetch, blocks, pdl,
                                       torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"int4_gemv_xstat_cuda returned {err}")
        return y

    def k_walking(x, w, s, y):
        """int4_matmul with the input-stationary GEMV switched off: the K-walking `_int4_gemv_kernel`."""
        limit, dq.IS_MAX_K, gluon, dq.USE_GLUON = dq.IS_MAX_K, 0, dq.USE_GLUON, False
        try:
            return int4_matmul(x, w, s)
        finally:
            dq.IS_MAX_K, dq.USE_GLUON = limit, gluon

    for N, K in ((14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096), (2048, 8192)):
        W = torch.randn(N, K, device=dev)
        w4, s4 = quantize_int4(W, G)
        del W
        wbytes = w4.numel() + s4.numel() * 4
        n = _copies(wbytes, dev)
        sets = [(torch.randn(1, K, device=dev, dtype=torch.bfloat16), w4.clone(), s4.clone(),
                 torch.empty(N, device=dev, dtype=torch.bfloat16)) for _ in range(n)]
        x0 = sets[0][0]
        ref = dequant_matmul_reference(x0, dequantize_int4(w4, s4)).float().view(-1)
        dense = [(torch.randn(1, K, device=dev, dtype=torch.bfloat16),
                  torch.randn(N, K, device=dev, dtype=torch.bfloat16)) for _ in range(_copies(N * K * 2, dev))]
        t_dense = _graph_ms([lambda x=x, W=W: x @ W.T for x, W in dense])
        del dense
        torch.cuda.empty_cache()
        print(f"{N} x {K}: bf16 x @ W.T {t_dense * 1e3:6.2f} us; int4 bytes {wbytes / 1e6:.1f} MB", flush=True)

        def record(name, call, **extra):
            try:
                y = call(*sets[0]).float().view(-1)
                torch.cuda.synchronize()
                err = float((y - ref).abs().max() / ref.abs().max())
                t = _graph_ms([lambda s=s: call(*s) for s in sets])
            except Exception as e:  # noqa: BLE001
                print(f"{N} x {K} {name} {extra}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                return
            row = dict(N=N, K=K, variant=name, time_us=t * 1e3, dense_us=t_dense * 1e3, speedup_vs_bf16=t_dense / t,
                       GBps=wbytes / t / 1e6, max_rel_err=err, **extra)
            res["rows"].append(row)
            print(f"{N} x {K} {name:12s} {t * 1e3:6.2f} us {row['GBps']:6.0f} GB/s {row['speedup_vs_bf16']:.2f}x bf16 "
                  f"err {err:.1e} {extra}", flush=True)

        if (N, K) == (14336, 4096):
            floor.read_floor(w4.numel())
        # int4_matmul as shipped (the name kept from the autotuned calls CG-CJ; a fixed config since call CK)
        record("package_tuned", lambda x, w, s, y: int4_matmul(x, w, s))
        for rows, prefetch in ((4, 1), (8, 1)):  # call CF's best CUDA configs (persistent grids)
            occ = lib.int4_gemv_xstat_occupancy(K, rows, prefetch)
            for pdl in (0, 1):
                record("cuda_xstat", lambda x, w, s, y, rows=rows, prefetch=prefetch, blocks=occ * sms, pdl=pdl:
                       cuda_gemv(x, w, s, y, rows, prefetch, blocks, pdl),
                       rows=rows, prefetch=prefetch, blocks=occ * sms, occupancy=occ, pdl=pdl)
        record("package_kwalk", k_walking)  # autotuned: the K-walking GEMV (int4_matmul's path for K > IS_MAX_K)
        warps = max(1, min(16, triton.next_power_of_2(K // 32) // 32))
        for rows in (2, 4, 8):
            for pps in (0, 1, 2, 3, 4, 5, 6):
                for pdl in (False, True):
                    if not pdl and (rows, pps) not in ((4, 2), (8, 2)):
                        continue  # the side configs: with PDL only (call CH: PDL won everywhere)
                    record("triton_is", lambda x, w, s, y, rows=rows, pps=pps, pdl=pdl:
                           package_gemv(x, w, s, rows, pps, pdl, sms),
                           rows=rows, pps=pps, num_warps=warps, pdl=pdl)
        best = sorted((r for r in res["rows"] if (r["N"], r["K"]) == (N, K)), key=lambda r: r["time_us"])[:5]
        print(f"{N} x {K} best: " + "; ".join(f"{r['variant']} {r['time_us']:.2f} us {r['speedup_vs_bf16']:.2f}x"
                                                for r in best), flush=True)
        del sets
        torch.cuda.empty_cache()
    res["floor"] = floor.out["floor"]
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        check_cpu()
    else:
        main()
