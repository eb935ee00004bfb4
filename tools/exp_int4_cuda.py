"""Device experiment (session 16): is issue 5's int4 GEMV figure (>= 3x the bf16 GEMV at M = 1, Llama-3.1-8B layer
shapes, group 128) reachable on the H200 with a CUDA C++ kernel on the package's own int4 layout?
(`tools/exp_int4_cuda.cu`; the Triton kernel measured 1.89-2.31x in call BX.)

Prediction: the lop3 + hsub2 + hfma2 inner loop costs ~2 instructions per weight (3.5 us of issue at 14336 x 4096,
under the ~7.4 us the 31 MB of weights and fp32 scales take at the copy bandwidth), so the kernel is bound by its
loads: ~8.5-9.5 us at 14336 x 4096 (3.3-3.7x against cuBLAS's ~31.7 us); the small shapes (4096 x 4096, 8.9 MB)
keep a fixed ~2 us and land nearer 3x. With fp32 products (~3.5 instructions per weight) the big shapes should
still be load-bound.

Timed as the micro-benchmark times (`bench_kernels._graph_ms`: CUDA-graph replay of a chain of calls on distinct
buffers adding up to >= 4x L2), next to `x @ W.T` in bf16 and the package's Triton `int4_matmul`, in one process.
Errors: max |y - ref| / max |ref| against x @ dequant(W)^T in fp32.

Call CD: the one-shot grid tied the Triton kernel (14.6 us at 14336 x 4096). Call CE adds a persistent grid whose
loads run 1-3 steps ahead across row groups, and a plain read of the packed bytes (the floor for any kernel).

    python3 tools/exp_int4_cuda.py OUT.json [path/to/libint4.so]   # builds the .so with nvcc if absent
"""

import ctypes
import json
import os
import subprocess
import sys

import torch

from llmlab.kernels.bench_kernels import _copies, _graph_ms
from llmlab.kernels.dequant_matmul import dequant_matmul_reference, dequantize_int4, int4_matmul, quantize_int4

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    out_path = sys.argv[1]
    so = sys.argv[2] if len(sys.argv) > 2 else "/tmp/libint4.so"
    if not os.path.exists(so):
        subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler",
                        "-fPIC", "-o", so, os.path.join(HERE, "exp_int4_cuda.cu")], check=True)
    lib = ctypes.CDLL(so)
    lib.int4_gemv_cuda.restype = ctypes.c_int
    lib.int4_gemv_cuda.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6 + [ctypes.c_void_p]
    lib.int4_gemv_cuda_persistent.restype = ctypes.c_int
    lib.int4_gemv_cuda_persistent.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 7 + [ctypes.c_void_p]
    sys.path.insert(0, HERE)
    import exp_attention_tail as floor  # a plain read of the packed weights' bytes (nothing runs on import)
    dev, G = "cuda", 128
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("LLMLAB_COMMIT", ""), "rows": []}

    def cuda_gemv(x, w, s, y, rows, f32):
        err = lib.int4_gemv_cuda(w.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0], x.shape[-1], G,
                                 rows, f32, 1, torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"int4_gemv_cuda returned {err}")
        return y

    def cuda_persistent(x, w, s, y, rows, f32, depth):
        err = lib.int4_gemv_cuda_persistent(w.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0],
                                            x.shape[-1], G, rows, f32, depth, 1,
                                            torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"int4_gemv_cuda_persistent returned {err}")
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
            print(f"{N} x {K} {name:8s} {t * 1e3:6.2f} us {row['GBps']:6.0f} GB/s {row['speedup_vs_bf16']:.2f}x bf16 "
                  f"err {err:.1e} {extra}", flush=True)

        floor.read_floor(w4.numel())  # prints its best six; the rows go to the JSON too (call CE's are in its log)
        record("triton", lambda x, w, s, y: int4_matmul(x, w, s))
        for f32 in (0, 1):
            for rows in (1, 2, 4):
                record("cuda", lambda x, w, s, y, rows=rows, f32=f32: cuda_gemv(x, w, s, y, rows, f32),
                       rows=rows, fp32_products=bool(f32))
            for rows, depths in ((1, (1, 2, 3)), (2, (1, 2, 3)), (4, (1, 2))):
                for depth in depths:
                    record("persistent", lambda x, w, s, y, rows=rows, f32=f32, depth=depth:
                           cuda_persistent(x, w, s, y, rows, f32, depth), rows=rows, fp32_products=bool(f32),
                           depth=depth)
        del sets
        torch.cuda.empty_cache()
    res["floor"] = floor.out["floor"]
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
