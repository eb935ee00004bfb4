"""Device experiment (call BB, session 10): where decode attention's fixed ~6 us per call goes at batch 1.

The kernel micro-benchmark (Llama-3.1-8B: 32 heads, 8 KV heads, hd 128, bf16) takes 5.8 us at 1K keys (4 MB) and
14.2 us at 8K (33.5 MB, 8.0 us at the copy bandwidth): ~6 us a call that is not streaming. Timed the same way
(CUDA-graph replay of a chain of calls on distinct buffers, `bench_kernels._graph_ms`):

1. floor: a plain read of the same bytes (each program sums a contiguous chunk; no softmax, no merge), with and
   without PDL — what any one-launch kernel of these bytes costs in this harness;
2. the split kernel alone (the merge skipped: output unused) and split + merge kernel, for a few explicit configs;
3. the split kernel's own merge (FUSED_MERGE) at 8-32 splits (the tuner offers it up to 8), with the merge tile
   at 4096 and 8192 partial values (one or two L2 round trips for 16 splits);
4. the split kernel letting the next kernel launch after its wait instead of at its start (LLMLAB_AB_LATE_TRIGGER,
   a temporary switch of commit c01a1ad, removed after call BB: at later commits these rows equal the plain ones),
   with and without the merge's trigger_next.

Writes JSON to argv[1].
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

from llmlab.kernels import decode_attention as da
from llmlab.kernels._util import pdl_kwargs
from llmlab.kernels.bench_kernels import _graph_ms

torch.manual_seed(0)
dev = "cuda"
out = {"floor": [], "attention": []}


@triton.jit
def _read_kernel(x_ptr, out_ptr, CHUNK, PDL: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    base = x_ptr + tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, CHUNK, BLOCK, num_stages=STAGES):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_floor(nbytes):
    n = nbytes // 2
    copies = max(2, -(-200_000_000 // nbytes))
    xs = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    for programs in (128, 132, 256, 264, 512):
        chunk = n // programs
        for block, warps, stages in ((2048, 4, 3), (4096, 4, 3), (4096, 8, 4), (8192, 8, 3)):
            if chunk % block:
                continue
            for pdl in (True, False):
                kw = pdl_kwargs(torch.device(dev)) if pdl else {"PDL": False}
                outs = [torch.empty(programs, device=dev) for _ in xs]

                def fn(x, o, chunk=chunk, block=block, warps=warps, stages=stages, kw=kw, programs=programs):
                    _read_kernel[(programs,)](x, o, chunk, BLOCK=block, STAGES=stages, num_warps=warps, **kw)
                t = _graph_ms([lambda x=x, o=o: fn(x, o) for x, o in zip(xs, outs)])
                err = float((outs[0].sum() - xs[0].float()[:programs * chunk].sum()).abs()
                            / xs[0].float().abs().sum())
                r = dict(bytes=nbytes, programs=programs, block=block, warps=warps, stages=stages, pdl=pdl,
                         time_us=t * 1e3, GBps=programs * chunk * 2 / t / 1e6, err=err)
                out["floor"].append(r)
    rows = sorted([r for r in out["floor"] if r["bytes"] == nbytes], key=lambda r: r["time_us"])
    for r in rows[:6]:
        print(f"floor {nbytes / 1e6:6.1f} MB: {r['time_us']:6.1f} us {r['GBps']:6.0f} GB/s  programs {r['programs']} "
              f"block {r['block']} warps {r['warps']} stages {r['stages']} pdl {r['pdl']}", flush=True)
    del xs
    torch.cuda.empty_cache()


NO_RUN = __name__ != "__main__"  # imported (tools/ncu_attention.py): only the read kernel is wanted
for nb in () if NO_RUN else (4 << 20, 2 * 8 * 8192 * 128 * 2, 2 * 8 * 16384 * 128 * 2):
    read_floor(nb)

B, H, Hkv, hd = 1, 32, 8, 128
scale = hd ** -0.5
real_merge = da._merge_into
for S in () if NO_RUN else (1024, 8192, 16384, 32768):
    nbytes = 2 * B * Hkv * S * hd * 2
    sets = [(torch.randn(B, H, hd, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16))
            for _ in range(max(2, -(-200_000_000 // nbytes)))]
    q, k, v = sets[0]
    ref = da.decode_attention_reference(q, k, v).float()

    def record(name, fn, cfg=None, check=True, **extra):
        try:
            o = fn(q, k, v)
            err = float((o.float() - ref).norm() / ref.norm()) if check else None
            t = _graph_ms([lambda q=q, k=k, v=v: fn(q, k, v) for q, k, v in sets])
        except Exception as e:  # noqa: BLE001
            print(f"attention S={S} {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            return None
        r = dict(S=S, variant=name, config=str(cfg), time_us=t * 1e3, GBps=nbytes / t / 1e6, rel_err=err, **extra)
        out["attention"].append(r)
        print(f"attention S={S:6d} {name:22s} {t * 1e3:6.1f} us {nbytes / t / 1e6:6.0f} GB/s err "
              f"{err if err is None else f'{err:.1e}'} {cfg}", flush=True)
        return r

    da._decode_split_tuned.cache.clear()
    record("tuned", lambda q, k, v: da.decode_attention(q, k, v), None)
    out["attention"][-1]["config"] = str(da._decode_split_tuned.best_config)
    for n_splits in (8, 16, 32):
        split_n = S // n_splits
        for bn, w, st in ((128, 4, 3), (64, 4, 3), (64, 4, 4), (32, 4, 3)):
            if split_n % bn:
                continue
            base = dict(BLOCK_N=bn, SPLIT_N=split_n)
            unf = triton.Config({**base, "FUSED_MERGE": False}, num_warps=w, num_stages=st)
            record("split+merge", lambda q, k, v, c=unf: da._decode(q, k, v, None, scale, config=c), unf,
                   splits=n_splits)
            da._merge_into = lambda *a, **kw: None
            try:
                record("split only", lambda q, k, v, c=unf: da._decode(q, k, v, None, scale, config=c), unf,
                       check=False, splits=n_splits)
            finally:
                da._merge_into = real_merge
            os.environ["LLMLAB_AB_LATE_TRIGGER"] = "1"
            try:
                record("split+merge late", lambda q, k, v, c=unf: da._decode(q, k, v, None, scale, config=c), unf,
                       splits=n_splits)
                record("split+merge late+tn", lambda q, k, v, c=unf: da._decode(q, k, v, None, scale, config=c,
                                                                                 trigger_next=True), unf,
                       splits=n_splits)
            finally:
                os.environ.pop("LLMLAB_AB_LATE_TRIGGER")
            fus = triton.Config({**base, "FUSED_MERGE": True}, num_warps=w, num_stages=st)
            for tile in (4096, 8192):
                da.FUSED_MERGE_TILE = tile
                record(f"fused tile {tile}", lambda q, k, v, c=fus: da._decode(q, k, v, None, scale, config=c), fus,
                       splits=n_splits)
            da.FUSED_MERGE_TILE = 4096
    del sets
    torch.cuda.empty_cache()

out["versions"] = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
                   "commit": os.environ.get("LLMLAB_COMMIT", "?")}
if not NO_RUN:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
