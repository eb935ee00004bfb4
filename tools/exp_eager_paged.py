"""Device diagnosis (session 11, call BM): why the chat ladder's "+paged_kv" rung decodes ~2.5x faster than "eager"
on the H200 (TPOT p50 10.6-12.4 ms against 25.7-29.7 ms in every ladder file of 2026-12-01), while lab 03 (CPU)
finds the paged reference path slower — it copies the whole cache into a contiguous tensor every step.

Llama-3.2-1B shape, random bf16 weights, a 128-token prompt, 256 new tokens, greedy, the eager decode with the
contiguous `KVCache` and with `PagedKVCache` (what the two rungs run), alternating, 4 repeats each: per-repeat
tokens/s and decode-step times; then torch.profiler over 8 decode steps of each: the ops with the most host time and
the counts of kernel launches and host synchronizations per step."""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from llmlab.engine import LLM
from llmlab.cache.paged_cache import PagedKVCache

llm = LLM.from_preset("llama-3.2-1b", device="cuda", dtype=torch.bfloat16)
prompt = [(7 * i) % 1000 + 1 for i in range(128)]
paths = {"contiguous": {}, "paged": {"cache_factory": PagedKVCache}}
for name, kw in paths.items():  # warm up
    llm.generate(prompt, max_new_tokens=8, stop_at_eos=False, **kw)
ref = {}
for rep in range(4):
    for name, kw in paths.items():
        g = llm.generate(prompt, max_new_tokens=256, stop_at_eos=False, **kw)
        ms = g.step_ms[1:]
        ref.setdefault(name, g.token_ids)
        print(f"{name:10s} repeat {rep}: {256 / sum(g.step_ms) * 1e3:6.1f} tok/s  "
              f"TPOT mean {statistics.fmean(ms):6.2f} "
              f"p50 {statistics.median(ms):6.2f} min {min(ms):6.2f} max {max(ms):6.2f} ms; first/last 32 steps "
              f"{statistics.fmean(ms[:32]):6.2f} / {statistics.fmean(ms[-32:]):6.2f} ms", flush=True)
print("greedy tokens equal:", ref["contiguous"] == ref["paged"])
for name, kw in paths.items():
    steps = []

    def on_token(step, tokens, steps=steps):
        steps.append(step)
        return False

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, max_new_tokens=9, stop_at_eos=False, on_token=on_token, **kw)
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = {e.key: e.count for e in ka if "Synchronize" in e.key or "Memcpy" in e.key}
    print(f"\n== {name}: 9 generated tokens (prefill + 8 decode steps): kernel launches {launches}, {syncs}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
sys.stdout.flush()
