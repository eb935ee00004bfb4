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
next to `x @ W.T` in bf16 and the package's `int4_matmul`, in one process. Both a CUDA C++ build of the idea (to
learn whether the idea holds) and a Triton one (what the package could use). Errors: max |y - ref| / max |ref|
against x @ dequant(W)^T in fp32.

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
import triton.language as tl

from llmlab.kernels.dequant_matmul import X_EXP, _field, _lift, _split8

HERE = os.path.dirname(os.path.abspath(__file__))


@triton.jit
def _xstat_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn, n_chunks,
                  GROUP: tl.constexpr, Q: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr):
    """Program p takes chunks p, p + P, ... of R rows; thread-slot q owns k in [32q, 32q + 32) (words 4q .. 4q + 3,
    code i of word j at bits 4i: k = 32q + 8j + i). Q: the power of two >= K / 32."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rq = tl.arange(0, Q)
    rj = tl.arange(0, 4)
    ri = tl.arange(0, 8)
    rr = tl.arange(0, R)
    q_mask = rq < K // 32
    # x once per program: (Q, 4, 8) -> eight (Q, 4) lifted partners, one per code position
    xk = 32 * rq[:, None, None] + 8 * rj[None, :, None] + ri[None, None, :]
    x = tl.load(x_ptr + xk, mask=q_mask[:, None, None], other=0.0).to(tl.float32)
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.reshape(x, (Q * 4, 8)))
    off = tl.sum(tl.reshape(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, (Q, 4)), axis=1) * (8.0 * 2.0 ** -X_EXP)  # (Q,)
    l0 = tl.reshape(_lift(x0, 0), (Q, 4))
    l1 = tl.reshape(_lift(x1, 4), (Q, 4))
    l2 = tl.reshape(_lift(x2, 8), (Q, 4))
    l3 = tl.reshape(_lift(x3, 12), (Q, 4))
    l4 = tl.reshape(_lift(x4, 16), (Q, 4))
    l5 = tl.reshape(_lift(x5, 8), (Q, 4))
    l6 = tl.reshape(_lift(x6, 12), (Q, 4))
    l7 = tl.reshape(_lift(x7, 16), (Q, 4))
    grp = (32 * rq) // GROUP
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    w_off = (4 * rq)[:, None] + rj[None, :]  # (Q, 4)
    for c in tl.range(tl.program_id(0), n_chunks, tl.num_programs(0), num_stages=STAGES):
        rn = c * R + rr
        n_mask = rn < N
        w = tl.load(w_words + rn[:, None, None] * stride_wn + w_off[None, :, :],
                    mask=n_mask[:, None, None] & q_mask[None, :, None], other=0)  # (R, Q, 4)
        top = w >> 12
        part = _field(w, 0, 4) * l0[None]  # one chain: a multiply, then seven FMAs per word
        part += _field(w, 4, 4) * l1[None]
        part += _field(w, 8, 4) * l2[None]
        part += _field(w, 12, 4) * l3[None]
        part += _field(w, 16, 4) * l4[None]
        part += _field(top, 8, 4) * l5[None]
        part += _field(top, 12, 4) * l6[None]
        part += _field(top, 16, 4) * l7[None]
        pq = tl.sum(part, axis=2) - off[None, :]  # (R, Q): a thread's 32 k, all in one group
        s = tl.load(s_ptr + rn[:, None] * stride_sn + grp[None, :], mask=n_mask[:, None] & q_mask[None, :],
                    other=0.0)
        y = tl.sum(pq * (s * 2.0 ** (X_EXP // 2)), axis=1) * 2.0 ** (X_EXP - X_EXP // 2)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def xstat_gemv(x, packed, scales, R=8, programs=0, stages=1, pdl=False):
    """y (1, N) = x (1, K) @ dequant(packed, scales)^T; K a multiple of 32, groups of a multiple of 32."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    assert K % 32 == 0 and G % 32 == 0 and x.shape == (1, K) and x.is_contiguous() and packed.is_contiguous()
    Q = triton.next_power_of_2(K // 32)
    n_chunks = triton.cdiv(N, R)
    grid = (n_chunks if programs <= 0 else min(programs, n_chunks),)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    kw = {"launch_pdl": True} if pdl else {}
    _xstat_kernel[grid](x, packed, scales, y, N, K, packed.stride(0) // 4, scales.stride(0), n_chunks,
                        GROUP=G, Q=Q, R=R, PDL=pdl, STAGES=stages, num_warps=max(1, min(16, Q // 32)), **kw)
    return y


def check_cpu() -> None:
    """The Triton kernel against x @ dequant(W)^T in the interpreter (fp32)."""
    from llmlab.kernels.dequant_matmul import dequant_matmul_reference, dequantize_int4, quantize_int4
    torch.manual_seed(0)
    for N, K, G, R, programs in ((17, 64, 32, 4, 0), (16, 256, 128, 8, 3), (33, 96, 32, 2, 5), (8, 1024, 256, 8, 1)):
        w4, s4 = quantize_int4(torch.randn(N, K), G)
        x = torch.randn(1, K) * 3
        ref = dequant_matmul_reference(x, dequantize_int4(w4, s4))
        y = xstat_gemv(x, w4, s4, R=R, programs=programs)
        err = float((y - ref).abs().max() / ref.abs().max())
        print(f"N={N} K={K} G={G} R={R} programs={programs}: max rel err {err:.1e}")
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

    for N, K in ((14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096)):
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
        record("package", lambda x, w, s, y: int4_matmul(x, w, s))
        for rows in (4, 8, 16):
            for prefetch in (0, 1):
                occ = lib.int4_gemv_xstat_occupancy(K, rows, prefetch)
                for blocks in (0, occ * sms):
                    for pdl in (0, 1):
                        record("cuda_xstat", lambda x, w, s, y, rows=rows, prefetch=prefetch, blocks=blocks, pdl=pdl:
                               cuda_gemv(x, w, s, y, rows, prefetch, blocks, pdl),
                               rows=rows, prefetch=prefetch, blocks=blocks, occupancy=occ, pdl=pdl)
        for rows in (4, 8, 16):
            for programs in (0, 2 * sms, 4 * sms):
                for stages in (1, 2):
                    for pdl in (False, True):
                        record("triton_xstat", lambda x, w, s, y, rows=rows, programs=programs, stages=stages, pdl=pdl:
                               xstat_gemv(x, w, s, R=rows, programs=programs, stages=stages, pdl=pdl),
                               rows=rows, programs=programs, stages=stages, pdl=pdl)
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
