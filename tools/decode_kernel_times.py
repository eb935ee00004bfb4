"""Where a batch-1 decode step's GPU time goes, kernel by kernel (a device-call tool; CUDA only).

Profiles `n` decode steps of a preset model (random weights) under the given switch settings with
`llmlab.measure.profiling.profile_decode`, then sums the trace's kernel events per kernel name: launches per token, mean
duration, microseconds per token. Run it with LLMLAB_PDL=0 for each kernel's own duration: with programmatic
dependent launch a kernel starts before the one ahead of it ends and its recorded duration includes the wait.

    python tools/decode_kernel_times.py llama-3.2-1b cuda_graphs=true,triton_kernels=true out.json
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import sys
import tempfile


def kernel_table(trace_path: str, steps: int) -> list[dict]:
    """Per kernel name (longest first): launches and microseconds per decode step, from a Chrome trace."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        agg[e["name"]][0] += 1
        agg[e["name"]][1] += e["dur"]
    rows = [{"kernel": name[:90], "per_token": n / steps, "mean_us": t / n, "us_per_token": t / steps}
            for name, (n, t) in agg.items()]
    return sorted(rows, key=lambda r: -r["us_per_token"])


def main(model: str, setting: str, out: str, steps: int = 16) -> None:
    from llmlab.measure.bench import load_bench_model
    from llmlab.measure.profiling import format_summary, profile_decode

    settings = {k: v.lower() == "true" for k, v in (kv.split("=") for kv in setting.split(","))}
    llm, _, _ = load_bench_model(model)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json.gz")
        s = profile_decode(llm, n_steps=steps, settings=settings, trace_path=trace)
        # the trace holds the prefill too: its own kernels (cuBLAS GEMMs, SDPA) show up by name, the LM head and
        # sampling kernels it shares with the decode steps are counted ~1/steps too high
        rows = kernel_table(trace, steps)
    print(format_summary(s))
    print(f"{'per tok':>8} {'mean us':>8} {'us/tok':>8}  kernel (per decode step; prefill kernels listed too)")
    for r in rows[:25]:
        print(f"{r['per_token']:8.1f} {r['mean_us']:8.2f} {r['us_per_token']:8.1f}  {r['kernel']}")
    import torch
    import triton

    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "commit": os.environ.get("LLMLAB_COMMIT", "?"),
                   "versions": {"torch": torch.__version__, "triton": triton.__version__},
                   "model": model, "settings": settings, "pdl": os.environ.get("LLMLAB_PDL", "1"),
                   "summary": {k: v for k, v in s.items() if isinstance(v, (int, float, str, type(None)))},
                   "kernels": rows}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
