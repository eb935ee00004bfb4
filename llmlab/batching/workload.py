"""Serving workloads: requests that arrive over time, with prompt and output lengths drawn from a committed table.

A batch benchmark that hands the engine every request at once measures throughput only. A server meets requests as
they come: arrivals are random (a Poisson process at `rate` requests per second is the usual model: independent
arrivals, exponential gaps of mean 1 / rate), and lengths vary by orders of magnitude (a one-line chat answer next
to a 1,000-token essay, a 4K-token document to summarise). Both matter to batching: a static batch waits for its
longest request (padding, idle rows), continuous batching lets each request leave when it is done.

    trace = make_trace(n=64, rate=8.0, mix={"chat": 0.8, "long_document": 0.2}, seed=0, max_context=1024)
    trace[0]   # TraceRequest(arrival_s=0.12, prompt_len=96, max_new_tokens=64, kind='chat', id=0)

The lengths come from `data/workloads/request_lengths.json` (rows of prompt and output tokens with a weight, per
kind). `max_context` scales a row down to fit a model with a short context (the default model: 1,024 tokens),
keeping its prompt : output proportion, so the same trace shape runs on every model.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from llmlab import REPO_ROOT

__all__ = ["TraceRequest", "LENGTHS_FILE", "load_lengths", "poisson_arrivals", "make_trace", "trace_prompts"]

LENGTHS_FILE = REPO_ROOT / "data" / "workloads" / "request_lengths.json"


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives (seconds from the start), its prompt and output lengths (tokens),
    which kind of row it was drawn from, and its index in the trace."""

    arrival_s: float
    prompt_len: int
    max_new_tokens: int
    kind: str
    id: int


def load_lengths(path: str | Path | None = None) -> dict[str, list[dict]]:
    """{kind: [{"prompt", "output", "weight"}, ...]} from the lengths table (default `LENGTHS_FILE`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a row without positive integer prompt / output / weight.
    """
    path = Path(path) if path is not None else LENGTHS_FILE
    kinds = json.loads(path.read_text())["kinds"]
    for kind, rows in kinds.items():
        for row in rows:
            if not all(isinstance(row.get(k), int) and row[k] > 0 for k in ("prompt", "output", "weight")):
                raise ValueError(f"{path}: a {kind!r} row needs positive integers prompt, output, weight: {row}")
    return kinds


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds, increasing, the first after 0) of `n` requests of a Poisson process at `rate`
    requests per second: exponential gaps of mean 1 / rate. rate = math.inf: every request at time 0 (all at once).

    Raises:
        ValueError: rate not > 0, or n < 0.
    """
    if not rate > 0:
        raise ValueError(f"rate={rate!r}: the arrival rate must be > 0 requests per second (math.inf: all at once)")
    if n < 0:
        raise ValueError(f"n={n}: the number of requests must be >= 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def _fit(prompt: int, output: int, max_context: int | None) -> tuple[int, int]:
    """Scale a (prompt, output) pair down, keeping its proportion, so that prompt + output <= max_context."""
    if max_context is None or prompt + output <= max_context:
        return prompt, output
    scale = max_context / (prompt + output)
    return max(1, int(prompt * scale)), max(1, int(output * scale))


def make_trace(n: int, rate: float = math.inf, mix: dict[str, float] | None = None, seed: int = 0,
               max_context: int | None = None, lengths: dict[str, list[dict]] | None = None) -> list[TraceRequest]:
    """`n` requests arriving as a Poisson process at `rate` per second, each drawn from the lengths table.

    Args:
        n: number of requests (>= 0).
        rate: requests per second (math.inf, the default: all arrive at time 0, a batch).
        mix: {kind: share} of the table's kinds (default {"chat": 1.0}); shares are normalised.
        seed: the same seed gives the same trace (arrivals and lengths from separate streams, so changing the rate
            keeps the lengths).
        max_context: the model's context; longer rows are scaled down to fit (`_fit`).
        lengths: a table as `load_lengths` returns (default: the committed one).

    Raises:
        ValueError: a kind not in the table, a share < 0 or all zero, or a bad rate / n (`poisson_arrivals`).
    """
    table = lengths if lengths is not None else load_lengths()
    mix = {"chat": 1.0} if mix is None else dict(mix)
    unknown = set(mix) - set(table)
    if unknown:
        raise ValueError(f"mix names unknown kinds {sorted(unknown)}; the table has {sorted(table)}")
    if any(s < 0 for s in mix.values()) or not sum(mix.values()) > 0:
        raise ValueError(f"mix={mix}: shares must be >= 0 and not all zero")
    arrivals = poisson_arrivals(rate, n, seed)
    rng = random.Random(seed + 1_000_003)
    kinds, shares = list(mix), list(mix.values())
    trace = []
    for i, t in enumerate(arrivals):
        kind = rng.choices(kinds, weights=shares)[0]
        rows = table[kind]
        row = rng.choices(rows, weights=[r["weight"] for r in rows])[0]
        prompt, output = _fit(row["prompt"], row["output"], max_context)
        trace.append(TraceRequest(t, prompt, output, kind, i))
    return trace


def trace_prompts(trace: list[TraceRequest], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids for each request's prompt (seeded; the same trace and seed give the same prompts). Ids are
    drawn from 1..vocab_size-1 (0 is often a special token). A benchmark's timing does not depend on the text."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size}: need at least 2 token ids")
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(r.prompt_len)] for r in trace]
