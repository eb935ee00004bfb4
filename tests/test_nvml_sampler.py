"""The NVML sampler's thread and buffer logic, on a CPU, with a fake backend (no GPU, no driver needed)."""

import ctypes.util
import threading
import time

import pytest

from llmlab.telemetry import nvml_sampler
from llmlab.telemetry.nvml_sampler import GPM_SERIES, NvmlBackend, Sampler, SamplerError, nvml_available


class FakeBackend:
    """Returns NVML-like readings; optionally GPM series, a failure after n reads, or a slow read."""

    def __init__(self, gpm: bool = False, fail_after: int | None = None, read_delay_s: float = 0.0):
        self.gpm, self.fail_after, self.read_delay_s = gpm, fail_after, read_delay_s
        self.reads = 0
        self.opened = self.closed = 0

    def open(self):
        self.opened += 1

    def read(self):
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise OSError("GPU is lost (fake)")
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        self.reads += 1
        r = {"gpu_util_pct": 10.0, "mem_util_pct": 2.0, "power_w": 120.0, "sm_clock_mhz": 1980.0,
             "mem_used_gb": 3.5, "pcie_tx_mb_s": 0.1, "pcie_rx_mb_s": 0.2}
        if self.gpm:
            r.update(sm_active_pct=5.0, sm_occupancy_pct=3.0, dram_bw_util_pct=4.0, tensor_active_pct=0.0)
        return r

    def close(self):
        self.closed += 1


def _sampler_threads():
    return [t for t in threading.enumerate() if t.name == "llmlab-nvml-sampler" and t.is_alive()]


def _wait_for(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return False


def test_a_recording_shorter_than_one_interval_gets_a_final_reading():
    fake = FakeBackend(gpm=True)
    s = Sampler(interval_s=10.0, backend=fake).start()
    s.stop(final_reading=True)
    assert fake.reads == 1 and len(s.samples()) == 1 and s.samples()[0]["gpu_util_pct"] == 10.0
    assert fake.closed == 1 and not _sampler_threads()
    fake = FakeBackend()
    s = Sampler(interval_s=10.0, backend=fake).start()
    s.stop()  # by default: no reading outside the interval
    assert fake.reads == 0 and s.samples() == []
    fake = FakeBackend(fail_after=0)
    s = Sampler(interval_s=10.0, backend=fake, raise_on_error=False).start()
    s.stop(final_reading=True)  # a failing final read is the sampler's error, not the caller's exception
    assert isinstance(s.error, OSError) and s.samples() == []


def test_rate_roughly_honours_interval():
    with Sampler(interval_s=0.02, backend=FakeBackend()) as s:
        time.sleep(0.5)
    n = len(s.samples())
    assert 5 <= n <= 30, n  # ideal 25; generous for a loaded 2-core CI runner
    ts = s.columns()["t_s"]
    assert ts == sorted(ts) and ts[0] > 0
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert min(gaps) > 0.005  # never bursts faster than the interval allows (drift-free schedule, no catch-up)


def test_buffer_is_bounded_and_cursor_survives_drops():
    be = FakeBackend()
    with Sampler(interval_s=0.002, max_samples=5, backend=be) as s:
        assert _wait_for(lambda: be.reads >= 20)
    rows = s.samples()
    assert len(rows) == 5
    assert rows[-1] == s.latest()
    new, cur = s.read_new(0)  # more than max_samples arrived: only the kept ones come back
    assert new == rows and cur == be.reads
    assert s.read_new(cur) == ([], cur)


def test_read_new_and_since_return_only_new_readings():
    be = FakeBackend()
    s = Sampler(interval_s=0.005, backend=be)
    assert s.latest() is None and s.samples() == [] and s.columns() == {}
    s.start()
    try:
        assert _wait_for(lambda: be.reads >= 3)
        first, cur = s.read_new(0)
        assert len(first) >= 3 and cur >= len(first)
        assert _wait_for(lambda: be.reads >= cur + 2)
        second, cur2 = s.read_new(cur)
        assert len(second) >= 2 and second[0]["t_s"] > first[-1]["t_s"]
        t_mid = first[-1]["t_s"]
        assert all(r["t_s"] > t_mid for r in s.since(t_mid))
        assert s.since(t_mid)[0] == second[0]
        assert 0 < s.now()
    finally:
        s.stop()
    assert not s.running and be.closed == 1
    s.stop()  # idempotent
    assert be.closed == 1


def test_no_thread_after_normal_exit():
    be = FakeBackend()
    with Sampler(interval_s=0.01, backend=be) as s:
        assert s.running and len(_sampler_threads()) == 1
    assert not s.running and _sampler_threads() == []
    assert be.opened == be.closed == 1
    n = len(s.samples())
    time.sleep(0.05)
    assert len(s.samples()) == n  # nothing appended after the block


def test_no_thread_after_exception_in_block():
    be = FakeBackend()
    with pytest.raises(ZeroDivisionError):
        with Sampler(interval_s=0.01, backend=be):
            1 / 0
    assert _sampler_threads() == [] and be.closed == 1


def test_no_thread_after_keyboard_interrupt_in_block():
    with pytest.raises(KeyboardInterrupt):
        with Sampler(interval_s=0.01, backend=FakeBackend()):
            raise KeyboardInterrupt
    assert _sampler_threads() == []


def test_backend_error_stops_thread_and_is_surfaced():
    be = FakeBackend(fail_after=3)
    with pytest.raises(SamplerError, match="GPU is lost") as info:
        with Sampler(interval_s=0.005, backend=be) as s:
            assert _wait_for(lambda: s.error is not None)
            assert _wait_for(lambda: not s.running)
            with pytest.raises(SamplerError):
                s.check()  # a poll loop sees it before the block ends
    assert isinstance(info.value.__cause__, OSError)
    assert len(s.samples()) == 3 and be.closed == 1 and _sampler_threads() == []


def test_backend_error_does_not_mask_the_blocks_own_exception():
    with pytest.raises(ValueError) as info:
        with Sampler(interval_s=0.005, backend=FakeBackend(fail_after=0)) as s:
            assert _wait_for(lambda: s.error is not None)
            raise ValueError("decode failed")
    assert "sampler had also stopped early" in " ".join(getattr(info.value, "__notes__", []))


def test_backend_error_only_recorded_when_raise_on_error_false():
    with Sampler(interval_s=0.005, backend=FakeBackend(fail_after=1), raise_on_error=False) as s:
        assert _wait_for(lambda: s.error is not None)
    assert isinstance(s.error, OSError) and "failed" in repr(s)


def test_gpm_absent_means_keys_absent():
    be = FakeBackend(gpm=False)
    with Sampler(interval_s=0.005, backend=be) as s:
        assert _wait_for(lambda: be.reads >= 2)
    cols = s.columns()
    assert "gpu_util_pct" in cols and list(cols)[0] == "t_s"
    for key in GPM_SERIES:
        assert key not in cols
        assert all(key not in r for r in s.samples())


def test_gpm_present_means_keys_present():
    be = FakeBackend(gpm=True)
    with Sampler(interval_s=0.005, backend=be) as s:
        assert _wait_for(lambda: be.reads >= 2)
    cols = s.columns()
    for key in GPM_SERIES:
        assert key in cols and None not in cols[key]
    assert all(len(v) == len(cols["t_s"]) for v in cols.values())


def test_columns_fill_gaps_with_none():
    s = Sampler(backend=FakeBackend())
    cols = s.columns([{"t_s": 0.1, "a": 1.0}, {"t_s": 0.2}])
    assert cols == {"t_s": [0.1, 0.2], "a": [1.0, None]}


def test_slow_backend_does_not_burst():
    be = FakeBackend(read_delay_s=0.03)
    with Sampler(interval_s=0.01, backend=be) as s:
        time.sleep(0.3)
    assert be.reads <= 12  # ~0.3 / 0.03 = 10, not a catch-up burst


def test_bad_arguments():
    with pytest.raises(ValueError):
        Sampler(interval_s=0, backend=FakeBackend())
    with pytest.raises(ValueError):
        Sampler(max_samples=0, backend=FakeBackend())
    s = Sampler(backend=FakeBackend())
    with s:
        with pytest.raises(RuntimeError, match="already running"):
            s.start()


def test_open_failure_starts_no_thread():
    class NoGpu(FakeBackend):
        def open(self):
            raise RuntimeError("cannot sample the GPU: no NVIDIA driver")

    with pytest.raises(RuntimeError, match="no NVIDIA driver"):
        with Sampler(backend=NoGpu()):
            pass
    assert _sampler_threads() == []


def test_nvml_available_never_raises():
    ok, reason = nvml_available()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    if ctypes.util.find_library("nvidia-ml") is None:  # this machine / CI: no driver
        assert ok is False and "driver" in reason


def test_nvml_available_reports_missing_library(monkeypatch):
    pynvml = pytest.importorskip("pynvml")

    def no_lib():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_lib)
    ok, reason = nvml_available()
    assert ok is False and "libnvidia-ml" in reason


def test_nvml_backend_open_raises_plainly_without_gpu(monkeypatch):
    monkeypatch.setattr(nvml_sampler, "nvml_available", lambda: (False, "no NVIDIA driver on this machine"))
    with pytest.raises(RuntimeError, match="no NVIDIA driver"):
        with Sampler(device_index=0):
            pass
    assert _sampler_threads() == []
    NvmlBackend().close()  # closing an unopened backend is a no-op
