"""The live dashboard: watch the GPU while the model decodes, flip an optimization, run again, compare.

    from llmlab.telemetry.dashboard import Dashboard
    dash = Dashboard(llm)          # shows itself when it is the last expression of a cell
    dash                           # Run / Stop in the browser, or from code:
    row = dash.run({"kv_cache": False}, max_new_tokens=64)

What it shows (ipywidgets + plotly `FigureWidget`):

* top panel: GPU-Util (what `nvidia-smi` reports), SM activity, SM occupancy and DRAM bandwidth utilisation, in %,
  sampled by `llmlab.telemetry.nvml_sampler.Sampler` at 10 Hz;
* per-token latency (ms) and tokens/s over the last 16 tokens, measured live;
* one control per optimization in `llmlab.switches.SWITCHES` (an on/off switch is a checkbox, a switch with
  choices a dropdown), prompt and output lengths, Run and Stop;
* a table and a bar chart that keep every run side by side: tokens/s, TTFT, TPOT, MBU, mean GPU-Util, mean SM
  activity.

Without an NVIDIA GPU (Binder, CI, a laptop) the dashboard says so in one line and the top panel replays the
recorded trace (`llmlab.telemetry.trace`, `data/traces/`) that best matches the settings, labelled with its device and date;
latency and tokens/s are still measured live, on the CPU.

Threads. Generation runs on a worker thread ("llmlab-dashboard-run"); on a GPU the sampler has its own thread.
Neither touches a widget: they append to buffers under a lock. The plots are updated from the kernel's main
thread — ipywidgets messages sent from other threads are fragile under ipykernel 7 (jupyter-widgets/ipywidgets
#4001, #4020):

* `run(...)` (a cell calling it) polls on the main thread every ~150 ms until the run ends; the cell blocks.
* the Run button starts the same run and schedules the poll loop as a task on the kernel's asyncio event loop,
  then returns, so the kernel stays free to receive the Stop click. Stop sets a `threading.Event`; the worker's
  `on_token` callback returns True at the next token, and `generate` ends ("stopped").

Every run ends by joining the worker and stopping (joining) the sampler; `close()` stops a run in progress and
does the same, so no llmlab thread outlives the dashboard.
"""

from __future__ import annotations

import asyncio
import html
import math
import numbers
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from llmlab import envinfo
from llmlab.engine import LLM
from llmlab.generate import check_lengths, format_ms
from llmlab.telemetry.nvml_sampler import Backend, Sampler, SamplerError, nvml_available
from llmlab.telemetry.record import setting_label
from llmlab.switches import SWITCHES, apply_switches
from llmlab.telemetry.trace import REPO_ROOT, Replay, Trace, find_trace, load_traces, summarize_run, trace_dir

# the GPU panel's series: (key in sampler readings, legend name)
GPU_SERIES = (
    ("gpu_util_pct", "GPU-Util (nvidia-smi)"),
    ("sm_active_pct", "SM activity"),
    ("sm_occupancy_pct", "SM occupancy"),
    ("dram_bw_util_pct", "DRAM bandwidth"),
    ("mem_util_pct", "memory busy (nvidia-smi)"),  # shown only where GPM (the three above) is missing
)
_GPM_KEYS = ("sm_active_pct", "sm_occupancy_pct", "dram_bw_util_pct")
# the comparison: (row key, bar title, unit)
BAR_METRICS = (
    ("tokens_per_s", "tokens/s", ""),
    ("ttft_ms", "TTFT", "ms"),
    ("tpot_ms", "TPOT", "ms"),
    ("mbu_pct", "MBU", "%"),
    ("gpu_util_pct", "mean<br>GPU-Util", "%"),
    ("sm_active_pct", "mean<br>SM activity", "%"),
)
ROLLING_TOKENS = 16  # tokens/s is averaged over this many tokens
THREAD_NAME = "llmlab-dashboard-run"
_UNSET: Any = object()  # "use the dashboard's default" for replay_speed (None has a meaning: all at once)


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
class _Run:
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

    def on_token(self, step: int, tokens: list[int]) -> bool:
        t = self.clock()
        with self.lock:
            prev = self.tok_t[-1] if self.tok_t else self.gen_start
            self.tok_t.append(t)
            self.tok_ms.append((t - prev) * 1e3)
        return self.stop.is_set()  # True asks generate to stop after this token


class Dashboard:
    """Live GPU telemetry and latency of a decode, with one control per optimization and a table of runs.

    Args:
        llm: the model to run (its device decides: CUDA + NVML -> live GPU panel; otherwise replay).
        prompt_tokens, max_new_tokens: the defaults shown in the controls (shrunk to fit the model's context).
        replay_speed: how fast a recorded trace replays without a GPU (1.0 = real time; None = all at once).
        idle_s: seconds sampled before and after the decode on a live GPU, to show the idle level.
        interval_s: sampler period (s); poll_s: how often the plots are refreshed (s).
        traces: a folder of recorded traces (default `llmlab.telemetry.trace.trace_dir()`), or a list of `Trace`s.
        sampler_backend: a `Backend` for the sampler (tests); default NVML GPU 0.
        live: None decides (live sampling iff the model is on CUDA and NVML works); True forces the live sampler
            path (with a fake `sampler_backend` in tests), False forces the replay.

    Attributes: `widget` (the ipywidgets box), `fig` (live FigureWidget), `bars` (comparison FigureWidget),
    `table` (HTML), `results` (one dict per run), `mode_line` (the one-line description of the GPU panel's
    source), `controls` (switch key -> widget).
    """

    def __init__(self, llm: LLM, *, prompt_tokens: int = 128, max_new_tokens: int = 256,
                 replay_speed: float | None = 1.0, idle_s: float = 0.5, interval_s: float = 0.1,
                 poll_s: float = 0.15, traces=None, sampler_backend: Backend | None = None,
                 live: bool | None = None):
        self.llm = llm
        self.replay_speed = replay_speed
        self.idle_s = idle_s
        self.interval_s = interval_s
        self.poll_s = poll_s
        self.sampler_backend = sampler_backend
        self.results: list[dict] = []
        self._run: _Run | None = None
        self._task = None
        self._n = 0
        self._shown_traces: set = set()
        self._peak_bw: float | None = None

        ok, why = nvml_available() if sampler_backend is None else (True, "test backend")
        on_cuda = llm.device.type == "cuda"
        self.live_gpu = (on_cuda and ok) if live is None else bool(live)
        if self.live_gpu:
            self.traces: list[Trace] = []
            source = "NVML" if sampler_backend is None else type(sampler_backend).__name__
            self.mode_line = f"Live: sampling {envinfo.device_name(llm.device)} through {source} every " \
                             f"{interval_s * 1000:.0f} ms while {llm.name} decodes on it."
        else:
            if isinstance(traces, list):
                self.traces = traces
                where = "the given traces"
            else:
                self.traces = load_traces(traces)
                folder = Path(traces if traces is not None else trace_dir()).resolve()
                where = str(folder.relative_to(REPO_ROOT)) + "/" if folder.is_relative_to(REPO_ROOT) else str(folder)
            reason = why if not ok else f"the model runs on the CPU ({llm.device})"
            if not ok:
                head = f"No GPU to watch here ({reason.rstrip('.')})"
            else:
                head = f"No GPU to watch: {reason}"
            if self.traces:
                t = self.traces[0]
                self.mode_line = f"{head}: the GPU panel replays a trace recorded on {t.device} on {t.date}; " \
                                 f"latency and tokens/s are measured live on this CPU."
            else:
                self.mode_line = f"{head}, and there is no recorded trace in {where}: the GPU panel stays " \
                                 f"empty; latency and tokens/s are measured live on this CPU."

        ctx = llm.config.max_seq_len
        self._build_controls(min(prompt_tokens, ctx // 2), max_new_tokens, ctx)
        self._build_figures()
        self.status = W.HTML(self._status_html("Ready. Choose the switches and press Run."))
        self.mode = W.HTML(f"<b>{html.escape(self.mode_line)}</b>")
        self.table = W.HTML(self._table_html())
        self.widget = W.VBox([self.mode, self.controls_box, self.status, self.fig, W.HTML("<b>All runs</b>"),
                              self.table, self.bars])
        self.widget.add_class("llmlab-dashboard")

    # -- widgets -------------------------------------------------------------------------------------------------
    def _build_controls(self, prompt_tokens: int, new_tokens: int, ctx: int) -> None:
        """One widget per registered switch (bool -> Checkbox, choices -> Dropdown), lengths, Run and Stop."""
        self.controls: dict[str, W.Widget] = {}
        for key, sw in SWITCHES.items():
            ok, why = sw.available(self.llm)
            tip = sw.help if ok else f"{sw.help} — not available here: {why}"
            if sw.choices is None:
                w = W.Checkbox(value=bool(sw.default), description=sw.label, indent=False, tooltip=tip,
                               layout=W.Layout(width="auto"))
            else:
                # the options' values are indices into sw.choices: ipywidgets reads a value of None as "nothing
                # selected", and None is a real choice here ("as loaded")
                options = [("as loaded" if c is None else str(c), i) for i, c in enumerate(sw.choices)]
                w = W.Dropdown(options=options, value=sw.choices.index(sw.default), description=sw.label,
                               tooltip=tip, layout=W.Layout(width="170px"), style={"description_width": "auto"})
            w.disabled = not ok
            self.controls[key] = w
        self.prompt_w = W.BoundedIntText(value=prompt_tokens, min=1, max=max(1, ctx - 1), description="prompt",
                                         layout=W.Layout(width="130px"), style={"description_width": "auto"})
        self.new_w = W.BoundedIntText(value=min(new_tokens, ctx - prompt_tokens), min=1, max=max(1, ctx - 1),
                                      description="new tokens", layout=W.Layout(width="165px"),
                                      style={"description_width": "auto"})
        self.run_button = W.Button(description="Run", button_style="success", icon="play",
                                   tooltip="decode once with these settings", layout=W.Layout(width="90px"))
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                    tooltip="stop the decode after the current token", layout=W.Layout(width="90px"))
        self.run_button.add_class("llmlab-run")
        self.stop_button.add_class("llmlab-stop")
        self.run_button.on_click(self._on_run_click)
        self.stop_button.on_click(lambda _b: self.stop())
        self.controls_box = W.HBox(list(self.controls.values()) + [self.prompt_w, self.new_w, self.run_button,
                                                                   self.stop_button],
                                   layout=W.Layout(flex_flow="row wrap", align_items="center"))

    def _build_figures(self) -> None:
        fig = make_subplots(rows=3, cols=1, vertical_spacing=0.09, row_heights=[0.44, 0.28, 0.28],
                            subplot_titles=("GPU", "latency of each token (ms)", "tokens/s (last 16 tokens)"))
        for key, name in GPU_SERIES:
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=name, legendgroup="gpu",
                                     line={"width": 2, "dash": "dot" if key == "mem_util_pct" else "solid"}),
                          row=1, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers", marker={"size": 4}, name="latency (ms)"),
                      row=2, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name="tokens/s"), row=3, col=1)
        fig.update_yaxes(title_text="%", range=[0, 105], row=1, col=1)
        fig.update_yaxes(title_text="ms", rangemode="tozero", row=2, col=1)
        fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=3, col=1)
        fig.update_xaxes(title_text="seconds", row=3, col=1)
        fig.update_layout(height=640, margin={"l": 60, "r": 20, "t": 30, "b": 40},
                          legend={"orientation": "v", "x": 1.02, "y": 1, "yanchor": "top"})
        self.fig = go.FigureWidget(fig)
        self._n_gpu = len(GPU_SERIES)

        bars = make_subplots(rows=1, cols=len(BAR_METRICS), horizontal_spacing=0.05,
                             subplot_titles=[f"{t} ({u})" if u else t for _, t, u in BAR_METRICS])
        for i, _ in enumerate(BAR_METRICS):
            bars.add_trace(go.Bar(x=[], y=[], showlegend=False), row=1, col=i + 1)
        bars.update_xaxes(type="category", tickangle=0)
        bars.update_layout(height=280, margin={"l": 40, "r": 10, "t": 50, "b": 30})
        self.bars = go.FigureWidget(bars)

    @property
    def latency_trace(self):
        """The live plot's per-token latency trace (x: seconds, y: ms)."""
        return self.fig.data[self._n_gpu]

    @property
    def gpu_traces(self) -> dict:
        """The live plot's GPU series: key (e.g. 'gpu_util_pct') -> plotly trace."""
        return {key: self.fig.data[i] for i, (key, _) in enumerate(GPU_SERIES)}

    def _status_html(self, text: str) -> str:
        return f"<span class='llmlab-status'>{html.escape(text)}</span>"

    def _set_status(self, text: str) -> None:
        self.status.value = self._status_html(text)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # -- the settings ------------------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The switch values the controls show now."""
        out = {}
        for k, w in self.controls.items():
            choices = SWITCHES[k].choices
            out[k] = w.value if choices is None else choices[w.value]
        return out

    def _show_settings(self, settings: dict[str, Any]) -> None:
        for k, v in settings.items():
            if k in self.controls:
                choices = SWITCHES[k].choices
                self.controls[k].value = v if choices is None else choices.index(v)

    # -- one run -------------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._run is not None and not self._run.finished

    def start(self, settings: dict[str, Any] | None = None, max_new_tokens: int | None = None,
              prompt_tokens: int | None = None, replay_speed: float | None = _UNSET) -> None:
        """Start a run and return at once; `run` or the Run button's poll task then drives the plots.

        settings: switch values (missing keys: what the controls show); None: the controls as they are.
        max_new_tokens, prompt_tokens: None takes the control's value; a value given must be a whole number >= 1,
        and when both are given they must fit the model's context together (`llmlab.generate.check_lengths`).
        Raises RuntimeError while another run is in progress; ValueError for bad settings (`apply_switches`) or
        lengths; TypeError for a length that is not a whole number. Nothing starts and no control changes.
        """
        if self.running:
            raise RuntimeError("a run is in progress: press Stop (or call dash.stop()) and wait for it to end")
        ctx = self.llm.config.max_seq_len
        for name, value in (("prompt_tokens", prompt_tokens), ("max_new_tokens", max_new_tokens)):
            if value is not None:  # given in code: checked like LLM.generate's (the controls are bounded)
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise TypeError(f"{name}={value!r}: give a whole number of tokens, e.g. {name}=64")
                if value < 1:
                    raise ValueError(f"{name}={value}: ask for at least 1 token")
        if prompt_tokens is not None and max_new_tokens is not None:
            check_lengths(int(prompt_tokens), int(max_new_tokens), ctx)
        settings = {**self.settings(), **(settings or {})}
        run_llm, kwargs = apply_switches(self.llm, settings)  # raises ValueError before anything starts
        self._show_settings(settings)
        ctx = run_llm.config.max_seq_len
        # the controls' values (or one length given in code beside the other control's) are fitted into the context
        prompt_len = max(1, min(int(prompt_tokens or self.prompt_w.value), ctx - 1))
        new = max(1, min(int(max_new_tokens or self.new_w.value), ctx - prompt_len))
        self.prompt_w.value, self.new_w.value = prompt_len, new
        gen = torch.Generator().manual_seed(self._n)
        prompt_ids = torch.randint(0, run_llm.config.vocab_size, (prompt_len,), generator=gen).tolist()

        self._n += 1
        speed = self.replay_speed if replay_speed is _UNSET else replay_speed
        run = _Run(number=self._n, settings=settings, label=f"#{self._n} {setting_label(settings)}", llm=run_llm,
                   kwargs=kwargs, prompt_ids=prompt_ids, new_tokens=new, live_gpu=self.live_gpu,
                   idle_s=self.idle_s if self.live_gpu else 0.0, clock=None)
        run.t_wall0 = time.perf_counter()
        if self.live_gpu:
            run.sampler = Sampler(interval_s=self.interval_s, backend=self.sampler_backend)
            run.sampler.start()  # raises RuntimeError if the GPU cannot be opened: nothing else started yet
            run.clock = run.sampler.now
            title = f"{envinfo.device_name(run_llm.device)}, live"
        else:
            run.clock = lambda: time.perf_counter() - run.t_wall0
            run.trace = find_trace(settings, traces=self.traces)
            if run.trace is not None:
                run.replay = Replay(run.trace, speed=speed or 1.0)
                run.replay_all = not speed
                title = f"replay of {run.trace.device}, recorded {run.trace.date}: " \
                        f"{run.trace.meta.get('setting_label', '')}" + \
                        (f" ({speed:g}x speed)" if speed and speed != 1 else "")
            else:
                title = "no GPU here, and no recorded trace to replay"
        self._reset_live_plot(run, title)
        self._run = run
        run.worker = threading.Thread(target=self._work, args=(run,), name=THREAD_NAME, daemon=True)
        run.worker.start()
        self.run_button.disabled = True
        self.stop_button.disabled = False
        self._set_status(f"Running {run.label}: {prompt_len}-token prompt, {new} new tokens on "
                         f"{envinfo.device_name(run_llm.device)} ...")

    def _work(self, run: _Run) -> None:
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

    def _reset_live_plot(self, run: _Run, title: str) -> None:
        if run.live_gpu:
            series = set(getattr(run.sampler.backend, "series", ()) or [k for k, _ in GPU_SERIES])
        elif run.trace is not None:
            series = set(run.trace.series)
        else:
            series = set()
        has_gpm = any(k in series for k in _GPM_KEYS)
        with self.fig.batch_update():
            for i, (key, _) in enumerate(GPU_SERIES):
                show = key in series and (key != "mem_util_pct" or not has_gpm)
                self.fig.data[i].x, self.fig.data[i].y = [], []
                self.fig.data[i].visible = True if show else False
            for tr in self.fig.data[self._n_gpu:]:
                tr.x, tr.y = [], []
            self.fig.layout.annotations[0].text = title
            self.fig.layout.annotations[1].text = f"latency of each token (ms), {run.label}"

    def _tick(self) -> bool:
        """One refresh, on the main thread: move new samples and tokens into the plots; finish the run when the
        worker is done (and the replay, unless stopped). Returns True when the run has ended."""
        run = self._run
        if run is None or run.finished:
            return True
        worker_done = run.worker is None or not run.worker.is_alive()
        self._pull(run, everything=run.stop.is_set() or run.replay_all)
        with run.lock:
            n_tok, last_ms = len(run.tok_t), (run.tok_ms[-1] if run.tok_ms else 0.0)
        if n_tok and not worker_done:
            self._set_status(f"Running {run.label}: {n_tok} / {run.new_tokens} tokens, {last_ms:.1f} ms for the "
                             f"last one")
        elif worker_done and run.replay is not None and not run.replay.done:
            self._set_status(f"{run.label}: generation done; replaying the rest of the recorded trace "
                             f"(Stop shows it all at once) ...")
        replay_done = run.replay is None or run.replay.done
        if worker_done and (replay_done or run.stop.is_set() or run.error is not None):
            self._finish(run)
            return True
        return False

    def _finish(self, run: _Run) -> None:
        """Join the worker, stop the sampler, add the run to the table and bars (main thread)."""
        run.stop.set()
        if run.worker is not None:
            run.worker.join()
        if run.sampler is not None:
            try:
                run.sampler.stop()
            except SamplerError as e:
                run.error = run.error or e
        self._pull(run, everything=True)  # the last readings (or the rest of the replay) and tokens
        run.finished = True
        g = run.generation
        if run.error is not None:
            self._set_status(f"{run.label} failed: {run.error!r}")
        elif g is None:
            self._set_status(f"{run.label} was stopped before its first token: nothing to add.")
        else:
            if run.trace is not None and run.trace.path not in self._shown_traces:
                self._shown_traces.add(run.trace.path)
                self.results.append(self._trace_row(run.trace))
            run.row = self._run_row(run)
            how = "stopped" if g.finish_reason == "stopped" else "done"
            # the status first, then the table: the page gets them as two messages, in this order, so whoever sees
            # the new row also sees how the run ended (a browser test read "Stopping ..." next to the new row)
            self._set_status(f"{run.label} {how}: {g.n_generated} tokens, {run.row['tokens_per_s']:.1f} tokens/s, "
                             f"TTFT {g.ttft_ms:.1f} ms, TPOT {format_ms(g.tpot_ms, unit=' ms')}. Change a switch "
                             f"and run again.")
            self.results.append(run.row)
            self._refresh_results()
        run.llm = None  # a converted model (another dtype) is freed with the run
        self.run_button.disabled = False
        self.stop_button.disabled = True

    def _pull(self, run: _Run, everything: bool = False) -> None:
        """Main thread: take the new sampler readings (or the replay's due ones; all remaining if `everything`)
        and the new tokens, and redraw what changed in one message."""
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
        with run.lock:
            tok_t, tok_ms = list(run.tok_t), list(run.tok_ms)
        lat, rate = self.fig.data[self._n_gpu], self.fig.data[self._n_gpu + 1]
        if not new and len(tok_t) == len(lat.x or ()):
            return
        with self.fig.batch_update():
            if new:
                ts = run.samples["t_s"]
                for i, (key, _) in enumerate(GPU_SERIES):
                    if key in run.samples:
                        self.fig.data[i].x, self.fig.data[i].y = ts, run.samples[key]
            if len(tok_t) != len(lat.x or ()):
                lat.x, lat.y = tok_t, tok_ms
                rate.x, rate.y = tok_t, rolling_rate(tok_t)

    # -- the rows ------------------------------------------------------------------------------------------------
    def _peak_bandwidth(self, device: torch.device) -> float | None:
        if self._peak_bw is None:
            from llmlab.measure.peaks import measure_peaks

            self._peak_bw = measure_peaks(device).copy_bw_gb_s
        return self._peak_bw

    def _run_row(self, run: _Run) -> dict:
        g = run.generation
        device = torch.device(g.device)
        peak = self._peak_bandwidth(device) if device.type == "cuda" else None  # MBU: GPU runs only
        window = (run.gen_start, run.gen_end) if run.live_gpu and run.gen_start is not None else None
        s = summarize_run([g.step_ms], len(run.prompt_ids), self.llm.config, g.dtype, use_cache=g.use_cache,
                          peak_bw_gb_s=peak, samples=run.samples if window else None, window=window)
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

    def _trace_row(self, trace: Trace) -> dict:
        s = trace.summary
        k = f"rec{len(self._shown_traces)}"
        return {
            "key": k,
            "run": f"{k} recorded: {trace.meta.get('setting_label', '')}",
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

    def _table_html(self) -> str:
        cols = [("run", "run", None), ("device", "device", None), ("source", "source", None),
                ("tokens", "tokens", "d"), ("tokens_per_s", "tokens/s", ".1f"), ("ttft_ms", "TTFT ms", ".1f"),
                ("tpot_ms", "TPOT ms", ".2f"), ("tpot_p90_ms", "TPOT p90 ms", ".2f"), ("mbu_pct", "MBU %", ".1f"),
                ("gpu_util_pct", "GPU-Util %", ".1f"), ("sm_active_pct", "SM activity %", ".1f"),
                ("dram_bw_util_pct", "DRAM BW %", ".1f")]

        def cell(v, fmt):
            if v is None or (isinstance(v, float) and not math.isfinite(v)):
                return "–"
            return html.escape(format(v, fmt) if fmt else str(v))

        head = "".join(f"<th style='padding:2px 8px'>{html.escape(t)}</th>" for _, t, _ in cols)
        body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px'>{cell(r.get(k), f)}</td>" for k, _, f in cols)
                       + "</tr>" for r in self.results)
        if not self.results:
            body = f"<tr><td colspan='{len(cols)}' style='padding:2px 8px'>no run yet</td></tr>"
        note = "<div style='font-size:85%'>MBU (model bandwidth utilisation) is computed for GPU runs only, " \
               "against the measured copy bandwidth; on a CPU a small model runs from caches.</div>"
        return f"<table class='llmlab-results'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"

    def _refresh_results(self) -> None:
        self.table.value = self._table_html()
        labels = [r["key"] for r in self.results]
        with self.bars.batch_update():
            for i, (key, _, _) in enumerate(BAR_METRICS):
                self.bars.data[i].x = labels
                self.bars.data[i].y = [r.get(key) for r in self.results]
                self.bars.data[i].hovertext = [f"{r['run']} ({r['device']})" for r in self.results]

    # -- driving it ----------------------------------------------------------------------------------------------
    def run(self, settings: dict[str, Any] | None = None, max_new_tokens: int | None = None,
            prompt_tokens: int | None = None, replay_speed: float | None = _UNSET) -> dict | None:
        """Run once and block (on the calling thread, e.g. a notebook cell) until the run ends; return its row.

        Refreshes the plots every `poll_s`. Interrupting the kernel (KeyboardInterrupt) stops the run, joins its
        threads and re-raises. Returns None if the run was stopped before its first token; raises the worker's
        exception if generation failed.
        """
        self.start(settings, max_new_tokens=max_new_tokens, prompt_tokens=prompt_tokens, replay_speed=replay_speed)
        run = self._run
        try:
            while not self._tick():
                time.sleep(self.poll_s)
        finally:
            if not run.finished:  # interrupted: stop, join, keep the UI consistent
                run.stop.set()
                self._finish(run)
        if run.error is not None:
            raise run.error
        return run.row

    async def arun(self, settings: dict[str, Any] | None = None, max_new_tokens: int | None = None,
                   prompt_tokens: int | None = None, replay_speed: float | None = _UNSET) -> dict | None:
        """Like `run`, but awaitable (`await dash.arun(...)` in a cell): the kernel stays free for Stop clicks."""
        self.start(settings, max_new_tokens=max_new_tokens, prompt_tokens=prompt_tokens, replay_speed=replay_speed)
        run = self._run
        await self._poll(run)
        if run.error is not None:
            raise run.error
        return run.row

    async def _poll(self, run: _Run) -> None:
        try:
            while not self._tick():
                await asyncio.sleep(self.poll_s)
        except BaseException as e:  # noqa: BLE001 (CancelledError included): never leave threads behind
            if not run.finished:
                run.error = run.error or e
                run.stop.set()
                self._finish(run)
            if not isinstance(e, Exception):
                raise

    def _on_run_click(self, _button=None) -> None:
        """The Run button: start, then poll from a task on the kernel's event loop (this handler returns at once,
        so the kernel can receive Stop). Outside an event loop (plain Python) it runs to the end instead."""
        try:
            self.start()
        except (ValueError, RuntimeError) as e:
            self._set_status(f"Cannot run: {e}")
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            run = self._run
            while not self._tick():
                time.sleep(self.poll_s)
            if run.error is not None:
                raise run.error
            return
        self._task = loop.create_task(self._poll(self._run))

    def stop(self) -> None:
        """Ask the run in progress to stop after its current token (safe from any thread; no-op when idle)."""
        if self._run is not None and not self._run.finished:
            self._run.stop.set()
            self._set_status(f"Stopping {self._run.label} ...")

    def close(self, widgets: bool = False) -> None:
        """Stop a run in progress and join its threads (worker and sampler). widgets=True also closes the widgets
        (they disappear from the page). Safe to call twice."""
        run = self._run
        if run is not None and not run.finished:
            run.stop.set()
            self._finish(run)
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None
        if widgets:
            self.widget.close()
            for w in (self.fig, self.bars):
                w.close()

    def __enter__(self) -> "Dashboard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- static figures of a recorded trace (lab 01) -----------------------------------------------------------------


def trace_figure(trace: Trace, height: int = 560) -> go.Figure:
    """GPU-Util vs SM activity vs SM occupancy vs DRAM bandwidth over the recording (top), and the latency of
    each token (bottom), with the decoding window shaded. A static `go.Figure` (no widget)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4],
                        subplot_titles=(f"{trace.device}: what NVML reports (%)",
                                        "latency of each token (ms); the first of each call includes the prefill"))
    ts = trace.samples["t_s"]
    has_gpm = any(k in trace.samples for k in _GPM_KEYS)
    for key, name in GPU_SERIES:
        if key in trace.samples and (key != "mem_util_pct" or not has_gpm):
            fig.add_scatter(x=ts, y=trace.samples[key], mode="lines", name=name, row=1, col=1,
                            line={"dash": "dot" if key == "mem_util_pct" else "solid"})
    fig.add_scatter(x=trace.tokens["t_s"], y=trace.tokens["step_ms"], mode="markers", marker={"size": 3},
                    name="token latency (ms)", row=2, col=1)
    a, b = trace.decode_window
    fig.add_vrect(x0=a, x1=b, fillcolor="gray", opacity=0.08, line_width=0, row=1, col=1)
    fig.update_yaxes(title_text="%", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="ms", type="log", row=2, col=1)
    fig.update_xaxes(title_text="seconds (shaded: decoding)", row=2, col=1)
    fig.update_layout(height=height, title=f"Replay of {trace.label}", legend={"orientation": "h", "y": -0.15})
    return fig


def kernel_timeline_figure(trace: Trace, height: int = 260) -> go.Figure | None:
    """The profiled decode steps of a trace as a timeline: a bar where a GPU kernel ran, white where none did.
    None if the trace has no kernel profile."""
    k = trace.kernels
    if not k or not k.get("intervals_us"):
        return None
    xs, ys = [], []
    for a, b in k["intervals_us"]:
        xs += [a / 1e3, a / 1e3, b / 1e3, b / 1e3, None]
        ys += [0, 1, 1, 0, None]
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="lines", fill="toself", line={"width": 0.5},
                               name="a kernel is running"))
    t = 0.0
    for i, step in enumerate(k.get("step_us", [])):
        t += step / 1e3
        if i < len(k["step_us"]) - 1:
            fig.add_vline(x=t, line_dash="dash", line_color="gray")
    busy = 100 * k["busy_us"] / k["window_us"]
    fig.update_layout(height=height, yaxis={"visible": False, "range": [0, 1.3]},
                      xaxis_title="ms (dashed: token boundaries)",
                      title=f"{k['steps']} decode steps on {trace.device}: {k['n_kernels']} kernels, "
                            f"a kernel running {busy:.0f}% of the time")
    return fig
