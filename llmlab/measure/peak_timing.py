"""Timing a device's two peaks — a large device-to-device copy and a large matmul — and judging whether the machine
was quiet while they ran.

`time_copy` and `time_matmul` time repeated calls (CUDA events on a GPU, the host clock on a CPU, after an untimed
warm-up) and return a `Timing`: the work per call (bytes read + written, or FLOP), each repeat's seconds and, on a
Linux CPU, the share of the measuring threads' time spent waiting for a core another process held (schedstat).
`measure_copy_bandwidth` (GB/s) and `measure_matmul_tflops` (TFLOP/s) give the median rate alone.

A measurement taken while the machine is busy reads low, and every MBU or MFU computed against it reads high. So
`judge` gives each pair of timings a verdict, "steady" or "noisy" with its reasons: the repeats spread out (`spread`:
the median repeat well behind the fastest), the threads waited for a CPU (a steady load slows every repeat alike and
leaves no spread), or a GPU's copy reached under half its datasheet bandwidth. `llmlab.measure.peaks` measures again
while the verdict is noisy, and caches only steady peaks.

Sources: the STREAM "copy" convention of counting bytes read + bytes written (J. McCalpin,
https://www.cs.virginia.edu/stream/); Linux's /proc/<pid>/task/<tid>/schedstat (Documentation/scheduler/
sched-stats.rst: its second field is the time spent waiting on a runqueue).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

# A measurement is "noisy" (the machine looked busy) when any of these is exceeded; see `judge`.
MAX_SPREAD = 0.2  # `spread`; idle, it read 0-0.04 on an H200 and up to 0.13 on a 2-core CPU (2026-12-04)
MAX_CPU_WAIT = 0.1  # share of the measuring threads' time spent waiting for a CPU held by another process
MIN_DATASHEET_FRACTION = 0.5  # copy bandwidth vs the datasheet's (GPUs reach ~0.7-0.9)


def measured_device(device: str | torch.device | None) -> torch.device:
    """The device a peak is measured on: "cuda", "cuda:N", "cpu" or a torch.device; None = CUDA if available.

    Raises:
        ValueError: a device type other than cuda or cpu, or cuda where PyTorch sees no CUDA GPU.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {device} is not supported: llmlab.measure.peaks measures 'cuda' or 'cpu'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was requested but PyTorch sees no CUDA GPU here "
                         f"(torch.cuda.is_available() is False): measure the CPU (device='cpu') instead")
    return device


@dataclass(frozen=True)
class Timing:
    """One measurement's timed repeats.

    work: bytes moved (copy) or FLOP (matmul) per call; times_s: seconds of each timed call; cpu_wait: the share
    (0-1) of the measuring threads' time spent runnable but waiting for a CPU, warm-up included (None on a GPU or
    where Linux's /proc/<pid>/task/<tid>/schedstat is not available).
    """

    work: float
    times_s: tuple[float, ...]
    cpu_wait: float | None = None

    @property
    def rate(self) -> float:
        """work per second at the median time (bytes/s or FLOP/s)."""
        return self.work / statistics.median(self.times_s)

    @property
    def spread(self) -> float:
        """`spread(self.times_s)`."""
        return spread(self.times_s)


def spread(times_s) -> float:
    """How far the median repeat falls behind the fastest: 1 - min(times_s) / median(times_s), in [0, 1).

    0.03: the median call ran at 97% of the fastest one's rate. A busy machine slows some repeats and not others,
    so the spread grows; a single slow repeat does not move it. Raises ValueError for no times or a time <= 0.
    """
    times_s = list(times_s)
    if not times_s or min(times_s) <= 0:
        raise ValueError(f"spread needs positive times, got {times_s}")
    return 1.0 - min(times_s) / statistics.median(times_s)


def judge(copy: Timing, matmul: Timing, datasheet_bw_gb_s: float | None = None) -> tuple[str, tuple[str, ...]]:
    """The verdict on one measurement of both peaks: ("steady", ()) or ("noisy", reasons).

    Noisy when a spread exceeds MAX_SPREAD, when the measuring threads waited for a CPU more than MAX_CPU_WAIT of
    the time (another process had the cores: the copy then reads steadily low, with no spread to show it), or when
    the copy reaches less than MIN_DATASHEET_FRACTION of `datasheet_bw_gb_s` (GB/s; pass it for a GPU in
    DATASHEET only). Each reason is a short phrase, e.g. "copy spread 45%".
    """
    reasons = []
    for name, t in (("copy", copy), ("matmul", matmul)):
        if t.spread > MAX_SPREAD:
            reasons.append(f"{name} spread {t.spread:.0%}")
    waits = [t.cpu_wait for t in (copy, matmul) if t.cpu_wait is not None]
    if waits and max(waits) > MAX_CPU_WAIT:
        reasons.append(f"the measuring threads waited {max(waits):.0%} of the time for a CPU")
    if datasheet_bw_gb_s and copy.rate / 1e9 < MIN_DATASHEET_FRACTION * datasheet_bw_gb_s:
        reasons.append(f"copy {copy.rate / 1e9:.0f} GB/s is {copy.rate / 1e9 / datasheet_bw_gb_s:.0%} of the "
                       f"datasheet's {datasheet_bw_gb_s:.0f}")
    return ("noisy" if reasons else "steady"), tuple(reasons)


def _runqueue_wait_s() -> float | None:
    """Seconds this process's threads have waited, runnable, for a CPU (sum of field 2 of Linux's
    /proc/self/task/*/schedstat); None where that is not readable."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, found = 0, False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            found = True
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile, or no schedstat
            continue
    return total / 1e9 if found else None


def _time_repeats(fn, device: torch.device, repeats: int, warmup: int = 2,
                  warmup_s: float = 0.0) -> tuple[tuple[float, ...], float | None]:
    """Seconds of each of `repeats` timed calls of `fn()` (CUDA events on a GPU, perf_counter on a CPU), and on a
    CPU the share of the measuring threads' time spent waiting for a CPU (`Timing.cpu_wait`; None on a GPU).

    Untimed warm-up: at least `warmup` calls and at least `warmup_s` seconds (a GPU needs ~0.1 s to raise its
    clocks from idle).
    """
    wait0 = _runqueue_wait_s() if device.type == "cpu" else None
    t0 = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - t0 < warmup_s:
        fn()
        done += 1
        if device.type == "cuda" and done % 8 == 0:
            torch.cuda.synchronize(device)  # keep the host from queueing far ahead of the clock
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # ms -> s
    else:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    cpu_wait = None
    wait1 = _runqueue_wait_s() if wait0 is not None else None
    if wait1 is not None:
        wall = time.perf_counter() - t0
        cpu_wait = min(1.0, max(0.0, (wait1 - wait0) / (wall * torch.get_num_threads())))
    return tuple(times), cpu_wait


def _default_repeats(device: torch.device) -> int:
    return 10 if device.type == "cuda" else 5


def time_copy(device: str | torch.device | None = None, nbytes: int | None = None,
              repeats: int | None = None) -> Timing:
    """The repeats of `dst.copy_(src)` behind `measure_copy_bandwidth` (same arguments); work = 2 x nbytes."""
    device = measured_device(device)
    if nbytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            nbytes = min(2 << 30, free // 8)
        else:
            nbytes = 64 << 20
    repeats = repeats or _default_repeats(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times, wait = _time_repeats(lambda: dst.copy_(src), device, repeats,
                                warmup_s=0.25 if device.type == "cuda" else 0.0)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return Timing(moved, times, wait)


def measure_copy_bandwidth(device: str | torch.device | None = None, nbytes: int | None = None,
                           repeats: int | None = None) -> float:
    """Device-memory bandwidth (GB/s) of `dst.copy_(src)`, counting bytes read + bytes written (2 x nbytes).

    Args:
        device: "cuda", "cuda:1", "cpu", or None (CUDA if available).
        nbytes: size of each buffer; default 2 GiB on CUDA (capped at 1/8 of free memory), 64 MiB on CPU.
            On an H200: 256 MiB ~4000 GB/s, 1 GiB ~4140, 2 GiB and 4 GiB ~4220 (2026-11-30).
        repeats: timed copies (median reported); default 10 on CUDA, 5 on CPU. Untimed copies warm up first
            (>= 2, and >= 0.25 s on CUDA so the clocks are up).

    Raises ValueError for an unsupported device. Allocates 2 x nbytes (freed on return).
    """
    return time_copy(device, nbytes, repeats).rate / 1e9


def matmul_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the matmul peak: bf16 on CUDA (fp16 where bf16 is unsupported, e.g. T4), fp32 on a CPU."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def time_matmul(device: str | torch.device | None = None, n: int | None = None, dtype: torch.dtype | None = None,
                repeats: int | None = None) -> Timing:
    """The repeats of an n x n matmul behind `measure_matmul_tflops` (same arguments); work = 2 n^3 FLOP."""
    device = measured_device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    dtype = dtype or matmul_dtype(device)
    repeats = repeats or _default_repeats(device)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    times, wait = _time_repeats(lambda: torch.matmul(a, b, out=out), device, repeats,
                                warmup_s=0.25 if device.type == "cuda" else 0.0)
    return Timing(2 * n**3, times, wait)


def measure_matmul_tflops(device: str | torch.device | None = None, n: int | None = None,
                          dtype: torch.dtype | None = None, repeats: int | None = None) -> float:
    """Dense matmul rate (TFLOP/s) of an n x n @ n x n product: 2 n^3 FLOP / median time.

    Defaults: CUDA — n=8192 in bf16 (fp16 where bf16 is unsupported, e.g. T4), 10 repeats; CPU — n=1024 in fp32,
    5 repeats (~0.1-1 s in total on a laptop/CI core count).
    A large matmul is power-limited: on the course's H200 it read 625-770 TFLOP/s from run to run (SM clock
    dropping to ~1500 MHz at 600+ W), so treat the number as +-10%.
    Raises ValueError for an unsupported device.
    """
    return time_matmul(device, n, dtype, repeats).rate / 1e12
