"""The decode profiler: the counting on hand-made events (GPU and CPU cases), a real CPU profile with its Chrome
trace, and (on a GPU) kernels, launches and idle gaps per token."""

from __future__ import annotations

import gzip
import json

import pytest
from tiny_models import tiny_model

from llmlab.cli import main
from llmlab.engine import LLM
from llmlab.measure.profiling import Ev, call_totals, format_summary, profile_decode, step_gaps_us, summarize


def _gpu_call(n_tokens: int, kernels_per_step: int = 3, step_us: float = 100.0, kernel_us: float = 10.0,
              ranges: bool = True) -> list[Ev]:
    """A fake profiled generate call on a GPU: per step one top-level op (with a nested one), one launch per
    kernel, kernels of `kernel_us` back to back starting 20 us into the step."""
    evs = []
    for i in range(n_tokens):
        t0 = i * step_us
        if ranges:
            evs.append(Ev(f"llmlab.step.{i}", "step", t0, t0 + step_us, step=i))
        evs.append(Ev("aten::linear", "op", t0 + 1, t0 + 15, top_level=True))
        evs.append(Ev("aten::mm", "op", t0 + 2, t0 + 14, top_level=False))
        for k in range(kernels_per_step):
            evs.append(Ev("cudaLaunchKernel", "launch", t0 + 3 + k, t0 + 3.5 + k))
            a = t0 + 20 + k * kernel_us
            evs.append(Ev("gemv_kernel" if k == 0 else "elementwise", "kernel", a, a + kernel_us))
        evs.append(Ev("cudaStreamSynchronize", "sync", t0 + 60, t0 + 99))
    return evs


def test_gpu_counts_per_token_from_two_calls():
    prefill, full = _gpu_call(1), _gpu_call(5)
    s = summarize(prefill, full, n_steps=4)
    assert s["cuda"] is True
    assert s["kernels_per_token"] == 3 and s["launches_per_token"] == 3 and s["syncs_per_token"] == 1
    assert s["aten_ops_per_token"] == 1 and s["aten_calls_per_token"] == 2
    assert s["launch_api_ms_per_token"] == pytest.approx(1.5e-3)
    assert s["gpu_busy_ms_per_token"] == pytest.approx(0.030)
    assert s["step_ms"] == pytest.approx(0.100)
    assert s["gpu_idle_ms_per_token"] == pytest.approx(0.070)
    assert s["gpu_busy_fraction"] == pytest.approx(0.3)
    # last kernel of a step ends at +50 us, the next step's first starts at +120 us: a 70 us gap
    assert s["idle_gap_between_steps_us"] == pytest.approx(70.0)
    assert s["top_kernels"][0]["name"] == "elementwise" and s["top_kernels"][0]["per_token"] == 2
    assert "kernels per token" in format_summary(s)


def test_gaps_are_not_guessed_when_steps_arrive_in_bursts():
    full = [e for e in _gpu_call(5) if e.kind != "step"]
    # on_token fired for all steps at the very end (tokens read back in one block): empty ranges
    full += [Ev(f"llmlab.step.{i}", "step", 500 + i * 0.1, 500 + (i + 1) * 0.1, step=i) for i in range(5)]
    assert step_gaps_us(full) is None
    s = summarize(_gpu_call(1), full, n_steps=4)
    assert s["kernels_per_token"] == 3  # the counts do not need the step ranges
    assert s["idle_gap_between_steps_us"] is None and "read back in blocks" in s["note"]


def test_step_time_comes_from_the_full_calls_own_ranges():
    """A slow prefill-only call (a loaded machine) must not shrink the decode step: the full call's ranges time it."""
    slow_prefill = _gpu_call(1) + [Ev("aten::add", "op", 2000, 2001, top_level=True)]  # wall 2001 us > the full call
    s = summarize(slow_prefill, _gpu_call(5), n_steps=4)
    assert s["step_ms"] == pytest.approx(0.100) and s["step_ms_from"] == "step ranges"
    assert s["gpu_idle_ms_per_token"] == pytest.approx(0.070)
    bursts = [e for e in _gpu_call(5) if e.kind != "step"]
    bursts += [Ev(f"llmlab.step.{i}", "step", 500 + i * 0.1, 500 + (i + 1) * 0.1, step=i) for i in range(5)]
    s = summarize(_gpu_call(1), bursts, n_steps=4)  # ranges that do not follow tokens: the difference of calls
    assert s["step_ms"] == pytest.approx(0.100) and s["step_ms_from"] == "difference of the two calls"


def test_cpu_events_count_operators_only():
    cpu = lambda n: [e for e in _gpu_call(n) if e.kind in ("op", "step")]  # noqa: E731
    s = summarize(cpu(1), cpu(3), n_steps=2)
    assert s["cuda"] is False and s["kernels_per_token"] is None and s["gpu_busy_fraction"] is None
    assert s["aten_ops_per_token"] == 1 and "CPU run" in s["note"]
    assert call_totals([])["wall_us"] == 0.0
    with pytest.raises(ValueError):
        summarize(cpu(1), cpu(3), n_steps=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model(seed=0), name="tiny")


def test_profile_decode_on_cpu_writes_a_trace(llm, tmp_path):
    # 8 steps: the decode time is the difference of two calls, so it must stand well above a loaded CPU's noise
    s = profile_decode(llm, n_steps=8, prompt_len=16, trace_path=tmp_path / "trace.json")
    assert s["device"] == "cpu" and s["cuda"] is False and s["decode_steps"] == 8
    assert s["aten_ops_per_token"] > 10  # a 2-layer decoder calls dozens of operators per token
    assert s["aten_calls_per_token"] >= s["aten_ops_per_token"]
    assert s["step_ms"] > 0
    assert any(op["name"] == "aten::linear" for op in s["top_ops"])
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "llmlab.step.1" in names and "aten::linear" in names
    s2 = profile_decode(llm, n_steps=2, prompt_len=8, settings={"kv_cache": False}, trace_path=tmp_path / "t.json.gz")
    assert s2["setting_label"] == "no KV cache"
    with gzip.open(tmp_path / "t.json.gz") as f:
        assert "traceEvents" in json.load(f)


def test_profile_decode_errors(llm):
    with pytest.raises(ValueError, match="at least one decode step"):
        profile_decode(llm, n_steps=0)
    with pytest.raises(ValueError, match=r"exceed the model.s context of 256 tokens: use a prompt of at most 247"):
        profile_decode(llm, n_steps=8, prompt_len=250)
    # more steps than any prompt leaves room for: only fewer steps help, and no prompt length below 1 is named
    with pytest.raises(ValueError, match=r"use at most 247 decode steps \(n_steps, --steps\)$"):
        profile_decode(llm, n_steps=1100, prompt_len=8)
    with pytest.raises(ValueError, match=r"use at most 254 decode steps"):
        profile_decode(llm, n_steps=255, prompt_len=1)
    with pytest.raises(ValueError, match=r"a shorter prompt and fewer steps: together at most 255 tokens"):
        profile_decode(llm, n_steps=255, prompt_len=255)
    with pytest.raises(ValueError, match="unknown switch"):
        profile_decode(llm, n_steps=2, prompt_len=8, settings={"warp_drive": True})
    with pytest.raises(ValueError, match="cannot run in profile_decode: it times each token"):
        profile_decode(llm, n_steps=2, prompt_len=8, settings={"batching": "continuous"})


def test_cli_profile(capsys, tmp_path):
    assert main(["profile", "--steps", "2", "--prompt-tokens", "8", "--device", "cpu",
                 "--trace", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "aten ops per token" in out and "perfetto" in out


@pytest.mark.gpu
def test_profile_decode_on_gpu_counts_kernels():
    llm = LLM.from_preset("smollm2-135m", device="cuda")
    s = profile_decode(llm, n_steps=6, prompt_len=32)
    print(format_summary(s))
    assert s["cuda"] is True
    assert s["kernels_per_token"] > 50 and s["launches_per_token"] > 50  # eager: ~10 kernels per layer
    assert 0 < s["gpu_busy_fraction"] <= 1
    assert s["gpu_idle_ms_per_token"] >= 0
    from llmlab.switches import SWITCHES

    if "cuda_graphs" in SWITCHES:
        g = profile_decode(llm, n_steps=6, prompt_len=32, settings={"cuda_graphs": True})
        print(format_summary(g))
        assert g["launches_per_token"] < s["launches_per_token"] / 10  # one graph launch replaces them


@pytest.mark.parametrize("bad", ["README.md/x.json", "folder", "/sys/t.json", "t.txt"])
def test_cli_profile_refuses_a_trace_path_before_profiling(bad, capsys, tmp_path, monkeypatch):
    """A trace path inside a file, a folder, an unwritable folder (/sys: not even root may create files), or a
    name that is not .json / .json.gz (the trace is JSON whatever the name says)."""
    import os

    import llmlab.measure.bench

    (tmp_path / "README.md").write_text("a file")
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    if bad.startswith("/sys") and not os.path.isdir("/sys"):
        pytest.skip("no /sys here")

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the trace path was checked")

    monkeypatch.setattr(llmlab.measure.bench, "load_bench_model", no_loading)
    assert main(["profile", "--steps", "2", "--prompt-tokens", "8", "--device", "cpu", "--trace", bad]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("llmlab: error: ") and bad in err and err.count("\n") == 1
    assert "--trace " in err  # the fix: an example of a path that works


def test_profile_refuses_two_dtypes(capsys, monkeypatch):
    """--dtype fp32 with --setting dtype=fp16 ran fp16 without a word."""
    import llmlab.measure.bench

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(llmlab.measure.bench, "load_bench_model", no_loading)
    assert main(["profile", "--device", "cpu", "--dtype", "fp32", "--setting", "dtype=fp16"]) == 2
    err = capsys.readouterr().err
    assert "--dtype fp32 and --setting dtype=fp16 disagree (the setting would win): give the dtype once" in err


class Loaded(Exception):
    """Raised by the stand-in loader: the arguments got past every check made before the load."""


@pytest.fixture
def no_loading(monkeypatch):
    """`load_bench_model` replaced: it records its calls and raises `Loaded` instead of building a model."""
    import llmlab.measure.bench

    calls = []

    def loader(*a, **k):
        calls.append((a, k))
        raise Loaded()

    monkeypatch.setattr(llmlab.measure.bench, "load_bench_model", loader)
    return calls


@pytest.mark.parametrize("setting, refused", [
    ("cuda_graphs=true", "cuda_graphs=true"),
    ("prefill_graphs=on", "prefill_graphs=true"),
    ("pinned_memory=yes", "pinned_memory=true"),
    ("triton_kernels=true", "triton_kernels=true"),  # needs triton and a CUDA GPU
    ("step_tuning=true", "step_tuning=true"),
    ("kv_cache=false,cuda_graphs=true,prefill_graphs=true", "cuda_graphs=true"),  # the first one found is named
])
def test_profile_refuses_a_gpu_only_setting_before_the_model_loads(setting, refused, no_loading, capsys,
                                                                   monkeypatch):
    """On a machine without CUDA, `llmlab profile --setting cuda_graphs=true` built the model (for a preset, GBs of
    random weights) before apply_switches refused the setting."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["profile", "--model", "llama-3.1-8b", "--setting", setting]) == 2
    out, err = capsys.readouterr()
    assert no_loading == [] and out == ""
    assert err.startswith(f"llmlab: error: --setting {refused}: switch ") and err.count("\n") == 1
    assert "cannot run here" in err and f"drop {refused} from --setting" in err  # the fix
    if "triton is not installed" not in err:
        assert "needs a CUDA GPU" in err and "a machine with an NVIDIA GPU" in err


def test_profile_on_the_cpu_of_a_gpu_machine_names_the_device_flag(no_loading, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU is there; --device cpu asks for the CPU
    assert main(["profile", "--device", "cpu", "--setting", "cuda_graphs=true"]) == 2
    err = capsys.readouterr().err
    assert no_loading == []
    assert "needs a CUDA GPU; drop cuda_graphs=true from --setting or run it on the GPU with --device cuda" in err


def test_profile_refuses_torch_compile_without_a_compiler_before_the_model_loads(no_loading, capsys, monkeypatch):
    import shutil

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no g++, c++ or clang++
    assert main(["profile", "--setting", "torch_compile=true"]) == 2
    err = capsys.readouterr().err
    assert no_loading == []
    assert err.startswith("llmlab: error: --setting torch_compile=true: switch 'torch.compile' cannot run here: ")
    assert "C++ compiler" in err and "drop torch_compile=true from --setting" in err


def test_profile_refuses_switches_that_cannot_run_together_before_the_model_loads(no_loading, capsys):
    assert main(["profile", "--device", "cpu", "--setting", "kv_cache=false,gpu_sampling=true"]) == 2
    err = capsys.readouterr().err
    assert no_loading == []
    assert err.startswith("llmlab: error: --setting kv_cache=false,gpu_sampling=true: ")
    assert "turn the KV cache on" in err
    assert main(["profile", "--device", "cpu", "--setting", "kv_cache=false,batching=continuous"]) == 2
    err = capsys.readouterr().err
    assert no_loading == []
    assert err.startswith("llmlab: error: --setting kv_cache=false,batching=continuous: batching='continuous' runs")
    assert "turn kv_cache on" in err
    assert main(["profile", "--device", "cpu", "--setting", "batching=continuous"]) == 2  # alone: the timing's limit
    err = capsys.readouterr().err
    assert no_loading == []
    assert "batching='continuous' cannot run in llmlab profile: it times each token" in err


@pytest.mark.parametrize("setting", ["", "kv_cache=false", "gpu_sampling=true", "dtype=bf16,paged_kv=true",
                                     "cuda_graphs=false,triton_kernels=off"])  # off = the default: nothing to check
def test_profile_lets_settings_a_cpu_runs_reach_the_loader(setting, no_loading, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Loaded):
        main(["profile", "--setting", setting] if setting else ["profile"])
    assert len(no_loading) == 1


def test_a_switch_that_needs_the_model_to_answer_is_left_to_apply_switches(no_loading, monkeypatch):
    """On a GPU, step tuning's availability depends on the model's layers (`step_tuning.fusable`): the check
    before the load cannot answer it and lets it through; `apply_switches` asks again after the load."""
    import dataclasses

    import torch

    from llmlab import switches

    asked = []

    def needs_the_model(llm):
        asked.append(llm.device.type)
        return llm.model is not None, ""  # the stand-in has no model: AttributeError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(switches.SWITCHES, "step_tuning",
                        dataclasses.replace(switches.SWITCHES["step_tuning"], available=needs_the_model))
    with pytest.raises(Loaded):
        main(["profile", "--device", "cuda", "--setting", "step_tuning=true"])
    assert asked == ["cuda"] and len(no_loading) == 1


def test_profile_decode_checks_the_trace_path_first(llm, tmp_path):
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ValueError, match=r"f is a file, not a folder"):
        profile_decode(llm, n_steps=2, prompt_len=8, trace_path=tmp_path / "f" / "x.json")


def test_a_trace_the_exporter_did_not_write_is_reported(llm, tmp_path, capsys, monkeypatch):
    """torch's exporter only logs when it cannot open the file: the file is checked before "trace:" is printed."""
    from torch.profiler import profile

    monkeypatch.setattr(profile, "export_chrome_trace", lambda self, path: None)  # writes nothing, raises nothing
    s = profile_decode(llm, n_steps=2, prompt_len=8, trace_path=tmp_path / "t.json")
    assert s["trace_path"] is None and "not written to" in s["trace_error"]
    assert "trace: NOT written" in format_summary(s) and "perfetto" not in format_summary(s)
    assert main(["profile", "--steps", "2", "--prompt-tokens", "8", "--device", "cpu",
                 "--trace", str(tmp_path / "p.json")]) == 2
    out, err = capsys.readouterr()
    assert "perfetto" not in out and err.startswith("llmlab: error: the trace was not written to")


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_a_failed_export_keeps_the_previous_trace_and_leaves_no_temp_file(llm, tmp_path, monkeypatch, name):
    from torch.profiler import profile

    old = tmp_path / name
    old.write_bytes(b"the previous trace")

    def disk_full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(profile, "export_chrome_trace", disk_full)
    s = profile_decode(llm, n_steps=2, prompt_len=8, trace_path=old)
    assert s["trace_path"] is None and "No space left" in s["trace_error"]
    assert old.read_bytes() == b"the previous trace" and sorted(p.name for p in tmp_path.iterdir()) == [name]
    monkeypatch.undo()
    s = profile_decode(llm, n_steps=2, prompt_len=8, trace_path=old)  # a good export replaces it
    assert s["trace_path"] is not None and old.stat().st_size > 100 and len(list(tmp_path.iterdir())) == 1
