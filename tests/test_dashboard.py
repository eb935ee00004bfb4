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
