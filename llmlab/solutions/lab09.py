"""Lab 09 (capstone): the check the notebook runs on the student's `best_rung(rows, max_ttft_ms)`.

The task: among a bench run's rows (`llmlab.measure.bench_file`: dicts with "step", "tokens_per_s", "ttft_ms", ...),
return the step name of the ladder rung with the most tokens/s whose TTFT is at most `max_ttft_ms`, or None when no
rung meets the limit. Rungs are the llmlab rows: not Hugging Face's peers (steps "hf_*", a different engine, not a
switch you can turn on) and not the roofline (step "roofline": a limit computed from the bandwidth, with no TTFT).
A TTFT exactly at the limit meets it.

`check_best_rung` runs the student's function on rows shaped like recorded runs (a chat ladder on an H200 with and
without its top rung, a CPU run where Hugging Face is fastest, a batch run where no rung meets the limit and one
where the batching rungs do) and, when the answers differ, names the common mistake they match (`WRONG_ANSWERS`:
the limit ignored, the peers or the roofline counted, < instead of <=, the lowest TTFT picked, TPOT read instead of
TTFT, the fastest rung returned when none qualifies) or the first case it got wrong, with the rows that decide it.
"""

from __future__ import annotations

import copy
from typing import Callable

from llmlab.measure.bench_file import result_row

__all__ = ["CASES", "WRONG_ANSWERS", "best_rung", "check_best_rung"]

_NOT_WRITTEN = ("best_rung is not written yet: replace the `raise NotImplementedError(...)` line with your answer "
                "(return a rung's step name, or None)")


def _is_rung(row: dict) -> bool:
    return row["step"] != "roofline" and not row["step"].startswith("hf_")


def best_rung(rows: list[dict], max_ttft_ms: float) -> str | None:
    """The step of the rung (not a peer 'hf_*', not the 'roofline') with the highest tokens_per_s among those with
    ttft_ms <= max_ttft_ms; None if no rung meets the limit. Rows without a TTFT never meet it. `rows` is not
    changed."""
    ok = [r for r in rows if _is_rung(r) and r["ttft_ms"] is not None and r["ttft_ms"] <= max_ttft_ms]
    return max(ok, key=lambda r: r["tokens_per_s"])["step"] if ok else None


def _rows(workload: str, table: list[tuple]) -> list[dict]:
    """Bench rows from (step, tokens/s, TTFT ms, TPOT ms); TTFT None for the roofline."""
    return [result_row(workload=workload, model="llama-3.2-1b", step=s, batch_size=1 if workload == "chat" else 64,
                       weights="bf16", tokens_per_s=tps, ttft_ms=ttft, tpot_ms_p50=tpot, tpot_ms_p90=tpot)
            for s, tps, ttft, tpot in table]


_CHAT = [("no_kv_cache", 84.4, 10.6, 10.5), ("eager", 88.4, 11.9, 10.8), ("+gpu_sampling", 55.5, 17.9, 18.4),
         ("+cuda_graphs", 395.0, 19.7, 2.46), ("+torch_compile", 588.2, 14.2, 1.65),
         ("+triton_kernels", 1098.4, 19.6, 0.84), ("+step_tuning", 1181.9, 20.0, 0.77),
         ("hf_eager", 66.2, 18.4, 15.9), ("hf_static", 354.0, 24.8, 2.79), ("roofline", 1690.9, None, 0.59)]
_CPU = [("no_kv_cache", 20.1, 45.8, 49.8), ("eager", 67.6, 58.3, 10.9), ("+int8", 69.7, 47.0, 11.8),
        ("+int4", 29.0, 75.7, 32.0), ("+static_batching", 68.2, 49.7, 11.9), ("+continuous_batching", 61.5, 63.3, 13.1),
        ("hf_eager", 75.0, 40.0, 21.6), ("hf_static", 72.0, 44.0, 23.3), ("roofline", 272.3, None, 3.67)]
_BATCH = [("eager", 958.0, 3186.0, 17.8), ("+cuda_graphs", 2849.8, 1090.9, 5.45),
          ("+torch_compile", 4269.5, 732.9, 3.57), ("+triton_kernels", 11921.7, 266.1, 1.19),
          ("+prefill_graphs", 12182.9, 253.7, 1.19),
          ("hf_eager", 3794.7, 162.1, 15.6), ("hf_static", 8021.0, 178.6, 6.47), ("roofline", 25075.7, None, 0.64)]
_BATCHING = [("+static_batching", 9050.0, 240.0, 6.9), ("+continuous_batching", 7010.0, 150.0, 8.8)]

# (what the run is, its rows, the TTFT limit in ms)
CASES: tuple[tuple[str, list[dict], float], ...] = (
    ("a chat ladder on an H200 without its prefill-graphs rung, TTFT <= 15 ms", _rows("chat", _CHAT), 15.0),
    ("the same ladder with its top rung, +prefill_graphs (TTFT 2.2 ms), TTFT <= 15 ms",
     _rows("chat", _CHAT[:7] + [("+prefill_graphs", 1288.0, 2.2, 0.77)] + _CHAT[7:]), 15.0),
    ("a CPU run where Hugging Face's generate is the fastest under the limit, TTFT <= 60 ms",
     _rows("chat", _CPU), 60.0),
    ("the same CPU run with a limit no rung meets, TTFT <= 11.5 ms", _rows("chat", _CPU), 11.5),
    ("a rung exactly at the limit, TTFT <= 15 ms",
     _rows("chat", [("eager", 90.0, 12.0, 10.5), ("+cuda_graphs", 400.0, 19.5, 2.4),
                    ("+torch_compile", 590.0, 15.0, 1.6), ("roofline", 1690.0, None, 0.59)]), 15.0),
    ("64 requests on an H200, no batching rungs: no rung meets TTFT <= 200 ms", _rows("batch", _BATCH), 200.0),
    ("64 requests with the batching rungs, TTFT <= 200 ms", _rows("batch", _BATCH[:5] + _BATCHING + _BATCH[5:]), 200.0),
    ("64 requests with the batching rungs, TTFT <= 300 ms", _rows("batch", _BATCH[:5] + _BATCHING + _BATCH[5:]), 300.0),
)


def _fastest(rows):
    return max(rows, key=lambda r: r["tokens_per_s"])["step"] if rows else None


# plausible wrong answers, each with the message that explains what it misses
WRONG_ANSWERS: tuple[tuple[Callable[[list[dict], float], str | None], str], ...] = (
    (lambda rows, lim: _fastest([r for r in rows if _is_rung(r)]),
     "your answer ignores the TTFT limit: it returns the fastest rung overall. Keep only the rungs whose ttft_ms is "
     "<= max_ttft_ms, then take the one with the most tokens/s (None if none is left): a user who waits longer "
     "than the limit for the first token is not served, however high the throughput"),
    (lambda rows, lim: _fastest([r for r in rows if r["step"] != "roofline" and r["ttft_ms"] <= lim]),
     "your answer counts Hugging Face's rows (steps 'hf_eager', 'hf_static'): they are the peers the ladder is "
     "compared with, a different engine, not a rung you can switch on. Skip steps that start with 'hf_'"),
    (lambda rows, lim: _fastest([r for r in rows if not r["step"].startswith("hf_")
                                 and (r["ttft_ms"] or 0.0) <= lim]),
     "your answer picks the 'roofline' row: it is the bandwidth limit, computed, not a configuration that ran (its "
     "ttft_ms is None). Skip it, and any row without a TTFT"),
    (lambda rows, lim: _fastest([r for r in rows if _is_rung(r) and r["ttft_ms"] < lim]),
     "a TTFT exactly at the limit meets it: keep ttft_ms <= max_ttft_ms, not <"),
    (lambda rows, lim: next(iter(sorted((r for r in rows if _is_rung(r) and r["ttft_ms"] <= lim),
                                        key=lambda r: r["ttft_ms"])), {"step": None})["step"],
     "your answer returns the rung with the LOWEST TTFT under the limit; the limit is a constraint, not the goal. "
     "Among the rungs that meet it, take the one with the most tokens/s"),
    (lambda rows, lim: _fastest([r for r in rows if _is_rung(r) and r["tpot_ms_p50"] <= lim]),
     "your answer compares the limit with tpot_ms_p50, the time per output token after the first; the limit is on "
     "the time to the FIRST token: compare ttft_ms"),
    (lambda rows, lim: best_rung(rows, lim) or _fastest([r for r in rows if _is_rung(r)]),
     "when no rung meets the limit, return None: the fastest rung does not serve this user either (it keeps them "
     "waiting past the limit)"),
)


def _call(fn, rows: list[dict], limit: float, what: str):
    """fn on a copy of `rows`, checking that it leaves them alone and returns a step name or None."""
    given = copy.deepcopy(rows)
    try:
        got = fn(given, limit)
    except NotImplementedError as e:
        raise AssertionError(_NOT_WRITTEN) from e
    except TypeError as e:
        raise AssertionError(
            f"{what}: best_rung raised TypeError ({e}). A row's ttft_ms can be None — the 'roofline' row has no TTFT "
            f"(it is a limit, not a run) — and None <= a number is an error: skip rows whose ttft_ms is None") from e
    if given != rows:
        raise AssertionError(f"{what}: best_rung changed `rows` (sorted them, removed or edited rows). The notebook "
                             f"uses the rows again after calling it: use sorted(...), max(...) or a new list instead")
    if isinstance(got, dict):
        raise AssertionError(f"{what}: best_rung returned a whole row; return its step name, row['step'] "
                             f"(e.g. '+torch_compile'), or None")
    if got is not None and not isinstance(got, str):
        raise AssertionError(f"{what}: best_rung returned {got!r} ({type(got).__name__}); return a step name (str), "
                             f"e.g. '+torch_compile', or None when no rung meets the limit")
    steps = [r["step"] for r in rows]
    if got is not None and got not in steps:
        raise AssertionError(f"{what}: best_rung returned {got!r}, which is not the step of any row "
                             f"({', '.join(steps)}); return None when no rung meets the limit")
    return got


def _show(rows: list[dict], limit: float) -> str:
    def ttft(r):
        return "no TTFT" if r["ttft_ms"] is None else f"TTFT {r['ttft_ms']:g} ms" + (" (over)" if r["ttft_ms"] > limit
                                                                                      else "")
    return "; ".join(f"{r['step']}: {r['tokens_per_s']:g} tok/s, {ttft(r)}" for r in rows)


def check_best_rung(fn: Callable[[list[dict], float], str | None]) -> None:
    """Check `fn(rows, max_ttft_ms) -> step name | None` against `best_rung` on `CASES`.

    Raises:
        AssertionError: the stub (NotImplementedError) is still there; fn changes its rows, raises TypeError on a row
            without a TTFT, or returns something that is not a row's step name or None; or its answers differ from
            the reference — the message names the common mistake they match (`WRONG_ANSWERS`), else the first case
            it got wrong, its rows and the right answer.
    """
    got = [_call(fn, rows, limit, what) for what, rows, limit in CASES]
    want = [best_rung(rows, limit) for _, rows, limit in CASES]
    if got == want:
        return
    for wrong, why in WRONG_ANSWERS:
        if got == [wrong(rows, limit) for _, rows, limit in CASES]:
            raise AssertionError(why)
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    what, rows, limit = CASES[i]
    raise AssertionError(f"{what}: your best_rung says {got[i]!r}, the answer is {want[i]!r}. The rows: "
                         f"{_show(rows, limit)}")
