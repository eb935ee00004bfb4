"""Serving workloads (arrival traces, the committed length table) and serving metrics (percentiles, TTFT / TPOT /
queueing, throughput)."""

from __future__ import annotations

import math
import statistics

import pytest

from llmlab.batching.workload import load_lengths, make_trace, poisson_arrivals, trace_prompts
from llmlab.measure.serving import RequestTimes, curve_point, percentile, summarize


def test_poisson_arrivals_have_the_asked_rate_and_are_seeded():
    times = poisson_arrivals(rate=10.0, n=4000, seed=3)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)  # mean gap 1 / rate
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.08)  # exponential: std == mean
    assert poisson_arrivals(10.0, 50, seed=3) == times[:50]
    assert poisson_arrivals(10.0, 50, seed=4) != times[:50]
    assert poisson_arrivals(math.inf, 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0, 3)
    with pytest.raises(ValueError, match="n=-1"):
        poisson_arrivals(1.0, -1)


def test_a_trace_draws_lengths_from_the_table_and_fits_the_context():
    table = load_lengths()
    assert {"chat", "long_document"} <= set(table)
    trace = make_trace(200, rate=5.0, mix={"chat": 0.7, "long_document": 0.3}, seed=1)
    pairs = {(r["prompt"], r["output"]) for rows in table.values() for r in rows}
    assert all((t.prompt_len, t.max_new_tokens) in pairs for t in trace)
    assert 0.55 < sum(t.kind == "chat" for t in trace) / 200 < 0.85
    assert [t.id for t in trace] == list(range(200))
    fitted = make_trace(200, rate=5.0, mix={"chat": 0.7, "long_document": 0.3}, seed=1, max_context=1024)
    assert all(t.prompt_len + t.max_new_tokens <= 1024 for t in fitted)
    assert [t.arrival_s for t in fitted] == [t.arrival_s for t in trace]  # only lengths change
    # a different rate keeps the lengths (separate random streams)
    assert [(t.prompt_len, t.max_new_tokens) for t in make_trace(50, rate=1.0, seed=2)] == \
        [(t.prompt_len, t.max_new_tokens) for t in make_trace(50, rate=9.0, seed=2)]
    with pytest.raises(ValueError, match="unknown kinds"):
        make_trace(3, mix={"poetry": 1.0})
    with pytest.raises(ValueError, match="shares"):
        make_trace(3, mix={"chat": 0.0})


def test_trace_prompts_match_the_lengths_and_avoid_token_zero():
    trace = make_trace(10, seed=0, max_context=256)
    prompts = trace_prompts(trace, vocab_size=100, seed=5)
    assert [len(p) for p in prompts] == [t.prompt_len for t in trace]
    assert all(0 < tok < 100 for p in prompts for tok in p)
    assert trace_prompts(trace, 100, seed=5) == prompts


def test_percentile_interpolates_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile(xs, 90) == pytest.approx(7.6)  # numpy.percentile(xs, 90)
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)
    with pytest.raises(ValueError, match="NaN"):
        percentile([1.0, float("nan")], 50)


def test_summary_of_a_known_run():
    reqs = [RequestTimes(0.0, 0.0, 0.1, 1.1, 11),  # TTFT 100 ms, TPOT (1.0 s / 10) = 100 ms
            RequestTimes(0.5, 1.0, 1.2, 1.6, 5),   # queued 500 ms, TTFT 700 ms, TPOT 100 ms
            RequestTimes(0.6, None, None, None, 0)]  # never admitted (cancelled while waiting)
    s = summarize(reqs, wall_s=2.0)
    assert s["requests"] == 3 and s["finished"] == 2 and s["tokens"] == 16
    assert s["tokens_per_s"] == 8.0 and s["requests_per_s"] == 1.0
    assert s["ttft_ms_p50"] == pytest.approx(400.0) and s["ttft_ms_p99"] == pytest.approx(694.0)
    assert s["tpot_ms_p50"] == pytest.approx(100.0)
    assert s["queueing_ms_p50"] == pytest.approx(250.0)
    assert curve_point(4.0, reqs, 2.0)["rate"] == 4.0
    with pytest.raises(ValueError, match="wall_s"):
        summarize(reqs, 0)
