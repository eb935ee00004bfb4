"""Lab 06 (batching): the exercise check accepts the notebook's answer and the package's reference and rejects the
stub and plausible wrong answers with a message that names the mistake; labs/student/ holds the lab without its
answer; the lab's recorded-curve cell says when data/bench/ has no serving curve and draws one when it has (a
synthetic file here). The notebook itself runs under nbval: `pytest labs/06_batching.ipynb`."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmlab.batching import curve_file, trace_runner
from llmlab.batching.static import left_pad, position_ids
from llmlab.solutions import lab06

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "labs" / "06_batching.ipynb"
STUDENT = ROOT / "labs" / "student" / "06_batching.ipynb"


def _tool():
    spec = importlib.util.spec_from_file_location("make_student_labs", ROOT / "tools" / "make_student_labs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def cell_with(path: Path, marker: str) -> str:
    return next(c for c in code_cells(path) if marker in c)


def exercise(path: Path):
    """The notebook's `left_pad_mask_and_positions`, from its exercise cell executed on its own."""
    ns = {"torch": torch}
    exec(compile(cell_with(path, "def left_pad_mask_and_positions("), str(path), "exec"), ns)
    return ns["left_pad_mask_and_positions"]


# -- the exercise check ---------------------------------------------------------------------------------------------

def test_the_notebooks_answer_and_the_reference_pass():
    lab06.check_left_pad(exercise(LAB))
    lab06.check_left_pad(lab06.left_pad_mask_and_positions)


def test_the_stub_is_rejected_with_a_message():
    with pytest.raises(AssertionError, match="not written yet"):
        lab06.check_left_pad(exercise(STUDENT))


def _answer(right=False, invert=False, shared=False, from_one=False, pads_at=None, fixed_pad=None, mask_dtype=None,
            pos_dtype=torch.long, width=0, as_lists=False, mutate=False):
    """A left-pad answer with one deliberate mistake switched on."""
    def fn(prompts, pad_id=0):
        if mutate:
            prompts[0].append(pad_id)
            prompts[0].pop()
            prompts[0].insert(0, pad_id)
        B, T = len(prompts), max(len(p) for p in prompts) + width
        ids = torch.full((B, T), pad_id if fixed_pad is None else fixed_pad, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.bool)
        for b, p in enumerate(prompts):
            cols = slice(0, len(p)) if right else slice(T - len(p), T)
            ids[b, cols] = torch.tensor(p)
            mask[b, cols] = True
        if right:
            pos = torch.arange(T).expand(B, T).clone()
        elif shared:
            pos = torch.arange(T).expand(B, T).clone()
        else:
            pos = position_ids(mask)
            if from_one:
                pos = torch.where(mask, pos + 1, pos)
            if pads_at is not None:
                pos = torch.where(mask, pos, torch.full_like(pos, pads_at))
        if invert:
            mask = ~mask
        if mask_dtype is not None:
            mask = mask.to(mask_dtype)
        out = (ids, mask, pos.to(pos_dtype))
        return tuple(t.tolist() for t in out) if as_lists else out
    return fn


def test_the_test_helper_is_right_when_no_mistake_is_on():
    lab06.check_left_pad(_answer())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_a_mask_of_zeros_and_ones_is_accepted_in_any_integer_dtype(dtype):
    lab06.check_left_pad(_answer(mask_dtype=dtype))


@pytest.mark.parametrize("answer, message", [
    (_answer(right=True), "pads are on the RIGHT"),
    (_answer(invert=True), "mask is inverted"),
    (_answer(shared=True), "counted from the batch's first column"),
    (_answer(from_one=True), "start at 1"),
    (_answer(pads_at=0), r"pads got positions \[0, 0\]; give them \[3, 4\]"),
    (_answer(pads_at=1), "scatter with repeated indices"),
    (_answer(fixed_pad=0), "write pad_id=42"),
    (_answer(mask_dtype=torch.float32), "float mask"),
    (_answer(pos_dtype=torch.int32), "position_ids is torch.int32"),
    (_answer(width=2), r"expected \(B, T\) = \(3, 5\)"),
    (_answer(as_lists=True), "return torch tensors"),
    (_answer(mutate=True), "changed the prompts"),
    (lambda prompts, pad_id=0: left_pad(prompts, pad_id), "return three tensors"),
])
def test_wrong_answers_are_rejected_with_the_reason(answer, message):
    with pytest.raises(AssertionError, match=message):
        lab06.check_left_pad(answer)


def test_the_cases_cover_equal_lengths_a_single_prompt_and_a_one_token_prompt():
    shapes = [[len(p) for p in prompts] for _, prompts, _ in lab06.CASES]
    assert any(len(set(s)) == 1 and len(s) > 1 for s in shapes)  # equal lengths: no pads
    assert any(len(s) == 1 for s in shapes)
    assert any(1 in s and len(s) > 1 for s in shapes)
    assert any(pad_id != 0 for _, _, pad_id in lab06.CASES)


def test_a_wrong_answer_on_one_row_is_named_by_its_row():
    def one_off(prompts, pad_id=0):
        ids, mask, pos = lab06.left_pad_mask_and_positions(prompts, pad_id)
        if len(prompts) == 4:
            pos = pos.clone()
            pos[1, -1] += 5  # one real token of row 1 at a wrong position
        return ids, mask, pos

    with pytest.raises(AssertionError, match="row 1's real tokens got positions"):
        lab06.check_left_pad(one_off)


# -- the student copy ------------------------------------------------------------------------------------------------

def test_the_student_notebook_is_the_lab_without_its_answer():
    (_, dest, text, n), = _tool().plan([LAB], STUDENT.parent)
    assert n == 1 and dest == STUDENT
    assert STUDENT.read_text() == text, "labs/student is stale: run python3 tools/make_student_labs.py"
    student = STUDENT.read_text()
    for answer in ("BEGIN SOLUTION", "END SOLUTION", "torch.arange(L, T)"):
        assert answer not in student
    assert 'raise NotImplementedError(\\"write your answer here\\")' in student


@pytest.mark.parametrize("path", [LAB, STUDENT])
def test_cells_parse_and_outputs_are_stripped(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 12
    for c in code:
        ast.parse("".join(c["source"]))
        assert c["outputs"] == [] and c["execution_count"] is None


def test_the_lab_has_goals_a_summary_and_says_what_needs_a_gpu():
    text = "\n".join("".join(c["source"]) for c in json.loads(LAB.read_text())["cells"] if c["cell_type"] == "markdown")
    assert "**Learning goals.**" in text and "## What you saw" in text
    flat = " ".join(text.split())
    assert "about a minute" in flat and "NVIDIA GPU" in flat
    assert "static batches of 64 requests and a serving curve" in flat


# -- the recorded serving curve ------------------------------------------------------------------------------------

def _run_replay(monkeypatch, directory: Path) -> dict:
    """The lab's plot_curve cell and its recorded-curve cell, as on a CPU, reading curves from `directory`."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    shown = []
    monkeypatch.setattr(curve_file, "DEFAULT_DIR", directory)
    monkeypatch.setattr(go.Figure, "show", lambda self, *a, **k: shown.append(self))
    ns = {"go": go, "make_subplots": make_subplots, "math": math, "trace_runner": trace_runner,
          "work": SimpleNamespace(device=torch.device("cpu"))}
    exec(compile(cell_with(LAB, "def plot_curve("), "plot_curve", "exec"), ns)
    exec(compile(cell_with(LAB, "trace_runner.latest_curve()"), "recorded curve", "exec"), ns)
    ns["shown"] = shown
    return ns


def _curve_rows() -> list[dict]:
    rows = []
    for rate in (4.0, 16.0, 64.0):
        for mode, tps in (("continuous", min(rate * 100, 3000.0)), ("static", min(rate * 100, 1500.0))):
            row = {k: 10.0 for k in trace_runner.CURVE_KEYS}
            row.update(rate=rate, mode=mode, tokens_per_s=tps, requests=64, tokens=6400, n=64)
            rows.append(row)
    return rows


def test_the_lab_says_when_no_curve_is_recorded(tmp_path, monkeypatch, capsys):
    ns = _run_replay(monkeypatch, tmp_path)
    assert ns["recorded"] is None and ns["shown"] == []
    assert "No serving curve recorded on a GPU in data/bench/ yet" in capsys.readouterr().out


def test_the_lab_draws_a_recorded_curve(tmp_path, monkeypatch, capsys):
    trace_runner.save_curve(_curve_rows(), tmp_path / "nvidia-h200_serving_llama-3.2-1b_20261210T000000Z.json",
                            model={"id": "llama-3.2-1b"}, settings={"n": 64}, device="NVIDIA H200",
                            extra={"batch_sweep": [{"batch": 1, "tokens_per_s": 90.0},
                                                   {"batch": 64, "tokens_per_s": 5000.0}]})
    trace_runner.save_curve(_curve_rows(), tmp_path / "cpu.json", model={"id": "default"}, settings={},
                            device="CPU: x (1 threads)")
    ns = _run_replay(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert ns["recorded"]["device"] == "NVIDIA H200" and "NVIDIA H200 | model llama-3.2-1b" in out
    assert re.search(r"rate +64/s continuous +3000 tokens/s", out)
    curve_fig, sweep_fig = ns["shown"]
    offered, *lines = curve_fig.data
    assert list(offered.y) == [400.0, 1600.0, 6400.0]  # rate x 100 tokens per request
    assert [t.name for t in lines] == ["continuous", "continuous (p90)", "static", "static (p90)"]
    assert list(sweep_fig.data[0].x) == [1, 64]


# -- the GPU counters during the batch sweep ------------------------------------------------------------------------

def test_the_sweep_samples_gpu_counters_per_batch_size_where_nvml_works(monkeypatch, capsys):
    """The section-1 cells on the GPU path, with a fake NVML backend (and the default model on this CPU): every
    batch size gets the mean of each counter it read, and the counters cell plots those the device has."""
    import functools

    import plotly.graph_objects as go

    from llmlab.telemetry import nvml_sampler

    class FakeNvml:  # GPU-Util and SM activity, no DRAM counter (like a GPU without GPM for that metric)
        def open(self):
            pass

        def read(self):
            return {"gpu_util_pct": 40.0, "sm_active_pct": 12.0, "read_ms": 0.1}

        def close(self):
            pass

    shown = []
    monkeypatch.setattr(go.Figure, "show", lambda self, *a, **k: shown.append(self))
    cells = code_cells(LAB)
    ns = {"display": lambda obj: None}
    exec(compile(cells[0], "setup", "exec"), ns)
    ns.update(gpu=True, work=ns["llm"], BATCHES=[1, 16], nvml_available=lambda: (True, "fake"),
              Sampler=functools.partial(nvml_sampler.Sampler, interval_s=0.01, backend=FakeNvml()))
    exec(compile(cell_with(LAB, "batch_sweep(work, [b]"), "sweep", "exec"), ns)
    exec(compile(cell_with(LAB, "if live_gpu:\n"), "counters", "exec"), ns)
    assert [r["batch"] for r in ns["sweep"]] == [1, 16]
    assert all(r["gpu_util_pct"] == 40.0 and r["sm_active_pct"] == 12.0 and r["dram_bw_util_pct"] is None
               for r in ns["sweep"])
    counters = shown[-1]
    assert [t.name for t in counters.data] == ["GPU-Util (nvidia-smi)", "SM activity"]
    assert "No GPU counters" not in capsys.readouterr().out
