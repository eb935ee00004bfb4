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
and make every MBU/MFU computed against them read high. So each measurement is timed and judged by
`llmlab.measure.peak_timing` (`time_copy`, `time_matmul`, `judge`): "noisy" when its repeats spread out, when on a
CPU its threads waited for a core another process held, or when on a GPU in DATASHEET the copy reaches under half
the datasheet's bandwidth; else "steady". A noisy measurement is repeated (MAX_ATTEMPTS in all); if it stays noisy
it is saved marked "noisy" and measured again on the next call. Only steady entries are read back from the cache,
until asked to measure again (`refresh=True`, `llmlab bench --refresh-peaks`); entries of an older format (no
"version", no verdict) are measured again.

This module keeps the datasheet, the retries and the cache; the timing, `judge` and the thresholds it uses are
importable from here as before.

Sources: NVIDIA datasheets (URLs in `DATASHEET`); the STREAM "copy" convention of counting bytes read + bytes
written (J. McCalpin, https://www.cs.virginia.edu/stream/); gpt-fast's measured-bandwidth reporting.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from llmlab.envinfo import device_name  # the cache is keyed by it (a CPU's model name and thread count)

# The timing and its verdict live in llmlab.measure.peak_timing; callers (tests, the labs, the README) still reach
# all of these through this module, and some are used only by them (F401). `_measure` calls time_copy and
# time_matmul through this module's names, so replacing them here (the tests' stand-in machine) replaces what
# measure_peaks times.
from llmlab.measure.peak_timing import (  # noqa: F401
    MAX_CPU_WAIT,
    MAX_SPREAD,
    MIN_DATASHEET_FRACTION,
    Timing,
    judge,
    matmul_dtype,
    measure_copy_bandwidth,
    measure_matmul_tflops,
    measured_device,
    spread,
    time_copy,
    time_matmul,
)

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


# -- the cached record -------------------------------------------------------------------------------------------

MAX_ATTEMPTS = 3  # measurements per `measure_peaks` call while they stay noisy
RETRY_PAUSE_S = 0.5  # pause before measuring again
CACHE_VERSION = 2  # of a cache entry; entries without "version" (format 1) had no verdict and are measured again


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
    dtype = matmul_dtype(device)
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
    device = measured_device(device)
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
