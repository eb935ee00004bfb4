"""The capstone (lab 09): the whole ladder against its peers and the roofline, on this machine and in the recorded
GPU runs, and whether a "utilization" number ranks the rows the way tokens/s does.

    row_kind(row)            'rung' (the ladder's), 'peer' (Hugging Face generate) or 'roofline' (the limit)
    headline(doc)            the fastest rung and its ratio to eager, to each peer and to the roofline
    SMALL_BATCH              a batch workload small enough for a CPU: 8 requests of two prompt lengths
    plan(llm, workload)      which rungs and peers the lab times here: all on a CPU; on a GPU the rungs that change
                             what the step waits for (`GPU_PLAN`), so that the quantized and batching rungs fit
    run_ladder(llm, ...)     `llmlab.measure.bench.run_bench` on a loaded model: no file, the CPU thread count the
                             tour uses, a Workload object accepted as well as a name
    check_settings(llm, settings)        every switch's value for a partial dict, checked before anything runs
    measure_config(llm, settings, ...)   one combination of switches, measured exactly as a ladder rung
    recorded_ladder(...)     the newest GPU run of a workload's ladder, preferring one with its peers
    missing_rungs(doc)       the ladder's rungs a bench document did not measure, with the reason where it gives one
    newest_with_step(...)    the newest GPU run that measured a given rung
    rank_correlation(...)    Spearman's rank correlation between a column and tokens/s
    inversions(...)          pairs of rows where the faster one reads the LOWER utilization

Why rank correlation: a utilization number that measured how much useful work a configuration does would order the
rows as tokens/s does (rho near +1). MBU does, by construction (bytes the step must read / step time / peak). NVML's
GPU-Util counts the share of time in which any kernel ran, so a step full of slow kernels reads as high as a step
of fast ones (NVML: https://docs.nvidia.com/deploy/nvml-api/; MBU: Databricks 2023,
https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from llmlab.engine import LLM
from llmlab.ladder import LADDER, LadderStep, register_step, step_names
from llmlab.measure.bench import run_bench
from llmlab.measure.bench_file import list_bench
from llmlab.measure.timing import cpu_threads_for, intra_op_threads
from llmlab.measure.workloads import WORKLOADS, Workload, get_workload
from llmlab.switches import SWITCHES, WEIGHT_FORMATS, defaults, describe

PEERS = ("hf_eager", "hf_static")
ROOFLINE = "roofline"
YOURS = "yours"  # the step name of `measure_config`'s row

# On a GPU, the rungs and peers the lab times for each workload. The host-paced eager variants (no_kv_cache, +paged_kv,
# +gpu_sampling, +pinned_memory; labs 03 and 05 time them) are left out: on an H100 the batch workload's no_kv_cache
# and +paged_kv rows alone ran past a 3-minute budget, before CUDA graphs. Every rung still runs with the switches
# of the rungs below it (`llmlab.ladder.available_steps`), listed or not. The batch workload also leaves out the rows
# of the batch-1 rungs (+torch_compile, +step_tuning: their switches still carry into the rows above) and the
# quantized rungs, which labs 04 and 05 time; its peers are the two the batching figures compare with: one padded
# static-cache batch and HF's continuous batching.
GPU_PLAN = {
    "chat": (("eager", "+cuda_graphs", "+torch_compile", "+triton_kernels", "+step_tuning", "+prefill_graphs",
              "+int8", "+int4", "+int8_lm_head", "+int4_lm_head"), ("hf_eager", "hf_static")),
    "batch": (("eager", "+cuda_graphs", "+triton_kernels", "+prefill_graphs", "+one_at_a_time",
               "+static_batching", "+continuous_batching"), ("hf_static", "hf_continuous")),
}

SMALL_BATCH = Workload("batch-small", "8 requests at once: 4 each of 32- and 64-token prompts, 16 new tokens each",
                       (32,) * 4 + (64,) * 4, 16, 16)


def row_kind(row: dict) -> str:
    """'roofline' for the bandwidth-limit row, 'peer' for Hugging Face generate (steps 'hf_*'), else 'rung'."""
    step = row.get("step", "")
    if step == ROOFLINE:
        return "roofline"
    return "peer" if step.startswith("hf_") else "rung"


def _use_workload(workload: str | Workload) -> str:
    """The name `run_bench` looks up; a Workload object is added to `WORKLOADS` under its name first.

    Raises:
        ValueError: another workload already has that name (give this one another name).
    """
    if isinstance(workload, str):
        return workload
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r}: give a workload name ({', '.join(WORKLOADS)}) or a Workload")
    known = WORKLOADS.get(workload.name)
    if known is not None and known != workload:
        raise ValueError(f"workload name {workload.name!r} is taken by another workload ({known.description}); "
                         f"give yours another name")
    WORKLOADS[workload.name] = workload
    return workload.name


def run_ladder(llm: LLM, workload: str | Workload = "chat", *, quick: bool = False, steps: list[str] | None = None,
               peers: bool = True, model_id: str = "default", print_fn: Callable[..., Any] | None = None,
               **bench_kwargs) -> dict:
    """Run `workload` over the ladder (every rung that can run here, or `steps`) on the loaded `llm`, with the peers
    (`peers`) and the roofline, and return the bench document (`run_bench`; nothing is written: out=None).

    A small model on a CPU is timed on one intra-op thread, as `llmlab tour` does (`cpu_threads_for`): steadier on a
    shared machine. model_id: the model's id in the document ('default': the LLM's name). bench_kwargs go to
    `run_bench` (repeats, time_budget_s, measured_peaks, ...). print_fn: where the bench's lines go (default: none).

    Raises:
        ValueError: an unknown workload or step, a workload that does not fit the model's context (run_bench's
            messages), or a Workload whose name another workload has.
    """
    name = _use_workload(workload)
    with intra_op_threads(cpu_threads_for(llm.device, llm.config.num_params())):
        return run_bench(name, model_id, steps=steps, peers=peers, out=None, quick=quick, llm=llm,
                         print_fn=print_fn or (lambda *a, **k: None), **bench_kwargs)


def plan(llm: LLM, workload: str | Workload) -> dict[str, Any]:
    """The `steps` and `peers` arguments of `run_ladder` for the lab on `llm`'s device: {} on a CPU (every rung that
    can run, the default peers); on a CUDA GPU `GPU_PLAN`'s rungs and peers for the workload ({} for a workload it
    does not name). Pass it on: `run_ladder(llm, "chat", **plan(llm, "chat"))`.

    Raises:
        ValueError: a workload name that `llmlab.measure.workloads.WORKLOADS` does not have (the message lists them).
        TypeError: a workload that is neither a name nor a Workload.
    """
    if isinstance(workload, Workload):
        name = workload.name
    elif isinstance(workload, str):
        name = get_workload(workload).name
    else:
        raise TypeError(f"workload must be a workload name or a Workload, got {type(workload).__name__}")
    if llm.device.type != "cuda" or name not in GPU_PLAN:
        return {}
    steps, peers = GPU_PLAN[name]
    return {"steps": list(steps), "peers": list(peers)}


def check_settings(llm: LLM, settings: dict[str, Any]) -> dict[str, Any]:
    """Every switch's value for `settings` (missing keys take their defaults), checked without touching the model.

    Raises:
        ValueError: settings is not a dict; an unknown switch (the message lists the known ones); a value outside a
            switch's choices or not True/False for an on/off switch; a switch that cannot be turned on here (its
            reason, e.g. "needs a CUDA GPU").
    """
    if not isinstance(settings, dict):
        raise ValueError(f"settings={settings!r}: give a dict of switch name -> value, e.g. {{'weights': 'int8'}}")
    unknown = sorted(set(settings) - set(SWITCHES))
    if unknown:
        raise ValueError(f"unknown switch(es) {unknown}; known: {', '.join(SWITCHES)}")
    full = {**defaults(), **settings}
    for key, value in full.items():
        sw = SWITCHES[key]
        if sw.choices is not None and value not in sw.choices:
            raise ValueError(f"{key}={value!r} is not one of {sw.choices}")
        if sw.choices is None and not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: this switch is on or off; give True or False")
        if value != sw.default:
            ok, why = sw.available(llm)
            if not ok:
                raise ValueError(f"switch {key!r} cannot be set to {value!r} here: {why}; leave it at {sw.default!r}")
    return full


def measure_config(llm: LLM, settings: dict[str, Any], workload: str | Workload = "chat", *, quick: bool = False,
                   **bench_kwargs) -> dict:
    """Measure one combination of switches (`llmlab.switches`; missing keys take their defaults) on `workload`,
    exactly as `run_ladder` measures a rung (same prompts, warm-up, repeats and metrics), and return its row
    (step 'yours', label: the switches that are on). Nothing is written; the ladder is left as it was.

    Raises:
        ValueError: a bad setting (`check_settings`'s messages); a workload or step problem (`run_ladder`'s).
        RuntimeError: the combination failed while it ran (the message gives the error, e.g. two switches that
            `apply_switches` refuses together).
    """
    full = check_settings(llm, settings)
    if YOURS in step_names():
        raise ValueError(f"the ladder already has a rung named {YOURS!r}; measure_config needs that name")
    fmt = full.get("weights")  # the row's weight format, as the quantized rungs label theirs ('int4-g64' -> 'int4')
    step = register_step(LadderStep(YOURS, full, "your combination of switches", label=describe(settings),
                                    weights=WEIGHT_FORMATS[fmt][0] if fmt else None, cumulative=False))
    try:  # every switch is given, so nothing from the rungs below leaks into this row
        doc = run_ladder(llm, workload, quick=quick, steps=[YOURS], peers=False, **bench_kwargs)
    finally:
        LADDER.remove(step)
    row = next((r for r in doc["results"] if r["step"] == YOURS), None)
    if row is None:
        why = next((s["reason"] for s in doc["skipped"] if s["step"] == YOURS), "no row was measured")
        raise RuntimeError(f"your configuration did not run: {why}")
    return row


def _steps(doc: dict) -> set[str]:
    return {r["step"] for r in doc["results"]}


def _gpu_runs(directory, workload: str | None, model_id: str | None) -> list[dict]:
    """GPU bench files (not CPU runs, not kernel micro-benchmarks), oldest first."""
    out = []
    for d in list_bench(directory):
        wl = d.get("workload")
        if "cpu" in d["device"].lower() or not isinstance(wl, dict):
            continue
        if workload is not None and wl.get("name") != workload:
            continue
        if model_id is not None and d.get("model", {}).get("id") != model_id:
            continue
        out.append(d)
    return out


def recorded_ladder(workload: str, model_id: str | None = None,
                    directory: str | os.PathLike | None = None) -> dict | None:
    """The newest GPU bench file of `workload` (and model `model_id`, if given) that climbed the ladder from its
    'eager' rung AND ran both Hugging Face peers; without such a file, the newest that climbed from 'eager'; None if
    there is neither. directory: default data/bench/."""
    runs = [d for d in _gpu_runs(directory, workload, model_id) if "eager" in _steps(d)]
    with_peers = [d for d in runs if set(PEERS) <= _steps(d)]
    return (with_peers or runs or [None])[-1]


def missing_rungs(doc: dict) -> list[tuple[str, str]]:
    """[(rung, why)] for every rung of the ladder (`llmlab.ladder.step_names`, this process's) that `doc` has no row
    for, in ladder order: the document's own reason where it lists the rung as skipped, else 'not in this run'."""
    have = _steps(doc)
    why = {s["step"]: s["reason"] for s in doc.get("skipped", [])}
    return [(n, why.get(n, "not in this run")) for n in step_names() if n not in have]


def newest_with_step(step: str, workload: str | None = None, model_id: str | None = None,
                     directory: str | os.PathLike | None = None) -> dict | None:
    """The newest GPU bench file (of `workload` / `model_id`, if given) with a row for `step`; None if none has."""
    runs = [d for d in _gpu_runs(directory, workload, model_id) if step in _steps(d)]
    return runs[-1] if runs else None


def _measured(rows: list[dict], key: str) -> list[dict]:
    """The rows that ran (rungs and peers, not the roofline) and have both `key` and tokens_per_s."""
    def ok(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return [r for r in rows if row_kind(r) != "roofline" and ok(r.get(key)) and ok(r.get("tokens_per_s"))]


def _ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties given the mean of the ranks they share."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_correlation(rows: list[dict], key: str) -> float | None:
    """Spearman's rank correlation (in [-1, 1]) between column `key` (e.g. 'gpu_util', 'mbu', 'sm_active') and
    tokens_per_s over the rows that ran (the roofline left out) and have both. +1: the column orders the rows
    exactly as tokens/s does; -1: exactly the other way; None: fewer than 3 such rows, or either column constant.
    Ties get their mean rank (Spearman 1904, https://doi.org/10.2307/1412159)."""
    rs = _measured(rows, key)
    if len(rs) < 3:
        return None
    a, b = _ranks([r[key] for r in rs]), _ranks([r["tokens_per_s"] for r in rs])
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    sa = math.sqrt(sum((x - ma) ** 2 for x in a))
    sb = math.sqrt(sum((y - mb) ** 2 for y in b))
    if sa == 0 or sb == 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (sa * sb)


def inversions(rows: list[dict], key: str) -> list[tuple[dict, dict]]:
    """[(faster, slower)] for every pair of rows that ran where the faster one (more tokens_per_s) reads a LOWER
    `key` (e.g. 'gpu_util'): evidence that the column does not rank configurations. Sorted by the tokens/s ratio
    faster / slower, largest first; [] when the column orders every pair as tokens/s does."""
    rs = _measured(rows, key)
    pairs = [(a, b) for a in rs for b in rs if a["tokens_per_s"] > b["tokens_per_s"] and a[key] < b[key]]
    return sorted(pairs, key=lambda p: p[0]["tokens_per_s"] / p[1]["tokens_per_s"], reverse=True)


def headline(doc: dict) -> dict:
    """The fastest rung of a bench document and what it buys: {"fastest": its row, "over_eager": tokens/s ratio to
    the 'eager' rung (None without one), "over": {peer step: ratio} for the peers that ran, "of_roofline": its
    tokens/s / the roofline row's (None without one)}.

    Raises:
        ValueError: the document has no rung with tokens/s (only peers, or nothing ran).
    """
    rows = {r["step"]: r for r in doc["results"]}
    rungs = [r for r in doc["results"] if row_kind(r) == "rung" and r.get("tokens_per_s")]
    if not rungs:
        raise ValueError(f"no ladder rung ran in this document (steps: {', '.join(rows) or 'none'})")
    top = max(rungs, key=lambda r: r["tokens_per_s"])
    tps = top["tokens_per_s"]

    def ratio(step):
        r = rows.get(step)
        return tps / r["tokens_per_s"] if r and r.get("tokens_per_s") else None

    roof = ratio(ROOFLINE)  # top / roofline: the share of the limit the fastest rung reaches
    return {"fastest": top, "over_eager": ratio("eager"),
            "over": {p: ratio(p) for p in PEERS if ratio(p) is not None}, "of_roofline": roof}
