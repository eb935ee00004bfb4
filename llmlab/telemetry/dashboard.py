"""The live dashboard: watch the GPU while the model decodes, flip an optimization, run again, compare.

    from llmlab.telemetry.dashboard import Dashboard
    dash = Dashboard(llm)          # shows itself when it is the last expression of a cell
    dash                           # Run / Stop in the browser, or from code:
    row = dash.run({"kv_cache": False}, max_new_tokens=64)

What it shows (ipywidgets + plotly `FigureWidget`):

* top panel: GPU-Util (what `nvidia-smi` reports), SM activity, SM occupancy and DRAM bandwidth utilisation, in %,
  sampled by `llmlab.telemetry.nvml_sampler.Sampler` at 10 Hz;
* per-token latency (ms) and tokens/s over the last 16 tokens, measured live; all three panels share one time
  axis (seconds since Run);
* one control per optimization in `llmlab.switches.SWITCHES` (`llmlab.telemetry.controls`), prompt and output
  lengths, Run and Stop; a switch that cannot run here is greyed out, and a note under the controls says why;
* a table and a bar chart that keep every run side by side: tokens/s, TTFT, TPOT, MBU, mean GPU-Util, mean SM
  activity.

Without an NVIDIA GPU (Binder, CI, a laptop) the dashboard says so in one line and the top panel replays the
recorded trace (`llmlab.telemetry.trace`, `data/traces/`) that best matches the settings, labelled with its
device and date, drawn when it is replayed (recorded seconds / replay speed); latency and tokens/s are still
measured live, on the CPU. On a GPU without NVML GPM (older than Hopper) the panel shows what NVML reports and
says, in the panel and in the notes, which series it cannot show.

The browser. The kernel holds the figures' data; a view in the page gets each change as a message, and every
change is also written into the widget state a view is drawn from (`figures.sync_widget_state`), so a view
drawn late (Run All while the page still loads the widget code) or again (a page reload) shows what the kernel
holds, and goes on updating.

Threads. Generation runs on a worker thread ("llmlab-dashboard-run"); on a GPU the sampler has its own thread.
Neither touches a widget: they append to buffers under a lock (`llmlab.telemetry.live_run`: a run's state, its
worker, its row in the table). The plots (`llmlab.telemetry.figures`) are updated from the kernel's main
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
import numbers
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as W
import torch

from llmlab import envinfo
from llmlab.engine import LLM
from llmlab.generate import check_lengths, format_ms
from llmlab.switches import apply_switches, check_per_token_settings
from llmlab.telemetry.controls import (live_mode_line, notes_html, read_settings, replay_mode_line, run_controls,
                                       show_settings, switch_controls)
from llmlab.telemetry.figures import (BAR_METRICS, GPU_SERIES, comparison_bars, figure_output, live_figure,
                                      missing_gpu_notes, results_table_html, set_time_span, show_gpu_series,
                                      sync_widget_state)
from llmlab.telemetry.live_run import (THREAD_NAME, LiveRun, decode, gpu_series, probe_series, rolling_rate, run_row,
                                       sample_times, take_samples, time_span, trace_row)
from llmlab.telemetry.nvml_sampler import Backend, Sampler, SamplerError, nvml_available
from llmlab.telemetry.record import setting_label
from llmlab.telemetry.trace import REPO_ROOT, Replay, Trace, find_trace, load_traces, trace_dir

_UNSET: Any = object()  # "use the dashboard's default" for replay_speed (None has a meaning: all at once)
SYNC_EVERY_S = 0.5  # during a run, the figures' full state is re-sent at most this often (for views drawn later)


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

    Attributes: `widget` (the ipywidgets box), `fig` (live FigureWidget), `bars` (comparison `go.Figure`, shown
    by the Output widget `bars_view`),
    `table` (HTML), `results` (one dict per run), `mode_line` (the one-line description of the GPU panel's
    source), `controls` (switch key -> widget), `unavailable` (switch key -> why it cannot run here), `notes`
    (HTML: those switches, and what the GPU panel cannot show).
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
        self._run: LiveRun | None = None
        self._task = None
        self._n = 0
        self._shown_traces: set = set()
        self._peak_bw: float | None = None
        self._synced_at = 0.0
        self._gpu_notes: list[str] = []

        ok, why = nvml_available() if sampler_backend is None else (True, "test backend")
        on_cuda = llm.device.type == "cuda"
        self.live_gpu = (on_cuda and ok) if live is None else bool(live)
        if self.live_gpu:
            self.traces: list[Trace] = []
            source = "NVML" if sampler_backend is None else type(sampler_backend).__name__
            self.mode_line = live_mode_line(llm, source, interval_s)
            series = probe_series(sampler_backend)
            self._gpu_notes = missing_gpu_notes(series) if series else []
        else:
            if isinstance(traces, list):
                self.traces = traces
                where = "the given traces"
            else:
                self.traces = load_traces(traces)
                folder = Path(traces if traces is not None else trace_dir()).resolve()
                where = str(folder.relative_to(REPO_ROOT)) + "/" if folder.is_relative_to(REPO_ROOT) else str(folder)
            self.mode_line = replay_mode_line(llm, (ok, why), self.traces, where)

        ctx = llm.config.max_seq_len
        self._build_controls(min(prompt_tokens, ctx // 2), max_new_tokens, ctx)
        self._build_figures()
        self.status = W.HTML(self._status_html("Ready. Choose the switches and press Run."))
        self.mode = W.HTML(f"<b>{html.escape(self.mode_line)}</b>")
        self.notes = W.HTML(notes_html(self.unavailable, self._gpu_notes), layout=W.Layout(width="100%"))
        self.notes.add_class("llmlab-notes")
        self.table = W.HTML(results_table_html(self.results), layout=W.Layout(width="100%"))
        full = W.Layout(width="100%")
        self.widget = W.VBox([self.mode, self.controls_box, self.notes, self.status, self.fig,
                              W.HTML("<b>All runs</b>"), self.table, self.bars_view], layout=full)
        self.widget.add_class("llmlab-dashboard")

    # -- widgets -------------------------------------------------------------------------------------------------
    def _build_controls(self, prompt_tokens: int, new_tokens: int, ctx: int) -> None:
        """One widget per registered switch (`llmlab.telemetry.controls`), lengths, Run and Stop."""
        self.controls, self.unavailable = switch_controls(self.llm)
        self.prompt_w, self.new_w, self.run_button, self.stop_button = run_controls(prompt_tokens, new_tokens, ctx)
        self.run_button.on_click(self._on_run_click)
        self.stop_button.on_click(lambda _b: self.stop())
        self.controls_box = W.HBox(list(self.controls.values()) + [self.prompt_w, self.new_w, self.run_button,
                                                                   self.stop_button],
                                   layout=W.Layout(flex_flow="row wrap", align_items="center", width="100%"))

    def _build_figures(self) -> None:
        """The live panels: a FigureWidget updated in place while a run goes (`_pull`). The comparison bars change
        once per run: a plain figure in the kernel (`bars`), shown through an Output widget whose whole content
        is replaced each time (`bars_view`). A view of the bars as a FigureWidget took no further updates after
        a page reload; an Output widget's content is kernel-side state, drawn again on every reload."""
        self.fig = live_figure()
        self._n_gpu = len(GPU_SERIES)
        self.bars = comparison_bars()
        self.bars_view = W.Output(layout=W.Layout(width="100%"))
        self.bars_view.add_class("llmlab-bars")
        self.bars_view.outputs = (figure_output(self.bars),)

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

    def _sync(self, force: bool = True) -> None:
        """Send the figures' full kernel-side state to the browser (`sync_widget_state`), so a view drawn now or
        later (a reload, a second view) shows what the kernel holds. `force=False` skips it within
        SYNC_EVERY_S of the last one."""
        now = time.monotonic()
        if force or now - self._synced_at >= SYNC_EVERY_S:
            sync_widget_state(self.fig)
            self._synced_at = now

    def _repr_mimebundle_(self, **kwargs):
        self._sync()  # displayed again (a new cell, a reload's re-execution): the views start from current state
        return self.widget._repr_mimebundle_(**kwargs)

    # -- the settings ------------------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The switch values the controls show now."""
        return read_settings(self.controls)

    def _show_settings(self, settings: dict[str, Any]) -> None:
        show_settings(self.controls, settings)

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
        Raises RuntimeError while another run is in progress; ValueError for bad settings (`apply_switches`,
        including switches the batching mode cannot run with), for batching='continuous'
        (`llmlab.switches.check_per_token_settings`) or lengths; TypeError for a length that is not a whole number.
        Nothing starts and no control changes.
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
        check_per_token_settings(settings, "the dashboard")  # before apply_switches, which may convert the model
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
        run = LiveRun(number=self._n, settings=settings, label=f"#{self._n} {setting_label(settings)}", llm=run_llm,
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
                run.time_scale = 1.0 / speed if speed else 1.0  # a reading is drawn when it is replayed
                title = f"replay of {run.trace.device}, recorded {run.trace.date}: " \
                        f"{run.trace.meta.get('setting_label', '')}" + \
                        (f" ({speed:g}x speed)" if speed and speed != 1 else "")
            else:
                title = "no GPU here, and no recorded trace to replay"
        self._reset_live_plot(run, title)
        self._run = run
        run.worker = threading.Thread(target=decode, args=(run,), name=THREAD_NAME, daemon=True)
        run.worker.start()
        self.run_button.disabled = True
        self.stop_button.disabled = False
        self._set_status(f"Running {run.label}: {prompt_len}-token prompt, {new} new tokens on "
                         f"{envinfo.device_name(run_llm.device)} ...")

    def _show_gpu_series(self, run: LiveRun) -> None:
        """Show the GPU panel's series the run's source reports, hide the others, and say what is missing (in the
        panel and in the notes under the controls)."""
        run.gpu_series = gpu_series(run)
        self._gpu_notes = show_gpu_series(self.fig, run.gpu_series, run.live_gpu)
        self.notes.value = notes_html(self.unavailable, self._gpu_notes)

    def _reset_live_plot(self, run: LiveRun, title: str) -> None:
        fig = self.fig
        with fig.batch_update():
            for tr in fig.data:
                tr.x, tr.y = [], []
            fig.layout.annotations[0].text = title
            fig.layout.annotations[1].text = f"latency of each token (ms), {run.label}"
            set_time_span(fig, time_span(run))
        self._show_gpu_series(run)
        self._sync()

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

    def _finish(self, run: LiveRun) -> None:
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
        if run.error is not None:  # the message, as the student would read it raised in a cell (escaped once)
            self._set_status(f"{run.label} failed: {str(run.error) or type(run.error).__name__}")
        elif g is None:
            self._set_status(f"{run.label} was stopped before its first token: nothing to add.")
        else:
            if run.trace is not None and run.trace.path not in self._shown_traces:
                self._shown_traces.add(run.trace.path)
                self.results.append(trace_row(run.trace, f"rec{len(self._shown_traces)}"))
            device = torch.device(g.device)
            peak = self._peak_bandwidth(device) if device.type == "cuda" else None  # MBU: GPU runs only
            run.row = run_row(run, self.llm.config, peak)
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
        self._sync()  # the final state, for any view drawn from now on

    def _pull(self, run: LiveRun, everything: bool = False) -> None:
        """Main thread: take the new sampler readings (or the replay's due ones; all remaining if `everything`)
        and the new tokens, and redraw what changed in one message."""
        new = take_samples(run, everything)
        with run.lock:
            tok_t, tok_ms = list(run.tok_t), list(run.tok_ms)
        lat, rate = self.fig.data[self._n_gpu], self.fig.data[self._n_gpu + 1]
        if not new and len(tok_t) == len(lat.x or ()):
            return
        if new and run.gpu_series is None:
            self._show_gpu_series(run)  # a live source that declared nothing: its first readings tell
        with self.fig.batch_update():
            if new:
                ts = sample_times(run)
                for i, (key, _) in enumerate(GPU_SERIES):
                    if key in run.samples:
                        self.fig.data[i].x, self.fig.data[i].y = ts, run.samples[key]
            if len(tok_t) != len(lat.x or ()):
                lat.x, lat.y = tok_t, tok_ms
                rate.x, rate.y = tok_t, rolling_rate(tok_t)
            set_time_span(self.fig, time_span(run))
        self._sync(force=everything)

    # -- the table of runs ---------------------------------------------------------------------------------------
    def _peak_bandwidth(self, device: torch.device) -> float | None:
        if self._peak_bw is None:
            from llmlab.measure.peaks import measure_peaks

            self._peak_bw = measure_peaks(device).copy_bw_gb_s
        return self._peak_bw

    def _refresh_results(self) -> None:
        self.table.value = results_table_html(self.results)
        labels = [r["key"] for r in self.results]
        with self.bars.batch_update():
            for i, (key, _, _) in enumerate(BAR_METRICS):
                self.bars.data[i].x = labels
                self.bars.data[i].y = [r.get(key) for r in self.results]
                self.bars.data[i].hovertext = [f"{r['run']} ({r['device']})" for r in self.results]
        self.bars_view.outputs = (figure_output(self.bars),)  # the whole figure, replaced: see `_build_figures`

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

    async def _poll(self, run: LiveRun) -> None:
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
            for w in (self.fig, self.bars_view):
                w.close()

    def __enter__(self) -> "Dashboard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
