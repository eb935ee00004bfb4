"""Trace files: save/load round trip, size, listing and matching, replay order and timing, the run summary."""

from __future__ import annotations

import json

import pytest

from llmlab.measure import roofline
from llmlab.config import ModelConfig
from llmlab.telemetry.trace import (DEFAULT_TRACE_DIR, Replay, Trace, find_trace, list_traces, load_trace, load_traces,
                                    replay, save_trace, slug, summarize_run, trace_dir, trace_filename, window_means)
from trace_fixture import FIXTURE, synthetic_trace


def test_fixture_is_synthetic_and_labelled():
    t = load_trace(FIXTURE)
    assert t.meta["synthetic"] is True
    assert "SYNTHETIC" in t.label and "not a measurement" in t.label
    assert t.series[:2] == ["gpu_util_pct", "mem_util_pct"]


def test_data_traces_hold_only_real_recordings():
    for path in list_traces(DEFAULT_TRACE_DIR):
        t = load_trace(path)
        assert not t.meta.get("synthetic"), f"{path} is synthetic: fixtures belong in tests/data/"
        assert t.meta.get("device") and t.meta.get("date") and t.samples.get("t_s"), path
        assert path.stat().st_size < 1_000_000, f"{path} is over 1 MB"


def test_round_trip(tmp_path):
    t = synthetic_trace()
    path = save_trace(t, directory=tmp_path)
    assert path.name == trace_filename(t.meta) == "synthetic-gpu-test-fixture_llama-3.2-1b_kv-cache_bf16.json"
    back = load_trace(path)
    assert back.path == path
    assert back.meta == json.loads(json.dumps(t.meta))
    assert list(back.samples) == list(t.samples)
    for k in t.samples:
        assert back.samples[k] == pytest.approx(t.samples[k], abs=0.01)
    assert back.tokens["t_s"] == pytest.approx(t.tokens["t_s"], abs=1e-4)
    assert back.tokens["step_ms"] == pytest.approx(t.tokens["step_ms"], abs=1e-3)
    assert [c["n_tokens"] for c in back.calls] == [c["n_tokens"] for c in t.calls]
    assert back.summary["tokens_per_s"] == pytest.approx(t.summary["tokens_per_s"], rel=1e-3)
    assert back.kernels["n_kernels"] == t.kernels["n_kernels"]
    assert back.calls_step_ms()[0][0] == pytest.approx(t.calls_step_ms()[0][0], abs=1e-3)
    # saving again what was loaded gives the same bytes (rounding is idempotent)
    again = save_trace(back, tmp_path / "again.json")
    assert again.read_text() == path.read_text()


def test_a_long_fast_recording_stays_under_1_mb(tmp_path):
    # 15 s of decoding at ~1000 tokens/s (a future CUDA-graph run): 15k tokens, 170 readings of 7 series
    t = synthetic_trace(decode_s=15.0, tpot_ms=1.0, new_tokens=256)
    assert len(t.tokens["t_s"]) > 12_000
    size = save_trace(t, directory=tmp_path).stat().st_size
    assert size < 500_000, size


def test_nan_and_none_become_null(tmp_path):
    t = synthetic_trace()
    t.samples["sm_active_pct"][0] = float("nan")
    t.samples["sm_active_pct"][1] = None
    back = load_trace(save_trace(t, tmp_path / "x.json"))
    assert back.samples["sm_active_pct"][:2] == [None, None]
    assert "sm_active_pct" not in back.readings()[0]  # absent from that reading, not zero


def test_list_load_and_find(tmp_path):
    assert list_traces(tmp_path / "missing") == [] and load_traces(tmp_path / "missing") == []
    assert find_trace({"kv_cache": True}, tmp_path) is None
    old = synthetic_trace()
    old.meta = {**old.meta, "date": "2026-01-01T00:00:00Z"}
    new = synthetic_trace()
    new.meta = {**new.meta, "date": "2026-02-01T00:00:00Z", "setting_slug": "kv-cache_bf16-b"}
    nocache = synthetic_trace()
    nocache.meta = {**nocache.meta, "settings": {"kv_cache": False, "dtype": "bf16"}, "setting_slug": "no-kv-cache"}
    for t in (old, new, nocache):
        save_trace(t, directory=tmp_path)
    (tmp_path / "notes.txt").write_text("not a trace")
    (tmp_path / "broken.json").write_text("{\"format\": \"something else\"}")
    names = [p.name for p in list_traces(tmp_path)]
    assert names == sorted(names) and len(names) == 4  # every *.json, sorted; .txt ignored
    traces = load_traces(tmp_path)
    assert len(traces) == 3  # the broken file is skipped
    assert traces[0].meta["date"] >= traces[-1].meta["date"]
    assert find_trace({"kv_cache": False}, tmp_path).settings["kv_cache"] is False
    assert find_trace({"kv_cache": True, "dtype": None}, tmp_path).meta["date"].startswith("2026-02")  # newest
    assert find_trace({}, traces=traces) is traces[0]


def test_trace_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMLAB_TRACE_DIR", raising=False)
    assert trace_dir() == DEFAULT_TRACE_DIR and DEFAULT_TRACE_DIR.parts[-2:] == ("data", "traces")
    monkeypatch.setenv("LLMLAB_TRACE_DIR", str(tmp_path))
    assert trace_dir() == tmp_path


def test_bad_files_raise_value_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_trace(p)
    d = synthetic_trace().to_dict()
    with pytest.raises(ValueError, match="version"):
        Trace.from_dict({**d, "version": 99})
    with pytest.raises(ValueError, match="format"):
        Trace.from_dict({**d, "format": "x"})
    with pytest.raises(ValueError, match="t_s"):
        Trace.from_dict({**d, "samples": {**d["samples"], "gpu_util_pct": [1.0]}})
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "nope.json")


def test_replay_all_at_once_in_order():
    t = synthetic_trace()
    slept = []
    rows = list(replay(t, realtime=False, sleep=slept.append))
    assert slept == [] and len(rows) == len(t.samples["t_s"])
    assert [r["t_s"] for r in rows] == t.samples["t_s"]
    assert rows[0]["gpu_util_pct"] == t.samples["gpu_util_pct"][0]


def test_replay_in_scaled_real_time():
    t = synthetic_trace()
    now = [100.0]
    waits = []

    def sleep(s):
        waits.append(s)
        now[0] += s

    rows = list(replay(t, speed=2.0, sleep=sleep, clock=lambda: now[0]))
    assert len(rows) == len(t.samples["t_s"])
    assert sum(waits) == pytest.approx(t.duration_s / 2.0)
    assert all(w > 0 for w in waits)
    with pytest.raises(ValueError):
        next(replay(t, speed=0))


def test_replay_cursor():
    t = synthetic_trace()
    r = Replay(t, speed=2.0)
    assert r.duration_s == pytest.approx(t.duration_s / 2)
    first = r.until(0.5)  # 0.5 s of wall time at 2x = the readings up to t_s = 1.0
    assert [x["t_s"] for x in first] == [x for x in t.samples["t_s"] if x <= 1.0]
    assert r.until(0.5) == []
    rest = r.rest()
    assert len(first) + len(rest) == len(t.samples["t_s"]) and r.done


def test_summarize_run_numbers():
    cfg = ModelConfig.from_preset("llama-3.2-1b")
    s = summarize_run([[10, 2, 2, 2], [12, 2, 4]], prompt_tokens=128, config=cfg, dtype="bfloat16",
                      peak_bw_gb_s=4000.0, datasheet_bw_gb_s=4800.0)
    assert s["n_calls"] == 2 and s["n_tokens"] == 7
    assert s["tokens_per_s"] == pytest.approx(7 / 0.034)
    assert s["ttft_ms"] == 11
    assert s["tpot_ms"] == pytest.approx(2.4) and s["tpot_p50_ms"] == 2 and s["tpot_p90_ms"] == pytest.approx(3.2)
    assert s["decode_tokens_per_s"] == pytest.approx(1000 / 2.4)
    ctx = roofline.decode_mean_context_len(128, 4)  # 3.5 tokens per call, rounded to 4
    assert s["mbu"] == pytest.approx(roofline.mbu(2.4e-3, cfg, 1, ctx, 4000.0))
    assert s["mbu_datasheet"] == pytest.approx(s["mbu"] * 4000 / 4800)
    assert s["roofline_tokens_per_s"] == pytest.approx(roofline.roofline_tokens_per_s(cfg, 4000.0, 1, ctx))
    # the recompute path reads no KV cache: only the weights count
    nc = summarize_run([[10, 2, 2, 2]], 128, cfg, "bf16", use_cache=False, peak_bw_gb_s=4000.0)
    assert nc["bytes_per_step"] == roofline.weight_bytes(cfg, 2)
    # no config / no peak: no MBU, but the latencies
    bare = summarize_run([[5]], 4, None, "fp32")
    assert bare["mbu"] is None and bare["tpot_ms"] is None and bare["ttft_ms"] == 5
    with pytest.raises(ValueError):
        summarize_run([], 4, None, "fp32")


def test_window_means():
    samples = {"t_s": [0.1, 0.2, 0.3, 0.4], "a": [0.0, 10.0, 20.0, None], "b": [1.0, 1.0, 1.0, 1.0]}
    assert window_means(samples, 0.1, 0.4) == {"a": 15.0, "b": 1.0}
    assert window_means(samples, 0.25, 0.26) == {"a": 20.0, "b": 1.0}  # shorter than an interval: next reading
    assert window_means(samples, 5, 6) == {"a": None, "b": None}


def test_summary_of_the_fixture_separates_idle_and_decoding():
    s = synthetic_trace().summary
    assert s["gpu_util_pct_mean"] > 30 and s["idle_gpu_util_pct_mean"] == 0
    assert s["sm_active_pct_mean"] < 10 and s["profiled_gpu_busy_pct"] == pytest.approx(20)


def test_slug():
    assert slug("NVIDIA H200") == "nvidia-h200"
    assert slug("llama-3.2-1b") == "llama-3.2-1b"
    assert slug("  /weird  name!! ") == "weird-name"
    assert slug("") == "unknown"
