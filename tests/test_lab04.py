"""Lab 04 (weight quantization): the exercise check accepts the notebook's answer and the kernels' reference and
rejects the stub and plausible wrong answers with a message that names the mistake; tools/make_student_labs.py takes
the answers out (and refuses unbalanced markers); labs/student/ matches the lab and is not collected by pytest; the
lab's GPU section replays a recorded run with quantized rungs (a synthetic bench file here) or says there is none.
The notebook itself runs under nbval: `pytest labs/04_quantization.ipynb`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmlab.kernels.weight_quant import dequantize_int4, quantize_int4
from llmlab.measure import bench_file, roofline
from llmlab.solutions import lab04

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "labs" / "04_quantization.ipynb"
STUDENT = ROOT / "labs" / "student" / "04_quantization.ipynb"


def _tool():
    spec = importlib.util.spec_from_file_location("make_student_labs", ROOT / "tools" / "make_student_labs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


msl = _tool()


def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def exercise(path: Path) -> tuple:
    """(quantize, dequantize) defined by the notebook's exercise cell, executed on its own."""
    cell = next(c for c in code_cells(path) if "def quantize_int4_groupwise(" in c)
    ns = {"torch": torch}
    exec(compile(cell, str(path), "exec"), ns)
    return ns["quantize_int4_groupwise"], ns["dequantize_int4_groupwise"]


# -- the exercise check ---------------------------------------------------------------------------------------------

def test_the_notebooks_answer_and_the_reference_pass():
    lab04.check_int4_groupwise(*exercise(LAB))
    lab04.check_int4_groupwise(quantize_int4, dequantize_int4)


def test_the_stub_is_rejected():
    quantize, dequantize = exercise(STUDENT)
    with pytest.raises((AssertionError, NotImplementedError), match="not written yet|write your answer"):
        lab04.check_int4_groupwise(quantize, dequantize)
    good_q, good_dq = exercise(LAB)  # one written, the other not: still rejected, naming the missing one
    with pytest.raises(AssertionError, match="dequantize_int4_groupwise is not written yet"):
        lab04.check_int4_groupwise(good_q, dequantize)


def _quantize(w, g, divisor=7.0, swap=False, per_row=False, floor=True, twos=False, strided=False, eps=0.0,
              offset=8, in_dtype=False, scale_dtype=False, signed_max=False):
    """Group-wise int4 with one deliberate mistake switched on."""
    N, K = w.shape
    if scale_dtype:  # max |w| / 7 computed in w's own dtype (bf16), then made fp32
        amax = w.reshape(N, K // g, g).abs().amax(dim=2).clamp(min=1e-12)
        scales = (amax / divisor).float()
        u = (torch.round(w.float().reshape(N, K // g, g) / scales[..., None]).clamp(-8, 7) + offset)
        u = u.to(torch.uint8).reshape(N, K)
        return u[:, 0::2] | (u[:, 1::2] << 4), scales.contiguous()
    if strided:  # "groups" of every (K // g)-th input: (N, g, K // g) reduced over dim 1
        amax = w.float().reshape(N, g, K // g).abs().amax(dim=1)
    else:
        groups = w.float().reshape(N, K // g, g)
        amax = groups.abs().amax(dim=(1, 2))[:, None].expand(N, K // g) if per_row else groups.abs().amax(dim=2)
        amax = groups.amax(dim=2) if signed_max else amax  # the largest weight, not the largest magnitude
    scales = (amax.clamp(min=1e-12) if floor else amax) / divisor + eps
    groups = (w if in_dtype else w.float()).reshape(N, K // g, g)
    quotient = groups / scales[..., None].to(groups.dtype)  # in_dtype: rounded to w's dtype before round()
    q = torch.round(quotient.float()).clamp(-8, 7)
    u = (q.long() % 16 if twos else q + offset).to(torch.uint8).reshape(N, K)
    lo, hi = (u[:, 1::2], u[:, 0::2]) if swap else (u[:, 0::2], u[:, 1::2])
    return lo | (hi << 4), scales.contiguous()


def _dequantize(packed, scales, swap=False, offset=8, tile=False, wrap=False):
    N = packed.shape[0]
    lo, hi = (packed >> 4, packed & 0xF) if swap else (packed & 0xF, packed >> 4)
    u = torch.stack([lo, hi], -1).reshape(N, -1)
    u = (u - offset).float() + offset if wrap else u.float()  # wrap: u - 8 in uint8 arithmetic
    G = u.shape[1] // scales.shape[1]
    return (u - offset) * (scales.repeat(1, G) if tile else scales.repeat_interleave(G, dim=1))


def test_the_test_helpers_are_right_when_no_mistake_is_on():
    lab04.check_int4_groupwise(_quantize, _dequantize)


@pytest.mark.parametrize("quantize, dequantize, message", [
    (lambda w, g: _quantize(w, g, swap=True), _dequantize, "swapped"),
    (lambda w, g: _quantize(w, g, divisor=8.0), _dequantize, "divided by 8"),
    (lambda w, g: _quantize(w, g, divisor=15.0), _dequantize, "divided by 15"),
    (lambda w, g: _quantize(w, g, per_row=True), _dequantize, "one scale per ROW"),
    (lambda w, g: _quantize(w, g, floor=False), _dequantize, "all-zero group"),
    (lambda w, g: _quantize(w, g, twos=True), _dequantize, "two's complement"),
    (lambda w, g: _quantize(w, g, strided=True), _dequantize, "CONSECUTIVE inputs"),
    (lambda w, g: _quantize(w, g, eps=1e-6), _dequantize, "close but not equal.*nothing added"),
    (lambda w, g: _quantize(w, g, signed_max=True), _dequantize, "largest SIGNED weight.*w.abs"),
    (lambda w, g: _quantize(w, g, offset=7), _dequantize, "one below round.*the offset is 8"),
    (lambda w, g: _quantize(w, g, in_dtype=True), _dequantize, "this weight is torch.bfloat16: divide in fp32"),
    (lambda w, g: _quantize(w, g, scale_dtype=True), _dequantize, r"computed in torch.bfloat16.*w = w.float\(\)"),
    (lambda w, g: (_quantize(w, g)[0], _quantize(w, g)[1][:, :1]), _dequantize, "not one per row"),
    (lambda w, g: (_quantize(w, g)[0], _quantize(w, g)[1].bfloat16()), _dequantize, "float32"),
    (lambda w, g: (_quantize(w, g)[1], _quantize(w, g)[0]), _dequantize, "uint8"),
    (lambda w, g: None, _dequantize, "return a pair"),
    (_quantize, lambda p, s: _dequantize(p, s, swap=True), "wrong order"),
    (_quantize, lambda p, s: _dequantize(p, s, offset=7), "offset is 8"),
    (_quantize, lambda p, s: _dequantize(p, s, tile=True), "repeat_interleave"),
    (_quantize, lambda p, s: _dequantize(p, s, wrap=True), "uint8, where u - 8 wraps around"),
    (_quantize, lambda p, s: _dequantize(p, s).double(), "float32"),
])
def test_wrong_answers_are_rejected_with_the_reason(quantize, dequantize, message):
    with pytest.raises(AssertionError, match=message):
        lab04.check_int4_groupwise(quantize, dequantize)


def test_an_answer_that_changes_its_input_is_rejected():
    def in_place(w, g):
        out = _quantize(w, g)
        w.mul_(2)
        return out

    with pytest.raises(AssertionError, match="in place"):
        lab04.check_int4_groupwise(in_place, _dequantize)


# -- tools/make_student_labs.py ---------------------------------------------------------------------------------------

def test_markers_are_replaced_at_their_indentation():
    src = ("def f(x):\n    '''doc'''\n    # BEGIN SOLUTION\n    y = x + 1\n    return y\n    # END SOLUTION\n\n\n"
           "def g():\n        # BEGIN SOLUTION\n        return 2\n        # END SOLUTION")
    out, n = msl.strip_solutions(src)
    assert n == 2
    assert out == ("def f(x):\n    '''doc'''\n    raise NotImplementedError(\"write your answer here\")\n\n\n"
                   "def g():\n        raise NotImplementedError(\"write your answer here\")")
    assert msl.strip_solutions("x = 1\n") == ("x = 1\n", 0)


@pytest.mark.parametrize("src, message", [
    ("# BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("x = 1\n# END SOLUTION\n", "without"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "inside the block"),
])
def test_unbalanced_markers_are_refused(src, message):
    with pytest.raises(msl.MarkerError, match=message):
        msl.strip_solutions(src, "nb, cell 3")


def _notebook(*sources: str) -> dict:
    cells = [{"cell_type": "markdown", "id": "m", "metadata": {}, "source": ["# BEGIN SOLUTION in prose is kept\n"]}]
    for i, s in enumerate(sources):
        cells.append({"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": 3,
                      "outputs": [{"output_type": "stream", "name": "stdout", "text": ["answer: 42\n"]}],
                      "source": s.splitlines(keepends=True)})
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_the_tool_writes_copies_without_answers_or_outputs(tmp_path):
    lab = tmp_path / "07_x.ipynb"
    lab.write_text(json.dumps(_notebook("def f():\n    # BEGIN SOLUTION\n    return 42\n    # END SOLUTION\n",
                                        "print(f())\n")))
    plain = tmp_path / "08_y.ipynb"
    plain.write_text(json.dumps(_notebook("print(1)\n")))
    out = tmp_path / "student"
    assert msl.main([str(lab), str(plain), "--out", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["07_x.ipynb"]  # no markers: no copy
    nb = json.loads((out / "07_x.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "".join(code[0]["source"]) == 'def f():\n    raise NotImplementedError("write your answer here")\n'
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert nb["cells"][0]["source"] == ["# BEGIN SOLUTION in prose is kept\n"]
    assert msl.main([str(lab), "--out", str(out), "--check"]) == 0
    (out / "07_x.ipynb").write_text("{}")
    assert msl.main([str(lab), "--out", str(out), "--check"]) == 1


def test_the_tool_refuses_an_unbalanced_lab_and_writes_nothing(tmp_path, capsys):
    good = tmp_path / "01_a.ipynb"
    good.write_text(json.dumps(_notebook("# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n")))
    bad = tmp_path / "02_b.ipynb"
    bad.write_text(json.dumps(_notebook("y = 2\n", "# BEGIN SOLUTION\nx = 1\n")))
    out = tmp_path / "student"
    assert msl.main([str(good), str(bad), "--out", str(out)]) == 2
    assert not out.exists()
    assert "02_b.ipynb, cell 2, line 1" in capsys.readouterr().err


def test_the_student_notebook_is_the_lab_without_its_answers():
    (_, dest, text, n), = msl.plan([LAB], STUDENT.parent)
    assert n == 2 and dest == STUDENT
    assert STUDENT.read_text() == text, "labs/student is stale: run python3 tools/make_student_labs.py"
    student = STUDENT.read_text()
    for answer in ("BEGIN SOLUTION", "END SOLUTION", "u[:, 0::2] | (u[:, 1::2] << 4)", "repeat_interleave(G",
                   "clamp(min=1e-12) / 7"):
        assert answer not in student
    cell = next(c for c in code_cells(STUDENT) if "def quantize_int4_groupwise(" in c)
    assert cell.count('raise NotImplementedError("write your answer here")') == 2


@pytest.mark.parametrize("path", [LAB, STUDENT])
def test_cells_parse_and_outputs_are_stripped(path):
    import ast

    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 10
    for c in code:
        ast.parse("".join(c["source"]))
        assert c["outputs"] == [] and c["execution_count"] is None


def test_pytest_does_not_collect_the_student_notebooks():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "labs"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert "labs/04_quantization.ipynb" in out.stdout, out.stdout + out.stderr
    assert "labs/student" not in out.stdout


# -- the recorded GPU run with quantized rungs ----------------------------------------------------------------------

def _bench_doc(device="NVIDIA H200", workload="chat", date="2026-12-06T10:00:00Z", quantized=True,
               model="llama-3.1-8b") -> dict:
    base = dict(workload=workload, model=model, batch_size=1, prompt_tokens=128, new_tokens=256)
    ladder = [("eager", None, 25.0), ("+prefill_graphs", None, 4.0)]
    if quantized:
        ladder += [("+int8", "int8", 2.4), ("+int4", "int4", 1.6)]
    rows = [bench_file.result_row(**base, step=step, weights=w or "bf16", tokens_per_s=1e3 / tpot, ttft_ms=5.0,
                                  tpot_ms_p50=tpot, tpot_ms_p90=tpot, settings={"kv_cache": True, "weights": w})
            for step, w, tpot in ladder]
    rows.append(bench_file.result_row(**base, step="roofline", weights="bf16", tokens_per_s=280.0, tpot_ms_p50=3.6))
    doc = bench_file.bench_document(rows, device=device, peaks={"copy_GBps": 4185.0, "bf16_TFLOPs": 700.0},
                                    model={"id": model},
                                    workload={"name": workload, "prompt_lens": [128], "new_tokens": 256})
    doc["date"] = date
    return doc


def test_the_newest_h200_run_with_quantized_rungs_is_found(tmp_path):
    assert lab04.recorded_quant_ladder(tmp_path) is None
    for i, kw in enumerate([dict(), dict(date="2026-12-07T00:00:00Z", quantized=False),  # newer, no quantized rows
                            dict(date="2026-12-08T00:00:00Z", device="NVIDIA H100 80GB HBM3"),
                            dict(date="2026-12-09T00:00:00Z", workload="batch")]):
        bench_file.save_bench(_bench_doc(**kw), tmp_path / f"run{i}.json")
    found = lab04.recorded_quant_ladder(tmp_path, workload="chat")  # an H200 run before a newer H100 one
    assert found is not None and found["path"].endswith("run0.json")
    assert lab04.recorded_quant_ladder(tmp_path)["path"].endswith("run3.json")  # any workload
    assert lab04.recorded_quant_ladder(tmp_path, prefer=None, workload="chat")["path"].endswith("run2.json")
    assert lab04.recorded_quant_ladder(tmp_path, device_contains="H100", workload="chat")["path"].endswith("run2.json")
    assert lab04.recorded_quant_ladder(tmp_path, device_contains="A100") is None
    assert [lab04.is_quant_row(r) for r in found["results"]] == [False, False, True, True, False]
    bench_file.save_bench(_bench_doc(date="2026-12-10T00:00:00Z", model="llama-3.2-1b"), tmp_path / "run4.json")
    assert lab04.recorded_quant_ladder(tmp_path, workload="chat")["path"].endswith("run4.json")  # the newest
    assert lab04.recorded_quant_ladder(tmp_path, workload="chat", model_id="llama-3.1-8b")["path"].endswith("run0.json")


def _run_replay_cells(monkeypatch, bench_dir: Path) -> dict:
    """Execute the lab's setup and prediction cells, then its GPU section as on a CPU, reading `bench_dir`."""
    import plotly.graph_objects as go

    monkeypatch.setattr(bench_file, "DEFAULT_OUT", bench_dir)
    monkeypatch.setattr(go.Figure, "show", lambda self, *a, **k: None)
    cells = code_cells(LAB)
    ns: dict = {}
    exec(compile(cells[0], "setup", "exec"), ns)
    ns["gpu"] = False  # the CPU path, on any machine
    for marker in ("def bytes_per_token(", "recorded_quant_ladder(workload=", "WEIGHTS_FORMAT = {"):
        exec(compile(next(c for c in cells if marker in c), marker, "exec"), ns)
    return ns


def test_the_lab_says_when_no_run_is_recorded(tmp_path, monkeypatch, capsys):
    ns = _run_replay_cells(monkeypatch, tmp_path)
    assert ns["doc"] is None
    assert "no recorded GPU run with quantized rungs yet" in capsys.readouterr().out


def test_the_lab_replays_a_recorded_run(tmp_path, monkeypatch, capsys):
    bench_file.save_bench(_bench_doc(), tmp_path / "nvidia-h200_chat_llama-3.1-8b_20261206T100000Z.json")
    ns = _run_replay_cells(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert ns["doc"] is not None and "NVIDIA H200 | workload chat | model llama-3.1-8b" in out
    cfg = ns["ModelConfig"].from_preset("llama-3.1-8b")
    eager_ms = 1e3 * roofline.roofline_step_time_s(cfg, 1, roofline.decode_mean_context_len(128, 256), 4185.0)
    roof = out[out.index("roofline per rung"):].splitlines()  # the lab's table, after the bench's own
    eager = next(line for line in roof if line.startswith("eager "))
    assert f"{eager_ms:.3f} ms" in eager and "bf16" in eager
    int4 = next(line for line in roof if line.startswith("+int4 "))
    assert "int4 g128" in int4
    assert "TPOT speed-up over +prefill_graphs: +int8 1.67x, +int4 2.50x" in out
    assert [b[0] for b in ns["bars"]] == ["eager", "+prefill_graphs", "+int8", "+int4"]


def test_the_lab_replays_the_8b_run_this_repository_ships(monkeypatch, capsys):
    """On a CPU the lab must find a GPU run with quantized rungs in data/bench/ (an H100 one while no H200 run has
    them): the replay, not the "no recorded run" message."""
    ns = _run_replay_cells(monkeypatch, bench_file.DEFAULT_OUT)
    out = capsys.readouterr().out
    assert ns["doc"] is not None, out
    assert "workload chat | model llama-3.1-8b" in out and "no recorded GPU run" not in out
    assert "TPOT speed-up over" in out
    _assert_bytes_agree(out, lm_head=False)


def _assert_bytes_agree(out: str, lm_head: bool) -> None:
    """The lab's roofline table: for every rung this lab's byte count agrees with the bench's; with `lm_head`, it
    has rungs with a quantized lm_head."""
    table = out[out.index("roofline per rung"):].splitlines()[2:]
    rows = [line for line in table if line.startswith("+")]
    assert rows and (not lm_head or any("+lm_head" in line for line in rows))
    for line in rows:
        lab_gb, bench_gb = line.split("ms")[0].split()[-3:-1]
        assert lab_gb == bench_gb, line


def test_the_lab_counts_a_quantized_lm_heads_bytes_as_the_bench_did(tmp_path, monkeypatch, capsys):
    """The newest shipped 8B chat run that has rungs with a quantized lm_head, replayed alone: the lab's bytes agree
    with the bench's for those rungs too."""
    import shutil

    def has_lm_head(path: Path) -> bool:
        doc = json.loads(path.read_text())
        return any("lm_head" in str(r.get("step")) and r.get("weights") != "bf16" for r in doc.get("results", []))

    shipped = sorted(Path(bench_file.DEFAULT_OUT).glob("*_chat_llama-3.1-8b_*.json"), key=lambda p: p.stem[-16:])
    with_lm_head = [p for p in shipped if has_lm_head(p)]
    assert with_lm_head, "no shipped 8B chat run has a quantized-lm_head rung"
    shutil.copy(with_lm_head[-1], tmp_path / with_lm_head[-1].name)
    ns = _run_replay_cells(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert ns["doc"] is not None, out
    _assert_bytes_agree(out, lm_head=True)


def test_the_lab_shows_the_recorded_quality_table(tmp_path, monkeypatch, capsys):
    """The cell reading data/quant/perplexity_default.json (tools/quant_quality.py's format), on a synthetic file."""
    cell = next(c for c in code_cells(LAB) if "perplexity_default.json" in c)
    rows = [{"name": "fp32", "perplexity": 160.0, "agreement": 1.0, "weight_bytes": 30_950_400,
             "ppl_change_vs_fp32": 0.0},
            {"name": "int4 g128 awq", "perplexity": 162.0, "agreement": 0.375, "weight_bytes": 7_267_328,
             "ppl_change_vs_fp32": 0.0125}]
    (tmp_path / "data" / "quant").mkdir(parents=True)
    ns = {"REPO_ROOT": tmp_path}
    exec(compile(cell, "quality file", "exec"), ns)
    assert "is not in this repository yet" in capsys.readouterr().out
    doc = {"metadata": {"evaluation": {"tokens": 21404, "context": 1024}, "torch": "2.13.0", "commit": "abc"},
           "rows": rows}
    (tmp_path / "data" / "quant" / "perplexity_default.json").write_text(json.dumps(doc))
    exec(compile(cell, "quality file", "exec"), ns)
    out = capsys.readouterr().out
    assert "21404 held-out tokens in windows of 1024" in out
    line = next(x for x in out.splitlines() if x.startswith("int4 g128 awq"))
    assert line.split()[3:] == ["162.000", "+1.25%", "38%", "7.27"]
