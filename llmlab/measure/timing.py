"""Timing decode steps: CUDA events on a GPU, `time.perf_counter` on a CPU.

A GPU runs work asynchronously, so a host clock read right after a launch measures the launch, not the work.
CUDA events are recorded into the stream between the steps and read once at the end, so timing adds no host
synchronization of its own (https://pytorch.org/docs/stable/generated/torch.cuda.Event.html). On a CPU the work is
done when the call returns and the host clock is right.

On a machine shared with other work a single timing can be far off, so a claim such as "A is slower than B" is made
from repeats: `summarize_ms` reduces repeated timings to their median and spread and gives a verdict, "steady" or
"too noisy to conclude: rerun"; `compare_ms` says whether one set of repeats is slower than another beyond that
spread; `check_claim` turns such a comparison into the line a lab prints, and fails only when a steady measurement
contradicts the claim; `time_repeats` times a function that way (injectable clock, so the verdict logic can be
tested).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

SMALL_CPU_MODEL = 50e6  # parameters below which a CPU decode runs on one intra-op thread (`cpu_threads_for`)


def sync(device: torch.device | str) -> None:
    """Wait until the work queued on `device` has finished: `torch.cuda.synchronize` on a CUDA device, nothing on a
    CPU (there the work is done when the call returns). Read a host clock only after this."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_threads_for(device: torch.device | str, n_params: float) -> int | None:
    """How many intra-op threads to time a model with: 1 for a small model (< SMALL_CPU_MODEL parameters) on a CPU,
    unless OMP_NUM_THREADS is set; None (torch's default, one per core) otherwise. A small model's matrices are
    too small to split: waking the other threads costs more than they save, and on a core shared with other work
    every step waits for the slowest thread (a 2-core machine with one core busy decoded ~10x slower on two
    threads than on one)."""
    if torch.device(device).type != "cpu" or n_params >= SMALL_CPU_MODEL or os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block with torch's intra-op thread count set to n (None: left as it is); restored afterwards."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class StepTimer:
    """Marks the boundaries between steps and reports each step's duration in milliseconds.

    Usage: `t = StepTimer(device); t.start(); ...; t.mark()  # after each step; ...; t.step_ms()`.
    Step i runs from boundary i to boundary i+1, so the steps add up to the whole run, gaps included.
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [self._now()]

    def mark(self) -> None:
        self._marks.append(self._now())

    def step_ms(self) -> list[float]:
        """Durations (ms) of the marked steps; on CUDA waits for the last event first."""
        m = self._marks
        if self.cuda:
            if m:
                m[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(m, m[1:])]
        return [(b - a) * 1e3 for a, b in zip(m, m[1:])]


# Repeated timings: median, spread, verdict.
MAX_SPREAD = 0.2  # `Repeats.spread` above which repeats are "too noisy to conclude"; see `summarize_ms`
STEADY = "steady"
TOO_NOISY = "too noisy to conclude: rerun"


def machine_load_note() -> str:
    """A phrase on how busy the machine is, for the reason of a noisy verdict: e.g. "the load average is 4.8 on 2
    CPUs: other programs are using this machine"; "" where the load average is not available (Windows) or is below
    the number of CPUs."""
    try:
        load = os.getloadavg()[0]  # runnable processes, averaged over the last minute
    except (AttributeError, OSError):
        return ""
    cpus = os.cpu_count() or 1
    if load < cpus:
        return ""
    plural = "s" if cpus != 1 else ""
    return f"the load average is {load:.1f} on {cpus} CPU{plural}: other programs are using this machine"


@dataclass(frozen=True)
class Repeats:
    """Repeated timings of one thing, reduced by `summarize_ms`.

    samples_ms: each repeat (ms, in the order taken); median_ms: their median; low_ms, high_ms: the lower and upper
    quartiles (the middle half of the repeats lies between them); spread: (high_ms - low_ms) / median_ms;
    verdict: STEADY when spread <= max_spread, else TOO_NOISY.
    """

    samples_ms: tuple[float, ...]
    median_ms: float
    low_ms: float
    high_ms: float
    spread: float
    max_spread: float
    verdict: str

    @property
    def steady(self) -> bool:
        return self.verdict == STEADY

    @property
    def why(self) -> str:
        """"" when steady; else why the median cannot be trusted (the spread against its limit, and the machine's
        load where that tells more)."""
        if self.steady:
            return ""
        load = machine_load_note()
        return (f"the middle half of {len(self.samples_ms)} repeats spans {self.spread:.0%} of the median "
                f"({self.low_ms:.2f}-{self.high_ms:.2f} ms around {self.median_ms:.2f} ms; steady is at most "
                f"{self.max_spread:.0%})" + (f"; {load}" if load else ""))

    def __str__(self) -> str:
        return f"{self.median_ms:.2f} ms (spread {self.spread:.0%}, {self.verdict})"


def summarize_ms(samples_ms, max_spread: float = MAX_SPREAD) -> Repeats:
    """Median, quartiles, spread and verdict of repeated timings (ms).

    The spread is the interquartile range over the median: the middle half of the repeats, so one slow repeat (a
    page fault, a moment when another program held the core) does not move it, while a machine whose load comes
    and goes scatters the repeats and widens it. With fewer than 4 repeats the quartiles interpolate between the
    fastest, the median and the slowest. A verdict of TOO_NOISY means the median is not a number to rank or
    compare things by: rerun on a quieter machine, or with more repeats. (The quartiles and the interquartile range
    are those of Tukey's box plot: J. W. Tukey, Exploratory Data Analysis, 1977.)

    Raises:
        ValueError: fewer than 2 samples (one timing has no spread: repeat it), a sample that is not a positive
            finite number, or max_spread not > 0.
    """
    samples = tuple(float(t) for t in samples_ms)
    if len(samples) < 2:
        raise ValueError(f"samples_ms has {len(samples)} timing(s): give at least 2 repeats (5 or more to judge "
                         f"a busy machine), since one timing says nothing about the noise")
    if not all(0 < t < float("inf") for t in samples):
        raise ValueError(f"samples_ms={list(samples)}: every timing must be a positive finite number of ms")
    if not max_spread > 0:
        raise ValueError(f"max_spread={max_spread!r}: give the largest spread (> 0, e.g. 0.2 for 20%) still "
                         f"called steady")
    low, median, high = statistics.quantiles(samples, n=4, method="inclusive")
    spread = (high - low) / median
    return Repeats(samples, median, low, high, spread, max_spread, STEADY if spread <= max_spread else TOO_NOISY)


@dataclass(frozen=True)
class Comparison:
    """`compare_ms(a, b)`: ratio = a.median_ms / b.median_ms; verdict: "slower" (a is slower than b beyond the
    noise), "faster", "same within noise", or TOO_NOISY; why: the evidence, one sentence."""

    ratio: float
    verdict: str
    why: str

    @property
    def conclusive(self) -> bool:
        return self.verdict != TOO_NOISY


def compare_ms(a: Repeats, b: Repeats, a_name: str = "a", b_name: str = "b") -> Comparison:
    """Is `a` slower than `b`, beyond the noise of their repeats?

    "slower": the middle halves of the repeats do not overlap and a's is above b's (a.low_ms > b.high_ms): even a's
    fast repeats are slower than b's slow ones, however scattered each set is; "faster" the other way round. When
    the middle halves overlap: "same within noise" if both sets are steady (the difference, if any, is smaller than
    the machine's noise), TOO_NOISY if either is not (a real difference could be hidden: `Repeats.why` says which
    and why). a_name, b_name name them in `why`. Two boxes of a box plot that do not overlap is a stricter form of
    the notched box plot's test of two medians (McGill, Tukey & Larsen, "Variations of Box Plots", 1978).
    """
    ratio = a.median_ms / b.median_ms
    ranges = (f"{a_name} {a.low_ms:.2f}-{a.high_ms:.2f} ms, {b_name} {b.low_ms:.2f}-{b.high_ms:.2f} ms "
              f"(middle half of the repeats)")
    if a.low_ms > b.high_ms or a.high_ms < b.low_ms:
        verdict = "slower" if a.low_ms > b.high_ms else "faster"
        return Comparison(ratio, verdict, f"{a_name} {a.median_ms:.2f} ms = {ratio:.2f}x {b_name} "
                                          f"{b.median_ms:.2f} ms; the middle halves of their repeats do not overlap: "
                                          f"{ranges}")
    noisy = [(n, r) for n, r in ((a_name, a), (b_name, b)) if not r.steady]
    if noisy:
        return Comparison(ratio, TOO_NOISY, f"the repeats overlap ({ranges}) and are scattered: "
                          + "; ".join(f"{n}: {r.why}" for n, r in noisy))
    return Comparison(ratio, "same within noise", f"the repeats overlap: {ranges}")


def check_claim(claim: str, comparison: Comparison, expect: str = "slower") -> str:
    """Check a lab's claim against a measured comparison; return the line to print.

    claim: the statement, e.g. "step time rises with the context"; comparison: from `compare_ms` (or a check built on
    it, such as `llmlab.measure.kv_costs.context_trend`); expect: the verdict that confirms the claim.
    Returns "<claim>: yes (<why>)" when the verdict is `expect`, and "<claim>: too noisy to conclude:
    rerun (<why>)" when it is TOO_NOISY: then the machine, not the claim, is in question.

    Raises:
        AssertionError: the verdict is conclusive and not `expect`: a measurement steady enough to judge
            contradicts the claim.
    """
    if comparison.verdict == expect:
        return f"{claim}: yes ({comparison.why})"
    if comparison.verdict == TOO_NOISY:
        return f"{claim}: {TOO_NOISY} ({comparison.why})"
    raise AssertionError(f"{claim}: not so on this measurement, which is steady enough to judge: "
                         f"{comparison.verdict} ({comparison.why})")


def time_repeats(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, device: torch.device | str = "cpu",
                 max_spread: float = MAX_SPREAD, clock: Callable[[], float] = time.perf_counter) -> Repeats:
    """Call `fn()` `warmup` times untimed, then `repeats` times timed; `summarize_ms` of the times (ms).

    device: where fn's work runs; on CUDA each call is followed by `sync` so the clock sees the work, not the
    launch. clock: seconds (the default, time.perf_counter); a test can pass a fake one.

    Raises:
        ValueError: repeats not a whole number >= 2, warmup not a whole number >= 0, and as `summarize_ms`.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"repeats={repeats!r}: time at least 2 repeats (a whole number; 5 or more on a busy machine)")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: give a whole number of untimed calls >= 0")
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        sync(device)
        times.append((clock() - t0) * 1e3)
    return summarize_ms(times, max_spread)
