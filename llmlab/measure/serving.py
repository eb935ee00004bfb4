"""Serving metrics: what a server's users and its owner see, from per-request timestamps.

For each request the engine records when it arrived, when it was admitted into the running batch, when its first
token came out and when it finished, and how many tokens it produced. From those:

    queueing delay  admitted - arrived: waiting for a batch slot or for free KV blocks
    TTFT            first token - arrived: queueing + prefill (what a chat user feels before any text appears)
    TPOT            (finished - first token) / (tokens - 1): the time per output token after the first
    tokens/s        all output tokens / the run's wall time (the owner's throughput); requests/s likewise

Tail latency matters more than the mean for a service, so each latency is reported at p50, p90 and p99. Continuous
batching trades a little TPOT (bigger batches make each step slower) for much better TTFT and throughput; the
throughput-latency curve (`curve_point` at several arrival rates) shows where a configuration saturates: past that
rate the queue grows without bound and TTFT with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

__all__ = ["RequestTimes", "percentile", "summarize", "curve_point"]


@dataclass(frozen=True)
class RequestTimes:
    """One request's timeline (seconds on one clock) and output length. `admitted_s` / `first_token_s` /
    `finished_s` are None for a request that never got that far (cancelled, or still running)."""

    arrival_s: float
    admitted_s: float | None
    first_token_s: float | None
    finished_s: float | None
    tokens: int

    @property
    def queueing_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finished_s is None or self.first_token_s is None or self.tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.tokens - 1)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between the two nearest ranks (numpy's default);
    None for no values.

    Raises:
        ValueError: q outside 0..100, or a NaN value.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q={q}: a percentile is between 0 and 100")
    xs = sorted(values)
    if any(math.isnan(x) for x in xs):
        raise ValueError("percentile: the values hold a NaN")
    if not xs:
        return None
    rank = (len(xs) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _tails(name: str, values: list[float]) -> dict:
    """{name_p50, name_p90, name_p99} in milliseconds (None when no request has the value)."""
    return {f"{name}_ms_p{q}": (None if (p := percentile(values, q)) is None else 1e3 * p) for q in (50, 90, 99)}


def summarize(requests: list[RequestTimes], wall_s: float) -> dict:
    """The run's serving metrics: requests (finished / total), tokens, tokens/s, requests/s, and p50 / p90 / p99
    of queueing delay, TTFT and TPOT in milliseconds.

    Args:
        requests: every request of the run (unfinished ones count in `requests` but not in the rates).
        wall_s: the run's wall time in seconds, first arrival to last finish (> 0).

    Raises:
        ValueError: wall_s not > 0.
    """
    if not wall_s > 0:
        raise ValueError(f"wall_s={wall_s!r}: the run's wall time must be > 0 seconds")
    done = [r for r in requests if r.finished_s is not None]
    tokens = sum(r.tokens for r in done)
    out = {"requests": len(requests), "finished": len(done), "tokens": tokens, "wall_s": wall_s,
           "tokens_per_s": tokens / wall_s, "requests_per_s": len(done) / wall_s}
    out.update(_tails("queueing", [r.queueing_s for r in requests if r.queueing_s is not None]))
    out.update(_tails("ttft", [r.ttft_s for r in requests if r.ttft_s is not None]))
    out.update(_tails("tpot", [r.tpot_s for r in done if r.tpot_s is not None]))
    return out


def curve_point(rate: float, requests: list[RequestTimes], wall_s: float) -> dict:
    """One point of the throughput-latency curve: the offered arrival rate (requests/s) with `summarize`'s
    metrics of the run at that rate."""
    return {"rate": rate, **summarize(requests, wall_s)}
