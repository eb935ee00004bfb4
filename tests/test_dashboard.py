"""The dashboard, headless on a CPU: controls from the registry, programmatic runs, replay, Stop, threads."""

from __future__ import annotations

import asyncio
import time

import ipywidgets as W
import pytest

from llmlab import switches
from llmlab.telemetry.dashboard import Dashboard
from llmlab.telemetry.figures import GPU_SERIES, kernel_timeline_figure, trace_figure
from llmlab.telemetry.live_run import llmlab_threads, rolling_rate
from llmlab.engine import LLM
from llmlab.telemetry.trace import load_trace
from tiny_models import tiny_model
from trace_fixture import FIXTURE, synthetic_trace


class SlowLLM(LLM):
    """The tiny model, slowed to ~10 ms per token so a run lasts long enough to be stopped halfway."""

    def generate(self, prompt, on_token=None, **kwargs):
        def slow(step, tokens):
            time.sleep(0.01)
            return on_token(step, tokens) if on_token is not None else None

        return super().generate(prompt, on_token=slow, **kwargs)


class FakeBackend:
    series = ("gpu_util_pct", "sm_active_pct", "sm_occupancy_pct", "dram_bw_util_pct")

    def open(self):
        pass

    def read(self):
        return {"gpu_util_pct": 30.0, "sm_active_pct": 4.0, "sm_occupancy_pct": 2.0, "dram_bw_util_pct": 3.0}

    def close(self):
        pass


@pytest.fixture
def llm():
    return LLM(tiny_model(seed=2), None, name="tiny")


@pytest.fixture
def fixture_trace():
    return load_trace(FIXTURE)


@pytest.fixture(autouse=True)
def no_threads_left():
    yield
    assert llmlab_threads() == [], "a test left an llmlab thread running"


def _wait(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_controls_are_generated_from_the_registry(llm):
    extra_bool = switches.Switch("test_fused", "Fused test op", False, "a test switch", lambda m, v, kw: m)
    extra_choice = switches.Switch("test_mode", "Test mode", "a", "a test choice", lambda m, v, kw: m,
                                   choices=("a", "b"), available=lambda m: (False, "needs a GPU"))
    switches.register(extra_bool)
    switches.register(extra_choice)
    try:
        dash = Dashboard(llm, traces=[])
        assert list(dash.controls) == list(switches.SWITCHES)
        assert isinstance(dash.controls["kv_cache"], W.Checkbox) and dash.controls["kv_cache"].value is True
        assert isinstance(dash.controls["dtype"], W.Dropdown)
        assert dash.controls["dtype"].label == "as loaded"
        assert isinstance(dash.controls["test_fused"], W.Checkbox)
        assert dash.controls["test_mode"].disabled and "needs a GPU" in dash.controls["test_mode"].tooltip
        assert dash.settings() == {**switches.defaults()}
        dash.controls["dtype"].label = "bf16"
        assert dash.settings()["dtype"] == "bf16"
    finally:
        del switches.SWITCHES["test_fused"], switches.SWITCHES["test_mode"]


def test_programmatic_run_replays_and_measures_live(llm, fixture_trace):
    dash = Dashboard(llm, traces=[fixture_trace], replay_speed=None)
    assert dash.live_gpu is False
    assert dash.mode_line.startswith("No GPU to watch") and "replays a trace recorded on SYNTHETIC GPU" in \
        dash.mode_line and "measured live on this CPU" in dash.mode_line and "\n" not in dash.mode_line
    row = dash.run({"kv_cache": True}, max_new_tokens=12, prompt_tokens=8)
    assert row["tokens"] == 12 and row["finish"] == "length" and row["source"] == "live CPU"
    assert row["tokens_per_s"] > 0 and row["ttft_ms"] > 0 and row["tpot_ms"] > 0
    assert row["mbu_pct"] is None and row["gpu_util_pct"] is None  # CPU run: no GPU numbers of its own
    # the recorded run is in the table once, before the live one
    rec = dash.results[0]
    assert rec["source"].startswith("recorded") and rec["gpu_util_pct"] == pytest.approx(
        fixture_trace.summary["gpu_util_pct_mean"])
    assert dash.results[1] is row
    # the live plot: the whole trace replayed, one latency point per token
    gpu = dash.gpu_traces
    assert len(gpu["gpu_util_pct"].x) == len(fixture_trace.samples["t_s"])
    assert gpu["gpu_util_pct"].visible is True and gpu["mem_util_pct"].visible is False  # GPM present
    assert len(dash.latency_trace.x) == 12 and all(y > 0 for y in dash.latency_trace.y)
    assert "replay of SYNTHETIC GPU" in dash.fig.layout.annotations[0].text
    # table and bars keep both
    assert "#1 KV cache" in dash.table.value and "recorded" in dash.table.value
    assert list(dash.bars.data[0].x) == ["rec1", "#1"] and dash.bars.data[0].y[1] == pytest.approx(
        row["tokens_per_s"])
    dash.run({"kv_cache": False}, max_new_tokens=6, prompt_tokens=8)
    assert [r["key"] for r in dash.results] == ["rec1", "#1", "#2"]  # the trace row is not repeated
    assert dash.controls["kv_cache"].value is False  # the controls show what ran
    assert "done" in dash.status.value and not dash.run_button.disabled and dash.stop_button.disabled
    dash.close()


def test_replay_in_real_time_lasts_as_long_as_the_trace(llm):
    short = synthetic_trace(decode_s=0.3, idle_s=0.2, new_tokens=8)
    dash = Dashboard(llm, traces=[short], replay_speed=2.0)
    t0 = time.perf_counter()
    dash.run(max_new_tokens=4, prompt_tokens=4)
    assert time.perf_counter() - t0 >= short.duration_s / 2 - 0.05
    assert len(dash.gpu_traces["gpu_util_pct"].x) == len(short.samples["t_s"])


def test_without_any_trace_says_so_and_still_runs(llm, tmp_path):
    dash = Dashboard(llm, traces=tmp_path)  # an empty folder
    assert "no recorded trace in" in dash.mode_line and str(tmp_path) in dash.mode_line
    row = dash.run(max_new_tokens=5, prompt_tokens=4)
    assert row["tokens"] == 5 and len(dash.results) == 1
    assert all(len(tr.x or ()) == 0 for tr in dash.gpu_traces.values())
    assert "no recorded trace" in dash.fig.layout.annotations[0].text


def test_stop_ends_a_run_mid_way(fixture_trace):
    dash = Dashboard(SlowLLM(tiny_model(seed=3), None, name="slow"), traces=[fixture_trace])
    dash.start({"kv_cache": False}, max_new_tokens=120, prompt_tokens=4)
    assert dash.running and dash.run_button.disabled and not dash.stop_button.disabled
    assert any(t.name == "llmlab-dashboard-run" for t in llmlab_threads())
    with pytest.raises(RuntimeError, match="in progress"):
        dash.start()
    assert _wait(lambda: len(dash._run.tok_t) >= 3)
    dash.stop()
    while not dash._tick():
        time.sleep(0.02)
    row = dash.results[-1]
    assert row["finish"] == "stopped" and 3 <= row["tokens"] < 120
    assert "stopped" in dash.status.value
    # Stop during a replay shows the rest of the recording at once
    assert len(dash.gpu_traces["gpu_util_pct"].x) == len(fixture_trace.samples["t_s"])


def test_run_and_stop_buttons_on_an_event_loop(fixture_trace):
    """The browser path: Run schedules the poll loop on the running asyncio loop and returns at once; Stop (a
    click handled while the loop is free) ends the decode."""
    dash = Dashboard(SlowLLM(tiny_model(seed=4), None, name="slow"), traces=[fixture_trace], replay_speed=1.0)
    dash.new_w.value = 150

    async def scenario():
        dash.run_button.click()  # returns at once
        assert dash.running and dash._task is not None and not dash._task.done()
        for _ in range(500):  # the poll task draws the tokens while the decode goes on
            if len(dash.latency_trace.x or ()) >= 3:
                break
            await asyncio.sleep(0.01)
        n_latency = len(dash.latency_trace.x or ())
        dash.stop_button.click()
        await asyncio.wait_for(dash._task, timeout=20)
        return n_latency

    n_latency = asyncio.run(scenario())
    assert n_latency >= 3, "the poll task should have drawn tokens while the run went on"
    row = dash.results[-1]
    assert row["finish"] == "stopped" and row["tokens"] < 150
    assert not dash.running and not dash.run_button.disabled


def test_run_button_without_an_event_loop_runs_to_the_end(llm):
    dash = Dashboard(llm, traces=[])
    dash.new_w.value = 4
    dash.run_button.click()
    assert not dash.running and dash.results[-1]["tokens"] == 4


def test_live_path_with_a_fake_sampler(llm):
    dash = Dashboard(llm, traces=[], live=True, sampler_backend=FakeBackend(), idle_s=0.2, interval_s=0.02)
    assert dash.mode_line.startswith("Live: sampling")
    row = dash.run(max_new_tokens=10, prompt_tokens=4)
    assert row["source"] == "live GPU"
    assert row["gpu_util_pct"] == pytest.approx(30.0) and row["sm_active_pct"] == pytest.approx(4.0)
    assert len(dash.gpu_traces["gpu_util_pct"].x) >= 10  # ~0.4 s of idle + decode at 50 Hz
    assert not any(t.name == "llmlab-nvml-sampler" for t in llmlab_threads())


def test_bad_settings_start_nothing(llm):
    dash = Dashboard(llm, traces=[])
    with pytest.raises(ValueError, match="unknown switch"):
        dash.run({"warp_drive": True})
    with pytest.raises(ValueError, match="not one of"):
        dash.run({"dtype": "int3"})
    # what generate would refuse is refused here, not in the worker thread after the run started
    with pytest.raises(ValueError, match="static KV cache .* turn the KV cache on"):
        dash.run({"gpu_sampling": True, "kv_cache": False})
    with pytest.raises(ValueError, match="needs a CUDA GPU; leave it off or load the model on a CUDA GPU"):
        dash.run({"cuda_graphs": True})
    assert not dash.running and dash.results == []
    assert dash.controls["kv_cache"].value is True and dash.controls["gpu_sampling"].value is False
    dash.controls["kv_cache"].value = True
    dash._show_settings({"dtype": "fp32"})
    assert dash.settings()["dtype"] == "fp32"


def test_batching_the_dashboard_cannot_run_is_refused_before_starting(llm):
    """Continuous batching cannot take the per-token callback the dashboard draws its latency from: with the KV
    cache off or not, it is refused before a run starts, the controls as they were, and the next run works."""
    dash = Dashboard(llm, traces=[], replay_speed=None)
    dash.controls["dtype"].value = switches.SWITCHES["dtype"].choices.index("fp32")
    shown = dash.settings()
    for settings in ({"kv_cache": False, "batching": "continuous"}, {"batching": "continuous"},
                     {"paged_kv": True, "batching": "continuous"}):
        with pytest.raises(ValueError, match=r"^batching='continuous' cannot run in the dashboard: .* leave batching "
                                             r"as loaded \(None\), or set 'static' or 'one_at_a_time'"):
            dash.run(settings, max_new_tokens=4, prompt_tokens=4)
        assert not dash.running and dash._run is None and dash.results == []
        assert dash.settings() == shown and not dash.run_button.disabled
    dash.controls["batching"].value = switches.SWITCHES["batching"].choices.index("continuous")  # the Run button
    dash.run_button.click()
    assert dash._run is None and "Cannot run: batching=&#x27;continuous&#x27; cannot run in the dashboard" in \
        dash.status.value
    dash.controls["batching"].value = switches.SWITCHES["batching"].choices.index("one_at_a_time")
    assert dash.run(max_new_tokens=4, prompt_tokens=4)["tokens"] == 4
    dash.close()


class FailingLLM(LLM):
    """The tiny model whose timed run (the one with on_token, after the warm-up) fails."""

    def generate(self, prompt, on_token=None, **kwargs):
        if on_token is not None:
            raise ValueError("cannot run <this> with 'that' & \"those\"")
        return super().generate(prompt, **kwargs)


def test_a_failed_run_shows_the_message_not_its_repr():
    dash = Dashboard(FailingLLM(tiny_model(seed=2), None, name="failing"), traces=[], replay_speed=None)
    with pytest.raises(ValueError, match="cannot run <this>"):
        dash.run(max_new_tokens=4, prompt_tokens=4)
    assert dash.status.value == ("<span class='llmlab-status'>#1 KV cache failed: cannot run &lt;this&gt; with "
                                 "&#x27;that&#x27; &amp; &quot;those&quot;</span>")
    assert not dash.running and not dash.run_button.disabled and dash.results == []


def test_a_one_token_run_shows_no_tpot(llm):
    """One token has no decode step: the status line says "TPOT -", not "TPOT nan ms"."""
    dash = Dashboard(llm, traces=[])
    row = dash.run(max_new_tokens=1, prompt_tokens=4)
    assert row["tokens"] == 1
    assert "TPOT -." in dash.status.value and "nan" not in dash.status.value
    assert "nan" not in dash.table.value


def test_close_stops_and_joins_a_running_run(fixture_trace):
    dash = Dashboard(SlowLLM(tiny_model(seed=5), None, name="slow"), traces=[fixture_trace])
    dash.start(max_new_tokens=200, prompt_tokens=4)
    assert _wait(lambda: len(dash._run.tok_t) >= 1)
    dash.close()
    assert not dash.running and llmlab_threads() == []
    assert dash.results[-1]["finish"] == "stopped"
    dash.close()  # twice is fine
    dash.close(widgets=True)


def test_rolling_rate():
    assert rolling_rate([]) == []
    r = rolling_rate([0.0, 0.1, 0.2, 0.3], window=2)
    assert r[0] is None and r[1] == pytest.approx(10) and r[3] == pytest.approx(10)


def test_static_figures_of_a_trace(fixture_trace):
    fig = trace_figure(fixture_trace)
    names = [tr.name for tr in fig.data]
    assert "GPU-Util (nvidia-smi)" in names and "SM activity" in names and "token latency (ms)" in names
    assert "memory busy (nvidia-smi)" not in names  # GPM present: the coarse counter is left out
    assert all(len(tr.x) > 0 for tr in fig.data)
    tl = kernel_timeline_figure(fixture_trace)
    assert tl is not None and len(tl.data[0].x) == 5 * fixture_trace.kernels["n_kernels"]
    assert "20%" in tl.layout.title.text
    bare = synthetic_trace()
    bare.kernels = None
    assert kernel_timeline_figure(bare) is None
    assert {k for k, _ in GPU_SERIES} >= {"gpu_util_pct", "sm_active_pct", "dram_bw_util_pct"}


@pytest.mark.gpu
def test_live_gpu_panel_on_the_default_model():
    """On a CUDA GPU with NVML the dashboard samples the GPU while the shipped model decodes on it: the rows carry
    GPU-Util, SM activity and MBU of their own, the GPU panel fills, and the CUDA-graph rung decodes faster."""
    import torch

    from llmlab.telemetry.nvml_sampler import nvml_available

    ok, why = nvml_available()
    if not ok:
        pytest.skip(f"NVML is not usable here: {why}")
    llm = LLM.load(device="cuda")
    dash = Dashboard(llm, idle_s=0.2, interval_s=0.02, poll_s=0.02)
    try:
        assert dash.live_gpu and dash.mode_line.startswith("Live: sampling") and "NVML" in dash.mode_line
        rows = [dash.run({"cuda_graphs": on}, max_new_tokens=96, prompt_tokens=16) for on in (False, True)]
        for row in rows:
            assert row["source"] == "live GPU" and row["tokens"] == 96 and row["finish"] == "length"
            assert row["gpu_util_pct"] is not None and 0 <= row["gpu_util_pct"] <= 100
            assert row["sm_active_pct"] is not None and 0 <= row["sm_active_pct"] <= 100
            assert row["mbu_pct"] is not None and 0 < row["mbu_pct"] < 100
        assert len(dash.fig.data[0].x) > 10  # GPU-Util samples reached the live plot
        eager, graphs = rows
        assert graphs["tpot_ms"] < eager["tpot_ms"], (eager["tpot_ms"], graphs["tpot_ms"])
        assert [r["key"] for r in dash.results] == ["#1", "#2"]
    finally:
        dash.close()
    assert llmlab_threads() == [] and torch.cuda.is_available()


def test_lengths_given_in_code_are_checked_not_clamped(llm):
    """dash.run(max_new_tokens=-1) used to run 1 token and leave the control at 1: now it is refused, like
    LLM.generate, and nothing changes."""
    dash = Dashboard(llm, traces=[], prompt_tokens=8, max_new_tokens=12)
    try:
        before = (dash.prompt_w.value, dash.new_w.value)
        for kwargs, err in ((dict(max_new_tokens=-1), ValueError), (dict(max_new_tokens=0), ValueError),
                            (dict(max_new_tokens=2.7), TypeError), (dict(prompt_tokens=True), TypeError),
                            (dict(max_new_tokens=5000, prompt_tokens=8), ValueError)):
            with pytest.raises(err):
                dash.run(**kwargs)
            assert (dash.prompt_w.value, dash.new_w.value) == before and not dash.running
        assert dash.results == []
        row = dash.run(max_new_tokens=5)
        assert row["tokens"] == 5
    finally:
        dash.close()


# -- in the browser: state a view is drawn from, layout, time axis, what cannot run or be shown ---------------------


class NoGpmBackend:
    """A GPU without NVML GPM (A100, L4, T4): GPU-Util, NVML's memory-busy counter and power, nothing else."""

    series = ("gpu_util_pct", "mem_util_pct", "power_w")

    def open(self):
        pass

    def read(self):
        return {"gpu_util_pct": 55.0, "mem_util_pct": 20.0, "power_w": 150.0}

    def close(self):
        pass


class SilentBackend(NoGpmBackend):
    """A source that declares no series: the dashboard learns them from its readings."""

    series = ()


def _view_state(fig) -> dict:
    """What a browser view of `fig` is drawn from when it is created (a first render, a reload): the widget's
    synced state, as ipywidgets sends it to the page."""
    state = fig.get_state()
    return {"data": state["_widget_data"], "layout": state["_widget_layout"]}


def _bars_shown(dash) -> dict:
    """The plotly figure the bars' Output widget holds (what the page draws, on a reload too)."""
    (out,) = dash.bars_view.get_state()["outputs"]
    return out["data"]["application/vnd.plotly.v1+json"]


def test_a_view_drawn_after_the_run_shows_the_kernel_state(llm, fixture_trace):
    """Issues: empty axes after Run All (the widget code loaded after the run's messages), and after a reload."""
    from llmlab.telemetry.figures import sync_widget_state

    dash = Dashboard(llm, traces=[fixture_trace], replay_speed=None)
    row = dash.run(max_new_tokens=7, prompt_tokens=4)
    view = _view_state(dash.fig)
    n_gpu = len(GPU_SERIES)
    assert len(view["data"][n_gpu]["x"]) == row["tokens"] == 7  # latency points
    assert list(view["data"][n_gpu]["y"]) == pytest.approx(list(dash.latency_trace.y))
    assert len(view["data"][0]["x"]) == len(fixture_trace.samples["t_s"])  # the replayed GPU-Util
    assert "replay of SYNTHETIC GPU" in view["layout"]["annotations"][0]["text"]
    # the bars: the Output widget's content (kernel-side state) is the whole figure, replaced after each run
    bars = _bars_shown(dash)
    assert list(bars["data"][0]["x"]) == ["rec1", "#1"] and bars["data"][0]["y"][1] == pytest.approx(
        row["tokens_per_s"])
    dash.run(max_new_tokens=3, prompt_tokens=4)
    assert list(_bars_shown(dash)["data"][0]["x"]) == ["rec1", "#1", "#2"]
    row = dash.results[-1]
    # a change made without the dashboard (a stale state) is re-sent when the dashboard is displayed again
    dash.fig.data[n_gpu].y = [1.0] * 3
    assert list(_view_state(dash.fig)["data"][n_gpu]["y"]) != [1.0] * 3
    bundle = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert list(_view_state(dash.fig)["data"][n_gpu]["y"]) == [1.0] * 3
    sync_widget_state(dash.fig)  # nothing new: nothing changes
    dash.close()


def test_a_view_drawn_mid_run_is_at_most_a_sync_period_behind(fixture_trace):
    from llmlab.telemetry.dashboard import SYNC_EVERY_S

    dash = Dashboard(SlowLLM(tiny_model(seed=6), None, name="slow"), traces=[fixture_trace], poll_s=0.02)
    dash.start(max_new_tokens=200, prompt_tokens=4)
    try:
        assert _wait(lambda: len(dash._run.tok_t) >= 5)
        deadline = time.monotonic() + SYNC_EVERY_S + 0.1
        while time.monotonic() < deadline:
            dash._tick()
            time.sleep(0.02)
        assert dash.running, "the run should still be going"
        shown = len(_view_state(dash.fig)["data"][len(GPU_SERIES)]["x"])
        assert 5 <= shown <= len(dash.latency_trace.x) < 200
    finally:
        dash.close()


def test_figures_fill_the_width_and_the_modebar_clears_the_titles(llm):
    from llmlab.telemetry.figures import FIGURE_CONFIG, MODEBAR_PX, TITLE_PX

    dash = Dashboard(llm, traces=[])
    assert dash.widget.layout.width == "100%" and dash.table.layout.width == "100%"
    assert dash.bars_view.layout.width == "100%"
    assert dash.fig._config == FIGURE_CONFIG and FIGURE_CONFIG["responsive"] is True
    assert _bars_shown(dash)["config"] == FIGURE_CONFIG
    for fig, n_titles in ((dash.fig, 3), (dash.bars, len(dash.bars.data))):
        assert fig.layout.autosize is True and fig.layout.width is None  # the page decides the width
        titles = fig.layout.annotations[:n_titles]
        assert all(t.font.size == TITLE_PX and t.yanchor == "bottom" for t in titles)
        # the top row's titles sit in the top margin, above their panels; the modebar (top right) must fit above
        top = [t for t in titles if t.y >= 1 - 1e-9]
        assert top
        lines = max(t.text.count("<br>") + 1 for t in top)
        assert fig.layout.margin.t >= MODEBAR_PX + lines * TITLE_PX, (fig.layout.margin.t, lines)
    assert max(t.text.count("<br>") for t in dash.bars.layout.annotations) >= 1  # two-line titles exist
    # a wide table scrolls sideways inside the output area instead of wrapping every cell
    assert "overflow-x:auto" in dash.table.value and "white-space:nowrap" in dash.table.value
    assert dash.bars.layout.margin.t > dash.fig.layout.margin.t


def test_replay_and_live_panels_share_one_time_span(llm):
    trace = synthetic_trace(decode_s=0.4, idle_s=0.2, new_tokens=8)
    speed = 4.0
    dash = Dashboard(llm, traces=[trace], replay_speed=speed, poll_s=0.02)
    dash.start(max_new_tokens=6, prompt_tokens=4)
    layout = dash.fig.layout
    assert layout.xaxis.matches == layout.xaxis2.matches == "x3"  # linked: one zoom, one span
    # the span is known before anything is drawn: the whole replay, on the run's clock
    assert layout.xaxis3.range[1] == pytest.approx(trace.duration_s / speed * 1.02, rel=1e-3)
    while not dash._tick():
        time.sleep(0.02)
    gpu_x, lat_x = dash.gpu_traces["gpu_util_pct"].x, dash.latency_trace.x
    assert max(gpu_x) == pytest.approx(max(trace.samples["t_s"]) / speed)  # drawn when it was replayed
    end = layout.xaxis3.range[1]
    assert layout.xaxis3.range[0] == 0 and end >= max(gpu_x) and end >= max(lat_x)
    assert all(ax.range is None or tuple(ax.range) == tuple(layout.xaxis3.range)
               for ax in (layout.xaxis, layout.xaxis2))
    assert end < max(trace.samples["t_s"])  # the recorded seconds, replayed 4x faster, are not the span
    dash.close()


def test_switches_that_cannot_run_here_are_greyed_out_with_the_reason(llm):
    dash = Dashboard(llm, traces=[])
    expected = {k: sw.available(llm) for k, sw in switches.SWITCHES.items()}
    off = {k: why for k, (ok, why) in expected.items() if not ok}
    assert "cuda_graphs" in off, "on a CPU, CUDA graphs cannot run"
    assert dash.unavailable == off
    assert dash.notes in dash.widget.children  # visible on the page, not only on hover
    for key, sw in switches.SWITCHES.items():
        w = dash.controls[key]
        if key in off:
            assert w.disabled and off[key] in w.tooltip and "not available here" in w.tooltip
            assert f"<b>{sw.label}</b>: {off[key]}" in dash.notes.value
        else:
            assert not w.disabled and f"<b>{sw.label}</b>" not in dash.notes.value
    # a run from code with such a switch on is refused with the reason, before anything starts
    with pytest.raises(ValueError, match=off["cuda_graphs"]):
        dash.run({"cuda_graphs": True})
    assert not dash.running


def test_missing_gpu_notes():
    from llmlab.telemetry.figures import missing_gpu_notes

    full = {"gpu_util_pct", "mem_util_pct", "sm_active_pct", "sm_occupancy_pct", "dram_bw_util_pct"}
    assert missing_gpu_notes(full) == []
    assert missing_gpu_notes(full - {"sm_active_pct"}) == [
        "SM activity needs NVML GPM (Hopper or newer): not shown; the dotted line is NVML's coarser "
        "'memory busy (nvidia-smi)' instead."]
    (note,) = missing_gpu_notes({"gpu_util_pct"})
    assert note.startswith("SM activity, SM occupancy and DRAM bandwidth need NVML GPM (Hopper or newer): not shown")
    assert any("GPU-Util" in n and "MIG" in n for n in missing_gpu_notes({"sm_active_pct"}))


@pytest.mark.parametrize("backend", [NoGpmBackend, SilentBackend])
def test_a_gpu_without_gpm_shows_what_it_can_and_says_what_is_missing(llm, backend):
    dash = Dashboard(llm, traces=[], live=True, sampler_backend=backend(), idle_s=0.1, interval_s=0.02)
    missing = "SM activity, SM occupancy and DRAM bandwidth need NVML GPM (Hopper or newer): not shown"
    if backend.series:  # declared: said before the first run
        assert missing in dash.notes.value
    row = dash.run(max_new_tokens=6, prompt_tokens=4)
    assert missing in dash.notes.value
    note = dash.fig.layout.annotations[3]
    assert note.visible and missing in note.text
    gpu = dash.gpu_traces
    assert gpu["gpu_util_pct"].visible and len(gpu["gpu_util_pct"].x) > 0
    assert gpu["mem_util_pct"].visible and len(gpu["mem_util_pct"].x) > 0  # the coarse counter, instead
    assert not any(gpu[k].visible for k in ("sm_active_pct", "sm_occupancy_pct", "dram_bw_util_pct"))
    assert row["gpu_util_pct"] == pytest.approx(55.0) and row["sm_active_pct"] is None
    assert "55.0" in dash.table.value
    assert missing in _view_state(dash.fig)["layout"]["annotations"][3]["text"]
    dash.close()


def test_a_gpu_with_gpm_has_no_note(llm):
    dash = Dashboard(llm, traces=[], live=True, sampler_backend=FakeBackend(), idle_s=0.05, interval_s=0.02)
    dash.run(max_new_tokens=3, prompt_tokens=4)
    assert "GPU panel" not in dash.notes.value and not dash.fig.layout.annotations[3].visible
    assert dash.gpu_traces["sm_active_pct"].visible and not dash.gpu_traces["mem_util_pct"].visible
    dash.close()
