"""Device experiment (call BD, session 10): decode attention (Llama-3.1-8B: 32 heads, 8 KV heads, hd 128, bf16) at
8K-32K keys, timed as the kernel micro-benchmark times it (a CUDA-graph chain of calls on distinct buffers), three
ways of calling it: plain (`decode_attention(q, k, v)`, the micro-benchmark's row), with full-length seq_lens (the
static-cache path: a separately tuned key), and as the model's decode step calls it (seq_lens, prefetch_kv,
trigger_next — in the chain no call writes another's K/V, so prefetch_kv's promise holds). Plus split configs with
8 warps (call BB tried 4). Writes JSON to argv[1]."""

import json
import os
import sys

import torch
import triton

from llmlab.kernels import decode_attention as da
from llmlab.kernels.bench_kernels import _graph_ms

torch.manual_seed(0)
dev = "cuda"
B, H, Hkv, hd = 1, 32, 8, 128
scale = hd ** -0.5
rows = []
real_merge = da._merge_into
for S in (8192, 16384, 32768):
    nbytes = 2 * B * Hkv * S * hd * 2
    sets = [(torch.randn(B, H, hd, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16))
            for _ in range(max(2, -(-200_000_000 // nbytes)))]
    lens = torch.full((B,), S, device=dev, dtype=torch.int64)
    q, k, v = sets[0]
    ref = da.decode_attention_reference(q, k, v).float()
    variants = {
        "plain": lambda q, k, v: da.decode_attention(q, k, v),
        "seq_lens": lambda q, k, v: da.decode_attention(q, k, v, seq_lens=lens, check_lens=False),
        "model path": lambda q, k, v: da.decode_attention(q, k, v, seq_lens=lens, check_lens=False,
                                                          prefetch_kv=True, trigger_next=True),
    }
    for n_splits in (16, 32):
        for bn, w, st in ((128, 8, 3), (64, 8, 3), (64, 8, 4), (128, 8, 2)):
            cfg = triton.Config({"BLOCK_N": bn, "SPLIT_N": S // n_splits, "FUSED_MERGE": False}, num_warps=w,
                                num_stages=st)
            variants[f"{n_splits} splits {bn}/{w}w/{st}st"] = (
                lambda q, k, v, c=cfg: da._decode(q, k, v, None, scale, config=c))
    for name, fn in variants.items():
        for only in (False, True) if "splits" in name else (False,):
            if only:
                da._merge_into = lambda *a, **kw: None
            try:
                o = fn(q, k, v)
                err = None if only else float((o.float() - ref).norm() / ref.norm())
                t = _graph_ms([lambda q=q, k=k, v=v: fn(q, k, v) for q, k, v in sets])
            except Exception as e:  # noqa: BLE001
                print(f"S={S} {name}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            finally:
                da._merge_into = real_merge
            label = name + (" (split only)" if only else "")
            rows.append(dict(S=S, variant=label, time_us=t * 1e3, GBps=nbytes / t / 1e6, rel_err=err))
            print(f"S={S:6d} {label:36s} {t * 1e3:6.1f} us {nbytes / t / 1e6:6.0f} GB/s err {err}", flush=True)
    del sets
    torch.cuda.empty_cache()
json.dump({"rows": rows, "versions": {"torch": torch.__version__, "triton": triton.__version__,
                                      "device": torch.cuda.get_device_name(),
                                      "commit": os.environ.get("LLMLAB_COMMIT", "?")}},
          open(sys.argv[1], "w"), indent=1)
