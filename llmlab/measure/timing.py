"""Timing decode steps: CUDA events on a GPU, `time.perf_counter` on a CPU.

A GPU runs work asynchronously, so a host clock read right after a launch measures the launch, not the work.
CUDA events are recorded into the stream between the steps and read once at the end, so timing adds no host
synchronization of its own (https://pytorch.org/docs/stable/generated/torch.cuda.Event.html). On a CPU the work is
done when the call returns and the host clock is right.
"""

from __future__ import annotations

import time

import torch


def sync(device: torch.device | str) -> None:
    """Wait until the work queued on `device` has finished: `torch.cuda.synchronize` on a CUDA device, nothing on a
    CPU (there the work is done when the call returns). Read a host clock only after this."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
