"""A SYNTHETIC trace for the tests — made up, not measured. Real traces come from `llmlab record` on a GPU and
live in data/traces/; this one lives only in tests/data/ and says `"synthetic": true` in its meta.

Regenerate tests/data/synthetic_llama-3.2-1b_kv-cache_bf16.json with `python tests/trace_fixture.py`.
Not a test module (the name does not start with test_).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict
from pathlib import Path

from llmlab.config import ModelConfig
from llmlab.telemetry.trace import Trace, make_trace, save_trace

FIXTURE = Path(__file__).parent / "data" / "synthetic_llama-3.2-1b_kv-cache_bf16.json"


def synthetic_trace(decode_s: float = 3.0, idle_s: float = 1.0, interval_s: float = 0.1, tpot_ms: float = 14.0,
                    new_tokens: int = 64, seed: int = 0) -> Trace:
    """Idle, then back-to-back generate calls of `new_tokens` tokens at ~`tpot_ms` per token, then idle.

    The made-up levels mimic the pattern of an eager batch-1 decode: GPU-Util ~35% while decoding, SM activity,
    occupancy and DRAM bandwidth in single digits, everything ~0 when idle.
    """
    rng = random.Random(seed)
    config = ModelConfig.from_preset("llama-3.2-1b")
    t0, t_end = idle_s, idle_s + decode_s
    token_t, calls, calls_ms, t = [], [], [], t0
    while t < t_end:
        start, steps = t, []
        for i in range(new_tokens):
            ms = (40.0 if i == 0 else tpot_ms) * (1 + 0.05 * rng.uniform(-1, 1))
            t += ms / 1e3
            steps.append(ms)
            token_t.append(t)
        calls.append({"start_s": start, "end_s": t, "n_tokens": new_tokens, "finish": "length"})
        calls_ms.append(steps)
    t_end = t
    n = int((t_end + idle_s) / interval_s)
    samples = {"t_s": [], "gpu_util_pct": [], "mem_util_pct": [], "sm_active_pct": [], "sm_occupancy_pct": [],
               "dram_bw_util_pct": [], "tensor_active_pct": [], "power_w": []}
    for i in range(1, n + 1):
        ts = i * interval_s
        busy = t0 < ts <= t_end + 0.15  # NVML averages over a window: the level lags a little
        noise = 1 + 0.1 * math.sin(3 * ts)
        samples["t_s"].append(ts)
        samples["gpu_util_pct"].append(35.0 * noise if busy else 0.0)
        samples["mem_util_pct"].append(3.0 * noise if busy else 0.0)
        samples["sm_active_pct"].append(6.0 * noise if busy else 0.0)
        samples["sm_occupancy_pct"].append(2.5 * noise if busy else 0.0)
        samples["dram_bw_util_pct"].append(5.0 * noise if busy else 0.0)
        samples["tensor_active_pct"].append(0.5 if busy else 0.0)
        samples["power_w"].append(160.0 if busy else 90.0)
    # 3 profiled steps: 20 short kernels in the first 30% of each step, then nothing until the next token
    intervals, step_us = [], [tpot_ms * 1e3] * 3
    for s in range(3):
        base = s * tpot_ms * 1e3
        for k in range(20):
            a = base + k * 0.015 * tpot_ms * 1e3
            intervals.append([a, a + 0.01 * tpot_ms * 1e3])
    kernels = {"steps": 3, "window_us": sum(step_us), "busy_us": sum(b - a for a, b in intervals),
               "n_kernels": len(intervals), "step_us": step_us,
               "step_busy_us": [20 * 0.01 * tpot_ms * 1e3] * 3, "intervals_us": intervals,
               "note": "synthetic"}
    meta = {
        "device": "SYNTHETIC GPU (test fixture)", "date": "2026-01-01T00:00:00Z",
        "versions": {"llmlab": "0.1.0"}, "commit": "-", "model": "llama-3.2-1b",
        "model_label": "llama-3.2-1b (random weights)", "random_weights": True, "config": asdict(config),
        "params": config.num_params(), "settings": {"kv_cache": True, "dtype": "bf16"},
        "setting_label": "KV cache, bf16", "setting_slug": "kv-cache_bf16", "batch": 1, "dtype": "bfloat16",
        "prompt_tokens": 128, "new_tokens": new_tokens, "interval_s": interval_s, "idle_s": idle_s,
        "sampler_series": [k for k in samples if k != "t_s"],
        "peaks": {"copy_bw_gb_s": 4277.0, "datasheet_bw_gb_s": 4800.0},
        "synthetic": True,
        "note": "SYNTHETIC: made up by tests/trace_fixture.py for the tests; not a measurement",
    }
    return make_trace(meta, samples, token_t, calls_ms, calls, kernels=kernels)


if __name__ == "__main__":
    print(save_trace(synthetic_trace(), FIXTURE))
