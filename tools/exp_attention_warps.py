"""Device experiment (session 20): decode attention's split kernel with 1- and 2-warp programs.

Call CT found the 16-warp int4 GEMV 2 us faster without its per-chunk cross-warp step. The split kernel of
kernels/decode_attention.py runs 4 or 8 warps per program; with tl.dot on a (16 heads, BLOCK_N keys) score tile the
warps share the keys, so every tile's softmax max and sum cross warps through shared memory (a barrier per tile).
A 1-warp program keeps the whole online softmax in its warp (shuffles only); more, smaller programs fill each SM.
Every config is timed as the package times the op (split + merge, CUDA-graph replay of a chain on distinct caches,
`bench_kernels._graph_ms`), beside the autotuned op. B = 1, 32 / 8 heads, head_dim 128, bf16.

    python3 tools/exp_attention_warps.py OUT.json
"""
import json
import os
import sys

import torch
import triton

from llmlab.kernels import decode_attention as da
from llmlab.kernels.bench_kernels import _copies, _graph_ms

B, H, Hkv, hd = 1, 32, 8, 128
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "commit": os.environ.get("LLMLAB_COMMIT", ""), "rows": []}
TILES = [(16, 1, 2), (16, 1, 3), (32, 1, 2), (32, 1, 3), (16, 2, 3), (32, 2, 3), (64, 2, 3), (32, 4, 3)]
for S in (8192, 16384, 32768):
    nbytes = 2 * B * Hkv * S * hd * 2
    sets = [(torch.randn(B, H, hd, device="cuda", dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device="cuda", dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device="cuda", dtype=torch.bfloat16)) for _ in range(_copies(nbytes, "cuda"))]
    ref = da.decode_attention_reference(*sets[0]).float()
    t = _graph_ms([lambda s=s: da.decode_attention(*s) for s in sets])
    row = dict(S=S, variant="package", time_us=t * 1e3, GBps=nbytes / t / 1e6,
               config=str(da._decode_split_tuned.best_config))
    out["rows"].append(row)
    print(f"S={S}: package {t * 1e3:6.2f} us {nbytes / t / 1e6:7.0f} GB/s ({row['config']})", flush=True)
    for bn, w, st in TILES:
        for sn in (64, 128, 256, 512):
            if sn % bn:
                continue
            cfg = triton.Config({"BLOCK_N": bn, "SPLIT_N": sn, "FUSED_MERGE": False}, num_warps=w, num_stages=st)
            try:
                y = da._decode(*sets[0], None, hd ** -0.5, config=cfg).float()
                err = float((y - ref).abs().max() / ref.abs().max())
                t = _graph_ms([lambda s=s, c=cfg: da._decode(*s, None, hd ** -0.5, config=c) for s in sets])
            except Exception as e:  # noqa: BLE001
                print(f"   failed {bn}/{w}/{st} split {sn}: {type(e).__name__} {str(e)[:200]}", flush=True)
                continue
            out["rows"].append(dict(S=S, variant="config", BLOCK_N=bn, num_warps=w, num_stages=st, SPLIT_N=sn,
                                    time_us=t * 1e3, GBps=nbytes / t / 1e6, max_rel_err=err))
            print(f"   {t * 1e3:6.2f} us {nbytes / t / 1e6:7.0f} GB/s  BLOCK_N {bn} warps {w} stages {st} "
                  f"SPLIT_N {sn} err {err:.1e}", flush=True)
    best = sorted((r for r in out["rows"] if r["S"] == S), key=lambda r: r["time_us"])[:4]
    print(f"S={S} best: " + "; ".join(f"{r['time_us']:.2f} us {r.get('BLOCK_N')}/{r.get('num_warps')}/"
                                      f"{r.get('num_stages')}/{r.get('SPLIT_N')}" for r in best), flush=True)
    del sets
    torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
