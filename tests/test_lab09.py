"""Lab 09 (capstone): the exercise check (the reference and the notebook's answer pass; the stub and plausible wrong
answers are rejected with the message that names the mistake), the student copy, the capstone helpers on synthetic
bench documents (which recorded run is replayed, the rungs it lacks, rank correlation and inversions of a
utilization column, the headline ratios, one switch combination measured as a rung on a tiny CPU model), and the
lab's replay cells on a folder of synthetic recorded runs. The notebook itself runs under nbval:
`pytest labs/09_capstone.ipynb`."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from llmlab.engine import LLM
from llmlab.ladder import step_names
from llmlab.measure import bench_file, capstone
from llmlab.measure.workloads import WORKLOADS, Workload
from llmlab.solutions import lab09

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "labs" / "09_capstone.ipynb"
STUDENT = ROOT / "labs" / "student" / "09_capstone.ipynb"


def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def notebook_best_rung(path: Path):
    cell = next(c for c in code_cells(path) if "def best_rung(" in c)
    ns: dict = {}
    exec(compile(cell, str(path), "exec"), ns)
    return ns["best_rung"]


# -- the exercise check ---------------------------------------------------------------------------------------------

def test_the_reference_and_the_notebooks_answer_pass():
    lab09.check_best_rung(lab09.best_rung)
    lab09.check_best_rung(notebook_best_rung(LAB))


def test_the_cases_cover_none_a_boundary_and_a_peer_that_would_win():
    answers = [lab09.best_rung(rows, limit) for _, rows, limit in lab09.CASES]
    assert None in answers and len({a for a in answers if a}) >= 4
    assert any(any(r["ttft_ms"] == limit for r in rows) for _, rows, limit in lab09.CASES)
    assert any(any(r["step"].startswith("hf_") and r["ttft_ms"] <= limit
                   and r["tokens_per_s"] > max(x["tokens_per_s"] for x in rows if x["step"] == best)
                   for r in rows) for (_, rows, limit), best in zip(lab09.CASES, answers) if best)


def test_the_stub_is_rejected():
    def stub(rows, max_ttft_ms):
        raise NotImplementedError("write your answer here")
    with pytest.raises(AssertionError, match="not written yet"):
        lab09.check_best_rung(stub)
    with pytest.raises(AssertionError, match="not written yet"):
        lab09.check_best_rung(notebook_best_rung(STUDENT))


def test_the_wrong_answers_are_wrong_and_tell_apart():
    want = [lab09.best_rung(rows, limit) for _, rows, limit in lab09.CASES]
    got = [tuple(wrong(rows, limit) for _, rows, limit in lab09.CASES) for wrong, _ in lab09.WRONG_ANSWERS]
    assert all(list(g) != want for g in got)
    assert len(set(got)) == len(got), "two wrong answers give the same answers: the check cannot tell them apart"


@pytest.mark.parametrize("i", range(len(lab09.WRONG_ANSWERS)))
def test_each_plausible_wrong_answer_is_rejected_with_its_reason(i):
    wrong, why = lab09.WRONG_ANSWERS[i]
    with pytest.raises(AssertionError) as e:
        lab09.check_best_rung(wrong)
    assert str(e.value) == why


def _sorts_in_place(rows, limit):
    rows.sort(key=lambda r: -r["tokens_per_s"])
    return lab09.best_rung(rows, limit)


@pytest.mark.parametrize("fn, message", [
    (lambda rows, limit: next(r for r in rows if r["step"] == lab09.best_rung(rows, limit)) if
     lab09.best_rung(rows, limit) else None, "returned a whole row"),
    (lambda rows, limit: 42.0, "return a step name"),
    (lambda rows, limit: lab09.best_rung(rows, limit) or "", "not the step of any row"),
    (_sorts_in_place, "changed `rows`"),
    (lambda rows, limit: max((r for r in rows if r["ttft_ms"] <= limit and not r["step"].startswith("hf_")),
                             key=lambda r: r["tokens_per_s"])["step"], "ttft_ms can be None"),
    (lambda rows, limit: "eager", "the answer is '\\+torch_compile'"),
])
def test_other_mistakes_get_a_message_that_teaches(fn, message):
    with pytest.raises(AssertionError, match=message):
        lab09.check_best_rung(fn)


# -- the student copy and the notebook's shape ----------------------------------------------------------------------

def _msl():
    spec = importlib.util.spec_from_file_location("make_student_labs", ROOT / "tools" / "make_student_labs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_student_notebook_is_the_lab_without_its_answer():
    tool = ROOT / "tools" / "make_student_labs.py"
    if not tool.exists():
        pytest.skip("tools/make_student_labs.py is not in this tree")
    (_, dest, text, n), = _msl().plan([LAB], STUDENT.parent)
    assert n == 1 and dest == STUDENT
    assert STUDENT.read_text() == text, "labs/student is stale: run python3 tools/make_student_labs.py"
    assert 'r["ttft_ms"] <= max_ttft_ms' not in STUDENT.read_text()


@pytest.mark.parametrize("path", [LAB, STUDENT])
def test_goals_summary_stripped_outputs_and_cells_that_parse(path):
    import ast

    nb = json.loads(path.read_text())
    text = ["".join(c["source"]) for c in nb["cells"]]
    assert "Learning goals" in text[0] and text[-1].startswith("## What you saw")
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            ast.parse("".join(c["source"]))
            assert c["outputs"] == [] and c["execution_count"] is None


# -- synthetic bench documents --------------------------------------------------------------------------------------

def _doc(rows: list[tuple], device="NVIDIA H200", workload="chat", model="llama-3.2-1b",
         date="2026-12-06T10:00:00Z", skipped=()) -> dict:
    """A bench document from (step, tokens/s, ttft ms, gpu_util, mbu); the roofline row added unless given."""
    base = dict(workload=workload, model=model, batch_size=1, prompt_tokens=128, new_tokens=256)
    results = [bench_file.result_row(**base, step=s, weights="bf16", tokens_per_s=tps, ttft_ms=ttft,
                                     tpot_ms_p50=1e3 / tps, tpot_ms_p90=1e3 / tps, gpu_util=util, mbu=mbu,
                                     settings={"cuda_graphs": s not in ("eager", "hf_eager", "hf_static")})
               for s, tps, ttft, util, mbu in rows]
    if not any(r["step"] == "roofline" for r in results):
        results.append(bench_file.result_row(**base, step="roofline", weights="bf16", tokens_per_s=2000.0,
                                             tpot_ms_p50=0.5, tpot_ms_p90=0.5, mbu=1.0))
    doc = bench_file.bench_document(results, device=device, peaks={"copy_GBps": 4185.0, "bf16_TFLOPs": 700.0},
                                    model={"id": model}, workload={"name": workload, "prompt_lens": [128]},
                                    skipped=[{"step": s, "reason": why} for s, why in skipped])
    doc["date"] = date
    return doc


# like the recorded chat ladder: the CUDA-graph rungs all busy, the fastest not the busiest
H200_LIKE = [("eager", 94.0, 11.8, 0.27, 0.056), ("+cuda_graphs", 396.0, 19.3, 0.96, 0.24),
             ("+torch_compile", 588.0, 12.5, 0.99, 0.36), ("+triton_kernels", 1108.0, 18.1, 0.95, 0.71),
             ("+prefill_graphs", 1298.0, 2.2, 0.93, 0.78), ("hf_eager", 66.0, 18.4, 0.19, 0.039),
             ("hf_static", 354.0, 24.8, 0.57, 0.22)]


def test_row_kind():
    assert [capstone.row_kind({"step": s}) for s in ("eager", "+int4", "hf_static", "roofline")] == \
        ["rung", "rung", "peer", "roofline"]


def test_the_recorded_ladder_prefers_the_newest_run_with_peers(tmp_path):
    assert capstone.recorded_ladder("chat", directory=tmp_path) is None
    files = [("old_with_peers", _doc(H200_LIKE, date="2026-12-01T00:00:00Z")),
             ("new_without_peers", _doc(H200_LIKE[:5], date="2026-12-03T00:00:00Z")),
             ("newer_no_eager", _doc(H200_LIKE[1:], date="2026-12-04T00:00:00Z")),
             ("cpu", _doc(H200_LIKE, device="CPU: AMD EPYC", date="2026-12-05T00:00:00Z")),
             ("other_model", _doc(H200_LIKE, model="llama-3.1-8b", date="2026-12-05T00:00:00Z")),
             ("batch", _doc(H200_LIKE, workload="batch", date="2026-12-05T00:00:00Z"))]
    for name, doc in files:
        bench_file.save_bench(doc, tmp_path / f"{name}.json")
    assert capstone.recorded_ladder("chat", "llama-3.2-1b", tmp_path)["path"].endswith("old_with_peers.json")
    assert capstone.recorded_ladder("chat", None, tmp_path)["path"].endswith("other_model.json")
    assert capstone.recorded_ladder("long", None, tmp_path) is None
    (tmp_path / "old_with_peers.json").unlink()  # no run with peers left: the newest that climbed from eager
    assert capstone.recorded_ladder("chat", "llama-3.2-1b", tmp_path)["path"].endswith("new_without_peers.json")


def test_missing_rungs_and_the_newest_run_that_has_one(tmp_path):
    doc = _doc(H200_LIKE, skipped=[("+step_tuning", "failed: RuntimeError: boom")])
    missing = dict(capstone.missing_rungs(doc))
    assert list(missing) == [s for s in step_names() if s not in {r["step"] for r in doc["results"]}]
    assert missing["+step_tuning"] == "failed: RuntimeError: boom" and missing["+int4"] == "not in this run"
    assert "eager" not in missing
    assert capstone.newest_with_step("+int4", "chat", directory=tmp_path) is None
    bench_file.save_bench(_doc(H200_LIKE + [("+int4", 1900.0, 2.0, 0.9, 0.6)], date="2026-12-02T00:00:00Z"),
                          tmp_path / "with_int4.json")
    bench_file.save_bench(_doc(H200_LIKE, date="2026-12-09T00:00:00Z"), tmp_path / "newer.json")
    bench_file.save_bench(_doc(H200_LIKE + [("+int4", 900.0, 2.0, 0.9, 0.6)], device="CPU: x",
                               date="2026-12-10T00:00:00Z"), tmp_path / "cpu.json")
    assert capstone.newest_with_step("+int4", "chat", directory=tmp_path)["path"].endswith("with_int4.json")
    assert capstone.newest_with_step("+int4", "batch", directory=tmp_path) is None


def _rows(pairs, key="gpu_util"):
    return [{"step": f"s{i}", "tokens_per_s": tps, key: u} for i, (tps, u) in enumerate(pairs)]


def test_rank_correlation():
    assert capstone.rank_correlation(_rows([(1, 0.1), (2, 0.2), (3, 0.3)]), "gpu_util") == pytest.approx(1.0)
    assert capstone.rank_correlation(_rows([(1, 0.3), (2, 0.2), (3, 0.1)]), "gpu_util") == pytest.approx(-1.0)
    # the ranks, not the values: a monotone but curved relation is +1
    assert capstone.rank_correlation(_rows([(1, 0.01), (2, 0.02), (100, 0.9)]), "gpu_util") == pytest.approx(1.0)
    # ties share their mean rank: x ranks (1.5, 1.5, 3) against y (1, 2, 3) -> rho = sqrt(3) / 2
    assert capstone.rank_correlation(_rows([(1, 0.5), (2, 0.5), (3, 0.9)]), "gpu_util") == pytest.approx(3 ** 0.5 / 2)
    # the roofline and rows without the column do not count
    rows = _rows([(1, 0.1), (2, 0.2), (3, 0.3), (4, None)]) + [{"step": "roofline", "tokens_per_s": 9, "gpu_util": 0.0}]
    assert capstone.rank_correlation(rows, "gpu_util") == pytest.approx(1.0)
    assert capstone.rank_correlation(_rows([(1, 0.1), (2, 0.2)]), "gpu_util") is None  # too few rows
    assert capstone.rank_correlation(_rows([(1, 0.5), (2, 0.5), (3, 0.5)]), "gpu_util") is None  # constant
    assert capstone.rank_correlation(_rows([(1, 0.1), (2, 0.2), (3, 0.3)]), "mbu") is None  # not measured


def test_inversions_are_the_pairs_where_faster_reads_lower_widest_first():
    doc = _doc(H200_LIKE)
    flips = capstone.inversions(doc["results"], "gpu_util")
    assert flips and all(f["tokens_per_s"] > s["tokens_per_s"] and f["gpu_util"] < s["gpu_util"] for f, s in flips)
    ratios = [f["tokens_per_s"] / s["tokens_per_s"] for f, s in flips]
    assert ratios == sorted(ratios, reverse=True)
    fast, slow = flips[0]
    assert (fast["step"], slow["step"]) == ("+prefill_graphs", "+cuda_graphs")
    assert capstone.inversions(doc["results"], "mbu") == []
    assert capstone.rank_correlation(doc["results"], "mbu") > capstone.rank_correlation(doc["results"], "gpu_util")


def test_headline():
    h = capstone.headline(_doc(H200_LIKE))
    assert h["fastest"]["step"] == "+prefill_graphs"
    assert h["over_eager"] == pytest.approx(1298 / 94)
    assert h["over"] == {"hf_eager": pytest.approx(1298 / 66), "hf_static": pytest.approx(1298 / 354)}
    assert h["of_roofline"] == pytest.approx(1298 / 2000)
    h = capstone.headline(_doc([("+cuda_graphs", 396.0, 19.3, 0.96, 0.24)]))
    assert h["over_eager"] is None and h["over"] == {}
    with pytest.raises(ValueError, match="no ladder rung ran"):
        capstone.headline(_doc([("hf_eager", 66.0, 18.4, 0.19, 0.039)]))


# -- a configuration of your own, on a tiny CPU model ---------------------------------------------------------------

def _fake_peaks():
    from llmlab.measure.peaks import Peaks

    return Peaks(device_name="CPU: test", torch_version=torch.__version__, copy_bw_gb_s=10.0, matmul_tflops=0.1,
                 matmul_dtype="float32", measured_at="2026-01-02T03:04:05Z", cached=True,
                 cache_path="/cache/peaks.json", copy_spread=0.03, matmul_spread=0.01, repeats=5, attempts=1,
                 verdict="steady")


@pytest.fixture
def tiny():
    return LLM(tiny_model(seed=0), name="tiny")


def test_check_settings_fills_defaults_and_refuses_bad_ones(tiny):
    full = capstone.check_settings(tiny, {"weights": "int8"})
    assert full["weights"] == "int8" and full["kv_cache"] is True and full["cuda_graphs"] is False
    for settings, message in (({"kv_cahce": True}, "unknown switch"), ({"weights": "int3"}, "not one of"),
                              ({"kv_cache": "yes"}, "on or off"), ({"cuda_graphs": True}, "needs a CUDA GPU"),
                              (["weights"], "give a dict")):
        with pytest.raises(ValueError, match=message):
            capstone.check_settings(tiny, settings)


def test_measure_config_runs_one_row_and_leaves_the_ladder_alone(tiny):
    before = step_names()
    row = capstone.measure_config(tiny, {"weights": "int8"}, "chat", quick=True, repeats=1,
                                  measured_peaks=_fake_peaks())
    assert row["step"] == "yours" and row["weights"] == "int8" and row["tokens_per_s"] > 0
    assert row["label"] == "int8" and row["settings"]["weights"] == "int8" and row["settings"]["kv_cache"] is True
    assert step_names() == before
    with pytest.raises(ValueError, match="needs a CUDA GPU"):  # refused before anything runs
        capstone.measure_config(tiny, {"prefill_graphs": True}, "chat", quick=True, measured_peaks=_fake_peaks())
    # accepted switch by switch, refused together by apply_switches: the row fails, the ladder is restored
    with pytest.raises(RuntimeError, match="did not run"):
        capstone.measure_config(tiny, {"kv_cache": False, "gpu_sampling": True}, "chat", quick=True,
                                measured_peaks=_fake_peaks())
    assert step_names() == before


def test_run_ladder_takes_a_workload_object(tiny):
    wl = Workload("tiny-batch-test", "3 requests", (8, 8, 16), 4, 4)
    try:
        doc = capstone.run_ladder(tiny, wl, quick=True, steps=["eager"], peers=False, repeats=1,
                                  measured_peaks=_fake_peaks())
        assert [r["step"] for r in doc["results"]] == ["eager", "roofline"]
        assert doc["results"][0]["batch_size"] == 3 and doc["workload"]["name"] == "tiny-batch-test"
        with pytest.raises(ValueError, match="taken by another workload"):
            capstone.run_ladder(tiny, Workload("tiny-batch-test", "other", (8,), 4, 4), quick=True)
        with pytest.raises(TypeError, match="workload"):
            capstone.run_ladder(tiny, 3, quick=True)
    finally:
        WORKLOADS.pop("tiny-batch-test", None)


def test_the_gpu_plan_keeps_the_quantized_and_batching_rungs_and_leaves_the_cpu_ladder_whole(tiny, monkeypatch):
    """On a GPU the lab times GPU_PLAN's rungs (a whole ladder took the lab's three minutes before the quantized and
    batching rungs); on a CPU every rung runs. The plan names real rungs and peers, and reaches both top ends."""
    from llmlab.measure.peers import PEER_NAMES

    assert capstone.plan(tiny, "chat") == {} and capstone.plan(tiny, capstone.SMALL_BATCH) == {}
    monkeypatch.setattr(type(tiny), "device", property(lambda self: torch.device("cuda")), raising=False)
    chat, batch = capstone.plan(tiny, "chat"), capstone.plan(tiny, WORKLOADS["batch"])
    assert capstone.plan(tiny, "long") == {}  # a workload the plan does not name: every rung
    for got in (chat, batch):
        assert set(got["steps"]) <= set(step_names()) and set(got["peers"]) <= set(PEER_NAMES)
        assert got["steps"][0] == "eager" and "no_kv_cache" not in got["steps"]
        order = [step_names().index(s) for s in got["steps"]]
        assert order == sorted(order)  # the ladder's order: the cumulative rungs build up as they do there
    assert {"+int8", "+int4", "+prefill_graphs"} <= set(chat["steps"]) and "hf_static" in chat["peers"]
    assert {"+static_batching", "+continuous_batching", "+one_at_a_time"} <= set(batch["steps"])
    chat["steps"].append("x")  # a copy: the plan itself is not changed
    assert "x" not in capstone.plan(tiny, "chat")["steps"]
    with pytest.raises(ValueError, match="unknown workload 'CHAT'; known workloads: chat"):
        capstone.plan(tiny, "CHAT")
    with pytest.raises(TypeError, match="workload name or a Workload"):
        capstone.plan(tiny, None)


# -- the lab's replay cells, on a folder of synthetic recorded runs -------------------------------------------------

def _replay(monkeypatch, bench_dir: Path) -> dict:
    """Run the lab's setup, its chart helpers (on a synthetic CPU run) and its H200 replay cells, reading
    `bench_dir`."""
    import plotly.graph_objects as go

    monkeypatch.setattr(bench_file, "DEFAULT_OUT", bench_dir)
    monkeypatch.setattr(go.Figure, "show", lambda self, *a, **k: None)
    cells = code_cells(LAB)
    ns: dict = {}
    exec(compile(cells[0], "setup", "exec"), ns)
    ns["chat"] = _doc([("eager", 60.0, 50.0, None, 0.3), ("+int8", 62.0, 48.0, None, 0.15),
                       ("hf_eager", 50.0, 55.0, None, 0.25)], device="CPU: test")
    for marker in ("def ladder_chart(", "def not_measured(", "UTIL = {"):
        exec(compile(next(c for c in cells if marker in c), marker, "exec"), ns)
    return ns


def test_the_replay_cells_say_when_nothing_is_recorded(tmp_path, monkeypatch, capsys):
    ns = _replay(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert ns["h200_chat"] is None and "No GPU bench file of the chat workload" in out


def test_the_replay_cells_show_a_recorded_run_and_what_it_lacks(tmp_path, monkeypatch, capsys):
    bench_file.save_bench(_doc(H200_LIKE), tmp_path / "nvidia-h200_chat_llama-3.2-1b_20261206T100000Z.json")
    ns = _replay(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert "NVIDIA H200 | workload chat | model llama-3.2-1b" in out
    assert "fastest rung: +prefill_graphs at 1298 tokens/s" in out and "65% of the bandwidth roofline" in out
    assert "not measured: +int4" in out and "no recorded GPU run of this workload has it yet" in out
    assert "busiest by GPU-Util: +torch_compile (99%, 588 tokens/s); fastest: +prefill_graphs" in out
    assert "MBU: rank correlation with tokens/s +1.00; it orders every pair of rows as tokens/s does" in out
    assert ns["h200_util"]["busiest"]["step"] == "+torch_compile"


def test_the_replay_cells_check_their_claims_on_the_recorded_run(tmp_path, monkeypatch):
    """A recorded run where the busiest row IS the fastest fails the cell's check: the prose would be wrong."""
    honest = [(s, tps, ttft, 0.999 if s == "+prefill_graphs" else u, mbu) for s, tps, ttft, u, mbu in H200_LIKE]
    bench_file.save_bench(_doc(honest), tmp_path / "run.json")
    with pytest.raises(AssertionError, match="busiest row is the fastest"):
        _replay(monkeypatch, tmp_path)


def test_the_switch_list_cell_runs_on_a_copy(tiny, capsys):
    cell = next(c for c in code_cells(LAB) if "for key, sw in SWITCHES.items()" in c)
    from llmlab.switches import SWITCHES

    exec(compile(cell, "switches", "exec"), {"SWITCHES": SWITCHES, "work": tiny})
    out = capsys.readouterr().out
    assert all(key in out for key in SWITCHES) and "needs a CUDA GPU" in out


def test_the_cases_are_not_changed_by_the_check():
    before = copy.deepcopy(lab09.CASES)
    lab09.check_best_rung(lab09.best_rung)
    assert lab09.CASES == before
