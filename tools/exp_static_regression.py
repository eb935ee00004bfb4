"""Device experiment (session 13): why did the static-cache rungs get slower between two chat ladders?

The chat ladder of call BP (3d01caa, `..._chat_llama-3.2-1b_20261201T072740Z.json`) against call BN's (ac9c12c,
`..._041209Z.json`), same device kind, same workload:
    +gpu_sampling  (eager decode on the static cache, generate_fast mode "static")  TPOT p50 10.95 -> 21.06 ms
    +pinned_memory (the same, prompt through pinned memory)                          10.53 -> 20.71 ms
    TTFT of every rung that prefills through GraphDecoder.prefill                   11-15 -> 17-21 ms
while the rungs on llmlab.generate (eager, +paged_kv) did not move (10.3 / 11.6 -> 10.1 / 12.2 ms). On a CPU (the
default model) both commits take the same time per step, so the cause is on the CUDA side.

This runs ONE commit's code (argv[1]: a folder holding its llmlab/ and kernels/) on Llama-3.2-1B's shape (random
weights, bf16), 128-token prompt, 256 new tokens, greedy; variants alternate over rounds after one warm-up each:
    eager         llmlab.generate.generate (the +paged_kv rung's path, contiguous cache): the control
    static_sync   generate_fast mode "static", gpu_sampling=False (a read every step)
    static        generate_fast mode "static", gpu_sampling=True (the +gpu_sampling rung)
    graphs        generate_fast mode "graphs", gpu_sampling=True (the +cuda_graphs rung)
then torch.profiler over 32 steps of "static": the host's own time by operator and CUDA API call (self CPU time),
which says where the host's extra time goes. Writes JSON to argv[3]; argv[2] is a label.
"""

import json
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import llmlab  # noqa: E402
from llmlab.engine import LLM  # noqa: E402
from llmlab.runtime.fast_generate import generate_fast  # noqa: E402
from llmlab.generate import generate  # noqa: E402

label, out_path = sys.argv[2], sys.argv[3]
print(f"[{label}] llmlab from {llmlab.__file__}", flush=True)
gpu = torch.cuda.is_available()
if gpu:
    llm, N, ROUNDS = LLM.from_preset("llama-3.2-1b", device="cuda", dtype=torch.bfloat16), 256, 3
else:  # a smoke test of this script: the default model, no graphs
    llm, N, ROUNDS = LLM.load("default"), 16, 1
model = llm.model
sync = torch.cuda.synchronize if gpu else (lambda: None)
prompt = [(7 * i) % (llm.config.vocab_size - 1) + 1 for i in range(128)]

VARIANTS = {
    "eager": lambda n: generate(model, prompt, max_new_tokens=n),
    "static_sync": lambda n: generate_fast(model, prompt, max_new_tokens=n, mode="static", gpu_sampling=False),
    "static": lambda n: generate_fast(model, prompt, max_new_tokens=n, mode="static", gpu_sampling=True),
}
if gpu:
    VARIANTS["graphs"] = lambda n: generate_fast(model, prompt, max_new_tokens=n, mode="graphs", gpu_sampling=True)
rows = {name: [] for name in VARIANTS}
for name, fn in VARIANTS.items():
    fn(N)  # warm-up: the whole workload (graph capture, lazy setup)
sync()
for r in range(ROUNDS):
    for name, fn in VARIANTS.items():
        t = time.perf_counter()
        g = fn(N)
        sync()
        wall = time.perf_counter() - t
        ms = g.step_ms
        row = {"ttft_ms": ms[0], "tpot_p50_ms": statistics.median(ms[1:]), "tpot_mean_ms": statistics.fmean(ms[1:]),
               "wall_s": wall}
        rows[name].append(row)
        print(f"[{label}] round {r} {name:12s} TTFT {row['ttft_ms']:7.2f} ms  TPOT p50 {row['tpot_p50_ms']:7.3f} "
              f"mean {row['tpot_mean_ms']:7.3f} ms  wall {wall:6.3f} s", flush=True)

with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
    VARIANTS["static"](32)
    sync()
top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
host = [{"name": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in top]
print(f"[{label}] host time over 32 'static' steps, by self CPU time:")
for h in host:
    print(f"[{label}]   {h['self_cpu_ms']:8.2f} ms  x{h['count']:6d}  {h['name'][:70]}")
summary = {name: {k: statistics.median(x[k] for x in v) for k in v[0]} for name, v in rows.items()}
json.dump({"label": label, "code": sys.argv[1], "device": torch.cuda.get_device_name() if gpu else "cpu",
           "versions": {"torch": torch.__version__}, "rounds": rows, "median": summary, "host_profile": host},
          open(out_path, "w"), indent=1)
print(f"[{label}] medians: " + "; ".join(f"{k} TTFT {v['ttft_ms']:.2f} TPOT {v['tpot_p50_ms']:.3f}"
                                         for k, v in summary.items()))
