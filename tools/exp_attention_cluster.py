"""Device experiment (session 16): does merging the split partials inside a thread-block cluster (DSMEM) bring
batch-1 decode attention at 8K keys to >= 70% of copy bandwidth? (issue 5; `tools/exp_attention_cluster.cu`)

Session 10 (calls BB, BD) put the Triton kernel's fixed ~6 us per call at 8K in the combine of 16 partials: ~2.2 us
as a merge kernel, ~2.1 us as the split kernel's own last-program merge. 70% at 8K (33.5 MB) is ~11.6 us at the
4123 GB/s of call BX; the best plain read of those bytes took 9.5 us. Prediction: the cluster kernel streams within
~1 us of the plain read and merges in < 0.7 us, so ~10.5-11.5 us at 8K (70-77%); if it streams like the Triton
split kernel (11.8 us alone), it misses 70% even with a free merge.

Timed as the micro-benchmark times (CUDA-graph replay of a chain of calls on distinct buffers,
`llmlab.kernels.bench_kernels._graph_ms`), next to the package's Triton kernel and a plain read of the same bytes,
all in this process. Shapes: Llama-3.1-8B (32 heads, 8 KV heads, hd 128), bf16, batch 1.

    python3 tools/exp_attention_cluster.py OUT.json [path/to/libclattn.so]   # builds the .so with nvcc if absent
"""

import ctypes
import json
import math
import os
import subprocess
import sys

import torch

from llmlab.kernels import decode_attention as da
from llmlab.kernels.bench_kernels import _graph_ms
from llmlab.measure.peaks import measure_copy_bandwidth

HERE = os.path.dirname(os.path.abspath(__file__))


def build(so: str) -> None:
    cmd = ["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-shared",
           "-Xcompiler", "-fPIC", "-o", so, os.path.join(HERE, "exp_attention_cluster.cu")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(r.stdout + r.stderr, flush=True)
    r.check_returncode()


def main() -> None:
    out_path = sys.argv[1]
    so = sys.argv[2] if len(sys.argv) > 2 else "/tmp/libclattn.so"
    if not os.path.exists(so):
        build(so)
    lib = ctypes.CDLL(so)
    lib.cluster_attention.restype = ctypes.c_int
    lib.cluster_attention.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                                                                  ctypes.c_void_p, ctypes.c_int,
                                                                                  ctypes.POINTER(ctypes.c_int)]
    dev = "cuda"
    torch.manual_seed(0)
    B, H, Hkv, hd = 1, 32, 8, 128
    scale_log2 = hd ** -0.5 * math.log2(math.e)
    copy_gbps = measure_copy_bandwidth(dev)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": copy_gbps,
           "commit": os.environ.get("LLMLAB_COMMIT", ""), "rows": []}

    def cluster(q, k, v, o, n_split, stages, pdl, mode=0, query_only=False):
        n = ctypes.c_int(-1)
        err = lib.cluster_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), B, Hkv, k.shape[2],
                                    n_split, stages, scale_log2, pdl, mode, torch.cuda.current_stream().cuda_stream,
                                    int(query_only), ctypes.byref(n))
        if err:
            raise RuntimeError(f"cluster_attention returned CUDA error {err}")
        return n.value

    sys.path.insert(0, HERE)
    import exp_attention_tail as floor  # its plain-read kernel (nothing runs on import)

    for S in (1024, 8192, 16384, 32768):
        nbytes = 2 * B * Hkv * S * hd * 2
        sets = [(torch.randn(B, H, hd, device=dev, dtype=torch.bfloat16),
                 torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16),
                 torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16),
                 torch.empty(B, H, hd, device=dev, dtype=torch.bfloat16))
                for _ in range(max(2, -(-200_000_000 // nbytes)))]
        q, k, v, _ = sets[0]
        ref = da.decode_attention_reference(q, k, v).float()

        def record(name, call, check=True, **extra):
            try:
                o = call(*sets[0])
                torch.cuda.synchronize()
                err = float((o.float() - ref).norm() / ref.norm()) if check else None
                t = _graph_ms([lambda s=s: call(*s) for s in sets])
            except Exception as e:  # noqa: BLE001
                print(f"S={S} {name} {extra}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                return
            row = dict(S=S, variant=name, time_us=t * 1e3, GBps=nbytes / t / 1e6,
                       bw_fraction=nbytes / t / 1e6 / copy_gbps, rel_err=err, **extra)
            res["rows"].append(row)
            print(f"S={S:6d} {name:10s} {t * 1e3:6.2f} us {row['GBps']:6.0f} GB/s {row['bw_fraction']:.3f} of copy "
                  f"err {err if err is None else f'{err:.1e}'} {extra}", flush=True)

        record("triton", lambda q, k, v, o: da.decode_attention(q, k, v))
        floor.read_floor(nbytes)  # 128-512 programs, four tiles, with and without PDL; prints its best six
        best = min((r for r in floor.out["floor"] if r["bytes"] == nbytes), key=lambda r: r["time_us"])
        res["rows"].append(dict(S=S, variant="read", bw_fraction=best["GBps"] / copy_gbps, **best))
        for n_split in (8, 16):
            for stages in (4, 6):
                try:
                    mc = cluster(q, k, v, sets[0][3], n_split, stages, 1, query_only=True)
                except RuntimeError as e:
                    print(f"S={S} cluster {n_split} x {stages}: {e}", flush=True)
                    continue
                for mode in (0, 1, 2):  # the kernel; without the cluster merge; streaming only (see the .cu)
                    def call(q, k, v, o, n_split=n_split, stages=stages, mode=mode):
                        cluster(q, k, v, o, n_split, stages, 1, mode)
                        return o
                    record(("cluster", "no merge", "stream only")[mode], call, check=mode == 0, n_split=n_split,
                           stages=stages, pdl=1, max_active_clusters=mc)
        del sets
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
