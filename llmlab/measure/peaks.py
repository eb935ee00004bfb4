"""The device's limits — measured once and cached, next to the datasheet's — to judge a decode loop against.

MBU and MFU (`llmlab.measure.roofline`) divide by a peak. Two peaks are worth knowing:

* the datasheet's (H200 SXM: 4800 GB/s, 989 dense bf16 TFLOP/s) — what the hardware is sold as;
* the measured one — what a simple kernel actually reaches: a large device-to-device copy (bytes read +
  written) and a large bf16 matmul. On the course's H200 a one-off measurement for the course gave 4277 GB/s and
  804 TFLOP/s (an 8192^3 matmul), 89% and 81% of the datasheet; `measure_peaks` there gave 4085-4252 GB/s and 633-684
  TFLOP/s (its matmul is smaller; `data/bench/*.json` "peaks"). A decode step cannot beat the copy, so the
  measured bandwidth is the fair denominator.

`measure_peaks()` measures once per (device name, torch version) and caches the result in a JSON file
(`~/.cache/llmlab/peaks.json`, or `$XDG_CACHE_HOME/llmlab/peaks.json`; override with the `cache_path` argument
or the `LLMLAB_PEAKS_CACHE` environment variable). On a CPU it measures the same two things, sized down to run
in well under 2 s (fp32 matmul; bf16 matmul on CPUs is slow and unrepresentative).

Peaks measured while the machine is busy read low (a 2-core CPU: copy 17 GB/s with one core taken, 34-40 idle),
and make every MBU/MFU computed against them read high. So each measurement is judged (`judge`): "noisy" when its
repeats spread out (`spread`: the median repeat well behind the fastest), when on a CPU its threads waited for a
core another process held (Linux schedstat; a steady load slows every repeat alike and leaves no spread), or when
on a GPU in DATASHEET the copy reaches under half the datasheet's bandwidth; else "steady". A noisy measurement is
repeated (MAX_ATTEMPTS in all); if it stays noisy it is saved marked "noisy" and measured again on the next call.
Only steady entries are read back from the cache, until asked to measure again (`refresh=True`, `llmlab bench
--refresh-peaks`); entries of an older format (no "version", no verdict) are measured again.

Sources: NVIDIA datasheets (URLs in `DATASHEET`); the STREAM "copy" convention of counting bytes read + bytes
written (J. McCalpin, https://www.cs.virginia.edu/stream/); gpt-fast's measured-bandwidth reporting.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from llmlab.envinfo import device_name  # the cache is keyed by it (a CPU's model name and thread count)

# -- datasheet values --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet peaks: memory bandwidth (GB/s) and DENSE (no 2:4 sparsity) tensor-core TFLOP/s.

    bf16_tflops is None where the GPU has no bf16 tensor cores (T4). The fp16 figure is with fp32 accumulation,
    which is what PyTorch uses.
    """

    name: str
    bandwidth_gb_s: float
    bf16_tflops: float | None
    fp16_tflops: float
    source: str


_A100 = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (sparse figures halved)")
_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (datasheet; sparse figures halved)"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (datasheet; sparse figures halved)"
_ADA = "NVIDIA Ada GPU Architecture whitepaper v2.1, Appendix A (FP16/BF16 tensor, FP32 accumulate, dense)"

# Key: a regular expression matched (case-insensitive, first match wins, most specific first) against
# `torch.cuda.get_device_name()`, e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Tesla T4".
DATASHEET: dict[str, GpuSpec] = {
    r"(?<!G)H200 NVL": GpuSpec("H200 NVL", 4800, 835, 835, _H200),
    r"(?<!G)H200": GpuSpec("H200 SXM", 4800, 989, 989, _H200),
    r"H100 NVL": GpuSpec("H100 NVL", 3900, 835, 835, _H100),
    r"H100 PCIe": GpuSpec("H100 PCIe", 2000, 756, 756, _H100),
    r"H100": GpuSpec("H100 SXM", 3350, 989, 989, _H100),
    r"A100.*80\s?GB.*PCIe|A100.*PCIe.*80\s?GB": GpuSpec("A100 80GB PCIe", 1935, 312, 312, _A100),
    r"A100.*80\s?GB": GpuSpec("A100 80GB SXM", 2039, 312, 312, _A100),
    r"A100.*PCIe": GpuSpec("A100 40GB PCIe", 1555, 312, 312, _A100),
    r"A100": GpuSpec("A100 40GB SXM", 1555, 312, 312, _A100),
    r"\bL4\b": GpuSpec("L4", 300, 121, 121, "https://www.nvidia.com/en-us/data-center/l4/ (sparse figures halved)"),
    r"\bT4\b": GpuSpec("T4", 320, None, 65, "https://www.nvidia.com/en-us/data-center/tesla-t4/ (mixed precision)"),
    r"RTX 4090": GpuSpec("GeForce RTX 4090", 1008, 165.2, 165.2, _ADA),
}


def datasheet_for(device_name: str) -> GpuSpec | None:
    """The datasheet entry whose pattern matches `device_name` (e.g. `torch.cuda.get_device_name()`), or None.

    Matching is by substring, most specific first: "NVIDIA H200 NVL" -> H200 NVL, "NVIDIA H200" -> H200 SXM,
    "NVIDIA A100-SXM4-80GB" -> A100 80GB SXM, "NVIDIA L40S" -> None (L4 only matches as a whole word),
    "NVIDIA GH200 480GB" -> None (a Grace Hopper superchip, not an H200).
    An SXM part and its PCIe variant can share a name prefix; unlisted variants fall back to the SXM figures.
    """
    for pattern, spec in DATASHEET.items():
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return spec
    return None


# -- measurement -------------------------------------------------------------------------------------------------

# A measurement is "noisy" (the machine looked busy) when any of these is exceeded; see `judge`.
MAX_SPREAD = 0.2  # `spread`; idle, it read 0-0.04 on an H200 and up to 0.13 on a 2-core CPU (2026-12-04)
MAX_CPU_WAIT = 0.1  # share of the measuring threads' time spent waiting for a CPU held by another process
MIN_DATASHEET_FRACTION = 0.5  # copy bandwidth vs the datasheet's (GPUs reach ~0.7-0.9)
MAX_ATTEMPTS = 3  # measurements per `measure_peaks` call while they stay noisy
RETRY_PAUSE_S = 0.5  # pause before measuring again
CACHE_VERSION = 2  # of a cache entry; entries without "version" (format 1) had no verdict and are measured again


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {device} is not supported: llmlab.measure.peaks measures 'cuda' or 'cpu'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch.cuda.is_available() is False")
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
    device = _device(device)
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


def _matmul_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def time_matmul(device: str | torch.device | None = None, n: int | None = None, dtype: torch.dtype | None = None,
                repeats: int | None = None) -> Timing:
    """The repeats of an n x n matmul behind `measure_matmul_tflops` (same arguments); work = 2 n^3 FLOP."""
    device = _device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    dtype = dtype or _matmul_dtype(device)
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


# -- the cached record -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peaks:
    """What `measure_peaks` returns: measured peaks of one device, with the datasheet's where known.

    Fields: device_name; torch_version; copy_bw_gb_s (measured, read + written, GB/s); matmul_tflops (measured,
    TFLOP/s, in matmul_dtype); matmul_dtype ("bfloat16", "float32", ...); measured_at (ISO time, UTC);
    datasheet_bw_gb_s and datasheet_tflops (dense bf16, or fp16 if no bf16; None if the device is not in
    DATASHEET or is a CPU); cached (True if read from the cache file rather than measured now); cache_path (the
    file they were read from or saved to; None if measured but not saved, the file could not be written).
    `source()` says which, in words.

    How far to trust them (`judge`; None where not judged, e.g. a hand-made Peaks): copy_spread and matmul_spread
    (`spread` of the kept attempt's repeats); repeats (timed calls per measurement); cpu_wait (the larger of the two
    measurements' `Timing.cpu_wait`); attempts (measurements made, at most MAX_ATTEMPTS); verdict ("steady" or
    "noisy"); noise_reasons (`judge`'s reasons, empty when steady). `trust()` says it in words.
    """

    device_name: str
    torch_version: str
    copy_bw_gb_s: float
    matmul_tflops: float
    matmul_dtype: str
    measured_at: str
    datasheet_bw_gb_s: float | None = None
    datasheet_tflops: float | None = None
    cached: bool = False
    cache_path: str | None = None
    copy_spread: float | None = None
    matmul_spread: float | None = None
    repeats: int | None = None
    cpu_wait: float | None = None
    attempts: int | None = None
    verdict: str | None = None
    noise_reasons: tuple[str, ...] = ()

    @property
    def steady(self) -> bool:
        """True when judged steady; False when noisy or not judged."""
        return self.verdict == "steady"

    def source(self) -> str:
        """Where the numbers come from, for a printed line: "read from <file> (measured <measured_at>)",
        "measured now, saved to <file>" (+ " marked noisy: measured again next time" when noisy), or "measured now
        (not saved: the cache file could not be written)"."""
        if self.cached:
            return f"read from {self.cache_path} (measured {self.measured_at})"
        if self.cache_path is None:
            return "measured now (not saved: the cache file could not be written)"
        noisy = " marked noisy: measured again next time" if self.verdict == "noisy" else ""
        return f"measured now, saved to {self.cache_path}{noisy}"

    def trust(self) -> str:
        """How far to trust the numbers, for a printed line; "" when not judged (verdict None). E.g.
        "spread 2% (copy), 1% (matmul) over 5 repeats: steady", or "spread 60% (copy), 9% (matmul) over 5
        repeats, 3 attempts: noisy (copy spread 60%): the machine looks busy, MBU and MFU may read high; measure
        again when it is idle"."""
        if self.verdict is None:
            return ""

        def pct(x):
            return "?" if x is None else f"{x:.0%}"

        text = f"spread {pct(self.copy_spread)} (copy), {pct(self.matmul_spread)} (matmul) over {self.repeats} repeats"
        if self.attempts and self.attempts > 1:
            text += f", {self.attempts} attempts"
        if self.steady:
            return text + ": steady"
        why = f" ({'; '.join(self.noise_reasons)})" if self.noise_reasons else ""
        return (f"{text}: {self.verdict}{why}: the machine looks busy, MBU and MFU may read high; measure again when "
                f"it is idle")


def default_cache_path() -> Path:
    """`$LLMLAB_PEAKS_CACHE`, else `$XDG_CACHE_HOME/llmlab/peaks.json`, else `~/.cache/llmlab/peaks.json`."""
    if os.environ.get("LLMLAB_PEAKS_CACHE"):
        return Path(os.environ["LLMLAB_PEAKS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmlab" / "peaks.json"


def _cache_key(name: str) -> str:
    return f"{name} | torch {torch.__version__}"


def _read_cache(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # missing or corrupt: measure again
        return {}


def _write_cache(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".peaks-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    except BaseException:
        os.unlink(tmp)
        raise


_STORED = [f.name for f in fields(Peaks) if f.name not in ("cached", "cache_path")]


def _trusted_entry(entry, path: Path) -> Peaks | None:
    """The cache entry as a Peaks (cached=True), or None when it is to be measured again: not a steady
    format-2 entry, or missing a field."""
    if not isinstance(entry, dict) or not isinstance(entry.get("version"), int) or entry["version"] < CACHE_VERSION:
        return None
    if entry.get("verdict") != "steady":
        return None
    try:
        p = Peaks(**{k: entry[k] for k in _STORED if k in entry}, cached=True, cache_path=str(path))
    except TypeError:  # a required field is missing
        return None
    return replace(p, noise_reasons=tuple(p.noise_reasons))


def _measure(device: torch.device, name: str) -> Peaks:
    """Up to MAX_ATTEMPTS measurements (RETRY_PAUSE_S apart) until one is steady; else the one with the highest
    copy rate, marked noisy."""
    sheet = datasheet_for(name) if device.type == "cuda" else None
    # a MIG slice has a share of the GPU's bandwidth: no datasheet bound for it
    bound = sheet.bandwidth_gb_s if sheet and not re.search(r"\bMIG\b", name) else None
    dtype = _matmul_dtype(device)
    tried = []
    for attempt in range(MAX_ATTEMPTS):
        if attempt:
            time.sleep(RETRY_PAUSE_S)
        copy, matmul = time_copy(device), time_matmul(device, dtype=dtype)
        verdict, reasons = judge(copy, matmul, bound)
        tried.append((copy, matmul, verdict, reasons))
        if verdict == "steady":
            break
    copy, matmul, verdict, reasons = tried[-1] if verdict == "steady" else max(tried, key=lambda t: t[0].rate)
    waits = [t.cpu_wait for t in (copy, matmul) if t.cpu_wait is not None]
    return Peaks(
        device_name=name,
        torch_version=torch.__version__,
        copy_bw_gb_s=copy.rate / 1e9,
        matmul_tflops=matmul.rate / 1e12,
        matmul_dtype=str(dtype).removeprefix("torch."),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        datasheet_bw_gb_s=sheet.bandwidth_gb_s if sheet else None,
        datasheet_tflops=(sheet.bf16_tflops or sheet.fp16_tflops) if sheet else None,
        copy_spread=copy.spread,
        matmul_spread=matmul.spread,
        repeats=len(copy.times_s),
        cpu_wait=max(waits) if waits else None,
        attempts=len(tried),
        verdict=verdict,
        noise_reasons=reasons,
    )


def measure_peaks(device: str | torch.device | None = None, cache_path: str | os.PathLike | None = None,
                  refresh: bool = False) -> Peaks:
    """Measured copy bandwidth and matmul rate of `device`, cached per (device name, torch version).

    Args:
        device: "cuda", "cuda:N", "cpu", or None (CUDA if available).
        cache_path: the JSON cache file; default `default_cache_path()`. Several devices share one file.
        refresh: measure again even if cached, and overwrite the entry.

    Returns a `Peaks` (cached=True when read from the file; cache_path names the file, see `Peaks.source`;
    `Peaks.trust` says how steady the measurement was). Only a steady entry is read back: a noisy one, or one
    written by an older llmlab (no verdict), is measured again. A noisy measurement is measured again up to
    MAX_ATTEMPTS times in all; if it stays noisy, the attempt with the highest copy rate is returned and saved
    with verdict "noisy". The first call takes ~1 s on an H200, well under 1 s on an idle CPU (up to ~2.5 s
    while the machine is busy). A missing or corrupt cache file is (re)written; an unwritable one only loses the
    caching.
    Raises ValueError for an unsupported device.
    """
    device = _device(device)
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    name = device_name(device)
    key = _cache_key(name)
    if not refresh:
        cached = _trusted_entry(_read_cache(path).get(key), path)
        if cached is not None:
            return cached
    peaks = _measure(device, name)
    record = {k: v for k, v in asdict(peaks).items() if k in _STORED}
    record["version"] = CACHE_VERSION
    cache = _read_cache(path)  # re-read: another process may have added a device meanwhile
    cache[key] = record
    try:
        _write_cache(path, cache)
    except OSError:
        return peaks
    return replace(peaks, cache_path=str(path))
