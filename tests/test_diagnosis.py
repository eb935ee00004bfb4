"""Lab 08's diagnosis: the rules on synthetic measurements (every class, every threshold, the order), the numbers
they read (MFU / MBU is intensity / ridge, the KV share's bytes), the recorded H200 rows classified as their numbers
say, live measurements and sweeps on a tiny CPU model, the trace read back for a timeline, ONNX Runtime's skip and
its plumbing, and the exercise check (the reference and the notebook's answer pass; the stub and plausible wrong
answers are rejected with their reason)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from llmlab.config import ModelConfig
from llmlab.engine import LLM
from llmlab.measure import diagnosis, roofline
from llmlab.measure.bench_file import latest_ladder
from llmlab.measure.diagnosis import (BANDWIDTH_BOUND, CLASSES, COMPUTE_BOUND, KV_BOUND, LAUNCH_BOUND, RULES,
                                      Measurements, Rule, classify, diagnose)
from llmlab.solutions import lab08

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "labs" / "08_diagnosis.ipynb"
STUDENT = ROOT / "labs" / "student" / "08_diagnosis.ipynb"
PEAKS = {"copy_GBps": 10.0, "bf16_TFLOPs": 0.05}  # a made-up CPU: nothing is measured in these tests


def m(idle=0.1, mbu=0.5, mfu=0.01, kv=0.1) -> Measurements:
    return Measurements(idle_share=idle, mbu=mbu, mfu=mfu, kv_share=kv)


# -- Measurements ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("idle_share", -0.01), ("idle_share", 1.01), ("idle_share", math.nan), ("idle_share", None), ("idle_share", True),
    ("mbu", 0.0), ("mbu", -0.2), ("mbu", math.inf), ("mfu", -1e-9), ("mfu", "0.1"), ("kv_share", 1.5),
    ("kv_share", -0.1),
])
def test_bad_measurements_are_refused_naming_the_field(field, value):
    kwargs = dict(idle_share=0.1, mbu=0.5, mfu=0.01, kv_share=0.1)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        Measurements(**kwargs)


def test_the_ends_of_each_range_are_accepted():
    Measurements(idle_share=0, mbu=1e-9, mfu=0, kv_share=0)
    Measurements(idle_share=1, mbu=1.4, mfu=2, kv_share=1)  # MBU above 1: a CPU whose caches beat the copy


def test_mfu_over_mbu_is_intensity_over_ridge():
    cfg = ModelConfig.from_preset("llama-3.2-1b")
    for batch, ctx, step_s in ((1, 128, 8e-4), (64, 300, 2e-3), (256, 4000, 9e-3)):
        mbu = roofline.mbu(step_s, cfg, batch, ctx, 4193)
        mfu = roofline.mfu(step_s, cfg, batch, ctx, 671)
        want = roofline.arithmetic_intensity(cfg, batch, ctx) / roofline.ridge_point(671, 4193)
        assert math.isclose(m(mbu=mbu, mfu=mfu).mfu_over_mbu, want, rel_tol=1e-9)


# -- the rules ------------------------------------------------------------------------------------------------------

def test_the_rule_table_is_the_one_the_lab_states():
    assert {r.label for r in RULES} == set(CLASSES) and len(RULES) == len(CLASSES)
    assert [(r.label, r.quantity, r.threshold) for r in RULES] == [
        (LAUNCH_BOUND, "idle_share", 0.5), (COMPUTE_BOUND, "mfu_over_mbu", 1.0), (KV_BOUND, "kv_share", 0.5),
        (BANDWIDTH_BOUND, None, None)]
    assert all(r.why and r.fix for r in RULES)
    lab = "".join("".join(c["source"]) for c in json.loads(LAB.read_text())["cells"] if c["cell_type"] == "markdown")
    for text in ("idle share ≥ 0.5", "MFU ≥ MBU", "KV share ≥ 0.5"):
        assert text in lab, f"the lab's rule table no longer states {text!r}"


@pytest.mark.parametrize("meas, label", [
    (m(idle=0.8, mbu=0.05, mfu=0.0003, kv=0.003), LAUNCH_BOUND),
    (m(idle=0.04, mbu=0.77, mfu=0.005, kv=0.003), BANDWIDTH_BOUND),
    (m(idle=0.03, mbu=0.6, mfu=0.02, kv=0.85), KV_BOUND),
    (m(idle=0.05, mbu=0.3, mfu=0.5, kv=0.05), COMPUTE_BOUND),
    # the order: launch-bound before everything, compute-bound before KV-bound
    (m(idle=0.7, mbu=0.05, mfu=0.2, kv=0.9), LAUNCH_BOUND),
    (m(idle=0.2, mbu=0.3, mfu=0.35, kv=0.6), COMPUTE_BOUND),
    # each threshold exactly (>=) and just below
    (m(idle=0.5), LAUNCH_BOUND), (m(idle=0.4999), BANDWIDTH_BOUND),
    (m(mbu=0.2, mfu=0.2), COMPUTE_BOUND), (m(mbu=0.2, mfu=0.1999), BANDWIDTH_BOUND),
    (m(kv=0.5), KV_BOUND), (m(kv=0.4999), BANDWIDTH_BOUND),
    # the extremes of each range
    (m(idle=1.0, mbu=1e-6, mfu=0.0, kv=1.0), LAUNCH_BOUND), (m(idle=0.0, mbu=1.3, mfu=0.0, kv=0.0), BANDWIDTH_BOUND),
])
def test_the_first_rule_that_holds_decides(meas, label):
    d = diagnose(meas)
    assert d.label == label == classify(meas) and d.rule.label == label
    checked = [r for r in RULES if r.quantity is not None][:len(d.evidence)]
    assert len(d.evidence) == RULES.index(d.rule) + 1  # one line per rule checked, the deciding one last
    assert all(line.startswith(r.quantity) for line, r in zip(d.evidence, checked))


def test_diagnose_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match="Measurements"):
        diagnose({"idle_share": 0.9, "mbu": 0.1, "mfu": 0.0, "kv_share": 0.0})
    no_catch_all = (Rule(LAUNCH_BOUND, "idle_share", 0.5, "why", "fix"),)
    assert diagnose(m(idle=0.9), no_catch_all).label == LAUNCH_BOUND
    with pytest.raises(ValueError, match="catch-all"):
        diagnose(m(idle=0.1), no_catch_all)


# -- the KV share's bytes -------------------------------------------------------------------------------------------

def test_kv_share_is_the_cache_over_all_bytes_read():
    cfg = ModelConfig.from_preset("llama-3.2-1b")
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, bf16: 32 KiB for this shape
    weights = roofline.weight_params_read(cfg) * 2
    for batch, ctx in ((1, 0), (1, 8064), (16, 8064), (64, 131072)):
        kv = batch * ctx * per_token
        assert math.isclose(diagnosis.kv_share(cfg, batch, ctx), kv / (kv + weights), rel_tol=1e-12, abs_tol=1e-15)
    shares = [diagnosis.kv_share(cfg, b, c) for b in (1, 4) for c in (128, 1024, 8192)]
    assert shares[:3] == sorted(shares[:3]) and all(a < b for a, b in zip(shares[:3], shares[3:]))


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_kv_bound_context_is_where_the_share_reaches_the_threshold(batch):
    cfg = ModelConfig.from_preset("llama-3.2-1b")
    ctx = diagnosis.kv_bound_context(cfg, batch)
    assert math.isclose(diagnosis.kv_share(cfg, batch, ctx), 0.5, rel_tol=1e-9)
    assert classify(m(kv=diagnosis.kv_share(cfg, batch, ctx * 1.01))) == KV_BOUND
    assert classify(m(kv=diagnosis.kv_share(cfg, batch, ctx * 0.99))) == BANDWIDTH_BOUND
    with pytest.raises(ValueError, match="batch"):
        diagnosis.kv_bound_context(cfg, 0)


# -- the recorded H200 runs -----------------------------------------------------------------------------------------

def _recorded(workload: str) -> dict:
    doc = latest_ladder(workload, "llama-3.2-1b")
    if doc is None:
        pytest.skip(f"no recorded {workload} ladder of the 1B shape in data/bench/")
    return doc


def _row(doc: dict, step: str) -> dict:
    return next(r for r in doc["results"] if r["step"] == step)


def test_the_recorded_chat_rows_classify_as_their_numbers_say():
    doc = _recorded("chat")
    eager = _row(doc, "eager")
    assert eager["gpu_util"] < 0.5  # the GPU ran a kernel less than half the time: idle share > 0.5
    assert diagnosis.classify(diagnosis.measurements_from_bench(eager, doc)) == LAUNCH_BOUND
    top = max((r for r in doc["results"] if r["step"] != "roofline" and not r["step"].startswith("hf_")),
              key=lambda r: r["tokens_per_s"])
    meas = diagnosis.measurements_from_bench(top, doc)
    # busy most of the step, far below the ridge (MFU < MBU), a 128-token context: a sliver of KV bytes
    assert top["gpu_util"] >= 0.5 and top["mfu"] < top["mbu"] and meas.kv_share < 0.05
    assert classify(meas) == BANDWIDTH_BOUND
    assert meas.idle_share == pytest.approx(1 - top["gpu_util"]) and meas.mbu == top["mbu"]


def test_the_recorded_long_row_is_classified_by_its_kv_share():
    doc = _recorded("long")
    cfg = ModelConfig.from_preset("llama-3.2-1b")
    prompt, new = doc["workload"]["prompt_lens"][0], doc["workload"]["new_tokens"]
    kv = roofline.kv_cache_bytes(cfg, 1, prompt + new / 2)  # the mean context of the decode steps, bf16
    want = kv / (kv + roofline.weight_bytes(cfg))
    for row in doc["results"]:
        if row["gpu_util"] is None:
            continue
        meas = diagnosis.measurements_from_bench(row, doc)
        assert meas.kv_share == pytest.approx(want, rel=1e-9)
        expected = (LAUNCH_BOUND if row["gpu_util"] <= 0.5 else COMPUTE_BOUND if row["mfu"] >= row["mbu"]
                    else KV_BOUND if want >= 0.5 else BANDWIDTH_BOUND)
        assert classify(meas) == expected, row["step"]


def test_bench_rows_group_their_prompts_as_the_engine_ran_them():
    cfg = ModelConfig.from_preset("llama-3.2-1b")
    doc = {"device": "GPU", "model": {"id": "llama-3.2-1b", "dtype": "bfloat16"},
           "workload": {"prompt_lens": [64, 512], "requests": 32, "new_tokens": 10}}
    row = {"step": "eager", "new_tokens": 10, "weight_bytes_per_param": 2.0}
    kv = sum(16 * roofline.kv_cache_bytes(cfg, 1, p + 5) for p in (64, 512))
    assert diagnosis.bench_kv_share(row, doc) == pytest.approx(kv / (kv + 2 * roofline.weight_bytes(cfg)))
    with pytest.raises(ValueError, match="gpu_util"):
        diagnosis.measurements_from_bench({"step": "roofline", "gpu_util": None, "mbu": 1.0, "mfu": 0.01}, doc)
    with pytest.raises(ValueError, match="config="):
        diagnosis.bench_kv_share(row, {**doc, "model": {"id": "my-model"}})


def test_classify_bench_leaves_out_the_roofline_row():
    doc = _recorded("chat")
    rows = diagnosis.classify_bench(doc)
    assert "roofline" not in {r["step"] for r in rows} and rows
    assert all(r["label"] == classify(r["measurements"]) for r in rows)


# -- live measurements and sweeps on a tiny CPU model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return LLM(tiny_model(seed=0), name="tiny")


def test_measure_step_reads_its_numbers_from_one_run(tiny, tmp_path):
    r = diagnosis.measure_step(tiny, prompt_len=24, new_tokens=6, batch=2, peaks=PEAKS, us_per_op=3.0,
                               profile_steps=2, trace_path=tmp_path / "t.json")
    cfg = tiny.config
    assert r["label"] in CLASSES and r["label"] == classify(r["measurements"])
    assert r["context_len"] == roofline.decode_mean_context_len(24, 6)
    assert r["kv_share"] == pytest.approx(diagnosis.kv_share(cfg, 2, r["context_len"], 4, 4))  # fp32 on a CPU
    assert r["mbu"] == pytest.approx(roofline.mbu(r["tpot_ms"] / 1e3, cfg, 2, r["context_len"], 10.0, 4, 4))
    assert r["idle_share"] == pytest.approx(min(1.0, r["aten_ops_per_token"] * 3.0 / 1e3 / r["tpot_ms"]))
    assert r["kernels_per_token"] is None and r["aten_ops_per_token"] > 10
    lanes = {row["lane"] for row in diagnosis.trace_timeline(r["profile"]["trace_path"], steps=(1,))}
    assert lanes == {"step", "host: operator"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(new_tokens=1), "new_tokens"), (dict(batch=0), "batch"), (dict(prompt_len=0), "prompt_len"),
    (dict(profile_steps=0), "profile_steps"), (dict(prompt_len=250, new_tokens=8), "context"),
    (dict(batch=1.5), "batch"),
])
def test_measure_step_refuses_a_workload_before_running_it(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        diagnosis.measure_step(tiny, **{"prompt_len": 8, "new_tokens": 4, **kwargs}, peaks=PEAKS)


def test_a_sweep_changes_one_thing(tiny):
    rows = diagnosis.sweep(tiny, "batch", [1, 3], prompt_len=8, new_tokens=4, peaks=PEAKS, us_per_op=3.0,
                           profile_steps=1)
    assert [(r["vary"], r["value"], r["batch"], r["prompt_len"]) for r in rows] == [("batch", 1, 1, 8),
                                                                                   ("batch", 3, 3, 8)]
    rows = diagnosis.sweep(tiny, "prompt_len", [8, 40], new_tokens=4, peaks=PEAKS, us_per_op=3.0, profile_steps=1)
    assert rows[0]["kv_share"] < rows[1]["kv_share"] and {r["batch"] for r in rows} == {1}


def test_a_rung_sweep_on_a_cpu_runs_eager_and_says_why_not_the_rest(tiny):
    lines = []
    rows = diagnosis.sweep(tiny, "rung", diagnosis.RUNTIME_RUNGS, prompt_len=8, new_tokens=4, peaks=PEAKS,
                           us_per_op=3.0, profile_steps=1, log=lines.append)
    assert [r["value"] for r in rows] == list(diagnosis.RUNTIME_RUNGS) and len(lines) == len(rows)
    assert rows[0]["skipped"] is None and rows[0]["label"] in CLASSES
    if not torch.cuda.is_available():
        assert all(r["skipped"] and r["label"] is None for r in rows[1:])
        assert "CUDA" in rows[1]["skipped"]


def test_a_sweep_refuses_bad_values_before_measuring_any(tiny, monkeypatch):
    monkeypatch.setattr(diagnosis, "measure_step", lambda *a, **k: pytest.fail("measured before checking"))
    with pytest.raises(ValueError, match="vary"):
        diagnosis.sweep(tiny, "threads", [1], peaks=PEAKS)
    with pytest.raises(ValueError, match="empty"):
        diagnosis.sweep(tiny, "batch", [], peaks=PEAKS)
    with pytest.raises(ValueError, match="context"):
        diagnosis.sweep(tiny, "prompt_len", [8, 400], new_tokens=4, peaks=PEAKS, us_per_op=1.0)
    with pytest.raises(ValueError, match="unknown ladder step"):
        diagnosis.sweep(tiny, "rung", ["eagre"], peaks=PEAKS, us_per_op=1.0)


# -- the trace read back --------------------------------------------------------------------------------------------

def _trace(tmp_path: Path, gz: bool) -> Path:
    ev = [{"ph": "X", "cat": "user_annotation", "name": "llmlab.step.1", "ts": 1000.0, "dur": 100.0},
          {"ph": "X", "cat": "user_annotation", "name": "llmlab.step.2", "ts": 1100.0, "dur": 100.0},
          {"ph": "X", "cat": "gpu_user_annotation", "name": "llmlab.step.2", "ts": 1130.0, "dur": 500.0},
          {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 1010.0, "dur": 30.0},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1012.0, "dur": 20.0},  # inside linear: left out
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1015.0, "dur": 4.0},
          {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 1030.0, "dur": 12.0},
          {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1110.0, "dur": 5.0},
          {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1300.0, "dur": 5.0},  # after the steps
          {"ph": "i", "name": "marker", "ts": 1050.0}]
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    with (gzip.open(path, "wt") if gz else open(path, "w")) as f:
        json.dump({"traceEvents": ev}, f)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_the_timeline_keeps_top_level_operators_launches_and_kernels(tmp_path, gz):
    rows = diagnosis.trace_timeline(_trace(tmp_path, gz), steps=(1, 2))
    got = [(r["lane"], r["name"], r["start_us"]) for r in rows]
    assert got == [("step", "llmlab.step.1", 0.0), ("step", "llmlab.step.2", 100.0),
                   ("host: operator", "aten::linear", 10.0), ("host: CUDA API", "cudaLaunchKernel", 15.0),
                   ("GPU: kernel", "gemv", 30.0), ("host: operator", "aten::add", 110.0)]
    with pytest.raises(ValueError, match="llmlab.step"):
        diagnosis.trace_timeline(_trace(tmp_path, gz), steps=(7,))


# -- ONNX Runtime ---------------------------------------------------------------------------------------------------

def _no_ort(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("onnxruntime", "onnx") else real(name, *a))


def test_onnxruntime_is_skipped_with_the_reason_where_it_is_missing(tiny, monkeypatch):
    _no_ort(monkeypatch)
    ok, why = diagnosis.onnxruntime_status()
    assert not ok and "onnxruntime" in why and "pip install" in why
    out = diagnosis.onnxruntime_forward(tiny)
    assert out == {"available": False, "reason": why, "rows": []}


def _fake_ort(monkeypatch, tiny, export_error=None):
    """onnxruntime and onnx 'installed': the export writes a marker file, the session runs the model itself."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("onnxruntime", "onnx") else real(name, *a))
    exported = []

    def export(model, args, path, **kw):
        if export_error:
            raise export_error
        exported.append(kw)
        Path(path).write_bytes(b"onnx")

    class Session:
        def __init__(self, path, opts, providers):
            assert Path(path).read_bytes() == b"onnx" and opts.intra_op_num_threads == 1
            self.providers = providers

        def run(self, outputs, feed):
            with torch.inference_mode():
                return [tiny.model(torch.from_numpy(feed["input_ids"])).numpy()]

    fake = types.SimpleNamespace(SessionOptions=lambda: types.SimpleNamespace(), InferenceSession=Session)
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    monkeypatch.setattr(torch.onnx, "export", export)
    return exported


def test_onnxruntime_rows_where_it_is_installed(tiny, monkeypatch):
    exported = _fake_ort(monkeypatch, tiny)
    out = diagnosis.onnxruntime_forward(tiny, context_len=16, repeats=2)
    assert out["available"] and [r["runtime"] for r in out["rows"]] == ["PyTorch eager", "ONNX Runtime (CPU)"]
    assert all(r["ms"] > 0 for r in out["rows"]) and out["rows"][1]["max_abs_diff"] == 0.0
    assert exported[0]["dynamo"] is False and exported[0]["input_names"] == ["input_ids"]


def test_a_failed_export_is_reported_not_raised(tiny, monkeypatch):
    _fake_ort(monkeypatch, tiny, export_error=RuntimeError("unsupported operator"))
    out = diagnosis.onnxruntime_forward(tiny, context_len=16)
    assert not out["available"] and "unsupported operator" in out["reason"]
    with pytest.raises(ValueError, match="context_len"):
        diagnosis.onnxruntime_forward(tiny, context_len=0)
    with pytest.raises(ValueError, match="fp32"):
        diagnosis.onnxruntime_forward(LLM(tiny_model(seed=1).to(torch.bfloat16), name="bf16"))


# -- the exercise check ---------------------------------------------------------------------------------------------

def _notebook_classify(path: Path):
    cell = next("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                if c["cell_type"] == "code" and "def classify(" in "".join(c["source"]))
    ns: dict = {}
    exec(compile(cell, str(path), "exec"), ns)
    return ns["classify"]


def test_the_reference_and_the_notebooks_answer_pass():
    lab08.check_classify(classify)
    lab08.check_classify(_notebook_classify(LAB))


def test_the_cases_cover_every_class_and_threshold():
    labels = {classify(c) for _, c in lab08.CASES}
    assert labels == set(CLASSES)
    assert any(c.idle_share == 0.5 for _, c in lab08.CASES) and any(c.kv_share == 0.5 for _, c in lab08.CASES)
    assert any(c.mfu == c.mbu for _, c in lab08.CASES)


def test_the_stub_is_rejected():
    def stub(m):
        raise NotImplementedError("write your answer here")
    with pytest.raises(AssertionError, match="not written yet"):
        lab08.check_classify(stub)
    if STUDENT.exists():
        with pytest.raises(AssertionError, match="not written yet"):
            lab08.check_classify(_notebook_classify(STUDENT))


@pytest.mark.parametrize("i", range(len(lab08.WRONG_ANSWERS)))
def test_each_plausible_wrong_answer_is_rejected_with_its_reason(i):
    wrong, why = lab08.WRONG_ANSWERS[i]
    assert any(wrong(c) != classify(c) for _, c in lab08.CASES), "this wrong answer agrees with the rules"
    with pytest.raises(AssertionError) as e:
        lab08.check_classify(wrong)
    assert str(e.value) == why


def test_other_wrong_answers_get_the_step_and_the_rule():
    with pytest.raises(AssertionError, match=r"the rules say 'launch-bound': idle_share = 0.75 >= 0.5"):
        lab08.check_classify(lambda meas: BANDWIDTH_BOUND)
    with pytest.raises(AssertionError, match="mind the capitals"):
        lab08.check_classify(lambda meas: "Launch-bound")
    with pytest.raises(AssertionError, match="return exactly one of"):
        lab08.check_classify(lambda meas: None)


def test_the_student_notebook_is_the_lab_without_its_answer():
    tool = ROOT / "tools" / "make_student_labs.py"
    if not tool.exists():
        pytest.skip("tools/make_student_labs.py is not in this tree")
    spec = importlib.util.spec_from_file_location("make_student_labs", tool)
    msl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(msl)
    (_, dest, text, n), = msl.plan([LAB], STUDENT.parent)
    assert n == 1 and dest == STUDENT
    assert STUDENT.read_text() == text, "labs/student is stale: run python3 tools/make_student_labs.py"
    assert "m.mfu >= m.mbu" not in STUDENT.read_text()


def test_the_lab_has_goals_a_summary_and_stripped_outputs():
    nb = json.loads(LAB.read_text())
    text = ["".join(c["source"]) for c in nb["cells"]]
    assert "Learning goals" in text[0] and text[-1].startswith("## What you saw")
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in nb["cells"] if c["cell_type"] == "code")
