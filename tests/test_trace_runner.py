"""Serving an arrival trace in real time (`llmlab.batching.trace_runner`): every request is served once in each mode
with its solo greedy output (fp32, a tiny random model), no request is admitted before it arrives, the static batcher
makes later arrivals wait for the batch in flight (and waits for more requests up to its timeout), the curve rows
carry the serving metrics, and curve files round-trip and are found by device."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmlab.batching import curve_file, trace_runner
from llmlab.batching.trace_runner import (CURVE_KEYS, MODES, latest_curve, list_curves, load_curve, save_curve,
                                          serve_trace, throughput_latency_curve)
from llmlab.batching.workload import TraceRequest
from llmlab.generate import generate
from tiny_models import tiny_model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, max_seq_len=96)


def requests(*specs) -> list[TraceRequest]:
    """(arrival_s, prompt_len, max_new_tokens) -> TraceRequests in that order."""
    return [TraceRequest(t, p, n, "chat", i) for i, (t, p, n) in enumerate(specs)]


def prompts_for(trace, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (r.prompt_len,), generator=gen).tolist() for r in trace]


TRACE = requests((0.0, 5, 12), (0.0, 17, 3), (0.004, 1, 9), (0.01, 30, 6), (0.012, 9, 1), (0.03, 12, 14))


@pytest.fixture(scope="module")
def solo(model):
    return [generate(model, p, max_new_tokens=r.max_new_tokens).token_ids[0]
            for p, r in zip(prompts_for(TRACE), TRACE)]


@pytest.fixture(scope="module", params=MODES)
def served(request, model):
    engine = dict(block_size=4, token_budget=16, chunk=8) if request.param == "continuous" else {}
    return serve_trace(model, TRACE, prompts_for(TRACE), request.param, max_batch=3, static_wait_s=0.005, **engine)


def test_every_request_is_served_once_with_its_solo_output(served, solo):
    assert len(served.outputs) == len(served.requests) == len(TRACE)
    for i, (got, want) in enumerate(zip(served.outputs, solo)):
        assert got == want, f"{served.mode}: request {i} differs from its solo greedy output"
    assert [r.tokens for r in served.requests] == [r.max_new_tokens for r in TRACE]
    s = served.summary
    assert s["mode"] == served.mode and s["finished"] == s["requests"] == len(TRACE)
    assert s["tokens"] == sum(r.max_new_tokens for r in TRACE) and s["tokens_per_s"] > 0
    if served.mode != "continuous":  # every request in exactly one batch
        ids = sorted(i for b in served.batches for i in b["ids"])
        assert ids == list(range(len(TRACE)))


def test_an_admission_delay_keeps_every_solo_output(model, solo):
    run = serve_trace(model, TRACE, prompts_for(TRACE), "continuous", max_batch=3, block_size=4, token_budget=16,
                      chunk=8, admit_delay=2.0)
    assert run.outputs == solo
    assert all(r.admitted_s >= r.arrival_s for r in run.requests)


def test_no_request_is_admitted_before_it_arrives(served):
    for i, r in enumerate(served.requests):
        assert r.arrival_s == TRACE[i].arrival_s
        assert r.arrival_s <= r.admitted_s <= r.first_token_s <= r.finished_s, (served.mode, i, r)
    assert served.wall_s == pytest.approx(max(r.finished_s for r in served.requests))  # first arrival at 0


def test_batches_respect_max_batch_and_one_at_a_time_runs_in_arrival_order(served):
    if served.mode == "continuous":
        assert max(b["rows"] for b in served.batches) <= 3
        return
    limit = 1 if served.mode == "one_at_a_time" else 3
    assert all(1 <= len(b["ids"]) <= limit for b in served.batches)
    for a, b in zip(served.batches, served.batches[1:]):
        assert b["start_s"] >= a["end_s"]  # one batch at a time
    if served.mode == "one_at_a_time":
        assert [b["ids"][0] for b in served.batches] == list(range(len(TRACE)))  # FIFO
        assert served.summary["useful_share"] == 1.0 and served.summary["mean_batch"] == 1.0
    else:
        assert served.summary["useful_share"] < 1.0  # ragged prompts and outputs in one batch: pads, idle rows


def test_continuous_occupancy_is_recorded_and_every_block_comes_back(served):
    if served.mode != "continuous":
        assert served.occupancy == [] and served.engine_summary is None
        return
    occ = served.occupancy
    assert len(occ) == len(served.batches) > 0
    assert all(0 <= used <= total for _, used, total in occ)
    assert max(used for _, used, _ in occ) > 0 and occ[-1][1] == 0  # all freed after the last request
    assert [t for t, _, _ in occ] == sorted(t for t, _, _ in occ)
    assert served.engine_summary["finished"] == len(TRACE)


def test_static_mode_makes_a_later_arrival_wait_for_the_batch_in_flight(model):
    """Request 1 arrives 2 ms after request 0, whose batch (max_batch 1 here: it starts at once) runs 60 tokens:
    request 1 waits for all of them. Continuous batching admits it at the next step instead."""
    trace = requests((0.0, 8, 60), (0.002, 8, 4))
    prompts = prompts_for(trace, seed=3)
    static = serve_trace(model, trace, prompts, "static", max_batch=1, static_wait_s=0.0)
    first, second = static.requests
    assert second.arrival_s < first.finished_s, "precondition: request 1 arrived while batch 0 ran"
    assert second.admitted_s >= first.finished_s and second.queueing_s > 0
    cont = serve_trace(model, trace, prompts, "continuous", max_batch=4)
    assert cont.requests[1].admitted_s < cont.requests[0].finished_s  # joined the running batch
    assert cont.requests[1].queueing_s < second.queueing_s


def test_the_static_batcher_waits_for_more_requests_up_to_its_timeout(model):
    trace = requests((0.0, 6, 3), (0.01, 4, 3), (0.5, 5, 2))
    run = serve_trace(model, trace, prompts_for(trace), "static", max_batch=4, static_wait_s=0.05)
    assert [b["ids"] for b in run.batches] == [[0, 1], [2]]
    assert run.batches[0]["start_s"] >= 0.05  # held the oldest for static_wait_s, then went with what it had
    assert run.requests[0].queueing_s >= 0.05
    full = serve_trace(model, requests((0.0, 6, 3), (0.0, 4, 3)), prompts_for(trace[:2]), "static", max_batch=2,
                       static_wait_s=5.0)
    assert full.batches[0]["start_s"] < 1.0  # a full batch does not wait


def test_the_static_servers_decode_runner_is_built_at_its_largest_size_before_the_clock_starts(model, monkeypatch):
    """With a captured runner (static_mode "graphs" on a GPU), a runner that a later, larger batch outgrows is
    rebuilt and captured again mid-trace, on the clock. The server builds it for the largest batch the trace can
    form (max_batch rows, or fewer requests) of its longest prompt + longest answer before its first batch, as the
    continuous engine captures before its clock; every batch then takes its runner from the same cache (an LLM's
    own, or one kept for the trace when given a bare model)."""
    events = []

    class Runners:
        def runner_for(self, m, mode, batch, seq_len, kernels=None):
            events.append(("runner", self, m, mode, batch, seq_len, kernels))

    real = trace_runner.generate_static

    def fake_generate_static(llm, prompts, max_new_tokens, mode="static", runners=None, **kw):  # eager, recorded
        events.append(("batch", runners, mode))
        return real(getattr(llm, "model", llm), prompts, max_new_tokens, **kw)

    monkeypatch.setattr(trace_runner, "generate_static", fake_generate_static)
    own = Runners()
    llm = type("FakeLLM", (), {"model": model, "kernels": "kernel modules", "runners": own})()
    trace = requests((0.0, 20, 3), (0.0, 4, 11), (0.001, 9, 2))
    run = serve_trace(llm, trace, prompts_for(trace), "static", max_batch=2, static_wait_s=0.0, static_mode="graphs")
    assert events[0] == ("runner", own, model, "graphs", 2, 20 + 11, "kernel modules")
    assert events[1:] == [("batch", own, "graphs")] * len(run.batches)
    events.clear()
    monkeypatch.setattr(trace_runner, "RunnerCache", Runners)  # a bare model: one cache for the whole trace
    run = serve_trace(model, trace, prompts_for(trace), "static", max_batch=8, static_wait_s=0.0,
                      static_mode="graphs")
    cache = events[0][1]
    assert events[0] == ("runner", cache, model, "graphs", 3, 20 + 11, None)  # 3 requests: no 8-row runner
    assert events[1:] == [("batch", cache, "graphs")] * len(run.batches)
    events.clear()
    serve_trace(model, trace, prompts_for(trace), "static", max_batch=2)  # eager: nothing to build, no cache
    assert all(e[0] == "batch" and e[1] is None for e in events)


def test_a_static_batch_never_pads_past_the_context(model):
    """A long prompt and a long answer fit the context apart but not in one padded batch (the batch pads every
    row to the longest prompt and decodes every row for the longest answer): they go in two batches."""
    trace = requests((0.0, 60, 4), (0.0, 4, 60), (0.0, 3, 5))  # context 96: 60 + 60 would not fit
    prompts = prompts_for(trace, seed=5)
    run = serve_trace(model, trace, prompts, "static", max_batch=4, static_wait_s=0.0)
    assert [b["ids"] for b in run.batches] == [[0], [1, 2]]
    assert run.outputs == [generate(model, p, max_new_tokens=r.max_new_tokens).token_ids[0]
                           for p, r in zip(prompts, trace)]


def test_bad_input_names_the_argument(model):
    p = prompts_for(TRACE)
    with pytest.raises(ValueError, match="mode='batched'"):
        serve_trace(model, TRACE, p, "batched")
    with pytest.raises(ValueError, match="prompts: 5 given for 6"):
        serve_trace(model, TRACE, p[:5])
    with pytest.raises(ValueError, match="trace is empty"):
        serve_trace(model, [], [])
    with pytest.raises(TypeError, match="only apply to mode='continuous'"):
        serve_trace(model, TRACE, p, "static", token_budget=8)
    with pytest.raises(ValueError, match="static_wait_s"):
        serve_trace(model, TRACE, p, "static", static_wait_s=-1)
    with pytest.raises(ValueError, match="max_context=96"):
        serve_trace(model, requests((0.0, 90, 10)), [[1] * 90])
    with pytest.raises(TypeError, match="max_batch"):
        serve_trace(model, TRACE, p, max_batch=2.5)
    with pytest.raises(TypeError, match="llmlab.LLM"):
        serve_trace("model", TRACE, p)


def test_curve_rows_have_the_fields_and_the_same_work_in_each_mode(model):
    runs = {}
    lines = []
    rows = throughput_latency_curve(model, [math.inf, 200.0], n=4, seed=1, modes=MODES, max_context=24,
                                    max_batch=4, static_wait_s=0.0, runs=runs, log=lines.append, block_size=4)
    assert [(r["rate"], r["mode"]) for r in rows] == [(rate, m) for rate in (math.inf, 200.0) for m in MODES]
    for row in rows:
        assert set(CURVE_KEYS) <= set(row) and row["n"] == 4 and row["finished"] == 4
        assert row["tokens_per_s"] > 0 and row["ttft_ms_p50"] <= row["ttft_ms_p99"]
    assert len({r["tokens"] for r in rows}) == 1  # the same trace lengths at every rate and in every mode
    assert set(runs) == {(r["rate"], r["mode"]) for r in rows} and len(lines) == len(rows)
    for bad in ([], [0.0], [-1]):
        with pytest.raises(ValueError, match="rates"):
            throughput_latency_curve(model, bad)
    with pytest.raises(ValueError, match="modes"):
        throughput_latency_curve(model, [1.0], modes=("fast",))


def _rows(device_rate=math.inf):
    base = {k: 1.0 for k in CURVE_KEYS}
    return [{**base, "rate": device_rate, "mode": "continuous", "ttft_ms_p99": math.nan},
            {**base, "rate": 4.0, "mode": "static"}]


def test_save_and_load_round_trip(tmp_path):
    path = save_curve(_rows(), tmp_path / "a" / "curve.json", model={"id": "tiny"}, settings={"n": 4},
                      extra={"batch_sweep": [{"batch": 1, "tokens_per_s": 10.0}]})
    doc = load_curve(path)
    for key in ("device", "versions", "commit", "date", "model", "settings"):
        assert key in doc
    assert doc["rows"][0]["rate"] == math.inf and doc["rows"][1]["rate"] == 4.0
    assert doc["rows"][0]["ttft_ms_p99"] is None  # NaN is written as null
    assert doc["batch_sweep"][0]["batch"] == 1 and doc["path"] == str(path)
    assert json.loads(path.read_text())["rows"][0]["rate"] == "inf"  # plain JSON, no Infinity
    assert doc["versions"]["torch"] == torch.__version__
    with pytest.raises(ValueError, match="misses"):
        save_curve([{"rate": 1.0}], tmp_path / "b.json", model="m", settings={})
    assert not (tmp_path / "b.json").exists()
    (tmp_path / "c.json").write_text(json.dumps({"format": "llmlab-bench", "rows": []}))
    with pytest.raises(ValueError, match="not a serving-curve file"):
        load_curve(tmp_path / "c.json")


def test_the_newest_gpu_curve_is_found(tmp_path, monkeypatch):
    assert latest_curve(tmp_path) is None
    for name, device in (("old", "NVIDIA H200"), ("cpu", "CPU: some cpu (1 threads)"), ("h100", "NVIDIA H100")):
        save_curve(_rows(), tmp_path / f"{name}.json", model="m", settings={}, device=device)
    (tmp_path / "bench.json").write_text(json.dumps({"device": "NVIDIA H200", "results": []}))  # not a curve
    (tmp_path / "broken.json").write_text("{")
    for name, day in (("old", 1), ("cpu", 3), ("h100", 2)):
        doc = json.loads((tmp_path / f"{name}.json").read_text())
        doc["date"] = f"2026-12-0{day}T00:00:00Z"
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    assert [d["device"] for d in list_curves(tmp_path)] == ["NVIDIA H200", "NVIDIA H100", "CPU: some cpu (1 threads)"]
    assert latest_curve(tmp_path)["path"].endswith("old.json")  # an H200 first, though older
    assert latest_curve(tmp_path, prefer=None)["path"].endswith("h100.json")  # CPUs never count
    monkeypatch.setattr(curve_file, "DEFAULT_DIR", tmp_path)
    assert latest_curve()["path"].endswith("old.json")
    (tmp_path / "old.json").unlink()
    assert latest_curve()["path"].endswith("h100.json")  # no H200 curve: the newest from another GPU


def test_the_recording_script_refuses_a_machine_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        trace_runner.main([])


@pytest.mark.parametrize("argv, message", [
    (["--rates", "abc"], "--rates 'abc': 'abc' is not a number > 0"),
    (["--rates", "4,-1"], "'-1' is not a number > 0"),
    (["--rates", ","], "--rates: give at least one arrival rate"),
    (["--batches", "8,2.5"], "--batches '8,2.5': '2.5' is not a whole number > 0"),
    (["-n", "0"], "argument -n: 0 is not a positive whole number"),
    (["--max-batch", "-4"], "argument --max-batch: -4 is not a positive whole number"),
    (["--preset", "llama-9"], "--preset: unknown preset 'llama-9'")])
def test_the_recording_script_names_a_bad_flag_before_any_work(monkeypatch, capsys, argv, message):
    """Checked before the GPU check, the preset's load and the sweep: with a GPU a bad flag would otherwise end
    minutes of work; without one, the user would only hear that there is no GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # every flag is checked before the GPU is used
    monkeypatch.setattr(trace_runner, "throughput_latency_curve", lambda *a, **k: pytest.fail("ran the curve"))
    with pytest.raises(SystemExit) as info:
        trace_runner.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
