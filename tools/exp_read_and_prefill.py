"""Device experiment (session 12): what the host's token reads and the eager prefill cost the chat workload.

The chat ladder's step-tuned rung (2026-12-01, `..._chat_llama-3.2-1b_20261201T041209Z.json`) decodes at a TPOT p50
of 0.763 ms but a mean of 0.779 ms, and its TTFT is 15.4 ms: together ~8% of the run's 214 ms. Two changes aim at
them (commit of this file):

* the tokens are read every 16 steps ONE STEP LATE (`llmlab.runtime.fast_generate._TokenReader`): predicted to remove a
  bubble of ~50-250 us after each of the 16 reads, i.e. the mean TPOT close to the p50;
* the prefill replayed from a CUDA graph of its length bucket (`GraphDecoder.prefill(bucketed=True)`): predicted
  TTFT 15.4 -> ~1-2 ms (a 128-token prefill of a 1B model reads 2.5 GB and does 0.3 TFLOP: ~1 ms of work).

Variants, on ONE model with the +step_tuning rung's settings, rounds alternating (the noise between processes is
larger than these effects):
    at_once   reads waited for at once (the code before this session), eager prefill
    late      reads one step late, eager prefill
    late+pg   reads one step late, prefill graph
Per round and variant: tokens/s of the 256 new tokens (prefill included), TTFT, TPOT mean and p50, and the mean time
of the two steps right after each read against the others. Writes JSON to argv[1]; argv[2]: rounds (default 5).
Without a CUDA GPU it runs as a smoke test of itself: the default model, mode "static", 48 new tokens.
"""

import json
import os
import statistics
import sys
import time

import torch

from llmlab.runtime import fast_generate
from llmlab.envinfo import describe
from llmlab.engine import LLM
from llmlab.runtime.fast_generate import decode_mode, generate_fast
from llmlab.ladder import available_steps
from llmlab.switches import apply_switches

out_path = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
gpu = torch.cuda.is_available()
if gpu:
    llm = LLM.from_preset("llama-3.2-1b", device="cuda", dtype=torch.bfloat16)
    settings = next(r.settings for r in available_steps(llm)[0] if r.name == "+step_tuning")
    N = 256
else:  # a smoke test of this script
    llm, settings, N = LLM.load("default"), {"kv_cache": True}, 48
t0 = time.perf_counter()
run, kwargs = apply_switches(llm, settings)  # tunes the tiles (~20 s)
mode = decode_mode(kwargs.get("cuda_graphs", False), kwargs.get("torch_compile", False))
print(f"settings {settings} (mode {mode}); tuning {time.perf_counter() - t0:.1f} s", flush=True)
prompt = [(7 * i) % (llm.config.vocab_size - 1) + 1 for i in range(128)]
real_reader = fast_generate._TokenReader


class AtOnce(real_reader):
    """The reads of the code before: the host waits for each one right away."""

    def __init__(self, out, late):
        super().__init__(out, late=False)


VARIANTS = {"at_once": (AtOnce, False), "late": (real_reader, False), "late+pg": (real_reader, True)}


def one(name):
    reader, pg = VARIANTS[name]
    fast_generate._TokenReader = reader
    try:
        g = generate_fast(run.model, prompt, max_new_tokens=N, mode=mode, gpu_sampling=True,
                          pin_memory=kwargs.get("pin_memory", False), prefill_graph=pg)  # what LLM.generate runs
    finally:
        fast_generate._TokenReader = real_reader
    ms = g.step_ms
    decode = ms[1:]
    # a read at the end of step i - 1 (i = 16, 32, ...) leaves its gap in step i (read at once) or i + 1 (late)
    near = {j for i in range(16, N, 16) for j in (i, i + 1) if j < N}
    after_read = [ms[j] for j in sorted(near)]
    others = [ms[j] for j in range(1, N) if j not in near]
    return {"tokens_per_s": N / sum(ms) * 1e3, "ttft_ms": ms[0], "tpot_mean_ms": statistics.fmean(decode),
            "tpot_p50_ms": statistics.median(decode), "after_read_ms": statistics.fmean(after_read),
            "other_steps_ms": statistics.fmean(others), "max_step_ms": max(decode), "step1_ms": ms[1],
            "prefill_length": g.extra["prefill_length"], "host_reads": g.extra["host_reads"],
            "tokens": g.token_ids[0]}


for name in VARIANTS:  # warm up: captures the prefill graph, meets every KV length once
    one(name)
results = {name: [] for name in VARIANTS}
for r in range(rounds):
    for name in VARIANTS:
        m = one(name)
        results[name].append(m)
        print(f"round {r} {name:8s} {m['tokens_per_s']:7.1f} tok/s  TTFT {m['ttft_ms']:6.2f} ms  TPOT mean "
              f"{m['tpot_mean_ms'] * 1e3:6.1f} p50 {m['tpot_p50_ms'] * 1e3:6.1f} us  after a read "
              f"{m['after_read_ms'] * 1e3:6.1f} others {m['other_steps_ms'] * 1e3:6.1f} max {m['max_step_ms'] * 1e3:6.1f} "
              f"step1 {m['step1_ms'] * 1e3:6.1f} us", flush=True)
summary = {}
for name, ms in results.items():
    summary[name] = {k: statistics.median(m[k] for m in ms) for k in ms[0] if k not in ("tokens", "prefill_length")}
    summary[name]["tokens_equal_at_once"] = all(m["tokens"] == results["at_once"][0]["tokens"] for m in ms)
    print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in summary[name].items()})
for m in (m for ms in results.values() for m in ms):
    m.pop("tokens")
json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu", "commit": os.environ.get("LLMLAB_COMMIT"), "env": describe(), "settings": settings, "rounds": rounds,
           "summary": summary, "results": results}, open(out_path, "w"), indent=1, default=str)
