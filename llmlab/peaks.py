"""The device's limits — measured once and cached, next to the datasheet's — to judge a decode loop against.

MBU and MFU (`llmlab.roofline`) divide by a peak. Two peaks are worth knowing:

* the datasheet's (H200 SXM: 4800 GB/s, 989 dense bf16 TFLOP/s) — what the hardware is sold as;
* the measured one — what a simple kernel actually reaches: a large device-to-device copy (bytes read +
  written) and a large bf16 matmul. On the course's H200 a one-off measurement for the course gave 4277 GB/s and
  804 TFLOP/s (an 8192^3 matmul), 89% and 81% of the datasheet; `measure_peaks` there gave 4085-4252 GB/s and 633-684
  TFLOP/s (its matmul is smaller; `data/bench/*.json` "peaks"). A decode step cannot beat the copy, so the
  measured bandwidth is the fair denominator.

`measure_peaks()` measures once per (device name, torch version) and caches the result in a JSON file
(`~/.cache/llmlab/peaks.json`, or `$XDG_CACHE_HOME/llmlab/peaks.json`; override with the `cache_path` argument
or the `LLMLAB_PEAKS_CACHE` environment variable). On a CPU it measures the same two things, sized down to run
in well under 2 s (fp32 matmul; bf16 matmul on CPUs is slow and unrepresentative). The cached numbers are
kept until asked to measure again (`refresh=True`, `llmlab bench --refresh-peaks`): peaks measured while the
machine was busy read low, and make every MBU/MFU computed against them read high.

Sources: NVIDIA datasheets (URLs in `DATASHEET`); the STREAM "copy" convention of counting bytes read + bytes
written (J. McCalpin, https://www.cs.virginia.edu/stream/); gpt-fast's measured-bandwidth reporting.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

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


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {device} is not supported: llmlab.peaks measures 'cuda' or 'cpu'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch.cuda.is_available() is False")
    return device


def _median_time_s(fn, device: torch.device, repeats: int, warmup: int = 2, warmup_s: float = 0.0) -> float:
    """Median seconds of `fn()` over `repeats` timed calls: CUDA events on a GPU, perf_counter on a CPU.

    Untimed warm-up: at least `warmup` calls and at least `warmup_s` seconds (a GPU needs ~0.1 s to raise its
    clocks from idle).
    """
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
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    device = _device(device)
    if nbytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            nbytes = min(2 << 30, free // 8)
        else:
            nbytes = 64 << 20
    repeats = repeats or (10 if device.type == "cuda" else 5)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = _median_time_s(lambda: dst.copy_(src), device, repeats, warmup_s=0.25 if device.type == "cuda" else 0.0)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return moved / t / 1e9


def measure_matmul_tflops(device: str | torch.device | None = None, n: int | None = None,
                          dtype: torch.dtype | None = None, repeats: int | None = None) -> float:
    """Dense matmul rate (TFLOP/s) of an n x n @ n x n product: 2 n^3 FLOP / median time.

    Defaults: CUDA — n=8192 in bf16 (fp16 where bf16 is unsupported, e.g. T4), 10 repeats; CPU — n=1024 in fp32,
    3 repeats (~0.1-1 s in total on a laptop/CI core count).
    A large matmul is power-limited: on the course's H200 it read 625-770 TFLOP/s from run to run (SM clock
    dropping to ~1500 MHz at 600+ W), so treat the number as +-10%.
    Raises ValueError for an unsupported device.
    """
    device = _device(device)
    if device.type == "cuda":
        n = n or 8192
        dtype = dtype or (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
        repeats = repeats or 10
    else:
        n = n or 1024
        dtype = dtype or torch.float32
        repeats = repeats or 3
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t = _median_time_s(lambda: torch.matmul(a, b, out=out), device, repeats,
                       warmup_s=0.25 if device.type == "cuda" else 0.0)
    return 2 * n**3 / t / 1e12


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

    def source(self) -> str:
        """Where the numbers come from, for a printed line: "read from <file> (measured <measured_at>)",
        "measured now, saved to <file>", or "measured now (not saved: the cache file could not be written)"."""
        if self.cached:
            return f"read from {self.cache_path} (measured {self.measured_at})"
        if self.cache_path is None:
            return "measured now (not saved: the cache file could not be written)"
        return f"measured now, saved to {self.cache_path}"


def default_cache_path() -> Path:
    """`$LLMLAB_PEAKS_CACHE`, else `$XDG_CACHE_HOME/llmlab/peaks.json`, else `~/.cache/llmlab/peaks.json`."""
    if os.environ.get("LLMLAB_PEAKS_CACHE"):
        return Path(os.environ["LLMLAB_PEAKS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmlab" / "peaks.json"


def device_name(device: str | torch.device | None = None) -> str:
    """`torch.cuda.get_device_name()` on a GPU; on a CPU its model name and torch's thread count
    (e.g. "CPU: AMD EPYC 7763 64-Core Processor (2 threads)"), since the matmul rate depends on both."""
    device = _device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {model} ({torch.get_num_threads()} threads)"


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


def measure_peaks(device: str | torch.device | None = None, cache_path: str | os.PathLike | None = None,
                  refresh: bool = False) -> Peaks:
    """Measured copy bandwidth and matmul rate of `device`, cached per (device name, torch version).

    Args:
        device: "cuda", "cuda:N", "cpu", or None (CUDA if available).
        cache_path: the JSON cache file; default `default_cache_path()`. Several devices share one file.
        refresh: measure again even if cached, and overwrite the entry.

    Returns a `Peaks` (cached=True when read from the file; cache_path names the file, see `Peaks.source`). The
    first call on an H200 takes ~2 s; on a CPU well under 2 s. A missing or corrupt cache file is (re)written; an
    unwritable one only loses the caching.
    Raises ValueError for an unsupported device.
    """
    device = _device(device)
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    name = device_name(device)
    key = _cache_key(name)
    cache = _read_cache(path)
    if not refresh and isinstance(cache.get(key), dict):
        try:
            return Peaks(**{**cache[key], "cached": True, "cache_path": str(path)})
        except TypeError:  # an entry written by another llmlab version: measure again
            pass
    sheet = datasheet_for(name) if device.type == "cuda" else None
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.float32
    peaks = Peaks(
        device_name=name,
        torch_version=torch.__version__,
        copy_bw_gb_s=measure_copy_bandwidth(device),
        matmul_tflops=measure_matmul_tflops(device, dtype=dtype),
        matmul_dtype=str(dtype).removeprefix("torch."),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        datasheet_bw_gb_s=sheet.bandwidth_gb_s if sheet else None,
        datasheet_tflops=(sheet.bf16_tflops or sheet.fp16_tflops) if sheet else None,
    )
    record = asdict(peaks)
    record.pop("cached")
    record.pop("cache_path")
    cache = _read_cache(path)  # re-read: another process may have added a device meanwhile
    cache[key] = record
    try:
        _write_cache(path, cache)
    except OSError:
        return peaks
    return replace(peaks, cache_path=str(path))
