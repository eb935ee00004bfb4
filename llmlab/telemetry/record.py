"""`llmlab record`: decode on a real GPU while the NVML sampler watches, and keep what it saw as a trace file.

For each setting (a dict of switch values from `llmlab.switches`; default: the eager bf16 KV-cache decode at
batch 1, and the same without the KV cache) the recording is:

    warm-up: one whole call of the workload (not recorded; the eager decode's first run at new KV lengths is several
    times slower than the next, so a short warm-up would leave that one-off cost in the trace)
    sampler on (10 Hz) -> 1 s idle -> repeated generate calls (128-token random prompt, 256 new tokens, no EOS stop)
    until ~12 s of decoding -> 1 s idle -> sampler off
    a few decode steps under torch.profiler: the GPU kernels and the gaps between them (CUDA only)

and one trace per setting is written to `data/traces/<device>_<model>_<setting>.json` (`llmlab.telemetry.trace`). The idle
seconds make the contrast visible: GPU-Util jumps when decoding starts, SM activity and DRAM bandwidth barely move.

    llmlab record                                   # llama-3.2-1b shape, random bf16 weights, both settings
    llmlab record --preset llama-3.1-8b --duration 15
    llmlab record --model default --setting kv_cache=true,dtype=bf16 --out-dir /tmp/traces

Without a CUDA GPU the command prints one line saying so and exits with status 2. `record_setting` itself works
with any `Sampler` backend and any device, so the tests drive it on a CPU with a fake backend.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from llmlab import envinfo
from llmlab.engine import LLM
from llmlab.telemetry.nvml_sampler import Backend, Sampler
from llmlab.measure.profiling import union_length
from llmlab.switches import SWITCHES, apply_switches, check_per_token_settings, describe
from llmlab.telemetry.trace import Trace, make_trace, save_trace, slug, trace_dir

DEFAULT_PRESET = "llama-3.2-1b"
DEFAULT_SETTINGS: list[dict[str, Any]] = [
    {"kv_cache": True, "dtype": "bf16"},
    {"kv_cache": False, "dtype": "bf16"},
]

# -- settings as text -------------------------------------------------------------------------------------------


def setting_slug(settings: dict[str, Any]) -> str:
    """A file-name part for a settings dict, in registry order: {"kv_cache": True, "dtype": "bf16"} ->
    'kv-cache_bf16'; {"kv_cache": False, ...} -> 'no-kv-cache_bf16'. Switches left at None are skipped."""
    parts = []
    for key, sw in SWITCHES.items():
        if key not in settings:
            continue
        v = settings[key]
        name = key.replace("_", "-")
        if sw.choices is None:
            parts.append(name if v else f"no-{name}")
        elif v is not None:
            parts.append(slug(str(v)))
    return "_".join(parts) or "defaults"


setting_label = describe  # one labelling rule for traces, the dashboard and the benchmarks


def parse_setting(text: str) -> dict[str, Any]:
    """'kv_cache=false,dtype=bf16' -> {"kv_cache": False, "dtype": "bf16"}.

    Boolean switches take true/false/on/off/1/0/yes/no; choice switches one of their choices ('none' for None).
    Raises ValueError naming the unknown switch or the allowed values, or a switch given twice.
    """
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"setting {item!r}: write key=value, e.g. kv_cache=false")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in SWITCHES:
            raise ValueError(f"unknown switch {key!r}; known: {', '.join(SWITCHES)}")
        if key in out:
            raise ValueError(f"switch {key!r} is given twice in {text!r}; give each switch once (the last one "
                             f"would silently win)")
        sw = SWITCHES[key]
        if sw.choices is None:
            low = value.lower()
            if low not in ("true", "false", "on", "off", "1", "0", "yes", "no"):
                raise ValueError(f"{key} is on/off: write {key}=true or {key}=false, not {value!r}")
            out[key] = low in ("true", "on", "1", "yes")
        else:
            by_text = {("none" if c is None else str(c)).lower(): c for c in sw.choices}
            if value.lower() not in by_text:
                raise ValueError(f"{key}={value!r} is not one of {', '.join(by_text)}")
            out[key] = by_text[value.lower()]
    return out


# -- profiling a few decode steps --------------------------------------------------------------------------------


def summarize_kernels(step_ranges: dict[int, tuple[float, float]], kernels: list[tuple[float, float]],
                      steps: list[int]) -> dict | None:
    """The kernel timeline of some decode steps, from profiler times in microseconds.

    step_ranges: step index -> (start, end) of that step on the host; kernels: (start, end) of every GPU kernel;
    steps: the (consecutive) steps to keep. Kernels are clipped to the window from the first kept step's start to
    the last one's end. Returns None if no step or no kernel falls in it; else {"steps", "window_us", "busy_us"
    (union of the kernel intervals: time in which at least one kernel ran), "n_kernels", "step_us",
    "step_busy_us", "intervals_us" (relative to the window's start)}.
    """
    wanted = [i for i in steps if i in step_ranges]
    if not wanted:
        return None
    w0, w1 = step_ranges[wanted[0]][0], step_ranges[wanted[-1]][1]
    inside = sorted((max(a, w0), min(b, w1)) for a, b in kernels if b > w0 and a < w1)
    if not inside:
        return None
    step_us, step_busy = [], []
    for i in wanted:
        a, b = step_ranges[i]
        step_us.append(b - a)
        step_busy.append(union_length([(max(x, a), min(y, b)) for x, y in inside if y > a and x < b]))
    return {"steps": len(wanted), "window_us": w1 - w0, "busy_us": union_length(inside), "n_kernels": len(inside),
            "step_us": step_us, "step_busy_us": step_busy, "intervals_us": [[a - w0, b - w0] for a, b in inside]}


def profile_steps(llm: LLM, prompt_ids: list[int], kwargs: dict, n_new: int, cuda: bool):
    """Run `generate` under torch.profiler with each step (one token to the next, as `generate` times it) wrapped in
    a `record_function("llmlab.step.<i>")` range, opened and closed from `on_token`.

    Returns (step_ranges {i: (start_us, end_us)}, device_intervals [(start_us, end_us), ...]) on the profiler's
    clock; device_intervals are the GPU's kernels and copies (empty when cuda is False).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from llmlab.measure.profiling import STEP_PREFIX, StepRanges

    marks = StepRanges()

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        marks.open(0)
        try:
            llm.generate(prompt_ids, max_new_tokens=n_new, stop_at_eos=False, on_token=marks.on_token, **kwargs)
        finally:
            marks.close()
        if cuda:
            torch.cuda.synchronize()
    ranges, device = {}, []
    for e in prof.events():
        if e.name.startswith(STEP_PREFIX):
            if e.device_type == DeviceType.CPU:
                ranges[int(e.name.rsplit(".", 1)[1])] = (e.time_range.start, e.time_range.end)
        elif e.device_type == DeviceType.CUDA:
            device.append((e.time_range.start, e.time_range.end))
    return ranges, device


def profile_kernels(llm: LLM, prompt_ids: list[int], kwargs: dict, steps: int = 4, skip: int = 2) -> dict | None:
    """The GPU kernels of `steps` decode steps (after `skip` steps: the prefill and a first decode step), from a
    short decode under torch.profiler (`profile_steps`, `summarize_kernels`). `generate` reads every token back to
    the host (`.tolist()`), so each step's kernels finish inside its range. None on a CPU or if nothing was seen.

    busy_us / window_us is the share of time at least one kernel ran — what NVML's GPU-Util estimates (the
    profiler itself adds a little time per launch).
    """
    if llm.device.type != "cuda":
        return None
    ranges, kernels = profile_steps(llm, prompt_ids, kwargs, steps + skip + 1, cuda=True)
    out = summarize_kernels(ranges, kernels, list(range(skip, skip + steps)))
    if out is not None:
        out["note"] = "torch.profiler (CUPTI) over decode steps; the profiler adds a little time per launch"
    return out


# -- one recording -----------------------------------------------------------------------------------------------


def sampler_cost(llm: LLM, prompt_ids: list[int], kwargs: dict, new_tokens: int = 64,
                 interval_s: float = 0.1) -> dict[str, float]:
    """Does watching change what is watched? Median decode-step time (ms) of the same short run with no sampler,
    with NVML's basic readings only, and with the GPM metrics too — so a recording can say what sampling cost.

    Returns {"none": ms, "nvml": ms, "nvml+gpm": ms} (a key is missing where that backend cannot open).
    """
    from llmlab.telemetry.nvml_sampler import NvmlBackend

    def tpot_p50() -> float:
        g = llm.generate(prompt_ids, max_new_tokens=new_tokens, **kwargs)
        return g.metrics.tpot_p50_ms

    out = {"none": tpot_p50()}
    for label, gpm in (("nvml", False), ("nvml+gpm", True)):
        try:
            with Sampler(interval_s=interval_s, backend=NvmlBackend(gpm=gpm)):
                out[label] = tpot_p50()
        except RuntimeError:
            pass
    return out


def record_setting(llm: LLM, settings: dict[str, Any], *, model_name: str, duration_s: float = 12.0,
                   prompt_tokens: int = 128, new_tokens: int = 256, idle_s: float = 1.0, interval_s: float = 0.1,
                   backend: Backend | None = None, device_name: str | None = None, peaks: dict | None = None,
                   profile: bool = True, seed: int = 0, print_fn: Callable[[str], None] | None = None) -> Trace:
    """Record one setting: idle, decode for ~duration_s seconds (whole generate calls), idle; returns a `Trace`.

    Args:
        llm: the model (its device decides where it runs); settings: switch values for `apply_switches`.
        model_name: stored in the trace and its file name (e.g. the preset name).
        duration_s: decoding time to reach; calls are not cut, but a call running past 2 x duration_s is stopped.
        prompt_tokens, new_tokens: per call (random prompt ids, EOS ignored); both are shrunk to fit the context.
        idle_s: seconds sampled before and after the decoding.
        interval_s: sampler period (0.1 = 10 Hz). backend: the sampler backend (default NVML on GPU 0).
        device_name: stored in the trace (default `envinfo.device_name(llm.device)`).
        peaks: {"copy_bw_gb_s", "matmul_tflops", "datasheet_bw_gb_s", ...} used for MBU (None: no MBU).
        profile: also profile a few decode steps' kernels (CUDA only).

    Raises ValueError for bad settings (from `apply_switches`) or lengths; RuntimeError if the sampler's backend
    cannot open (no GPU); SamplerError if sampling failed.
    """
    say = print_fn or (lambda s: None)
    run_llm, kwargs = apply_switches(llm, settings)
    ctx = run_llm.config.max_seq_len
    prompt_tokens = max(1, min(prompt_tokens, ctx // 2))
    new_tokens = max(2, min(new_tokens, ctx - prompt_tokens))
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, run_llm.config.vocab_size, (prompt_tokens,), generator=gen).tolist()
    kwargs = {"stop_at_eos": False, **kwargs}  # every call generates new_tokens tokens, EOS or not

    run_llm.generate(prompt_ids, max_new_tokens=new_tokens, **kwargs)  # warm-up: the whole workload once
    time.sleep(idle_s)  # NVML averages GPU-Util over up to 1 s: let it forget the warm-up before sampling "idle"

    cost = sampler_cost(run_llm, prompt_ids, kwargs, interval_s=interval_s) if backend is None else {}
    if cost:
        say("  decode step p50 with no sampler / NVML / NVML+GPM: "
            + " / ".join(f"{v:.2f}" for v in cost.values()) + " ms")
    sampler = Sampler(interval_s=interval_s, backend=backend)
    token_t: list[float] = []
    calls: list[dict] = []
    calls_step_ms: list[list[float]] = []
    with sampler:
        time.sleep(idle_s)
        t_begin = sampler.now()
        hard_stop = t_begin + 2 * duration_s

        def on_token(step, tokens):
            t = sampler.now()
            token_t.append(t)
            return t > hard_stop

        while sampler.now() - t_begin < duration_s:
            start = sampler.now()
            g = run_llm.generate(prompt_ids, max_new_tokens=new_tokens, on_token=on_token, **kwargs)
            end = sampler.now()
            calls.append({"start_s": start, "end_s": end, "n_tokens": len(g.step_ms), "finish": g.finish_reason})
            calls_step_ms.append(list(g.step_ms))
            if g.finish_reason == "stopped":
                break
        time.sleep(idle_s)
    samples = sampler.columns()
    say(f"  {len(calls)} calls, {len(token_t)} tokens, {len(samples.get('t_s', []))} readings")

    kernels = None
    if profile:
        try:
            kernels = profile_kernels(run_llm, prompt_ids, {k: v for k, v in kwargs.items() if k != "stop_at_eos"})
        except Exception as e:  # the profiler is a bonus: never lose the recording over it
            say(f"  (kernel profile skipped: {e!r})")

    config = run_llm.config
    meta = {
        "device": device_name or envinfo.device_name(run_llm.device),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": envinfo.versions(["llmlab", "torch", "transformers", "nvidia-ml-py", "triton"]),
        "commit": envinfo.git_commit(),
        "model": model_name,
        "model_label": run_llm.name,
        "random_weights": run_llm.random_weights,
        "config": asdict(config),
        "params": config.num_params(),
        "settings": dict(settings),
        "setting_label": setting_label(settings),
        "setting_slug": setting_slug(settings),
        "batch": 1,
        "dtype": str(run_llm.dtype).removeprefix("torch."),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "interval_s": interval_s,
        "idle_s": idle_s,
        "sampler_series": [k for k in samples if k != "t_s"],
        "peaks": dict(peaks or {}),
        "synthetic": False,
        "sampler_cost_tpot_p50_ms": cost,
    }
    return make_trace(meta, samples, token_t, calls_step_ms, calls, kernels=kernels)


def _peaks_dict(device: torch.device) -> dict:
    from llmlab.measure.peaks import measure_peaks

    p = measure_peaks(device)
    return {"copy_bw_gb_s": p.copy_bw_gb_s, "matmul_tflops": p.matmul_tflops, "matmul_dtype": p.matmul_dtype,
            "datasheet_bw_gb_s": p.datasheet_bw_gb_s, "datasheet_tflops": p.datasheet_tflops,
            "measured_at": p.measured_at, "verdict": p.verdict, "noise_reasons": list(p.noise_reasons),
            "copy_spread": p.copy_spread, "mbu_divides_by": "copy_bw_gb_s (measured device-to-device copy)",
            "trust": p.trust()}


def summary_table(traces: list[Trace]) -> str:
    """A plain-text table: per trace, mean GPU-Util vs SM activity vs DRAM BW util, tokens/s, TPOT, MBU."""

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    head = f"{'setting':<22}{'GPU-Util %':>11}{'SM act. %':>10}{'SM occ. %':>10}{'DRAM BW %':>10}" \
           f"{'tokens/s':>10}{'TPOT ms':>9}{'MBU %':>7}"
    lines = [head, "-" * len(head)]
    for t in traces:
        s = t.summary
        mbu = s.get("mbu")
        lines.append(f"{t.meta.get('setting_label', '?')[:21]:<22}{f(s.get('gpu_util_pct_mean'), '.1f'):>11}"
                     f"{f(s.get('sm_active_pct_mean'), '.1f'):>10}{f(s.get('sm_occupancy_pct_mean'), '.1f'):>10}"
                     f"{f(s.get('dram_bw_util_pct_mean'), '.1f'):>10}{f(s.get('tokens_per_s'), '.1f'):>10}"
                     f"{f(s.get('tpot_ms'), '.2f'):>9}{f(mbu * 100 if mbu is not None else None, '.1f'):>7}")
    return "\n".join(lines)


def record(model: str | None = None, preset: str = DEFAULT_PRESET, settings: list[dict] | None = None,
           out_dir: str | Path | None = None, duration_s: float = 12.0, prompt_tokens: int = 128,
           new_tokens: int = 256, idle_s: float = 1.0, interval_s: float = 0.1, device: str = "cuda",
           profile: bool = True, print_fn: Callable[[str], None] = print) -> list[Path]:
    """Record every setting on the GPU and write the traces; returns the paths written.

    model: None -> the `preset` shape with random weights (bf16); 'default' or a folder/hub id -> that checkpoint.
    Raises RuntimeError("no CUDA GPU ...") without a GPU, ValueError for bad settings (batching='continuous' first,
    `llmlab.switches.check_per_token_settings`).
    """
    for s in settings or ():  # before the GPU checks and the model's load
        check_per_token_settings(s, "llmlab record")
    if not torch.cuda.is_available():
        raise RuntimeError("needs an NVIDIA GPU, and PyTorch sees no CUDA device on this machine "
                           "(the traces in data/traces/ were recorded on one)")
    from llmlab.telemetry.nvml_sampler import nvml_available

    ok, why = nvml_available()
    if not ok:
        raise RuntimeError(f"needs NVML to sample the GPU: {why}")
    dev = torch.device(device)
    if model is None:
        llm = LLM.from_preset(preset, device=dev, dtype="bf16")
        model_name = preset
    else:
        llm = LLM.load(model, device=dev, dtype="bf16")
        model_name = llm.name
    out = Path(out_dir) if out_dir is not None else trace_dir()
    print_fn(f"llmlab record: {llm!r}")
    peaks = _peaks_dict(dev)
    print_fn(f"peaks: copy {peaks['copy_bw_gb_s']:.0f} GB/s measured (datasheet {peaks['datasheet_bw_gb_s']}), "
             f"matmul {peaks['matmul_tflops']:.0f} TFLOP/s; {peaks['trust']}")
    name = envinfo.device_name(dev)
    traces, paths = [], []
    for s in settings or DEFAULT_SETTINGS:
        print_fn(f"recording {setting_slug(s)} for ~{duration_s:.0f} s ...")
        t = record_setting(llm, s, model_name=model_name, duration_s=duration_s, prompt_tokens=prompt_tokens,
                           new_tokens=new_tokens, idle_s=idle_s, interval_s=interval_s, device_name=name,
                           peaks=peaks, profile=profile, print_fn=print_fn)
        paths.append(save_trace(t, directory=out))
        traces.append(t)
        print_fn(f"  wrote {paths[-1]} ({paths[-1].stat().st_size / 1e3:.0f} kB)")
        torch.cuda.empty_cache()
    print_fn("")
    print_fn(summary_table(traces))
    return paths


def run_from_args(args: argparse.Namespace) -> int:
    """Run `llmlab record` from the CLI's parsed arguments (`llmlab.cli`); returns the exit status: 0, or 2 with
    one line on stderr (no GPU, bad setting, model not found, a model or KV cache too large for the memory)."""
    try:
        settings = [parse_setting(s) for s in args.setting] if args.setting else None
        record(model=args.model, preset=args.preset, settings=settings, out_dir=args.out_dir,
               duration_s=args.duration, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
               idle_s=args.idle, interval_s=args.interval, device=args.device, profile=not args.no_profile)
    except (RuntimeError, ValueError, FileNotFoundError, MemoryError) as e:
        print(f"llmlab record: {e}", file=sys.stderr)
        return 2
    return 0

