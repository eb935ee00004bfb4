"""Repeated timings and their verdicts (`llmlab.measure.timing`: summarize_ms, compare_ms, check_claim,
time_repeats; `llmlab.measure.kv_costs`: context_trend, reuse_verdict, and the sweep's verdicts): a steady set of
repeats gives "steady" and a claim is confirmed only beyond the noise; a noisy fake timer gives "too noisy to
conclude: rerun"; a steady measurement that contradicts a claim fails it. And labs 00 and 03 time the model on the
thread count `cpu_threads_for` picks, inside `intra_op_threads`."""

from __future__ import annotations

import ast
import json
import statistics
from pathlib import Path

import pytest
import torch

from llmlab.measure import kv_costs, timing
from llmlab.measure.timing import (STEADY, TOO_NOISY, Comparison, check_claim, compare_ms, intra_op_threads,
                                   summarize_ms, time_repeats)
from tiny_models import tiny_model

LABS = Path(__file__).resolve().parents[1] / "labs"


class FakeClock:
    """A clock (seconds) for code that reads it twice around each timed call: the second read of each pair comes
    `durations_ms[k]` after the first; the time between pairs (1 s, not counted) makes a mix-up show."""

    def __init__(self, durations_ms):
        self.durations = list(durations_ms)
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.now += self.durations.pop(0) / 1e3 if self.reads % 2 else 1.0
        self.reads += 1
        return self.now


STEADY_MS = [10.0, 10.2, 9.9, 10.1, 10.0, 10.3, 9.8]
NOISY_MS = [10.0, 19.0, 11.0, 25.0, 9.5, 16.0, 30.0]  # a machine whose load comes and goes


# -- summarize_ms ------------------------------------------------------------------------------------------------

def test_summary_is_median_quartiles_and_spread():
    r = summarize_ms(NOISY_MS)
    low, med, high = statistics.quantiles(NOISY_MS, n=4, method="inclusive")
    assert (r.median_ms, r.low_ms, r.high_ms) == (med, low, high) == (statistics.median(NOISY_MS), low, high)
    assert r.spread == pytest.approx((high - low) / med)
    assert r.samples_ms == tuple(NOISY_MS)


def test_steady_repeats_are_steady_and_a_noisy_timer_is_too_noisy():
    steady, noisy = summarize_ms(STEADY_MS), summarize_ms(NOISY_MS)
    assert steady.verdict == STEADY and steady.steady and steady.why == ""
    assert noisy.verdict == TOO_NOISY == "too noisy to conclude: rerun" and not noisy.steady
    assert "spans" in noisy.why and "steady is at most 20%" in noisy.why
    assert "too noisy" in str(noisy) and "steady" in str(steady)


def test_one_slow_repeat_does_not_make_repeats_noisy():
    """A single page fault or preemption: the median and the middle half ignore it."""
    r = summarize_ms(STEADY_MS + [80.0])
    assert r.steady and r.median_ms < 10.5


def test_max_spread_sets_the_line():
    assert summarize_ms(STEADY_MS, max_spread=0.01).verdict == TOO_NOISY  # 1.5% spread > 1%
    assert summarize_ms(NOISY_MS, max_spread=2.0).verdict == STEADY


@pytest.mark.parametrize("samples, match", [
    ([], "at least 2 repeats"), ([5.0], "at least 2 repeats"), ([5.0, 0.0], "positive finite"),
    ([5.0, -1.0], "positive finite"), ([5.0, float("nan")], "positive finite"),
    ([5.0, float("inf")], "positive finite"),
])
def test_summary_refuses_bad_samples(samples, match):
    with pytest.raises(ValueError, match=match):
        summarize_ms(samples)
    with pytest.raises(ValueError, match="max_spread"):
        summarize_ms(STEADY_MS, max_spread=0)


def test_the_reason_names_a_busy_machine(monkeypatch):
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (5.3, 4.0, 3.0))
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    assert "load average is 5.3 on 2 CPUs" in summarize_ms(NOISY_MS).why
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (0.4, 0.5, 0.5))
    assert timing.machine_load_note() == "" and "load average" not in summarize_ms(NOISY_MS).why


# -- time_repeats with a fake clock --------------------------------------------------------------------------------

def test_time_repeats_steady_clock():
    calls = []
    r = time_repeats(lambda: calls.append(1), repeats=len(STEADY_MS), warmup=2, clock=FakeClock(STEADY_MS))
    assert len(calls) == 2 + len(STEADY_MS)  # the warm-up calls run, untimed
    assert r.samples_ms == pytest.approx(STEADY_MS) and r.verdict == STEADY


def test_time_repeats_noisy_clock_is_too_noisy():
    r = time_repeats(lambda: None, repeats=len(NOISY_MS), clock=FakeClock(NOISY_MS))
    assert r.samples_ms == pytest.approx(NOISY_MS) and r.verdict == TOO_NOISY


@pytest.mark.parametrize("kwargs, match", [({"repeats": 1}, "repeats=1"), ({"repeats": True}, "repeats=True"),
                                           ({"repeats": 3.0}, "repeats=3.0"), ({"warmup": -1}, "warmup=-1")])
def test_time_repeats_refuses_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        time_repeats(lambda: None, **kwargs)


# -- compare_ms and check_claim ----------------------------------------------------------------------------------

def scaled(samples, k):
    return summarize_ms([t * k for t in samples])


def test_compare_needs_the_middle_halves_apart():
    base = summarize_ms(STEADY_MS)
    assert compare_ms(scaled(STEADY_MS, 1.5), base).verdict == "slower"
    assert compare_ms(base, scaled(STEADY_MS, 1.5)).verdict == "faster"
    assert compare_ms(scaled(STEADY_MS, 1.005), base).verdict == "same within noise"  # inside the noise
    assert compare_ms(scaled(STEADY_MS, 1.5), base).ratio == pytest.approx(1.5)


def test_a_small_difference_on_a_noisy_timer_is_too_noisy():
    c = compare_ms(scaled(NOISY_MS, 1.2), summarize_ms(NOISY_MS), "long", "short")
    assert c.verdict == TOO_NOISY and not c.conclusive and "long:" in c.why and "short:" in c.why


def test_a_difference_far_beyond_the_noise_is_concluded_on_a_noisy_timer():
    """Scattered repeats still rank two things whose middle halves are far apart (a 10x gap on a busy CPU)."""
    c = compare_ms(scaled(NOISY_MS, 10), summarize_ms(NOISY_MS))
    assert c.verdict == "slower" and c.conclusive


def test_check_claim_confirms_reports_noise_and_fails_a_contradiction():
    base = summarize_ms(STEADY_MS)
    assert check_claim("long is slower", compare_ms(scaled(STEADY_MS, 2), base)).startswith("long is slower: yes (")
    noisy = compare_ms(scaled(NOISY_MS, 1.2), summarize_ms(NOISY_MS))
    assert check_claim("long is slower", noisy).startswith("long is slower: too noisy to conclude: rerun (")
    with pytest.raises(AssertionError, match="not so on this measurement"):
        check_claim("long is slower", compare_ms(base, scaled(STEADY_MS, 2)))  # steady, and the other way round
    with pytest.raises(AssertionError):
        check_claim("long is slower", compare_ms(scaled(STEADY_MS, 1.005), base))  # steady, no difference
    assert check_claim("it rises", Comparison(2.0, "rises", "why"), expect="rises") == "it rises: yes (why)"


# -- the KV-cache checks: context_trend, reuse_verdict, the sweep on a fake clock ---------------------------------

def rows_of(medians, samples=STEADY_MS):
    """Sweep rows whose repeats are `samples` scaled to each median."""
    out = []
    for ctx, m in zip((16, 128, 256, 512), medians):
        rep = scaled(samples, m / statistics.median(samples))
        out.append({"context": ctx, "ms": rep.median_ms, "spread": rep.spread, "verdict": rep.verdict, "repeats": rep})
    return out


def test_context_trend_verdicts():
    assert kv_costs.context_trend(rows_of([10, 11, 12, 14])).verdict == "rises"
    flat = kv_costs.context_trend(rows_of([10, 10.02, 10.01, 10.03]))
    assert flat.verdict == "does not rise"  # steady and no difference: the claim would be contradicted
    with pytest.raises(AssertionError):
        check_claim("rises", flat, expect="rises")
    zigzag = kv_costs.context_trend(rows_of([10, 14, 11, 15]))  # steady points, but 128 -> 256 falls
    assert zigzag.verdict == TOO_NOISY and "fell where the context grew" in zigzag.why and "128 -> 256" in zigzag.why
    noisy = kv_costs.context_trend(rows_of([10, 11, 12, 12.5], NOISY_MS))
    assert noisy.verdict == TOO_NOISY


@pytest.mark.parametrize("rows, match", [([], "at least 2"), (rows_of([10, 11])[::-1], "increasing")])
def test_context_trend_refuses_bad_rows(rows, match):
    with pytest.raises(ValueError, match=match):
        kv_costs.context_trend(rows)


def sweep_clock(per_context_ms, rounds):
    """Durations in the sweep's order: round by round, each context in turn (round 0, the warm-up, included)."""
    return FakeClock([per_context_ms(r, i) for r in range(rounds + 1) for i in range(len(CONTEXTS))])


CONTEXTS = [8, 32, 64]


def test_sweep_on_a_steady_rising_clock_rises():
    model = tiny_model(seed=0)
    clock = sweep_clock(lambda r, i: 10 + 3 * i + 0.05 * (r % 3), rounds=5)
    rows = kv_costs.decode_latency_vs_context(model, CONTEXTS, steps=5, clock=clock)
    assert [r["ms"] for r in rows] == pytest.approx([10.05, 13.05, 16.05])
    assert all(r["verdict"] == STEADY for r in rows)
    assert kv_costs.context_trend(rows).verdict == "rises"


def test_sweep_on_a_noisy_clock_is_too_noisy():
    """The sweep's verdicts can fail: a timer whose readings jump (load that comes and goes) gives too noisy."""
    model = tiny_model(seed=0)
    clock = sweep_clock(lambda r, i: (10 + 0.5 * i) * (1, 2.5, 1.2, 3)[r % 4], rounds=8)
    rows = kv_costs.decode_latency_vs_context(model, CONTEXTS, steps=8, clock=clock)
    assert all(r["verdict"] == TOO_NOISY for r in rows)
    trend = kv_costs.context_trend(rows)
    assert trend.verdict == TOO_NOISY and "context 8:" in trend.why
    assert check_claim("rises", trend, expect="rises").startswith("rises: too noisy to conclude: rerun")


def test_sweep_refuses_too_few_steps_or_contexts():
    model = tiny_model(seed=0)
    with pytest.raises(ValueError, match="steps=1"):
        kv_costs.decode_latency_vs_context(model, CONTEXTS, steps=1)
    with pytest.raises(ValueError, match="contexts is empty"):
        kv_costs.decode_latency_vs_context(model, [], steps=3)


def test_reuse_ttft_rows_and_verdict():
    from tiny_models import prompt_ids
    model = tiny_model(seed=0)
    messages = [prompt_ids(1, n, seed=30 + n)[0].tolist() for n in (40, 8)]
    rows = kv_costs.reuse_ttft(model, messages, max_new_tokens=2, rounds=3)
    assert len(rows) == 6 and all(len(r["repeats"].samples_ms) == 3 for r in rows)
    assert all(r["ttft_ms"] == r["repeats"].median_ms and r["verdict"] in (STEADY, TOO_NOISY) for r in rows)
    v = kv_costs.reuse_verdict(rows, turn=2)
    assert v.verdict in ("slower", "faster", "same within noise", TOO_NOISY)
    with pytest.raises(ValueError, match="no row for turn 3"):
        kv_costs.reuse_verdict(rows, turn=3)
    with pytest.raises(ValueError, match="rounds=1"):
        kv_costs.reuse_ttft(model, messages, rounds=1)


def test_reuse_verdict_compares_the_modes_repeats():
    def row(turn, mode, samples):
        rep = summarize_ms(samples)
        return {"turn": turn, "mode": mode, "ttft_ms": rep.median_ms, "repeats": rep}

    rows = [row(2, "none", [50.0, 52, 51, 49, 50]), row(2, "contiguous", [10.0, 11, 10.5, 10.2, 10.4])]
    assert kv_costs.reuse_verdict(rows).verdict == "slower"  # no reuse is slower: reuse pays off
    rows[1] = row(2, "contiguous", [60.0, 61, 59, 60, 60.5])  # reuse slower than none on a steady machine
    with pytest.raises(AssertionError, match="not so"):
        check_claim("reuse cuts the TTFT", kv_costs.reuse_verdict(rows))


# -- the labs time on the chosen thread count ----------------------------------------------------------------------

TIMED_CALLS = {"generate", "count_tokens_through_model", "decode_latency_vs_context", "reuse_ttft", "quality_report",
               "say"}


def timed_calls_outside_threads(code: str) -> list[str]:
    """Names of the calls in TIMED_CALLS that are not inside a `with intra_op_threads(...)` block."""
    outside = []

    def visit(node, inside):
        if isinstance(node, ast.With) and any(isinstance(i.context_expr, ast.Call)
                                              and getattr(i.context_expr.func, "id", "") == "intra_op_threads"
                                              for i in node.items):
            inside = True
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in TIMED_CALLS and not inside:
                outside.append(name)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(code), False)
    return outside


@pytest.mark.parametrize("lab", ["00_tour.ipynb", "03_kv_cache.ipynb"])
def test_labs_time_the_model_inside_intra_op_threads(lab):
    cells = ["".join(c["source"]) for c in json.loads((LABS / lab).read_text(encoding="utf-8"))["cells"]
             if c["cell_type"] == "code"]
    assert any("threads = cpu_threads_for(" in c for c in cells)
    timed = [c for c in cells if any(f"{n}(" in c for n in TIMED_CALLS)]
    assert len(timed) >= 4
    for c in timed:
        assert timed_calls_outside_threads(c) == [], c.splitlines()[0]
    assert timed_calls_outside_threads("llm.generate('x')") == ["generate"]  # the check itself can fail


def test_intra_op_threads_restores_the_count_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with intra_op_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
