"""Peak measurement (on the CPU here), its JSON cache, and the datasheet table."""

import json
import time

import pytest
import torch

from llmlab import envinfo
from llmlab.measure import peaks


def test_cpu_measurements_are_positive_and_quick():
    t0 = time.perf_counter()
    bw = peaks.measure_copy_bandwidth("cpu", nbytes=16 << 20, repeats=3)
    tflops = peaks.measure_matmul_tflops("cpu")
    assert time.perf_counter() - t0 < 2.0
    assert 0.1 < bw < 10_000  # GB/s: any real CPU
    assert 1e-4 < tflops < 100  # TFLOP/s


def steady_times(spread=0.0, repeats=5):
    """Timed repeats of 1 s each, the fastest `spread` quicker: `peaks.spread` of them is `spread`."""
    return (1.0 - spread,) + (1.0,) * (repeats - 1)


class FakeMachine:
    """Stands in for `peaks.time_copy` / `peaks.time_matmul`: attempt i (one copy + one matmul) measures
    `states[i]` = (copy GB/s, matmul TFLOP/s, spread, cpu_wait), the last state for every later attempt."""

    def __init__(self, monkeypatch, *states):
        self.states, self.attempts = list(states), 0
        monkeypatch.setattr(peaks, "time_copy", self.copy)
        monkeypatch.setattr(peaks, "time_matmul", self.matmul)
        monkeypatch.setattr(peaks, "RETRY_PAUSE_S", 0.0)

    def _state(self):
        return self.states[min(self.attempts, len(self.states) - 1)]

    def copy(self, *a, **k):
        gb_s, _, spread, wait = self._state()
        return peaks.Timing(gb_s * 1e9, steady_times(spread), wait)

    def matmul(self, *a, **k):
        _, tflops, spread, wait = self._state()
        self.attempts += 1
        return peaks.Timing(tflops * 1e12, steady_times(spread), wait)


IDLE = (34.0, 0.2, 0.02, 0.0)
BUSY = (17.0, 0.07, 0.0, 0.5)  # one of two cores taken: steadily slow, the threads wait for a CPU
JITTERY = (5.0, 0.05, 0.6, 0.0)  # some repeats slowed, some not


def test_spread_is_how_far_the_median_falls_behind_the_fastest():
    assert peaks.spread([1.0] * 5) == 0.0
    assert peaks.spread([0.5, 1.0, 1.0, 1.0, 1.0]) == pytest.approx(0.5)
    assert peaks.spread([1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0  # one slow repeat does not move the median
    assert peaks.spread([1.0, 1.0, 3.0, 3.0, 3.0]) == pytest.approx(2 / 3)  # most repeats slowed
    with pytest.raises(ValueError):
        peaks.spread([])
    with pytest.raises(ValueError):
        peaks.spread([1.0, 0.0])


def test_judge_steady_and_noisy_timings():
    T = peaks.Timing
    tight = T(1e9, (0.100, 0.101, 0.102, 0.100, 0.103))
    assert peaks.judge(tight, tight) == ("steady", ())
    jittery = T(1e9, (0.100, 0.290, 0.310, 0.105, 0.300))  # a busy machine: median 0.29 s vs best 0.10 s
    verdict, reasons = peaks.judge(jittery, tight)
    assert verdict == "noisy" and reasons == ("copy spread 66%",)
    assert peaks.judge(tight, jittery) == ("noisy", ("matmul spread 66%",))
    # at the threshold, and just above it
    edge = peaks.MAX_SPREAD
    assert peaks.judge(T(1, steady_times(edge - 0.01)), tight)[0] == "steady"
    assert peaks.judge(T(1, steady_times(edge + 0.01)), tight)[0] == "noisy"
    # a steady load: no spread, but the threads waited for a CPU half of the time
    waited = T(1e9, tight.times_s, cpu_wait=0.5)
    assert peaks.judge(waited, tight) == ("noisy", ("the measuring threads waited 50% of the time for a CPU",))
    assert peaks.judge(T(1e9, tight.times_s, cpu_wait=0.02), tight)[0] == "steady"
    # a GPU's copy against its datasheet bandwidth: 4185 of 4800 GB/s is fine, 1000 is not
    h200 = peaks.datasheet_for("NVIDIA H200").bandwidth_gb_s
    assert peaks.judge(T(4185e9, steady_times()), tight, datasheet_bw_gb_s=h200)[0] == "steady"
    assert peaks.judge(T(1000e9, steady_times()), tight, datasheet_bw_gb_s=h200) == (
        "noisy", ("copy 1000 GB/s is 21% of the datasheet's 4800",))


def test_measure_peaks_on_this_cpu(tmp_path):
    """A real measurement: any verdict (the machine may be busy), but judged and saved with it."""
    path = tmp_path / "peaks.json"
    p = peaks.measure_peaks("cpu", cache_path=path)
    assert not p.cached and p.copy_bw_gb_s > 0 and p.matmul_tflops > 0
    assert p.matmul_dtype == "float32" and p.datasheet_bw_gb_s is None
    assert p.verdict in ("steady", "noisy") and p.repeats == 5 and 1 <= p.attempts <= peaks.MAX_ATTEMPTS
    assert 0 <= p.copy_spread < 1 and 0 <= p.matmul_spread < 1
    assert p.cpu_wait is None or 0 <= p.cpu_wait <= 1
    assert (p.verdict == "steady") == (p.noise_reasons == ())
    assert p.device_name == envinfo.device_name("cpu")  # one name for the device, in bench files and the cache
    assert p.device_name.startswith("CPU: ") and p.device_name.endswith(f" ({torch.get_num_threads()} thread" + ("" if torch.get_num_threads() == 1 else "s") + ")")
    data = json.loads(path.read_text())
    entry = data[f"{p.device_name} | torch {p.torch_version}"]
    assert list(data) == [f"{p.device_name} | torch {p.torch_version}"]
    assert entry["version"] == peaks.CACHE_VERSION and entry["verdict"] == p.verdict
    assert entry["copy_bw_gb_s"] == p.copy_bw_gb_s and "cached" not in entry and "cache_path" not in entry


def test_measure_peaks_caches_a_steady_measurement(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "peaks.json"
    machine = FakeMachine(monkeypatch, IDLE)
    first = peaks.measure_peaks("cpu", cache_path=path)
    assert (first.copy_bw_gb_s, first.matmul_tflops, first.cached) == (34.0, 0.2, False)
    assert (first.verdict, first.attempts, first.repeats, first.cpu_wait) == ("steady", 1, 5, 0.0)
    assert first.copy_spread == pytest.approx(0.02)
    second = peaks.measure_peaks("cpu", cache_path=path)
    assert machine.attempts == 1  # read from the file
    assert second.cached and second == peaks.Peaks(**{**first.__dict__, "cached": True})


def test_a_busy_machine_is_measured_again_until_steady(tmp_path, monkeypatch):
    machine = FakeMachine(monkeypatch, JITTERY, IDLE)
    p = peaks.measure_peaks("cpu", cache_path=tmp_path / "peaks.json")
    assert machine.attempts == 2
    assert (p.copy_bw_gb_s, p.verdict, p.attempts, p.noise_reasons) == (34.0, "steady", 2, ())


def test_a_noisy_measurement_is_not_trusted_from_the_cache(tmp_path, monkeypatch):
    """Busy for every attempt: the best attempt is kept, saved marked noisy, and the next call measures again
    (now idle: steady, then read from the cache)."""
    path = tmp_path / "peaks.json"
    monkeypatch.setenv("LLMLAB_PEAKS_CACHE", str(path))
    machine = FakeMachine(monkeypatch, JITTERY, BUSY, JITTERY)
    noisy = peaks.measure_peaks("cpu")
    assert machine.attempts == peaks.MAX_ATTEMPTS == 3
    assert (noisy.copy_bw_gb_s, noisy.verdict, noisy.attempts) == (17.0, "noisy", 3)  # the highest copy rate kept
    assert noisy.noise_reasons == ("the measuring threads waited 50% of the time for a CPU",)
    assert noisy.source() == f"measured now, saved to {path} marked noisy: measured again next time"
    entry = json.loads(path.read_text())[f"{noisy.device_name} | torch {noisy.torch_version}"]
    assert entry["verdict"] == "noisy" and entry["copy_bw_gb_s"] == 17.0

    machine.states = [IDLE]
    again = peaks.measure_peaks("cpu")
    assert machine.attempts == 4 and not again.cached
    assert (again.copy_bw_gb_s, again.verdict, again.attempts) == (34.0, "steady", 1)
    third = peaks.measure_peaks("cpu")
    assert machine.attempts == 4 and third.cached and third.copy_bw_gb_s == 34.0


def test_an_entry_of_the_old_format_is_measured_again(tmp_path, monkeypatch):
    """Format 1 (no "version", no verdict) may hold peaks measured on a busy machine: not read back."""
    path = tmp_path / "peaks.json"
    key = f"{envinfo.device_name('cpu')} | torch {torch.__version__}"
    old = {"device_name": envinfo.device_name("cpu"), "torch_version": torch.__version__, "copy_bw_gb_s": 5.0,
           "matmul_tflops": 0.05, "matmul_dtype": "float32", "measured_at": "2026-01-02T03:04:05Z",
           "datasheet_bw_gb_s": None, "datasheet_tflops": None}
    path.write_text(json.dumps({key: old}))
    machine = FakeMachine(monkeypatch, IDLE)
    p = peaks.measure_peaks("cpu", cache_path=path)
    assert machine.attempts == 1 and not p.cached and p.copy_bw_gb_s == 34.0
    assert json.loads(path.read_text())[key]["version"] == peaks.CACHE_VERSION
    # a format-2 entry with a field this version does not know is still read
    data = json.loads(path.read_text())
    data[key]["a_later_field"] = 1
    path.write_text(json.dumps(data))
    assert peaks.measure_peaks("cpu", cache_path=path).cached and machine.attempts == 1


def test_the_peaks_line_says_how_far_to_trust_them(tmp_path, monkeypatch):
    from llmlab.measure.bench_table import peaks_line

    FakeMachine(monkeypatch, IDLE)
    p = peaks.measure_peaks("cpu", cache_path=tmp_path / "peaks.json")
    assert peaks_line(p) == (f"peaks: copy 34 GB/s, matmul 0.20 TFLOP/s (float32), measured now, saved to "
                             f"{tmp_path / 'peaks.json'}; spread 2% (copy), 2% (matmul) over 5 repeats: steady")
    cached = peaks.measure_peaks("cpu", cache_path=tmp_path / "peaks.json")
    assert peaks_line(cached).endswith(": steady; --refresh-peaks measures them again")
    FakeMachine(monkeypatch, JITTERY)
    noisy = peaks.measure_peaks("cpu", cache_path=tmp_path / "peaks.json", refresh=True)
    line = peaks_line(noisy)
    assert line.startswith("peaks: copy 5 GB/s, matmul 0.05 TFLOP/s (float32), measured now, saved to ")
    assert ("; spread 60% (copy), 60% (matmul) over 5 repeats, 3 attempts: noisy (copy spread 60%; matmul "
            "spread 60%): the machine looks busy, MBU and MFU may read high") in line
    assert peaks.Peaks(**{**p.__dict__, "verdict": None}).trust() == ""  # not judged: nothing claimed


def test_refresh_and_corrupt_cache(tmp_path, monkeypatch):
    path = tmp_path / "peaks.json"
    path.write_text("{not json")
    FakeMachine(monkeypatch, (12.5, 0.25, 0.0, 0.0))
    p = peaks.measure_peaks("cpu", cache_path=path)  # corrupt file: measured and rewritten
    assert (p.copy_bw_gb_s, p.matmul_tflops, p.cached) == (12.5, 0.25, False)
    FakeMachine(monkeypatch, (13.0, 0.25, 0.0, 0.0))
    assert peaks.measure_peaks("cpu", cache_path=path).copy_bw_gb_s == 12.5  # cached
    assert peaks.measure_peaks("cpu", cache_path=path, refresh=True).copy_bw_gb_s == 13.0
    assert peaks.measure_peaks("cpu", cache_path=path).copy_bw_gb_s == 13.0
    # other devices' entries in the same file are kept
    data = json.loads(path.read_text())
    data["NVIDIA H200 | torch 2.11.0+cu130"] = {"copy_bw_gb_s": 4277.0}
    path.write_text(json.dumps(data))
    peaks.measure_peaks("cpu", cache_path=path, refresh=True)
    assert "NVIDIA H200 | torch 2.11.0+cu130" in json.loads(path.read_text())


def test_peaks_say_where_they_come_from(tmp_path, monkeypatch):
    """`Peaks.source()`: measured now and saved, read from the file (with the date measured), or not saved."""
    path = tmp_path / "peaks.json"
    FakeMachine(monkeypatch, (12.5, 0.25, 0.0, 0.0))
    p = peaks.measure_peaks("cpu", cache_path=path)
    assert p.cache_path == str(path) and p.source() == f"measured now, saved to {path}"
    assert "cache_path" not in json.loads(path.read_text())[f"{p.device_name} | torch {p.torch_version}"]
    again = peaks.measure_peaks("cpu", cache_path=path)
    assert again.cached and again.source() == f"read from {path} (measured {p.measured_at})"
    assert peaks.measure_peaks("cpu", cache_path=path, refresh=True).source().startswith("measured now")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    unsaved = peaks.measure_peaks("cpu", cache_path=blocker / "peaks.json")  # its folder is a file: not saved
    assert unsaved.cache_path is None and unsaved.source() == ("measured now (not saved: the cache file could not "
                                                               "be written)")


def test_the_test_session_keeps_out_of_the_users_cache():
    """The repository's conftest.py points LLMLAB_PEAKS_CACHE at a temporary file for the whole session, and the
    subprocesses it starts (the labs' notebook kernels under nbval) inherit it: no test writes ~/.cache."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    path = peaks.default_cache_path()
    assert Path(tempfile.gettempdir()) in path.parents and Path.home() / ".cache" not in path.parents
    code = "from llmlab.measure.peaks import default_cache_path as d; print(d())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(path)


def test_cache_path_from_env(tmp_path, monkeypatch):
    target = tmp_path / "env-peaks.json"
    monkeypatch.setenv("LLMLAB_PEAKS_CACHE", str(target))
    assert peaks.default_cache_path() == target
    monkeypatch.delenv("LLMLAB_PEAKS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert peaks.default_cache_path() == tmp_path / "xdg" / "llmlab" / "peaks.json"
    monkeypatch.setenv("LLMLAB_PEAKS_CACHE", str(target))
    FakeMachine(monkeypatch, IDLE)
    peaks.measure_peaks("cpu")
    assert target.exists()


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB SXM"),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
    ("NVIDIA L4", "L4"),
    ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
    ("NVIDIA L40S", None),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA GeForce RTX 3090", None),
])
def test_datasheet_lookup(name, expected):
    spec = peaks.datasheet_for(name)
    assert (spec.name if spec else None) == expected


def test_datasheet_values():
    h200 = peaks.datasheet_for("NVIDIA H200")
    assert (h200.bandwidth_gb_s, h200.bf16_tflops) == (4800, 989)
    assert peaks.datasheet_for("NVIDIA A100-SXM4-80GB").bandwidth_gb_s == 2039
    assert peaks.datasheet_for("Tesla T4").bf16_tflops is None
    for spec in peaks.DATASHEET.values():
        assert spec.bandwidth_gb_s > 0 and spec.fp16_tflops > 0 and spec.source


def test_unsupported_device():
    with pytest.raises(ValueError):
        peaks.measure_copy_bandwidth("meta")
