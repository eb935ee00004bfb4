"""Which bottleneck is yours: four classes of decode step, the rules that pick one from four measured numbers, where
each number comes from, and the controlled experiments (sweeps) that move a step from one class to another.

    launch-bound     the device waits for the host: for much of the step no kernel runs (Python, the dispatcher,
                     kernel launches, a sync to read the token back)
    compute-bound    the arithmetic is the roof: the step's FLOPs per byte reach the ridge point
    KV-bound         memory-bound, and the KV cache is most of the bytes the step reads
    bandwidth-bound  memory-bound, and the weights are most of the bytes

`RULES` are data: checked in order, the first that holds decides (`diagnose`, `classify`). Each reads one quantity
of a `Measurements`, compares it with its threshold (>=: a value exactly at the threshold is in the class) and says
why the threshold sits there and what fixes that class:

    1 launch-bound   idle_share >= 0.5   the host's share of the step is at least as big as the device's
    2 compute-bound  mfu / mbu >= 1      = arithmetic intensity / ridge point: the flat part of the roofline
    3 KV-bound       kv_share >= 0.5     the cache reads at least as many bytes as the weights
    4 bandwidth-bound otherwise

The numbers come from a live run (`measure_step`: a timed `generate` for TPOT, MBU, MFU; torch.profiler for the idle
share) or from a recorded bench row (`measurements_from_bench`: NVML GPU-Util for the idle share). `sweep` runs the
controlled experiments of a diagnosis — batch size, prompt length, output length, runtime (the ladder's rungs) —
one classified row per value; `onnxruntime_forward` compares one forward pass in PyTorch and ONNX Runtime where it is
installed; `trace_timeline` reads an exported profiler trace back for a timeline plot.

Sources: roofline (Williams, Waterman, Patterson, CACM 2009, https://doi.org/10.1145/1498765.1498785); MBU
(Databricks 2023, https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices); MFU (PaLM,
App. B, https://arxiv.org/abs/2204.02311); NVML GPU-Util (https://docs.nvidia.com/deploy/nvml-api/); PyTorch
profiler (https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from llmlab.config import PRESETS, ModelConfig
from llmlab.engine import LLM
from llmlab.ladder import available_steps
from llmlab.measure import roofline
from llmlab.measure.bench_file import peaks_dict
from llmlab.measure.model_bytes import step_weight_bytes
from llmlab.measure.profiling import op_overhead_us, profile_decode
from llmlab.measure.timing import cpu_threads_for, intra_op_threads
from llmlab.switches import apply_switches, describe

LAUNCH_BOUND, COMPUTE_BOUND, KV_BOUND, BANDWIDTH_BOUND = "launch-bound", "compute-bound", "KV-bound", "bandwidth-bound"
CLASSES = (LAUNCH_BOUND, BANDWIDTH_BOUND, KV_BOUND, COMPUTE_BOUND)


@dataclass(frozen=True)
class Measurements:
    """The four numbers the rules read, for one decode step (all fractions: 0.25 = 25%).

    idle_share: share of the step in which the device runs no kernel and waits for the host. From torch.profiler:
        1 - (time with >= 1 kernel running) / step time; from NVML: 1 - GPU-Util. On a CPU, which dispatches and
        computes on the same cores, the estimated share spent dispatching: operators per token x cost of one / TPOT.
    mbu: bytes the step must read / TPOT / peak copy bandwidth (> 0; may pass 1 on a CPU whose caches hold the model).
    mfu: FLOPs of the step / TPOT / peak matmul rate (>= 0).
    kv_share: KV-cache bytes / all bytes the step reads (weights once + every sequence's cache), in [0, 1].
    source: where the numbers came from (free text, shown in tables).

    Raises ValueError naming the field for a value that is not a finite number or out of its range.
    """

    idle_share: float
    mbu: float
    mfu: float
    kv_share: float
    source: str = ""

    def __post_init__(self) -> None:
        ranges = {"idle_share": (0, 1, "a fraction of the step in [0, 1] (0.75 = idle 75% of the step)"),
                  "mbu": (0, math.inf, "> 0 (a decode step reads at least its weights)"),
                  "mfu": (0, math.inf, ">= 0"),
                  "kv_share": (0, 1, "a fraction of the bytes in [0, 1]")}
        for name, (lo, hi, what) in ranges.items():
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
            if not ok or (name == "mbu" and v == 0):
                raise ValueError(f"Measurements: {name}={v!r} must be {what}")

    @property
    def mfu_over_mbu(self) -> float:
        """MFU / MBU = (FLOPs / peak FLOP/s) / (bytes / peak bytes/s) = arithmetic intensity / ridge point."""
        return self.mfu / self.mbu


@dataclass(frozen=True)
class Rule:
    """One row of the rule table: `label` when `getattr(m, quantity) >= threshold` (quantity None: always)."""

    label: str
    quantity: str | None
    threshold: float | None
    why: str
    fix: str

    def holds(self, m: Measurements) -> bool:
        return self.quantity is None or getattr(m, self.quantity) >= self.threshold

    @property
    def test(self) -> str:
        return "otherwise" if self.quantity is None else f"{self.quantity} >= {self.threshold:g}"


RULES: tuple[Rule, ...] = (
    Rule(LAUNCH_BOUND, "idle_share", 0.5,
         "for at least half of the step no kernel runs: the host (Python, dispatch, launches, syncs) is the larger "
         "part, so faster kernels or more bandwidth could shorten only the smaller half",
         "fewer, cheaper launches: CUDA graphs, torch.compile, fused kernels, sampling on the GPU (labs 05, 07)"),
    Rule(COMPUTE_BOUND, "mfu_over_mbu", 1.0,
         "MFU / MBU is the step's arithmetic intensity over the ridge point; at >= 1 the arithmetic would take at "
         "least as long as the reads even at both peaks: the flat part of the roofline",
         "fewer or cheaper FLOPs (lower-precision tensor cores, fp8), more GPUs; a bigger batch no longer adds "
         "tokens/s for free (lab 02)"),
    Rule(KV_BOUND, "kv_share", 0.5,
         "the step is memory-bound and the KV cache is at least half of its bytes: the context, not the weights, "
         "sets the step time, and quantizing the weights would save less than half",
         "a smaller cache: GQA/MQA, int8/fp8 KV, a shorter context or sliding window, fewer sequences per GPU "
         "(lab 03)"),
    Rule(BANDWIDTH_BOUND, None, None,
         "memory-bound and the weights are most of the bytes: reading the weights once per step sets its time",
         "fewer weight bytes (int8/int4, lab 04), more tokens per weight read (batching, labs 02, 06); at a low "
         "MBU, better kernels first (lab 07)"),
)


@dataclass(frozen=True)
class Diagnosis:
    """The class of a step, the rule that decided it, and one line per rule checked on the way (value vs threshold)."""

    label: str
    rule: Rule
    evidence: tuple[str, ...]


def diagnose(m: Measurements, rules: tuple[Rule, ...] = RULES) -> Diagnosis:
    """Walk `rules` in order; the first that holds gives the class. Raises TypeError for anything but a
    `Measurements`, ValueError when no rule holds (a rule table must end with a catch-all, quantity None)."""
    if not isinstance(m, Measurements):
        raise TypeError(f"diagnose: expected Measurements, got {type(m).__name__}")
    lines = []
    for rule in rules:
        if rule.quantity is None:
            return Diagnosis(rule.label, rule, tuple(lines + [f"otherwise: {rule.label}"]))
        value, ok = getattr(m, rule.quantity), rule.holds(m)
        lines.append(f"{rule.quantity} = {value:.3g} {'>=' if ok else '<'} {rule.threshold:g}: "
                     f"{rule.label if ok else 'not ' + rule.label}")
        if ok:
            return Diagnosis(rule.label, rule, tuple(lines))
    raise ValueError("no rule held: end the rule table with a catch-all Rule(label, None, None, why, fix)")


def classify(m: Measurements) -> str:
    """The class of a decode step by `RULES`: one of `CLASSES`."""
    return diagnose(m).label


# -- the bytes behind kv_share ---------------------------------------------------------------------------------------

def kv_share(config: ModelConfig, batch: int, context_len: float, weight_bytes_per_param: float = 2,
             kv_bytes_per_elem: float = 2) -> float:
    """KV-cache bytes / all bytes of one decode step (`llmlab.measure.roofline.decode_step_bytes`), in [0, 1).
    Raises ValueError for batch < 1, context_len < 0, bytes_per_param <= 0."""
    kv = roofline.kv_cache_bytes(config, batch, context_len, kv_bytes_per_elem)
    return kv / roofline.decode_step_bytes(config, batch, context_len, weight_bytes_per_param, kv_bytes_per_elem)


def kv_bound_context(config: ModelConfig, batch: int = 1, weight_bytes_per_param: float = 2,
                     kv_bytes_per_elem: float = 2) -> float:
    """Tokens of context per sequence at which `kv_share` reaches the KV rule's threshold (0.5: cache = weights).
    Llama-3.2-1B in bf16 at batch 1: 2.47 GB / 32 KB per token = ~75K tokens. Raises ValueError for batch < 1."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    t = next(r.threshold for r in RULES if r.label == KV_BOUND)
    per_token = batch * roofline.kv_bytes_per_token(config, kv_bytes_per_elem)
    return t / (1 - t) * roofline.weight_bytes(config, weight_bytes_per_param) / per_token


# -- measurements from a recorded bench row -------------------------------------------------------------------------

def _bench_config(doc: dict) -> ModelConfig:
    model_id = doc.get("model", {}).get("id")
    if model_id not in PRESETS:
        raise ValueError(f"the bench file's model {model_id!r} is not a preset: pass its ModelConfig as config=")
    return ModelConfig.from_preset(model_id)


def bench_kv_share(row: dict, doc: dict, config: ModelConfig | None = None) -> float:
    """`kv_share` over a bench row's decode steps: each prompt length of the workload decoded as one group of
    requests / lengths sequences (the llmlab engine's groups; Hugging Face's padded batch reads somewhat more), each
    step at its mean context. KV bytes per element from the model's dtype (2 for bf16/fp16, else 4)."""
    config = config or _bench_config(doc)
    wl = doc["workload"]
    lens, new = wl["prompt_lens"], row.get("new_tokens") or wl["new_tokens"]
    group = wl.get("requests", len(lens)) / len(lens)
    wbpp = row.get("weight_bytes_per_param") or 2.0
    kvb = 2 if doc.get("model", {}).get("dtype") in ("bfloat16", "float16") else 4
    kv = sum(group * roofline.kv_cache_bytes(config, 1, roofline.decode_mean_context_len(p, new), kvb) for p in lens)
    return kv / (kv + len(lens) * roofline.weight_bytes(config, wbpp))


def measurements_from_bench(row: dict, doc: dict, config: ModelConfig | None = None) -> Measurements:
    """A bench file row (`llmlab.measure.bench_file`) as `Measurements`: idle_share = 1 - gpu_util (NVML: the share
    of time in which at least one kernel ran, averaged over the timed runs, prefill included), its mbu and mfu,
    `bench_kv_share`. config: the model's, when the file's model is not a preset.
    Raises ValueError for a row without gpu_util, mbu or mfu (the roofline row, a CPU run)."""
    missing = [k for k in ("gpu_util", "mbu", "mfu") if row.get(k) is None]
    if missing:
        raise ValueError(f"row {row.get('step')!r} has no {', '.join(missing)} (the roofline row, or a run without "
                         f"NVML such as a CPU's): nothing to classify")
    return Measurements(idle_share=min(1.0, max(0.0, 1 - row["gpu_util"])), mbu=row["mbu"], mfu=row["mfu"],
                        kv_share=bench_kv_share(row, doc, config), source=f"{doc['device']}, {row['step']}")


def classify_bench(doc: dict, config: ModelConfig | None = None) -> list[dict]:
    """One tidy row per classifiable result of a bench document: step, label, the four quantities, gpu_util,
    tpot_ms (p50), tokens_per_s. Rows without GPU-Util or MBU (the roofline row) are left out."""
    out = []
    for row in doc["results"]:
        if any(row.get(k) is None for k in ("gpu_util", "mbu", "mfu")):
            continue
        m = measurements_from_bench(row, doc, config)
        out.append({"step": row["step"], "label": classify(m), "idle_share": m.idle_share, "mbu": m.mbu,
                    "mfu": m.mfu, "kv_share": m.kv_share, "gpu_util": row["gpu_util"],
                    "tpot_ms": row["tpot_ms_p50"], "tokens_per_s": row["tokens_per_s"], "measurements": m})
    return out


# -- live measurements and the controlled experiments ---------------------------------------------------------------

def _check_workload(llm: LLM, prompt_len: int, new_tokens: int, batch: int, profile_steps: int) -> None:
    """Raise ValueError, naming the argument, for a workload `measure_step` cannot run on `llm`."""
    for name, value, least in (("prompt_len", prompt_len, 1), ("new_tokens", new_tokens, 2), ("batch", batch, 1),
                               ("profile_steps", profile_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r} must be an integer >= {least}"
                             + (" (the decode steps follow the first token)" if name == "new_tokens" else ""))
    need = prompt_len + max(new_tokens, profile_steps + 1)
    if need > llm.config.max_seq_len:
        raise ValueError(f"prompt_len={prompt_len} + {need - prompt_len} tokens exceed the model's context of "
                         f"{llm.config.max_seq_len}: use a shorter prompt_len or fewer new_tokens")


def measure_step(llm: LLM, prompt_len: int = 128, new_tokens: int = 32, batch: int = 1, settings: dict | None = None,
                 peaks: dict | None = None, us_per_op: float | None = None, profile_steps: int = 4,
                 trace_path: str | os.PathLike | None = None, seed: int = 0) -> dict:
    """Measure and classify the decode step of one workload: `batch` random prompts of `prompt_len` tokens,
    `new_tokens` generated, under the switch `settings`.

    A warm-up, a timed `generate` (TPOT = the median decode step, ms: a busy machine's outliers move a mean; TTFT),
    then `profile_decode` over `profile_steps` decode steps (optionally writing a Chrome trace to `trace_path`).
    MBU / MFU / kv_share at the run's mean context (`roofline.decode_mean_context_len`), the weights' bytes from
    their tensors (`step_weight_bytes`), the KV cache in the model's dtype, against `peaks` ({"copy_GBps",
    "bf16_TFLOPs"}; default the measured ones). idle_share = 1 - (GPU busy time per token, from the profile) / TPOT
    on a GPU — the unprofiled TPOT, since the profiler slows the host and would inflate the idle time; on a CPU
    (aten operators per token x `us_per_op`, default `op_overhead_us`) / TPOT. Both clamped to [0, 1]. A small
    model on a CPU runs on one intra-op thread (`cpu_threads_for`).

    Returns a tidy dict: batch, prompt_len, new_tokens, context_len, setting_label, ttft_ms, tpot_ms, tokens_per_s
    (decode: batch x 1000 / TPOT), intensity (FLOP/byte), mbu, mfu, kv_share, idle_share, idle_from,
    aten_ops_per_token, kernels_per_token, launches_per_token (None on a CPU), label, measurements, profile.
    Raises ValueError: prompt_len or batch < 1, new_tokens < 2, profile_steps < 1 (or not integers), a workload
    longer than the context, switches that cannot run here.
    """
    _check_workload(llm, prompt_len, new_tokens, batch, profile_steps)
    settings = dict(settings or {})
    peaks = peaks or peaks_dict(llm.device)
    run_llm, kwargs = apply_switches(llm, settings)
    cfg = llm.config
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
    with intra_op_threads(cpu_threads_for(llm.device, cfg.num_params())):
        run_llm.generate(prompts, max_new_tokens=min(4, new_tokens), stop_at_eos=False, **kwargs)
        g = run_llm.generate(prompts, max_new_tokens=new_tokens, stop_at_eos=False, **kwargs)
        prof = profile_decode(llm, n_steps=profile_steps, settings=settings, prompt_len=prompt_len, batch=batch,
                              trace_path=trace_path, warmup=False, seed=seed)
    tpot = statistics.median(g.step_ms[1:])
    wbpp = step_weight_bytes(run_llm.model) / roofline.weight_params_read(cfg)
    kvb = torch.empty((), dtype=run_llm.dtype).element_size()
    ctx = roofline.decode_mean_context_len(prompt_len, new_tokens)
    if prof["cuda"]:
        busy_ms = prof["gpu_busy_ms_per_token"]
        idle_from = f"profiler: 1 - {busy_ms:.3f} ms of GPU work per token / TPOT"
    else:
        us = us_per_op if us_per_op is not None else op_overhead_us(llm.device)
        busy_ms = tpot - prof["aten_ops_per_token"] * us / 1e3
        idle_from = f"estimate: {prof['aten_ops_per_token']:.0f} operators x {us:.2f} us / TPOT"
    idle = min(1.0, max(0.0, 1 - busy_ms / tpot))
    m = Measurements(idle_share=idle, mbu=roofline.mbu(tpot / 1e3, cfg, batch, ctx, peaks["copy_GBps"], wbpp, kvb),
                     mfu=roofline.mfu(tpot / 1e3, cfg, batch, ctx, peaks["bf16_TFLOPs"]),
                     kv_share=kv_share(cfg, batch, ctx, wbpp, kvb), source=f"{llm.name} on {llm.device}")
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "context_len": ctx,
            "setting_label": describe(settings) if settings else "defaults", "ttft_ms": g.step_ms[0],
            "tpot_ms": tpot, "tokens_per_s": batch * 1e3 / tpot,
            "intensity": roofline.arithmetic_intensity(cfg, batch, ctx, wbpp, kvb), "mbu": m.mbu, "mfu": m.mfu,
            "kv_share": m.kv_share, "idle_share": m.idle_share, "idle_from": idle_from,
            "aten_ops_per_token": prof["aten_ops_per_token"], "kernels_per_token": prof["kernels_per_token"],
            "launches_per_token": prof["launches_per_token"], "label": classify(m), "measurements": m,
            "profile": prof}


SWEEPS = ("batch", "prompt_len", "new_tokens", "rung")
RUNTIME_RUNGS = ("eager", "+cuda_graphs", "+torch_compile", "+triton_kernels")


def sweep(llm: LLM, vary: str, values, *, prompt_len: int = 128, new_tokens: int = 32, batch: int = 1,
          settings: dict | None = None, peaks: dict | None = None, us_per_op: float | None = None,
          profile_steps: int = 4, log=None) -> list[dict]:
    """A controlled experiment: change one thing (`vary`, one of `SWEEPS`), keep the rest; one `measure_step` row
    per value, plus "vary" and "value" keys and "skipped" (None, or why that value could not run here).

    vary="rung": values are ladder rung names (`RUNTIME_RUNGS`: eager, CUDA graphs, torch.compile, the Triton
    kernels); each runs with the ladder's accumulated settings (`llmlab.ladder.available_steps`), and a rung that
    cannot run here becomes a skipped row with the ladder's reason. The peaks and the CPU's cost per operator are
    measured once for the whole sweep. log: called with one line per row (e.g. print), or None.
    Raises ValueError for an unknown `vary`, an empty `values`, or a value the model cannot run (`measure_step`).
    """
    if vary not in SWEEPS:
        raise ValueError(f"vary={vary!r}: sweep one of {', '.join(SWEEPS)}")
    values = list(values)
    if not values:
        raise ValueError("values is empty: give the values to sweep, e.g. [1, 2, 4, 8]")
    peaks = peaks or peaks_dict(llm.device)
    if us_per_op is None and llm.device.type == "cpu":
        us_per_op = op_overhead_us(llm.device)
    base = dict(prompt_len=prompt_len, new_tokens=new_tokens, batch=batch, settings=settings)
    if vary == "rung":
        runnable, skipped = available_steps(llm, values)
        settings_of, why_not = {r.name: r.settings for r in runnable}, {s.name: why for s, why in skipped}
        plans = [(v, why_not[v]) if v in why_not else (v, {**base, "settings": settings_of[v]}) for v in values]
    else:
        plans = [(v, {**base, vary: v}) for v in values]
        for _, plan in plans:  # every value checked before the first is measured
            _check_workload(llm, plan["prompt_len"], plan["new_tokens"], plan["batch"], profile_steps)
    rows = []
    for value, plan in plans:
        if isinstance(plan, str):
            rows.append({"vary": vary, "value": value, "skipped": plan, "label": None})
        else:
            rows.append({"vary": vary, "value": value, "skipped": None,
                         **measure_step(llm, peaks=peaks, us_per_op=us_per_op, profile_steps=profile_steps, **plan)})
        if log is not None:
            r = rows[-1]
            log(f"{vary} = {value}: " + (f"skipped ({r['skipped']})" if r["skipped"] else
                                         f"TPOT {r['tpot_ms']:.2f} ms, {r['tokens_per_s']:.0f} tokens/s, {r['label']}"))
    return rows


# -- the exported trace, read back for a timeline -------------------------------------------------------------------

def trace_timeline(trace_path: str | os.PathLike, steps: tuple[int, ...] = (1, 2)) -> list[dict]:
    """The events of decode steps `steps` in a Chrome trace written by `profile_decode` (.json or .json.gz), as rows
    {lane, name, start_us, dur_us} with start_us from the first chosen step's start. Lanes: "step", "host: operator"
    (top-level aten operators), "host: CUDA API" (launches, copies, syncs), "GPU: kernel" (kernels and copies).
    Raises ValueError when the file has none of those step ranges."""
    path = Path(trace_path)
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    names = {f"llmlab.step.{i}" for i in steps}  # the host's ranges; a GPU trace repeats them as gpu_user_annotation
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in names]
    if not ranges:
        raise ValueError(f"{path} has no llmlab.step.{steps} ranges: profile at least {max(steps)} decode steps")
    t0, t1 = min(e["ts"] for e in ranges), max(e["ts"] + e["dur"] for e in ranges)
    rows = [{"lane": "step", "name": e["name"], "start_us": e["ts"] - t0, "dur_us": e["dur"]} for e in ranges]
    lanes = {"cpu_op": "host: operator", "cuda_runtime": "host: CUDA API", "cuda_driver": "host: CUDA API",
             "kernel": "GPU: kernel", "gpu_memcpy": "GPU: kernel", "gpu_memset": "GPU: kernel"}
    open_until = -math.inf  # the end of the enclosing top-level operator: nested operators are left out
    for e in sorted(events, key=lambda e: e["ts"]):
        lane = lanes.get(e.get("cat"))
        if lane is None or not t0 <= e["ts"] < t1:
            continue
        if lane == "host: operator":
            if e["ts"] < open_until or not e["name"].startswith("aten::"):
                continue
            open_until = e["ts"] + e["dur"]
        rows.append({"lane": lane, "name": e["name"], "start_us": e["ts"] - t0, "dur_us": e["dur"]})
    return rows


# -- ONNX Runtime, where it is installed ----------------------------------------------------------------------------

def onnxruntime_status() -> tuple[bool, str]:
    """(True, "") when onnxruntime and onnx (torch.onnx's exporter needs it) are importable, else (False, why)."""
    missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
    if missing:
        return False, (f"{' and '.join(missing)} not installed (pip install onnxruntime onnx adds them; the course "
                       f"does not need them)")
    return True, ""


def onnxruntime_forward(llm: LLM, context_len: int = 128, repeats: int = 5, seed: int = 0) -> dict:
    """One forward pass over a `context_len`-token sequence (no KV cache: what a decode step recomputes without
    one), timed in PyTorch eager and in ONNX Runtime on the CPU, same weights, one intra-op thread each.

    The model is exported with torch.onnx's TorchScript exporter at this fixed shape. Returns {"available",
    "reason", "rows": [{"runtime", "ms" (median of `repeats`), "max_abs_diff" (ORT vs PyTorch logits)}]}; anything
    that fails on the way (the export, the session) gives available False and the error as the reason.
    Raises ValueError for a model that is not on the CPU in fp32, or context_len outside 1..max_seq_len.
    """
    ok, why = onnxruntime_status()
    if not ok:
        return {"available": False, "reason": why, "rows": []}
    if llm.device.type != "cpu" or llm.dtype != torch.float32:
        raise ValueError(f"onnxruntime_forward runs the CPU fp32 model; this one is {llm.dtype} on {llm.device}: "
                         f"use llmlab.load() (the default model on the CPU)")
    if not 1 <= context_len <= llm.config.max_seq_len:
        raise ValueError(f"context_len={context_len} must be in 1..{llm.config.max_seq_len}")
    ids = torch.randint(0, llm.config.vocab_size, (1, context_len), generator=torch.Generator().manual_seed(seed))

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    try:
        import numpy as np
        import onnxruntime as ort

        with tempfile.TemporaryDirectory() as tmp, intra_op_threads(1), torch.inference_mode():
            path = os.path.join(tmp, "decoder.onnx")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
                torch.onnx.export(llm.model, (ids,), path, dynamo=False, input_names=["input_ids"],
                                  output_names=["logits"])
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            feed = {"input_ids": ids.numpy()}
            ref = llm.model(ids)
            diff = float(np.abs(session.run(None, feed)[0] - ref.numpy()).max())
            rows = [{"runtime": "PyTorch eager", "ms": median_ms(lambda: llm.model(ids)), "max_abs_diff": 0.0},
                    {"runtime": "ONNX Runtime (CPU)", "ms": median_ms(lambda: session.run(None, feed)),
                     "max_abs_diff": diff}]
    except Exception as e:  # an export or a session that fails here is reported, not raised: the lab goes on
        return {"available": False, "reason": f"ONNX Runtime is installed, but {type(e).__name__}: {e}", "rows": []}
    return {"available": True, "reason": "", "rows": rows}
