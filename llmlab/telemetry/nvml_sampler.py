"""GPU telemetry at ~10 Hz: what `nvidia-smi` reports, and what it hides, sampled on a background thread.

`nvidia-smi`'s "GPU-Util" is the share of time in which *at least one* kernel was running on the GPU — not how
much of the GPU that kernel used. A decode loop that launches one tiny kernel after another can read 100% while
the streaming multiprocessors (SMs) sit mostly idle; an eager PyTorch loop that leaves gaps between kernels reads
~3-10% (the course's "nvidia-smi says 10%" puzzle). Hopper and newer GPUs expose GPU Performance Monitoring (GPM)
counters through NVML that answer the real questions: how many SMs were busy, how many warps were resident, how
much of the DRAM bandwidth was used, whether tensor cores ran at all.

Every reading is a dict of floats; the series (keys) and their units:

    t_s                 seconds since the sampler started (time.perf_counter, monotonic)
    gpu_util_pct        nvmlDeviceGetUtilizationRates().gpu: % of time >= 1 kernel ran (NOT SM usage)
    mem_util_pct        nvmlDeviceGetUtilizationRates().memory: % of time device memory was read or written
    sm_active_pct       GPM NVML_GPM_METRIC_SM_UTIL: % of SMs busy, averaged over the interval
    sm_occupancy_pct    GPM NVML_GPM_METRIC_SM_OCCUPANCY: resident warps / theoretical maximum, %
    dram_bw_util_pct    GPM NVML_GPM_METRIC_DRAM_BW_UTIL: DRAM bandwidth used / peak, %
    tensor_active_pct   GPM NVML_GPM_METRIC_ANY_TENSOR_UTIL: % of time SMs ran any tensor-core instruction
    power_w             nvmlDeviceGetPowerUsage (mW) / 1000
    sm_clock_mhz        nvmlDeviceGetClockInfo(NVML_CLOCK_SM)
    mem_used_gb         nvmlDeviceGetMemoryInfo().used / 1e9
    pcie_tx_mb_s        nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_TX_BYTES) (KB/s, over 20 ms) / 1000
    pcie_rx_mb_s        same for NVML_PCIE_UTIL_RX_BYTES (both only with NvmlBackend(pcie=True): each call blocks 20 ms)
    read_ms             how long the reading itself took (ms): the sampler's own cost

A series the device does not support is ABSENT from the readings, never filled with zeros: on a GPU without GPM
(anything older than Hopper) the four GPM keys are simply missing, so a plot cannot mistake "not measured" for
"idle". `NvmlBackend.series` lists what a device reports.

The sampler thread only appends readings to a bounded buffer. It never touches widgets: updating ipywidgets from
a background thread is fragile under ipykernel 7 (jupyter-widgets/ipywidgets#4001, #4020); the code running in the
cell polls `Sampler.read_new()` every ~100-200 ms and pushes the plot update itself.

    from llmlab.telemetry.nvml_sampler import Sampler, nvml_available
    ok, why = nvml_available()
    if ok:
        with Sampler(device_index=0, interval_s=0.1) as s:
            run_decode_loop()
        print(s.columns()["gpu_util_pct"])

Sources: NVML API reference, https://docs.nvidia.com/deploy/nvml-api/ (Device Queries; GPM functions);
nvidia-ml-py (`pynvml`), https://pypi.org/project/nvidia-ml-py/.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, Protocol

GPM_SERIES = ("sm_active_pct", "sm_occupancy_pct", "dram_bw_util_pct", "tensor_active_pct")
BASE_SERIES = (
    "gpu_util_pct", "mem_util_pct", "power_w", "sm_clock_mhz", "mem_used_gb", "pcie_tx_mb_s", "pcie_rx_mb_s",
)


def nvml_available() -> tuple[bool, str]:
    """Can this machine sample an NVIDIA GPU through NVML? Never raises.

    Returns:
        (True, "<n> NVIDIA GPU(s): <name of GPU 0>") or (False, a plain-language reason): nvidia-ml-py not
        installed, no NVIDIA driver (libnvidia-ml.so.1 not found — Binder, CI, a laptop), driver not loaded,
        no GPU visible, or NVML's own error message.
    """
    try:
        import pynvml
    except ImportError:
        return False, "nvidia-ml-py is not installed (pip install nvidia-ml-py; it is imported as `pynvml`)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return False, "no NVIDIA driver on this machine: the NVML library (libnvidia-ml.so.1) was not found"
    except pynvml.NVMLError_DriverNotLoaded:
        return False, "the NVIDIA driver is installed but not loaded (no GPU attached, or the kernel module is off)"
    except Exception as e:  # NVMLError subclasses, OSError from ctypes, ...
        return False, f"NVML could not start: {e}"
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return False, "the NVIDIA driver is loaded but no GPU is visible (check CUDA_VISIBLE_DEVICES / containers)"
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        name = name.decode() if isinstance(name, bytes) else name
        return True, f"{count} NVIDIA GPU(s): {name}"
    except Exception as e:
        return False, f"NVML started but could not query the GPUs: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


class Backend(Protocol):
    """What `Sampler` needs from a telemetry source (NVML on a GPU; a fake in tests).

    `open()` may raise (e.g. no GPU); `read()` returns one reading (series name -> float, no `t_s`) and may raise,
    which stops the sampler; `close()` releases resources and is called once after a successful `open()`.
    """

    def open(self) -> None: ...

    def read(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class NvmlBackend:
    """Reads one GPU through nvidia-ml-py (`pynvml`).

    Args:
        device_index: NVML's index of the GPU (NVML ignores CUDA_VISIBLE_DEVICES: index 0 is the first physical GPU).
        gpm: try GPM metrics (Hopper+). False skips them even where supported.

    After `open()`:
        name: the device name, e.g. "NVIDIA H200".
        gpm_supported: whether nvmlGpmQueryDeviceSupport said yes (and `gpm` was True).
        series: the keys `read()` returns (a series NVML answers NOT_SUPPORTED for at open time is left out).

    Raises (from open):
        RuntimeError: NVML unavailable (the message is `nvml_available()`'s reason) or device_index out of range.

    GPM needs two snapshots: `open()` takes the first, each `read()` takes a new one and asks
    `nvmlGpmMetricsGet` for the averages over the window between them (NVIDIA recommends windows >= 100 ms;
    shorter ones are noisy). A metric whose own `nvmlReturn` is not NVML_SUCCESS, or whose value is not finite
    (NVML returned NaN with SUCCESS for DRAM_BW_UTIL over a ~0 ms window on an H200), is left out of that reading.
    """

    # GPM series name -> the pynvml constant's name (looked up at open time; ids 2, 3, 10, 5 in nvml.h)
    _GPM_METRICS = {
        "sm_active_pct": "NVML_GPM_METRIC_SM_UTIL",
        "sm_occupancy_pct": "NVML_GPM_METRIC_SM_OCCUPANCY",
        "dram_bw_util_pct": "NVML_GPM_METRIC_DRAM_BW_UTIL",
        "tensor_active_pct": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    }

    def __init__(self, device_index: int = 0, gpm: bool = True, pcie: bool = False):
        self.device_index = device_index
        self.gpm = gpm
        # PCIe throughput is off by default: each nvmlDeviceGetPcieThroughput call measures over 20 ms and blocks
        # that long, so two of them at 10 Hz keep the sampler busy 40% of the time
        self.pcie = pcie
        self.name = ""
        self.gpm_supported = False
        self.series: tuple[str, ...] = ()
        self._nv: Any = None
        self._handle = None
        self._gpm_prev = None
        self._gpm_cur = None
        self._gpm_ids: list[int] = []
        self._optional: dict[str, bool] = {}

    # -- the plain (non-GPM) readings, one function per series group ------------------------------------------
    def _read_util(self) -> dict[str, float]:
        u = self._nv.nvmlDeviceGetUtilizationRates(self._handle)
        return {"gpu_util_pct": float(u.gpu), "mem_util_pct": float(u.memory)}

    def _read_power(self) -> dict[str, float]:
        return {"power_w": self._nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0}  # mW -> W

    def _read_clock(self) -> dict[str, float]:
        return {"sm_clock_mhz": float(self._nv.nvmlDeviceGetClockInfo(self._handle, self._nv.NVML_CLOCK_SM))}

    def _read_memory(self) -> dict[str, float]:
        return {"mem_used_gb": self._nv.nvmlDeviceGetMemoryInfo(self._handle).used / 1e9}  # bytes -> GB

    def _read_pcie(self) -> dict[str, float]:
        nv = self._nv
        tx = nv.nvmlDeviceGetPcieThroughput(self._handle, nv.NVML_PCIE_UTIL_TX_BYTES)  # KB/s
        rx = nv.nvmlDeviceGetPcieThroughput(self._handle, nv.NVML_PCIE_UTIL_RX_BYTES)
        return {"pcie_tx_mb_s": tx / 1000.0, "pcie_rx_mb_s": rx / 1000.0}

    def open(self) -> None:
        ok, reason = nvml_available()
        if not ok:
            raise RuntimeError(f"cannot sample the GPU: {reason}")
        import pynvml as nv

        self._nv = nv
        nv.nvmlInit()
        try:
            count = nv.nvmlDeviceGetCount()
            if not 0 <= self.device_index < count:
                raise RuntimeError(f"device_index={self.device_index} but NVML sees {count} GPU(s) (0..{count - 1})")
            self._handle = nv.nvmlDeviceGetHandleByIndex(self.device_index)
            name = nv.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else name
            # Probe each group once: a NOT_SUPPORTED series is dropped for good (absent, not zero); any other
            # error at open time is real and propagates.
            readers = {"util": self._read_util, "power": self._read_power, "clock": self._read_clock,
                       "memory": self._read_memory}
            if self.pcie:
                readers["pcie"] = self._read_pcie
            series: list[str] = []
            for group, fn in readers.items():
                try:
                    series += list(fn())
                    self._optional[group] = True
                except nv.NVMLError_NotSupported:
                    self._optional[group] = False
            self.gpm_supported = self.gpm and self._query_gpm_support()
            if self.gpm_supported:
                self._gpm_ids = [getattr(nv, const) for const in self._GPM_METRICS.values()]
                self._gpm_prev = nv.nvmlGpmSampleAlloc()
                self._gpm_cur = nv.nvmlGpmSampleAlloc()
                nv.nvmlGpmSampleGet(self._handle, self._gpm_prev)  # the start of the first window
                series += list(self._GPM_METRICS)
            self.series = tuple(series)
        except BaseException:
            self.close()
            raise

    def _query_gpm_support(self) -> bool:
        nv = self._nv
        if not hasattr(nv, "nvmlGpmQueryDeviceSupport"):  # nvidia-ml-py older than GPM
            return False
        try:
            return bool(nv.nvmlGpmQueryDeviceSupport(self._handle).isSupportedDevice)
        except nv.NVMLError:  # NOT_SUPPORTED, FUNCTION_NOT_FOUND (old driver), ...
            return False

    def _read_gpm(self) -> dict[str, float]:
        nv = self._nv
        nv.nvmlGpmSampleGet(self._handle, self._gpm_cur)
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self._gpm_ids)
        request.sample1 = self._gpm_prev
        request.sample2 = self._gpm_cur
        for i, metric_id in enumerate(self._gpm_ids):
            request.metrics[i].metricId = metric_id
        nv.nvmlGpmMetricsGet(request)
        out = {}
        for i, key in enumerate(self._GPM_METRICS):
            metric = request.metrics[i]
            value = float(metric.value)
            # NVML can answer SUCCESS with NaN when the window is too short (seen on an H200 right after open)
            if metric.nvmlReturn == nv.NVML_SUCCESS and math.isfinite(value):
                out[key] = value
        self._gpm_prev, self._gpm_cur = self._gpm_cur, self._gpm_prev  # this window's end starts the next one
        return out

    def read(self) -> dict[str, float]:
        """One reading (series -> float). Raises pynvml.NVMLError if NVML fails (e.g. GPU lost).

        Also reports `read_ms`, the time this reading itself took: sampling is not free, and a slow read is a
        sign that it competes with the program being watched.
        """
        t0 = time.perf_counter()
        reading: dict[str, float] = {}
        if self._optional.get("util"):
            reading.update(self._read_util())
        if self.gpm_supported:
            reading.update(self._read_gpm())
        if self._optional.get("power"):
            reading.update(self._read_power())
        if self._optional.get("clock"):
            reading.update(self._read_clock())
        if self._optional.get("memory"):
            reading.update(self._read_memory())
        if self._optional.get("pcie"):
            reading.update(self._read_pcie())
        reading["read_ms"] = (time.perf_counter() - t0) * 1e3
        return reading

    def close(self) -> None:
        nv = self._nv
        if nv is None:
            return
        for sample in (self._gpm_prev, self._gpm_cur):
            if sample is not None:
                try:
                    nv.nvmlGpmSampleFree(sample)
                except Exception:
                    pass
        self._gpm_prev = self._gpm_cur = None
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
        self._nv = None


class Sampler:
    """Sample a telemetry backend every `interval_s` seconds on a daemon thread, into a bounded buffer.

    Args:
        device_index: NVML index of the GPU (used only when `backend` is None).
        interval_s: seconds between readings (default 0.1 = 10 Hz). NVML's GPU-Util itself is averaged over
            1/6 s to 1 s depending on the GPU, so faster sampling repeats values; GPM windows < 100 ms are noisy.
        max_samples: the buffer keeps the newest `max_samples` readings (default 6000 = 10 min at 10 Hz);
            older ones are dropped.
        backend: any object with open()/read()/close() (see `Backend`); default `NvmlBackend(device_index)`.
        raise_on_error: if the thread failed, `__exit__` raises SamplerError (chained to the cause) when the
            `with` block itself finished normally. With False the failure is only in `.error`.

    Raises:
        ValueError: interval_s <= 0 or max_samples < 1.
        RuntimeError (from `__enter__`/`start()`): the backend could not open, e.g. no NVIDIA GPU — check
            `nvml_available()` first.
        SamplerError (from `__exit__`, `stop()`, `check()`): the sampling thread died; `.error` holds the cause.

    The first reading comes one interval after start (the GPM counters need a window). Readings are stamped
    `t_s` = seconds since start on `time.perf_counter`; `now()` gives the same clock so the caller can mark events
    (e.g. "decode started") on the plot's time axis. The thread stops at the first exception from the backend and
    on `stop()`/`__exit__`, which always join it — also when the block raises (KeyboardInterrupt included) — so no
    thread outlives the `with` block.
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.1, max_samples: int = 6000,
                 backend: Backend | None = None, raise_on_error: bool = True):
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be > 0 seconds")
        if max_samples < 1:
            raise ValueError(f"max_samples={max_samples} must be >= 1")
        self.interval_s = float(interval_s)
        self.max_samples = int(max_samples)
        self.backend: Backend = backend if backend is not None else NvmlBackend(device_index)
        self.raise_on_error = raise_on_error
        self.error: BaseException | None = None  # the exception that stopped the thread, if any
        self._buf: collections.deque[dict[str, float]] = collections.deque(maxlen=self.max_samples)
        self._count = 0  # readings ever appended (the cursor of `read_new`); not reduced by the deque dropping
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._opened = False
        self._t0 = 0.0

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> "Sampler":
        """Open the backend and start the thread: a fresh recording (the buffer is emptied, `t_s` restarts at 0).

        Raises RuntimeError if already running, or whatever the backend's open() raises (RuntimeError for NVML).
        Without a `with` block the caller must call `stop()` (e.g. in a `finally:`).
        """
        if self.running:
            raise RuntimeError("this Sampler is already running")
        self.backend.open()
        self._opened = True
        self.error = None
        with self._lock:
            self._buf.clear()
            self._count = 0
        self._stop.clear()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="llmlab-nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self, raise_error: bool | None = None, final_reading: bool = False) -> None:
        """Stop and join the thread, close the backend. Safe to call twice.

        final_reading: if the thread took no reading (the recording was shorter than one interval) and did not
        fail, take one now, before the backend closes, so that a short run still has a value (over the backend's
        own window: NVML's GPU-Util averages the last ~1/6-1 s; the GPM metrics the time since the last read).

        Raises SamplerError if the thread had failed and `raise_error` (default: `raise_on_error`) is true.
        """
        self._stop.set()
        thread, self._thread = self._thread, None
        try:
            if thread is not None:
                thread.join()
                if final_reading and self.error is None and self._count == 0 and self._opened:
                    try:
                        reading = self.backend.read()
                    except Exception as e:  # recorded like a failure of the thread
                        self.error = e
                    else:
                        with self._lock:
                            self._buf.append({"t_s": self.now(), **reading})
                            self._count += 1
        finally:
            if self._opened:
                self._opened = False
                self.backend.close()
        if (self.raise_on_error if raise_error is None else raise_error):
            self.check()

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # Stop (join) first, whatever happened in the block. If the block raised, its exception wins; a sampler
        # failure is attached to it as a note instead of replacing it.
        self.stop(raise_error=exc is None and self.raise_on_error)
        if exc is not None and self.error is not None and hasattr(exc, "add_note"):
            exc.add_note(f"(the GPU sampler had also stopped early: {self.error!r})")

    @property
    def running(self) -> bool:
        """True while the sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise SamplerError (from the cause) if the thread stopped on an error; a poll loop can call this."""
        if self.error is not None:
            raise SamplerError(f"the GPU sampler stopped on an error: {self.error!r}") from self.error

    def now(self) -> float:
        """Seconds since start on the readings' clock (`t_s`)."""
        return time.perf_counter() - self._t0

    # -- the thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_t = self.interval_s
        try:
            while not self._stop.wait(max(0.0, next_t - self.now())):
                reading = self.backend.read()
                t = self.now()
                with self._lock:
                    self._buf.append({"t_s": t, **reading})
                    self._count += 1
                next_t += self.interval_s
                if next_t < t:  # fell behind (slow backend, GIL held by the caller): skip, don't burst
                    next_t = t + self.interval_s
        except BaseException as e:  # anything, KeyboardInterrupt/SystemExit included: record and stop
            self.error = e

    # -- reading the buffer (any thread) -------------------------------------------------------------------------
    def samples(self) -> list[dict[str, float]]:
        """A copy of the buffered readings, oldest first: [{"t_s": ..., "gpu_util_pct": ..., ...}, ...]."""
        with self._lock:
            return list(self._buf)

    def latest(self) -> dict[str, float] | None:
        """The newest reading, or None before the first one."""
        with self._lock:
            return dict(self._buf[-1]) if self._buf else None

    def since(self, t_s: float) -> list[dict[str, float]]:
        """Buffered readings with `t_s` strictly greater than the given time (seconds since start)."""
        with self._lock:
            return [r for r in self._buf if r["t_s"] > t_s]

    def read_new(self, cursor: int = 0) -> tuple[list[dict[str, float]], int]:
        """Readings appended since `cursor`, and the cursor to pass next time (start with 0).

        For a UI poll loop: `new, cur = s.read_new(cur)`. If more than `max_samples` readings arrived since the
        last call, the dropped ones are skipped.
        """
        with self._lock:
            n_new = min(self._count - cursor, len(self._buf))
            new = list(self._buf)[len(self._buf) - n_new:] if n_new > 0 else []
            return new, self._count

    def columns(self, readings: list[dict[str, float]] | None = None) -> dict[str, list[float | None]]:
        """Columnar view: series name -> list of values (same length as the readings; `t_s` first).

        A series present in some readings but not others (e.g. a GPM metric whose nvmlReturn failed once) has
        None at the missing positions; a series in no reading (e.g. GPM on a pre-Hopper GPU) has no key at all.
        `readings` defaults to `samples()`.
        """
        rows = self.samples() if readings is None else readings
        keys: dict[str, None] = {"t_s": None} if rows else {}
        for r in rows:
            keys.update(dict.fromkeys(r))
        return {k: [r.get(k) for r in rows] for k in keys}

    def __repr__(self) -> str:
        state = "running" if self.running else ("failed" if self.error is not None else "stopped")
        return f"Sampler({state}, interval_s={self.interval_s}, {len(self._buf)} readings buffered)"


class SamplerError(RuntimeError):
    """The sampling thread stopped on an exception (see `.__cause__` / `Sampler.error`)."""
