"""Profile a few decode steps with torch.profiler: how many kernels a token costs, and where the GPU waits.

`profile_decode(llm)` runs one short `generate` under `torch.profiler` (CPU activity, plus CUDA on a GPU), with
each step — one token to the next, as `generate` times it — wrapped in a `record_function("llmlab.step.<i>")`
range. Step 0 is the prefill; the summary covers the decode steps after it (per token = per decode step, in
which each sequence of the batch gets one token):

    kernels_per_token        GPU kernels executed per decode step (one new token per sequence)
    launches_per_token       host calls that launch GPU work: cudaLaunchKernel*, cuLaunchKernel*, cudaGraphLaunch
    launch_api_ms_per_token  host time spent inside those calls
    aten_ops_per_token       PyTorch operators called from Python per step (top-level aten ops); on a CPU there
                             are no kernel launches, so this is the number to read there: each would be one or
                             more kernel launches on a GPU
    step_ms                  mean wall time of a decode step (profiler overhead included), from the step ranges
                             of the full call (`step_ms_from` says; the two calls' difference where the ranges
                             do not follow the tokens, as with GPU sampling)
    gpu_busy_ms_per_token    time in which at least one kernel ran (union of kernel intervals)
    gpu_idle_ms_per_token    step_ms - busy: the GPU waited for the host ("launch-bound" time)
    idle_gap_between_steps_us  mean gap from the last kernel of a step to the first kernel of the next: the host's
                             work between forward passes (sampling, reading the token back, Python)
    top_ops / top_kernels    the most frequent operators / the kernels taking the most GPU time, per token

and it can export a Chrome trace (`trace_path=...`) that https://ui.perfetto.dev or chrome://tracing open, to see
every kernel and the gaps between them on a timeline.

Per-token figures are the difference between two profiled calls of the same prompt — one generating only the
first token (prefill), one generating n more — divided by n, so they hold whatever a decode path does with its
step boundaries (GPU sampling reads tokens back in blocks of steps). The counting is split from the profiler
(`events_from_profiler` -> `summarize`) so it is testable on a CPU with hand-made events. Source: PyTorch profiler
recipe, https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html; Kineto/CUPTI for the GPU activity.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import statistics
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmlab.engine import LLM
from llmlab.switches import apply_switches, check_per_token_settings, describe

STEP_PREFIX = "llmlab.step."


class StepRanges:
    """Marks each decode step as a profiler range named `llmlab.step.<i>`, opened and closed from `on_token`.

    Usage: `marks.open(0)` before `generate(..., on_token=marks.on_token)`, `marks.close()` after. Step i's range
    runs from token i-1 reaching the host to token i reaching it. `last_step`: open no range after this step.
    """

    def __init__(self, last_step: int | None = None):
        self.last_step = last_step
        self._rf = None

    def open(self, i: int) -> None:
        from torch.profiler import record_function

        self._rf = record_function(f"{STEP_PREFIX}{i}")
        self._rf.__enter__()

    def close(self) -> None:
        if self._rf is not None:
            self._rf.__exit__(None, None, None)
            self._rf = None

    def on_token(self, step: int, _tokens) -> None:
        self.close()
        if self.last_step is None or step + 1 <= self.last_step:
            self.open(step + 1)
_LAUNCH = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|cudaGraphLaunch|"
                     r"cudaLaunchCooperativeKernel)(_v\d+)?$")
_SYNC = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize)(_v\d+)?$")


@dataclass(frozen=True)
class Ev:
    """One profiler event, reduced to what the summary needs. Times in microseconds on the profiler's clock.

    kind: "op" (an aten operator; top_level=True when no other aten op encloses it), "launch" (a host call that
    launches GPU work), "sync" (a host call that waits for the GPU), "kernel" (GPU), "memcpy" (GPU copy/memset),
    "step" (an llmlab.step.<i> range; `step` holds i), "other".
    """

    name: str
    kind: str
    start_us: float
    end_us: float
    top_level: bool = False
    step: int | None = None


def events_from_profiler(prof) -> list[Ev]:
    """Convert a finished `torch.profiler.profile`'s events into `Ev`s."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        a, b = float(e.time_range.start), float(e.time_range.end)
        name = e.name
        if e.device_type == DeviceType.CUDA:
            kind = "memcpy" if name.startswith(("Memcpy", "Memset")) else "kernel"
            out.append(Ev(name, kind, a, b))
        elif name.startswith(STEP_PREFIX):
            out.append(Ev(name, "step", a, b, step=int(name[len(STEP_PREFIX):])))
        elif name.startswith("aten::"):
            parent, top = e.cpu_parent, True
            while parent is not None:
                if parent.name.startswith("aten::"):
                    top = False
                    break
                parent = parent.cpu_parent
            out.append(Ev(name, "op", a, b, top_level=top))
        elif _LAUNCH.match(name):
            out.append(Ev(name, "launch", a, b))
        elif _SYNC.match(name):
            out.append(Ev(name, "sync", a, b))
    return out


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by intervals (overlaps counted once)."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + ((cur_b - cur_a) if cur_b is not None else 0.0)


def call_totals(events: list[Ev]) -> dict[str, Any]:
    """Totals of one profiled `generate` call: counts of host ops / launches / syncs and GPU kernels / copies,
    host time in launch calls, the GPU's busy time (union of its intervals) and the wall time from the first
    event to the last (host or GPU). Step ranges are ignored."""
    evs = [e for e in events if e.kind != "step"]
    if not evs:
        return {"wall_us": 0.0, "busy_us": 0.0, "ops": Counter(), "op_calls": 0, "launches": 0, "launch_us": 0.0,
                "syncs": 0, "kernels": Counter(), "kernel_us": Counter(), "memcpys": 0}
    gpu = [e for e in evs if e.kind in ("kernel", "memcpy")]
    kernel_us: Counter = Counter()
    for e in gpu:
        if e.kind == "kernel":
            kernel_us[e.name] += e.end_us - e.start_us
    return {
        "wall_us": max(e.end_us for e in evs) - min(e.start_us for e in evs),
        "busy_us": union_length([(e.start_us, e.end_us) for e in gpu]),
        "ops": Counter(e.name for e in evs if e.kind == "op" and e.top_level),
        "op_calls": sum(e.kind == "op" for e in evs),
        "launches": sum(e.kind == "launch" for e in evs),
        "launch_us": sum(e.end_us - e.start_us for e in evs if e.kind == "launch"),
        "syncs": sum(e.kind == "sync" for e in evs),
        "kernels": Counter(e.name for e in gpu if e.kind == "kernel"),
        "kernel_us": kernel_us,
        "memcpys": sum(e.kind == "memcpy" for e in gpu),
    }


def _step_ranges(events: list[Ev], first_step: int = 1) -> dict[int, tuple[float, float]] | None:
    """{step: (start_us, end_us)} of the step ranges from `first_step` on, or None when there are fewer than two or
    they do not follow the tokens one at a time: a range in which no operator started (GPU sampling reads tokens
    back in blocks, so `on_token` fires in bursts)."""
    steps = {e.step: (e.start_us, e.end_us) for e in events if e.kind == "step" and e.step >= first_step}
    ops = [e.start_us for e in events if e.kind == "op"]
    if len(steps) < 2:
        return None
    for a, b in steps.values():
        if not any(a <= t < b for t in ops):
            return None
    return steps


def decode_span_us(events: list[Ev]) -> float | None:
    """One call's decode time (µs) from its own step ranges: the start of step 1 (token 0 reached the host) to the
    end of the last step (the last token did). None without ranges that follow the tokens (`_step_ranges`)."""
    steps = _step_ranges(events)
    if steps is None:
        return None
    return max(b for _, b in steps.values()) - min(a for a, _ in steps.values())


def step_gaps_us(events: list[Ev], first_step: int = 1) -> list[float] | None:
    """GPU idle gaps between consecutive decode steps (µs): from the last GPU event that starts in step i's host
    range to the first that starts in step i+1's. None when the step ranges do not follow the GPU work one token at
    a time (e.g. GPU sampling reads tokens back in blocks, so `on_token` fires in bursts) — detected as a step
    range with no operator started in it — or when there is no GPU activity."""
    steps = _step_ranges(events, first_step)
    gpu = [e for e in events if e.kind in ("kernel", "memcpy")]
    if steps is None or not gpu:
        return None
    order = sorted(steps)
    gaps = []
    for i, j in zip(order, order[1:]):
        before = [e.end_us for e in gpu if steps[i][0] <= e.start_us < steps[i][1]]
        after = [e.start_us for e in gpu if steps[j][0] <= e.start_us < steps[j][1]]
        if before and after:
            gaps.append(max(0.0, min(after) - max(before)))
    return gaps or None


def summarize(prefill_only: list[Ev], full: list[Ev], n_steps: int, batch: int = 1, top: int = 10) -> dict[str, Any]:
    """Per-decode-step figures from two profiled calls of the same prompt: one that generates 1 token (the
    prefill) and one that generates 1 + n_steps. Their difference divided by n_steps is the cost of one decode
    step, whatever the decode path does with its step boundaries.

    Returns the fields described in the module docstring (GPU fields None when no GPU activity was recorded).
    Raises ValueError for n_steps < 1.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps={n_steps} must be >= 1")
    a, b = call_totals(prefill_only), call_totals(full)

    def per(key: str) -> float:
        return max(0.0, b[key] - a[key]) / n_steps

    ops = b["ops"] - a["ops"]  # Counter subtraction keeps positive counts
    cuda = bool(b["kernels"]) or b["launches"] > 0
    # the step's wall time from the full call's own step ranges where they follow the tokens: a difference of two
    # calls' wall times carries both calls' noise (on a loaded CPU it can even come out <= 0)
    span = decode_span_us(full)
    wall = span / n_steps if span is not None else per("wall_us")
    out: dict[str, Any] = {
        "decode_steps": n_steps,
        "batch": batch,
        "step_ms": wall / 1e3,
        "step_ms_from": "step ranges" if span is not None else "difference of the two calls",
        "aten_ops_per_token": max(0.0, sum(b["ops"].values()) - sum(a["ops"].values())) / n_steps,
        "aten_calls_per_token": per("op_calls"),
        "top_ops": [{"name": k, "per_token": v / n_steps} for k, v in ops.most_common(top)],
        "cuda": cuda,
        "kernels_per_token": None, "memcpys_per_token": None, "launches_per_token": None,
        "launch_api_ms_per_token": None, "syncs_per_token": None, "gpu_busy_ms_per_token": None,
        "gpu_idle_ms_per_token": None, "gpu_busy_fraction": None, "idle_gap_between_steps_us": None,
        "top_kernels": [],
    }
    if not cuda:
        out["note"] = ("CPU run: no GPU kernels or launches to count; aten_ops_per_token counts the PyTorch operators "
                       "called from Python per decode step (on a GPU each launches one or more kernels)")
        return out
    kernel_us = b["kernel_us"] - a["kernel_us"]
    kernel_n = b["kernels"] - a["kernels"]
    busy = per("busy_us")
    gaps = step_gaps_us(full)
    out.update({
        "kernels_per_token": max(0.0, sum(b["kernels"].values()) - sum(a["kernels"].values())) / n_steps,
        "memcpys_per_token": per("memcpys"),
        "launches_per_token": per("launches"),
        "launch_api_ms_per_token": per("launch_us") / 1e3,
        "syncs_per_token": per("syncs"),
        "gpu_busy_ms_per_token": busy / 1e3,
        "gpu_idle_ms_per_token": max(0.0, wall - busy) / 1e3,
        "gpu_busy_fraction": min(1.0, busy / wall) if wall > 0 else None,
        "idle_gap_between_steps_us": statistics.fmean(gaps) if gaps else None,
        "top_kernels": [{"name": k, "us_per_token": v / n_steps, "per_token": kernel_n[k] / n_steps}
                        for k, v in kernel_us.most_common(top)],
    })
    if gaps is None:
        out["note"] = ("idle_gap_between_steps_us is null: the step boundaries the host sees do not follow the GPU "
                       "one token at a time here (e.g. tokens read back in blocks)")
    return out


def check_trace_path(trace_path: str | os.PathLike) -> Path:
    """The trace file's path, checked BEFORE profiling: not a folder, named .json or .json.gz, and inside a folder
    that exists (or can be created) and can be written to. A probe file in the nearest existing folder is created
    and removed.

    Raises:
        ValueError: the path cannot be written (the message names it, why, and what to give instead).
    """
    path = Path(trace_path).expanduser()
    example = "--trace /tmp/decode.json"
    if path.is_dir():
        raise ValueError(f"trace path {path} is a folder; give a file name in it, e.g. --trace {path / 'decode.json'}")
    if not path.name.endswith((".json", ".json.gz")):
        raise ValueError(f"trace path {path} must end in .json, or .json.gz for a gzip-compressed trace (what "
                         f"torch.profiler writes and Perfetto reads), e.g. {example}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"cannot write the trace to {path}: {folder} is a file, not a folder; give a path inside "
                         f"a folder, e.g. {example}")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"cannot write the trace to {path}: the folder {folder} is not writable ({e.strerror}); "
                         f"give a path in a folder you can write to, e.g. {example}") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"cannot write the trace to {path}: the file exists and is read-only; give another name")
    return path


def _export(prof, path: Path) -> str | None:
    """Write the Chrome trace JSON to `path` (gzip-compressed when the name ends in .gz; Perfetto opens both).

    The trace is written to a temporary file in the same folder and moved into place only when it is complete, so
    a failed export (a full disk) leaves an older trace at `path` untouched. torch's exporter only logs when it
    cannot open the file, so the file is checked afterwards. Returns None when the trace was written, else why not.
    """
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".trace-", suffix=".json", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        tmp.unlink()  # torch's exporter creates the file itself: an empty one left here would pass for a trace
        if path.suffix == ".gz":
            raw = tmp.with_suffix(".raw.json")
            try:
                prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as src, gzip.open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            finally:
                raw.unlink(missing_ok=True)
        else:
            prof.export_chrome_trace(str(tmp))
        if not tmp.is_file() or tmp.stat().st_size == 0:
            return (f"the trace was not written to {path} (torch's exporter could not create it; see its log "
                    f"above); the profile above is complete")
        os.replace(tmp, path)
    except OSError as e:
        return f"the trace was not written to {path} ({e}); the profile above is complete"
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return None


def profile_decode(llm: LLM, n_steps: int = 8, settings: dict | None = None, prompt_len: int = 128,
                   batch: int = 1, trace_path: str | os.PathLike | None = None, warmup: bool = True,
                   seed: int = 0) -> dict[str, Any]:
    """Profile `n_steps` decode steps of `llm` under the switch `settings` and summarize them.

    Args:
        llm: the model (any device).
        n_steps: decode steps to summarize (the prefill step before them is profiled but not counted).
        settings: switch values (`llmlab.switches`), e.g. {"cuda_graphs": True}; None = the defaults.
        prompt_len, batch: the prompt (random token ids, seeded) — a (batch, prompt_len) batch.
        trace_path: where to write the Chrome trace (.json, or .json.gz to compress); None = no file. Checked
            before profiling (`check_trace_path`).
        warmup: run the same generate once untraced first (compilation, CUDA-graph capture, lazy init stay out).

    Returns:
        `summarize(...)` plus "device", "model", "settings", "setting_label", "prompt_len", "trace_path" (None
        when no trace was written) and "trace_error" (None, or why the trace file could not be written after all).

    Raises:
        ValueError: n_steps < 1, prompt_len + n_steps + 1 beyond the context, unknown/unavailable switches,
            batching='continuous' (the steps are marked through generate's on_token), a trace_path that cannot be
            written.
    """
    from torch.profiler import ProfilerActivity, profile

    if n_steps < 1:
        raise ValueError(f"n_steps={n_steps}: profile at least one decode step")
    context = llm.config.max_seq_len
    if prompt_len + n_steps + 1 > context:
        what = (f"a {prompt_len}-token prompt + {n_steps + 1} generated tokens (the prefill's token and {n_steps} "
                f"decode steps) exceed the model's context of {context} tokens: ")
        longest, most_steps = context - n_steps - 1, context - prompt_len - 1  # what fits with the other as is
        fixes = ([f"a prompt of at most {longest} tokens (prompt_len, --prompt-tokens)"] if longest >= 1 else []) + \
                ([f"at most {most_steps} decode steps (n_steps, --steps)"] if most_steps >= 1 else [])
        what += "use " + (" or ".join(fixes) if fixes else
                          f"a shorter prompt and fewer steps: together at most {context - 1} tokens")
        raise ValueError(what)
    if trace_path is not None:
        trace_path = check_trace_path(trace_path)
    settings = dict(settings or {})
    check_per_token_settings(settings, "profile_decode")  # its step marks come from generate's on_token
    run_llm, kwargs = apply_switches(llm, settings)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, llm.config.vocab_size, (batch, prompt_len), generator=gen).tolist()
    new = n_steps + 1  # step 0 = prefill + first token, then n_steps decode steps
    if warmup:
        run_llm.generate(prompt, max_new_tokens=new, stop_at_eos=False, **kwargs)
    cuda = run_llm.device.type == "cuda"
    marks = StepRanges(last_step=new - 1)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def profiled(n_new: int, with_steps: bool):
        if cuda:
            torch.cuda.synchronize(run_llm.device)
        with profile(activities=activities) as prof:
            if with_steps:
                marks.open(0)
            try:
                run_llm.generate(prompt, max_new_tokens=n_new, stop_at_eos=False,
                                 on_token=marks.on_token if with_steps else None, **kwargs)
            finally:
                marks.close()
            if cuda:
                torch.cuda.synchronize(run_llm.device)
        return prof

    prefill_events = events_from_profiler(profiled(1, False))
    prof = profiled(new, True)
    summary = summarize(prefill_events, events_from_profiler(prof), n_steps, batch=batch)
    summary.update({"device": str(run_llm.device), "model": llm.name, "settings": settings,
                    "setting_label": describe(settings) if settings else "defaults", "prompt_len": prompt_len,
                    "dtype": str(run_llm.dtype).removeprefix("torch."), "trace_path": None, "trace_error": None})
    if trace_path is not None:
        summary["trace_error"] = _export(prof, trace_path)
        if summary["trace_error"] is None:
            summary["trace_path"] = str(trace_path)
    return summary


def op_overhead_us(device=None, n: int = 2000, repeats: int = 5) -> float:
    """Microseconds per tiny PyTorch operation on `device` (in-place add on a 1-element tensor), median of repeats.

    On a GPU this is the rate at which the host can launch kernels that do nothing (the GPU finishes each at once,
    so the host's launch path is the limit; ~6.8 us on the course's H200 with torch 2.11); on a CPU it is the
    dispatcher's per-operator cost. Multiply by the operators per token to estimate the overhead of a decode step.
    """
    import time

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x = torch.zeros(1, device=device)
    cuda = device.type == "cuda"
    times = []
    for r in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        if cuda:
            torch.cuda.synchronize(device)
        if r:  # the first pass warms up
            times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def format_summary(s: dict[str, Any]) -> str:
    """A few lines of text for a profile summary."""
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [f"{s.get('model', '?')} on {s.get('device', '?')} ({s.get('dtype', '?')}), "
             f"{s.get('setting_label', 'defaults')}: {s['decode_steps']} decode steps, batch {s['batch']}",
             f"  decode step (wall)     {s['step_ms']:.3f} ms",
             f"  aten ops per token     {s['aten_ops_per_token']:.0f} called from Python "
             f"({s['aten_calls_per_token']:.0f} including nested)"]
    if s["cuda"]:
        lines += [f"  kernels per token      {f(s['kernels_per_token'], '.0f')} "
                  f"(+{f(s['memcpys_per_token'], '.0f')} copies); host launch calls {f(s['launches_per_token'], '.0f')}"
                  f" taking {f(s['launch_api_ms_per_token'], '.3f')} ms",
                  f"  GPU busy / idle        {f(s['gpu_busy_ms_per_token'], '.3f')} / "
                  f"{f(s['gpu_idle_ms_per_token'], '.3f')} ms per token "
                  f"({f(100 * s['gpu_busy_fraction'] if s['gpu_busy_fraction'] is not None else None, '.0f')}% busy)",
                  f"  gap between steps      {f(s['idle_gap_between_steps_us'], '.1f')} us"]
    else:
        lines.append(f"  ({s.get('note', '')})")
    if s.get("trace_path"):
        lines.append(f"  trace: {s['trace_path']} (open in https://ui.perfetto.dev or chrome://tracing)")
    if s.get("trace_error"):
        lines.append(f"  trace: NOT written: {s['trace_error']}")
    return "\n".join(lines)
