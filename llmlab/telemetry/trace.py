"""Recorded GPU traces: what a real GPU's telemetry looked like while it decoded, kept as a small JSON file.

A machine without an NVIDIA GPU (Binder, CI, a laptop) cannot sample NVML, so the dashboard replays a trace that
`llmlab record` wrote on a real GPU, while it still measures latency live on the CPU. A trace holds one decode
setting (e.g. "KV cache, bf16, batch 1") on one device:

    meta      device name, date (UTC), package versions, git commit, model (name, shape), the switch settings,
              batch size, dtype, prompt / new tokens per call, sampler interval, the peaks used for MBU
    samples   the NVML sampler's columns: `t_s` (seconds on the sampler's clock) and every series the device
              reported (`llmlab.telemetry.nvml_sampler`: gpu_util_pct, sm_active_pct, dram_bw_util_pct, ...); a series the
              device lacks is absent, a reading that lacked it holds null
    tokens    one entry per generated token: `t_s` (when the host had the token, on the sampler's clock) and
              `step_ms` (that step's latency; the first step of each call is prefill + first token = TTFT)
    calls     one entry per `generate` call: start_s, end_s, n_tokens, finish
    kernels   optional: the GPU kernels of a few profiled decode steps (torch.profiler), as [start_us, end_us]
              pairs, to show the gaps between kernels and between forward passes
    summary   tokens/s, TTFT, TPOT (mean, p50, p90), MBU (via `llmlab.measure.roofline`), mean GPU-Util, SM activity,
              SM occupancy and DRAM bandwidth utilisation over the decoding window

Floats are rounded (times to 0.1 ms, percentages to 0.01) so a 15-second recording stays well under 1 MB.
Files live in `data/traces/` (`trace_dir()`; override with the environment variable LLMLAB_TRACE_DIR) and are
named `<device>_<model>_<setting>.json`.

    from llmlab.telemetry.trace import list_traces, load_trace, replay
    t = load_trace(list_traces()[0])
    print(t.label, t.summary["tokens_per_s"])
    for reading in replay(t, speed=4.0):      # readings in 4x real time; realtime=False gives them all at once
        ...

This module needs neither torch nor plotly: it is plain bookkeeping, testable in milliseconds.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from llmlab import REPO_ROOT
from llmlab.config import ModelConfig
from llmlab.measure import roofline

FORMAT = "llmlab-trace"
VERSION = 1
DEFAULT_TRACE_DIR = REPO_ROOT / "data" / "traces"

# decimals kept per kind of number
_T_DECIMALS = 4  # seconds -> 0.1 ms
_MS_DECIMALS = 3  # milliseconds -> 1 us
_PCT_DECIMALS = 2  # percentages and other sampler values
_BYTES_PER_PARAM = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def trace_dir() -> Path:
    """Where recorded traces are looked for: $LLMLAB_TRACE_DIR if set, else `data/traces/` in the repository."""
    env = os.environ.get("LLMLAB_TRACE_DIR")
    return Path(env) if env else DEFAULT_TRACE_DIR


def slug(text: str) -> str:
    """A file-name-safe lower-case slug: 'NVIDIA H200' -> 'nvidia-h200', 'llama-3.2-1b' stays as it is."""
    s = re.sub(r"[^a-z0-9._]+", "-", str(text).lower()).strip("-._")
    return s or "unknown"


def _round(x: Any, nd: int) -> Any:
    if x is None:
        return None
    x = float(x)
    if not math.isfinite(x):
        return None  # JSON has no NaN; "not measured" is null
    r = round(x, nd)
    return int(r) if r == int(r) and abs(r) < 1e15 else r


# -- the record ---------------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """One recorded run. See the module docstring for the fields; `path` is where it was loaded from (not saved)."""

    meta: dict
    samples: dict[str, list]  # "t_s" + one list per series, all the same length
    tokens: dict[str, list]  # "t_s", "step_ms": one entry per generated token
    calls: list[dict]  # {"start_s", "end_s", "n_tokens", "finish"} per generate call
    summary: dict
    kernels: dict | None = None
    path: Path | None = field(default=None, compare=False)

    # -- views -------------------------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self.meta.get("device", "?")

    @property
    def date(self) -> str:
        """The recording day, YYYY-MM-DD."""
        return str(self.meta.get("date", "?"))[:10]

    @property
    def settings(self) -> dict:
        return dict(self.meta.get("settings", {}))

    @property
    def label(self) -> str:
        """'NVIDIA H200, recorded 2026-12-01: llama-3.2-1b, KV cache, bf16, batch 1' — for plot titles."""
        m = self.meta
        what = ", ".join(x for x in (m.get("model"), m.get("setting_label"), f"batch {m.get('batch', 1)}") if x)
        synthetic = "SYNTHETIC test fixture, not a measurement — " if m.get("synthetic") else ""
        return f"{synthetic}{self.device}, recorded {self.date}: {what}"

    @property
    def series(self) -> list[str]:
        """The sampler series present (without t_s)."""
        return [k for k in self.samples if k != "t_s"]

    @property
    def duration_s(self) -> float:
        ts = self.samples.get("t_s") or [0.0]
        return float(ts[-1])

    @property
    def decode_window(self) -> tuple[float, float]:
        """(start, end) seconds of the decoding, on the sampler's clock: first call's start to last call's end."""
        if not self.calls:
            return (0.0, 0.0)
        return (float(self.calls[0]["start_s"]), float(self.calls[-1]["end_s"]))

    def utilisation_line(self) -> str:
        """'while decoding: GPU-Util 31%, SM activity 4.2%, SM occupancy 2.0%, DRAM bandwidth 5.1%' (series the
        device did not report are left out)."""
        s = self.summary
        parts = [f"{name} {s[key]:.1f}%" for key, name in (
            ("gpu_util_pct_mean", "GPU-Util"), ("sm_active_pct_mean", "SM activity"),
            ("sm_occupancy_pct_mean", "SM occupancy"), ("dram_bw_util_pct_mean", "DRAM bandwidth"))
            if s.get(key) is not None]
        return "while decoding: " + (", ".join(parts) if parts else "no utilisation recorded")

    def readings(self) -> list[dict[str, float]]:
        """The samples as sampler readings (dicts with t_s and each series present in that reading), in order."""
        keys = list(self.samples)
        n = len(self.samples.get("t_s", []))
        out = []
        for i in range(n):
            out.append({k: self.samples[k][i] for k in keys if self.samples[k][i] is not None})
        return out

    def calls_step_ms(self) -> list[list[float]]:
        """Per-step latencies (ms) split by generate call: [[ttft, step1, step2, ...], ...]."""
        out, i = [], 0
        steps = self.tokens.get("step_ms", [])
        for c in self.calls:
            out.append(list(steps[i:i + int(c["n_tokens"])]))
            i += int(c["n_tokens"])
        return out

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta, "summary": self.summary,
                "calls": self.calls, "samples": self.samples, "tokens": self.tokens, "kernels": self.kernels}

    @classmethod
    def from_dict(cls, d: dict, path: Path | None = None) -> "Trace":
        """Raises ValueError if `d` is not an llmlab trace of a version this code reads."""
        where = f" ({path})" if path else ""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not an llmlab trace{where}: the 'format' field is missing or not {FORMAT!r}")
        if d.get("version") != VERSION:
            raise ValueError(f"trace version {d.get('version')!r}{where}; this llmlab reads version {VERSION}")
        for key in ("meta", "samples", "tokens", "calls", "summary"):
            if key not in d:
                raise ValueError(f"the trace{where} has no {key!r} section")
        n = len(d["samples"].get("t_s", []))
        bad = [k for k, v in d["samples"].items() if len(v) != n]
        if bad:
            raise ValueError(f"the trace{where}: sampler columns {bad} do not have {n} values like t_s")
        if len(d["tokens"].get("t_s", [])) != len(d["tokens"].get("step_ms", [])):
            raise ValueError(f"the trace{where}: tokens.t_s and tokens.step_ms differ in length")
        return cls(meta=d["meta"], samples=d["samples"], tokens=d["tokens"], calls=d["calls"],
                   summary=d["summary"], kernels=d.get("kernels"), path=path)


def round_trace(trace: Trace) -> Trace:
    """The same trace with its floats rounded as stored (times 0.1 ms, latencies 1 us, percentages 0.01)."""
    samples = {k: [_round(v, _T_DECIMALS if k == "t_s" else _PCT_DECIMALS) for v in vals]
               for k, vals in trace.samples.items()}
    tokens = {"t_s": [_round(v, _T_DECIMALS) for v in trace.tokens.get("t_s", [])],
              "step_ms": [_round(v, _MS_DECIMALS) for v in trace.tokens.get("step_ms", [])]}
    calls = [{**c, "start_s": _round(c["start_s"], _T_DECIMALS), "end_s": _round(c["end_s"], _T_DECIMALS)}
             for c in trace.calls]
    summary = {k: (_round(v, 4) if isinstance(v, float) else v) for k, v in trace.summary.items()}
    kernels = None
    if trace.kernels:
        kernels = dict(trace.kernels)
        if "intervals_us" in kernels:
            kernels["intervals_us"] = [[_round(a, 1), _round(b, 1)] for a, b in kernels["intervals_us"]]
        kernels = {k: (_round(v, 3) if isinstance(v, float) else v) for k, v in kernels.items()}
    return Trace(meta=trace.meta, samples=samples, tokens=tokens, calls=calls, summary=summary, kernels=kernels,
                 path=trace.path)


# -- files --------------------------------------------------------------------------------------------------------


def trace_filename(meta: dict) -> str:
    """`<device>_<model>_<setting>.json` from the meta's device, model and setting_slug."""
    return f"{slug(meta.get('device', 'device'))}_{slug(meta.get('model', 'model'))}_" \
           f"{slug(meta.get('setting_slug', 'run'))}.json"


def save_trace(trace: Trace, path: str | os.PathLike | None = None, directory: str | os.PathLike | None = None) -> Path:
    """Write `trace` (rounded) as compact JSON: one line per section, so a diff shows which part changed.

    path: the file; default `directory / trace_filename(trace.meta)`, directory defaulting to `trace_dir()`.
    Returns the path written. Creates the folder if needed.
    """
    if path is None:
        path = Path(directory if directory is not None else trace_dir()) / trace_filename(trace.meta)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    d = round_trace(trace).to_dict()
    lines = [f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'), allow_nan=False)}" for k, v in d.items()]
    text = "{\n" + ",\n".join(lines) + "\n}\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    trace.path = path
    return path


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace file. Raises FileNotFoundError, or ValueError for a file that is not a valid trace."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return Trace.from_dict(d, path=path)


def list_traces(directory: str | os.PathLike | None = None) -> list[Path]:
    """The trace files (`*.json`) in `directory` (default `trace_dir()`), sorted by name; [] if there is none."""
    folder = Path(directory) if directory is not None else trace_dir()
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("*.json") if p.is_file())


def load_traces(directory: str | os.PathLike | None = None) -> list[Trace]:
    """Every readable trace in `directory`, newest recording first. Files that are not traces are skipped."""
    out = []
    for p in list_traces(directory):
        try:
            out.append(load_trace(p))
        except (ValueError, OSError):
            continue
    out.sort(key=lambda t: str(t.meta.get("date", "")), reverse=True)
    return out


def find_trace(settings: dict | None = None, directory: str | os.PathLike | None = None,
               traces: list[Trace] | None = None) -> Trace | None:
    """The recorded trace that best matches `settings` (switch values), newest first among equals; None if none.

    Score: +1 for each switch whose value is the same in the trace, -1 for each that differs; a switch left at
    None (e.g. dtype "as loaded") matches anything. So {"kv_cache": False} finds the no-KV-cache recording.
    """
    traces = load_traces(directory) if traces is None else traces
    if not traces:
        return None
    settings = settings or {}

    def score(t: Trace) -> int:
        s, mine = 0, t.settings
        for k, v in settings.items():
            if v is None or k not in mine:
                continue
            s += 1 if mine[k] == v else -1
        return s

    best = max(score(t) for t in traces)
    return next(t for t in traces if score(t) == best)  # traces are newest first


# -- replay -------------------------------------------------------------------------------------------------------


class Replay:
    """Hands out a trace's readings as time passes, without sleeping: for a UI poll loop.

        r = Replay(trace, speed=2.0)
        new = r.until(elapsed_s)     # readings with t_s <= elapsed_s * speed not handed out before
        rest = r.rest()              # all remaining ones at once
    """

    def __init__(self, trace: Trace, speed: float = 1.0):
        if not speed > 0:
            raise ValueError(f"speed={speed} must be > 0 (1.0 = real time)")
        self.trace = trace
        self.speed = float(speed)
        self._rows = trace.readings()
        self._i = 0

    @property
    def done(self) -> bool:
        return self._i >= len(self._rows)

    @property
    def duration_s(self) -> float:
        """Wall-clock seconds the replay takes at this speed."""
        return (self._rows[-1]["t_s"] / self.speed) if self._rows else 0.0

    def until(self, elapsed_s: float) -> list[dict[str, float]]:
        j = self._i
        limit = elapsed_s * self.speed
        while j < len(self._rows) and self._rows[j]["t_s"] <= limit:
            j += 1
        out, self._i = self._rows[self._i:j], j
        return out

    def rest(self) -> list[dict[str, float]]:
        out, self._i = self._rows[self._i:], len(self._rows)
        return out


def replay(trace: Trace, speed: float = 1.0, realtime: bool = True, sleep=time.sleep,
           clock=time.perf_counter) -> Iterator[dict[str, float]]:
    """Yield the trace's sampler readings in order, each when its time comes (t_s / speed after the first next()).

    realtime=False yields them all at once. `sleep` and `clock` are injectable for tests.
    Raises ValueError for speed <= 0.
    """
    if not speed > 0:
        raise ValueError(f"speed={speed} must be > 0 (1.0 = real time)")
    rows = trace.readings()
    t0 = clock()
    for r in rows:
        if realtime:
            wait = t0 + r["t_s"] / speed - clock()
            if wait > 0:
                sleep(wait)
        yield r


# -- the summary of a run ------------------------------------------------------------------------------------------


def bytes_per_param(dtype: str) -> float:
    """2 for bf16/fp16, 4 for fp32 ('torch.' prefix allowed). Raises ValueError for another dtype."""
    d = str(dtype).removeprefix("torch.")
    if d not in _BYTES_PER_PARAM:
        raise ValueError(f"unknown dtype {dtype!r} for byte counting; known: {sorted(_BYTES_PER_PARAM)}")
    return _BYTES_PER_PARAM[d]


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def window_means(samples: dict[str, list], start_s: float, end_s: float) -> dict[str, float | None]:
    """Mean of each series over the readings with start_s < t_s <= end_s (each reading covers the interval before
    its stamp). A window shorter than one interval takes the first reading after start_s. None where no value."""
    ts = samples.get("t_s", [])
    idx = [i for i, t in enumerate(ts) if start_s < t <= end_s]
    if not idx:
        idx = [i for i, t in enumerate(ts) if t > start_s][:1]
    return {k: _mean(samples[k][i] for i in idx) for k in samples if k != "t_s"}


def summarize_run(calls_step_ms: list[list[float]], prompt_tokens: int, config: ModelConfig | None, dtype: str,
                  use_cache: bool = True, batch: int = 1, peak_bw_gb_s: float | None = None,
                  datasheet_bw_gb_s: float | None = None, samples: dict[str, list] | None = None,
                  window: tuple[float, float] | None = None) -> dict:
    """The numbers of a run, over one or more `generate` calls of the same setting.

    Args:
        calls_step_ms: per call, its step latencies in ms (step 0 = prefill + first token).
        prompt_tokens: prompt length of each call; config: the model's shape (None: no MBU); dtype: weights' dtype.
        use_cache: False = the recompute path; MBU then counts only the weights (no KV cache is read).
        peak_bw_gb_s: the bandwidth MBU divides by (measured copy bandwidth); datasheet_bw_gb_s: also MBU vs it.
        samples, window: sampler columns and the decoding window (seconds) for the mean utilisations.

    Returns a dict: n_calls, n_tokens, tokens_per_s (all tokens / all time, prefill included),
    decode_tokens_per_s (batch / mean TPOT), ttft_ms (median over calls), tpot_ms (mean), tpot_p50_ms,
    tpot_p90_ms, bytes_per_step (mean over the decode steps), achieved_gb_s, mbu and mbu_datasheet (fractions),
    roofline_tokens_per_s (the bandwidth ceiling at that byte count), and <series>_mean for each sampler series
    over the window (gpu_util_pct_mean, sm_active_pct_mean, ...). Values that cannot be computed are None.
    """
    calls = [list(c) for c in calls_step_ms if c]
    if not calls:
        raise ValueError("no generated token to summarize")
    steps = [s for c in calls for s in c]
    decode = [s for c in calls for s in c[1:]]
    n_tokens = batch * len(steps)
    total_s = sum(steps) / 1e3
    out: dict[str, Any] = {
        "n_calls": len(calls),
        "n_tokens": n_tokens,
        "tokens_per_s": n_tokens / total_s if total_s > 0 else None,
        "ttft_ms": statistics.median(c[0] for c in calls),
        "tpot_ms": statistics.fmean(decode) if decode else None,
        "tpot_p50_ms": roofline.percentile(decode, 50) if decode else None,
        "tpot_p90_ms": roofline.percentile(decode, 90) if decode else None,
    }
    out["decode_tokens_per_s"] = batch * 1e3 / out["tpot_ms"] if out["tpot_ms"] else None
    for k in ("bytes_per_step", "achieved_gb_s", "mbu", "mbu_datasheet", "roofline_tokens_per_s"):
        out[k] = None
    if config is not None and out["tpot_ms"]:
        wb = bytes_per_param(dtype)
        new_per_call = statistics.fmean(len(c) for c in calls)
        ctx = roofline.decode_mean_context_len(prompt_tokens, round(new_per_call)) if use_cache else 0.0
        moved = roofline.decode_step_bytes(config, batch, ctx, wb, wb)
        out["bytes_per_step"] = moved
        out["achieved_gb_s"] = roofline.achieved_bandwidth(moved, out["tpot_ms"] / 1e3)
        if peak_bw_gb_s:
            out["mbu"] = out["achieved_gb_s"] / peak_bw_gb_s
            out["roofline_tokens_per_s"] = batch * peak_bw_gb_s * 1e9 / moved
        if datasheet_bw_gb_s:
            out["mbu_datasheet"] = out["achieved_gb_s"] / datasheet_bw_gb_s
    if samples and window is not None:
        for k, v in window_means(samples, *window).items():
            out[f"{k}_mean"] = v
    return out


def config_from_meta(meta: dict) -> ModelConfig | None:
    """The model shape stored in a trace's meta (None if absent)."""
    c = meta.get("config")
    if not c:
        return None
    return ModelConfig(**c)


def make_trace(meta: dict, samples: dict[str, list], token_t_s: list[float], calls_step_ms: list[list[float]],
               calls: list[dict], kernels: dict | None = None) -> Trace:
    """Assemble a `Trace` and compute its summary from the meta (config, prompt_tokens, dtype, settings, batch,
    peaks) — what `llmlab record` does after a recording."""
    config = config_from_meta(meta)
    peaks = meta.get("peaks") or {}
    window = (float(calls[0]["start_s"]), float(calls[-1]["end_s"])) if calls else None
    summary = summarize_run(calls_step_ms, meta.get("prompt_tokens", 0), config, meta.get("dtype", "bf16"),
                            use_cache=bool(meta.get("settings", {}).get("kv_cache", True)),
                            batch=meta.get("batch", 1), peak_bw_gb_s=peaks.get("copy_bw_gb_s"),
                            datasheet_bw_gb_s=peaks.get("datasheet_bw_gb_s"), samples=samples, window=window)
    if window is not None and samples.get("t_s"):
        idle = window_means(samples, -1.0, window[0])
        summary["idle_gpu_util_pct_mean"] = idle.get("gpu_util_pct")
    if kernels and kernels.get("window_us"):
        summary["profiled_gpu_busy_pct"] = 100.0 * kernels.get("busy_us", 0.0) / kernels["window_us"]
    tokens = {"t_s": [t for t in token_t_s], "step_ms": [s for c in calls_step_ms for s in c]}
    return Trace(meta=meta, samples=samples, tokens=tokens, calls=calls, summary=summary, kernels=kernels)
