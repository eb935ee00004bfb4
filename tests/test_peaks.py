"""Peak measurement (on the CPU here), its JSON cache, and the datasheet table."""

import json
import time

import pytest

from llmlab import peaks


def test_cpu_measurements_are_positive_and_quick():
    t0 = time.perf_counter()
    bw = peaks.measure_copy_bandwidth("cpu", nbytes=16 << 20, repeats=3)
    tflops = peaks.measure_matmul_tflops("cpu")
    assert time.perf_counter() - t0 < 2.0
    assert 0.1 < bw < 10_000  # GB/s: any real CPU
    assert 1e-4 < tflops < 100  # TFLOP/s


def test_measure_peaks_caches(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "peaks.json"
    first = peaks.measure_peaks("cpu", cache_path=path)
    assert not first.cached and first.copy_bw_gb_s > 0 and first.matmul_tflops > 0
    assert first.matmul_dtype == "float32" and first.datasheet_bw_gb_s is None
    data = json.loads(path.read_text())
    assert list(data) == [f"{first.device_name} | torch {first.torch_version}"]

    def boom(*a, **k):
        raise AssertionError("should have been read from the cache")

    monkeypatch.setattr(peaks, "measure_copy_bandwidth", boom)
    monkeypatch.setattr(peaks, "measure_matmul_tflops", boom)
    second = peaks.measure_peaks("cpu", cache_path=path)
    assert second.cached and second.copy_bw_gb_s == first.copy_bw_gb_s
    assert second.matmul_tflops == first.matmul_tflops


def test_refresh_and_corrupt_cache(tmp_path, monkeypatch):
    path = tmp_path / "peaks.json"
    path.write_text("{not json")
    monkeypatch.setattr(peaks, "measure_copy_bandwidth", lambda *a, **k: 12.5)
    monkeypatch.setattr(peaks, "measure_matmul_tflops", lambda *a, **k: 0.25)
    p = peaks.measure_peaks("cpu", cache_path=path)  # corrupt file: measured and rewritten
    assert (p.copy_bw_gb_s, p.matmul_tflops, p.cached) == (12.5, 0.25, False)
    monkeypatch.setattr(peaks, "measure_copy_bandwidth", lambda *a, **k: 13.0)
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
    monkeypatch.setattr(peaks, "measure_copy_bandwidth", lambda *a, **k: 12.5)
    monkeypatch.setattr(peaks, "measure_matmul_tflops", lambda *a, **k: 0.25)
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
    child = subprocess.run([sys.executable, "-c", "from llmlab.peaks import default_cache_path as d; print(d())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(path)


def test_cache_path_from_env(tmp_path, monkeypatch):
    target = tmp_path / "env-peaks.json"
    monkeypatch.setenv("LLMLAB_PEAKS_CACHE", str(target))
    assert peaks.default_cache_path() == target
    monkeypatch.delenv("LLMLAB_PEAKS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert peaks.default_cache_path() == tmp_path / "xdg" / "llmlab" / "peaks.json"
    monkeypatch.setenv("LLMLAB_PEAKS_CACHE", str(target))
    monkeypatch.setattr(peaks, "measure_copy_bandwidth", lambda *a, **k: 1.0)
    monkeypatch.setattr(peaks, "measure_matmul_tflops", lambda *a, **k: 0.01)
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
