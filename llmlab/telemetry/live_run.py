"""One run of the dashboard: its state, the worker thread that decodes, and the row it adds to the table.

Threads. Generation runs on a worker thread (THREAD_NAME, `decode`); on a GPU the NVML sampler has its own thread.
Neither touches a widget: the worker appends each token's time to the run's buffers under `LiveRun.lock`, and the
sampler keeps its readings until the main thread takes them (`take_samples`). The dashboard's main thread reads
both and draws.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from llmlab import envinfo
from llmlab.engine import LLM
from llmlab.telemetry.nvml_sampler import Backend, NvmlBackend, Sampler
from llmlab.telemetry.trace import Replay, Trace, summarize_run

ROLLING_TOKENS = 16  # tokens/s is averaged over this many tokens
THREAD_NAME = "llmlab-dashboard-run"


def llmlab_threads() -> list[threading.Thread]:
    """Live threads started by llmlab (the dashboard's worker, the NVML sampler): [] when nothing runs."""
    return [t for t in threading.enumerate() if t.name.startswith("llmlab") and t.is_alive()]


def rolling_rate(t_s: list[float], window: int = ROLLING_TOKENS) -> list[float | None]:
    """tokens/s at each token over the previous `window` tokens (fewer at the start): k / (t_i - t_{i-k}).

    t_s: the times (s) at which the tokens arrived. None for the first token (no interval yet).
    """
    out: list[float | None] = []
    for i, t in enumerate(t_s):
        k = min(window, i)
        dt = t - t_s[i - k] if k else 0.0
        out.append(k / dt if k and dt > 0 else None)
    return out


@dataclass
class LiveRun:
    """The state of one run, shared by the worker thread (appends under `lock`) and the main thread (reads)."""

    number: int
    settings: dict
    label: str
    llm: LLM | None
    kwargs: dict
    prompt_ids: list[int]
    new_tokens: int
    live_gpu: bool
    idle_s: float
    clock: Any  # () -> seconds on the run's time axis
    sampler: Sampler | None = None
    replay: Replay | None = None
    replay_all: bool = False  # hand the whole trace out on the first poll (replay_speed None)
    trace: Trace | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    worker: threading.Thread | None = None
    tok_t: list = field(default_factory=list)  # when each token arrived (s, run clock)
    tok_ms: list = field(default_factory=list)  # host-measured latency of each step (ms)
    gen_start: float | None = None
    gen_end: float | None = None
    generation: Any = None
    error: BaseException | None = None
    cursor: int = 0  # sampler read_new cursor
    samples: dict = field(default_factory=dict)  # columns received so far: t_s + series
    t_wall0: float = 0.0
    finished: bool = False
    row: dict | None = None
    time_scale: float = 1.0  # run-clock seconds per second of the readings' t_s (1 / replay speed)
    gpu_series: set | None = None  # the series the GPU source reports (None: not known yet)

    def on_token(self, step: int, tokens: list[int]) -> bool:
        t = self.clock()
        with self.lock:
            prev = self.tok_t[-1] if self.tok_t else self.gen_start
            self.tok_t.append(t)
            self.tok_ms.append((t - prev) * 1e3)
        return self.stop.is_set()  # True asks generate to stop after this token


def decode(run: LiveRun) -> None:
    """The worker thread: a 2-token warm-up, (idle), generate with on_token checking the stop event, (idle).
    Never touches a widget; an exception is kept in run.error for the main thread."""
    threads = torch.get_num_threads()
    try:
        if run.llm.device.type == "cpu":
            # one intra-op thread for a CPU decode in this worker thread: with torch's default (one per core)
            # the decode ran ~4x slower here than the same `generate` on the notebook's main thread (2 cores,
            # 8.9 against 2.3 ms per token; with one thread 3.0, as `generate` with one). Set for this thread
            # only (OpenMP keeps the count per calling thread), so the notebook's own cells keep theirs.
            torch.set_num_threads(1)
        # untimed warm-up: the first call in a process pays one-time costs (allocator, thread pools)
        kwargs = {"stop_at_eos": False, **run.kwargs}  # time exactly new_tokens tokens
        run.llm.generate(run.prompt_ids[:8], max_new_tokens=2, **kwargs)
        if run.idle_s:
            run.stop.wait(run.idle_s)
        if not run.stop.is_set():
            run.gen_start = run.clock()
            run.generation = run.llm.generate(run.prompt_ids, max_new_tokens=run.new_tokens,
                                              on_token=run.on_token, **kwargs)
            run.gen_end = run.clock()
        if run.idle_s:
            run.stop.wait(run.idle_s)
    except BaseException as e:  # noqa: BLE001 — reported by the main thread
        run.error = e
    finally:
        torch.set_num_threads(threads)


def take_samples(run: LiveRun, everything: bool = False) -> list[dict]:
    """Main thread: the sampler's new readings (or the replay's due ones; all remaining if `everything`), added
    to `run.samples` as columns (None where a reading lacks a series). Returns the new readings."""
    if run.sampler is not None:
        new, run.cursor = run.sampler.read_new(run.cursor)
    elif run.replay is not None:
        new = run.replay.rest() if everything else run.replay.until(run.clock())
    else:
        new = []
    for r in new:
        n = len(run.samples.get("t_s", []))
        for k, v in r.items():
            run.samples.setdefault(k, [None] * n).append(v)
        for col in run.samples.values():
            if len(col) < n + 1:
                col.append(None)
    return new


def probe_series(backend: Backend | None) -> tuple[str, ...]:
    """The series a live GPU source reports, before any run: a given backend's `series` attribute; for NVML
    (backend None), a short open and close of GPU 0 (`NvmlBackend.series`). () when unknown; never raises."""
    if backend is not None:
        return tuple(getattr(backend, "series", None) or ())
    try:
        probe = NvmlBackend()
        probe.open()
    except Exception:  # noqa: BLE001 — a run that cannot open the GPU reports it itself
        return ()
    try:
        return tuple(probe.series)
    finally:
        probe.close()


def gpu_series(run: LiveRun) -> set | None:
    """The series the run's GPU source reports: the live sampler backend's `series` (where it declares none,
    the keys of its readings so far), the replayed trace's, or the empty set (nothing to replay). None while a
    live source has declared nothing and sent nothing yet."""
    if run.live_gpu:
        declared = tuple(getattr(run.sampler.backend, "series", None) or ())
        if declared:
            return set(declared)
        return (set(run.samples) - {"t_s"}) or None
    return set(run.trace.series) if run.trace is not None else set()


def sample_times(run: LiveRun) -> list[float]:
    """The times (s, on the run's clock: since Run) at which `run.samples` were taken or, for a replay, handed
    out: a recorded t_s divided by the replay speed. Same length as `run.samples["t_s"]`."""
    return [t * run.time_scale for t in run.samples.get("t_s", [])]


def time_span(run: LiveRun) -> float | None:
    """The seconds every live panel shows, [0, span]: the end of the replay (known from the start, so the time
    axis does not grow while it plays), the last reading and the last token, whichever is latest. None before
    anything is known (the panels autorange)."""
    ends = []
    if run.replay is not None:
        ends.append(run.replay.duration_s)  # replay_all replays at speed 1: its duration is the recording's
    ts = run.samples.get("t_s")
    if ts:
        ends.append(ts[-1] * run.time_scale)
    with run.lock:
        if run.tok_t:
            ends.append(run.tok_t[-1])
    end = max(ends, default=0.0)
    return end * 1.02 if end > 0 else None


def run_row(run: LiveRun, config, peak_bw_gb_s: float | None) -> dict:
    """The table row of a finished run (its `generation` set): tokens/s, TTFT, TPOT, MBU against `peak_bw_gb_s`
    (None: no MBU), and on a live GPU the means of the sampled series over the decode."""
    g = run.generation
    device = torch.device(g.device)
    window = (run.gen_start, run.gen_end) if run.live_gpu and run.gen_start is not None else None
    s = summarize_run([g.step_ms], len(run.prompt_ids), config, g.dtype, use_cache=g.use_cache,
                      peak_bw_gb_s=peak_bw_gb_s, samples=run.samples if window else None, window=window)
    return {
        "key": f"#{run.number}",
        "run": run.label,
        "device": envinfo.device_name(device),
        "source": "live GPU" if run.live_gpu else "live CPU" if device.type == "cpu" else "live (no NVML)",
        "settings": dict(run.settings),
        "tokens": g.n_generated,
        "finish": g.finish_reason,
        "tokens_per_s": s["tokens_per_s"],
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "tpot_p90_ms": s["tpot_p90_ms"],
        "mbu_pct": s["mbu"] * 100 if s["mbu"] is not None else None,
        "gpu_util_pct": s.get("gpu_util_pct_mean"),
        "sm_active_pct": s.get("sm_active_pct_mean"),
        "dram_bw_util_pct": s.get("dram_bw_util_pct_mean"),
        "step_ms": list(g.step_ms),
    }


def trace_row(trace: Trace, key: str) -> dict:
    """The table row of a recorded trace (shown beside the live runs it was replayed for), keyed `key`."""
    s = trace.summary
    return {
        "key": key,
        "run": f"{key} recorded: {trace.meta.get('setting_label', '')}",
        "device": trace.device,
        "source": f"recorded {trace.date}",
        "settings": trace.settings,
        "tokens": s.get("n_tokens"),
        "finish": f"{s.get('n_calls')} calls",
        "tokens_per_s": s.get("tokens_per_s"),
        "ttft_ms": s.get("ttft_ms"),
        "tpot_ms": s.get("tpot_ms"),
        "tpot_p90_ms": s.get("tpot_p90_ms"),
        "mbu_pct": s["mbu"] * 100 if s.get("mbu") is not None else None,
        "gpu_util_pct": s.get("gpu_util_pct_mean"),
        "sm_active_pct": s.get("sm_active_pct_mean"),
        "dram_bw_util_pct": s.get("dram_bw_util_pct_mean"),
    }
