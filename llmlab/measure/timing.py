"""Timing decode steps: CUDA events on a GPU, `time.perf_counter` on a CPU.

A GPU runs work asynchronously, so a host clock read right after a launch measures the launch, not the work.
CUDA events are recorded into the stream between the steps and read once at the end, so timing adds no host
synchronization of its own (https://pytorch.org/docs/stable/generated/torch.cuda.Event.html). On a CPU the work is
done when the call returns and the host clock is right.
"""

from __future__ import annotations

import contextlib
import os
import time

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
