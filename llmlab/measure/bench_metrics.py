"""What one timed run of a workload recorded (`Run`: its `generate` calls, step times and tokens), and the bench
metrics computed from it.

Definitions (Databricks 2023, https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices;
see `llmlab.measure.roofline`): tokens/s = generated tokens / wall time of the whole workload (prefill included);
TTFT = from the start of the workload to a request's first token (a request that waits for an earlier group counts
its wait); TPOT = one decode step (all sequences of a batch advance by one token); MBU / MFU = the bytes / FLOPs a
KV-cache decode step must move / do (weights once per step + each sequence's KV cache) divided by the measured step
time and the measured peak (`llmlab.measure.peaks`). The same model bytes and FLOPs are used for every row, so a row
that does more work than needed (no KV cache recomputes the sequence) shows a lower MBU/MFU, as "model" utilisation
should (PaLM, App. B, https://arxiv.org/abs/2204.02311).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from llmlab.ladder import LadderStep
from llmlab.measure import roofline

AS_LOADED = LadderStep("as loaded", {})  # weights in the model's own dtype (the peers, the roofline, a batch sweep)


@dataclass
class Call:
    """One `generate` call of a run: its requests (indices), prompt lengths, step times and tokens; ttft_ms: each
    request's own time to its first token, from the call's start, where requests do not all get their first token
    at the end of step 0 (continuous batching admits them over several steps); None: at the end of step 0."""

    requests: list[int]
    prompt_lens: list[int]
    step_ms: list[float]
    tokens: list[list[int]]
    ttft_ms: list[float] | None = None


@dataclass
class Run:
    """One run of a whole workload: its `generate` calls, one after the other."""

    calls: list[Call] = field(default_factory=list)

    @property
    def total_ms(self) -> float:
        return sum(sum(c.step_ms) for c in self.calls)

    def tokens_by_request(self) -> dict[int, list[int]]:
        return {r: t for c in self.calls for r, t in zip(c.requests, c.tokens)}


def decode_work(config, prompt_lens: list[int], n_steps: float, weight_bpp: float, kv_bytes: float,
                first_step: int = 1) -> tuple[float, float]:
    """(bytes, FLOPs) a KV-cache decode must move / do for decode steps first_step .. n_steps - 1 of a batch.

    Weights are read once per step for the whole batch; each sequence reads its own KV cache (prompt + tokens so
    far). With first_step=1 this is the decode after the prefill's first token (what TPOT times); first_step=0
    counts n_steps full steps (the roofline row).
    """
    steps = n_steps - first_step
    if steps <= 0:
        return 0.0, 0.0
    byts = steps * roofline.weight_bytes(config, weight_bpp)
    flops = 0.0
    for p in prompt_lens:
        ctx = p + (first_step + n_steps - 1) / 2  # mean cached tokens over the steps
        byts += steps * roofline.kv_cache_bytes(config, 1, ctx, kv_bytes)
        flops += steps * roofline.decode_step_flops(config, 1, ctx)
    return byts, flops


def run_metrics(run: Run, config, weight_bpp: float, kv_bytes: float, peak_bw: float | None,
                peak_tflops: float | None) -> dict:
    """tokens/s, TTFT, TPOT (mean, p50, p90), achieved GB/s, MBU and MFU of one run (see the module docstring)."""
    n_tokens = sum(len(t) for c in run.calls for t in c.tokens)
    total_s = run.total_ms / 1e3
    ttfts, waited = [], 0.0
    for c in run.calls:
        ttfts += [waited + t for t in c.ttft_ms] if c.ttft_ms is not None else [waited + c.step_ms[0]] * len(c.requests)
        waited += sum(c.step_ms)
    decode_ms = [ms for c in run.calls for ms in c.step_ms[1:]]
    byts = flops = 0.0
    for c in run.calls:
        b, f = decode_work(config, c.prompt_lens, len(c.step_ms), weight_bpp, kv_bytes)
        byts, flops = byts + b, flops + f
    decode_s = sum(decode_ms) / 1e3
    out = {"tokens_per_s": n_tokens / total_s if total_s > 0 else None,
           "ttft_ms": statistics.fmean(ttfts),
           "tpot_ms": statistics.fmean(decode_ms) if decode_ms else None,
           "tpot_ms_p50": roofline.percentile(decode_ms, 50) if decode_ms else None,
           "tpot_ms_p90": roofline.percentile(decode_ms, 90) if decode_ms else None,
           "achieved_GBps": byts / decode_s / 1e9 if decode_s > 0 else None,
           "mbu": None, "mfu": None}
    if decode_s > 0 and peak_bw:
        out["mbu"] = byts / decode_s / 1e9 / peak_bw
    if decode_s > 0 and peak_tflops:
        out["mfu"] = flops / decode_s / 1e12 / peak_tflops
    return out


def median_metrics(per_run: list[dict]) -> dict:
    """The median of each metric over the runs (`run_metrics` dicts), ignoring None; None where all are None."""
    out = {}
    for k in per_run[0]:
        vals = [m[k] for m in per_run if m[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    return out
