"""`llmlab bench`: a quick CPU run writes a valid JSON file with the ladder, the peers and the roofline; the metric
bookkeeping; the schema check; clear errors for unknown workloads, models and steps."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from llmlab.measure import bench, bench_file, bench_table, roofline
from llmlab.measure.bench import run_bench
from llmlab.measure.bench_file import ROW_KEYS, bench_document, list_bench, result_row, save_bench, validate_bench
from llmlab.measure.bench_metrics import Call, Run, decode_work, run_metrics
from llmlab.measure.peers import hf_peer_model
from llmlab.measure.workloads import WORKLOADS, group_by_length, make_prompts
from llmlab.cli import main
from llmlab.engine import LLM
from tiny_models import tiny_model


@pytest.fixture(autouse=True)
def peaks_cache(tmp_path_factory, monkeypatch):
    """One measured-peaks cache for the module's runs (measuring takes ~1 s), outside the user's home."""
    monkeypatch.setenv("LLMLAB_PEAKS_CACHE", str(tmp_path_factory.getbasetemp() / "peaks.json"))


@pytest.fixture(scope="module")
def chat_doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    doc = run_bench("chat", "default", peers=True, out=out, quick=True, device="cpu", print_fn=lambda *a: None,
                    peaks_cache=tmp_path_factory.getbasetemp() / "peaks.json")
    return doc, out


def test_quick_chat_writes_one_valid_file(chat_doc):
    doc, out = chat_doc
    files = list(out.glob("*.json"))
    assert len(files) == 1
    assert re.fullmatch(r"cpu[a-z0-9.-]*_chat_pydoc-llama_\d{8}T\d{6}Z\.json", files[0].name), files[0].name
    on_disk = json.loads(files[0].read_text())
    validate_bench(on_disk)
    for key in ("device", "commit", "versions", "peaks", "results", "notes"):
        assert key in on_disk
    assert set(on_disk["peaks"]) >= {"copy_GBps", "bf16_TFLOPs"}
    assert on_disk["peaks"]["matmul_dtype"] == "float32"  # labelled: a CPU's rate is fp32
    assert on_disk["complete"] is True
    assert isinstance(on_disk["versions"], dict) and "torch" in on_disk["versions"]
    # one timed run a row: the file and the table say that its rows' differences are mostly chance
    assert sum("one timed run a row" in n and "--repeats 3" in n for n in on_disk["notes"]) == 1


def test_results_hold_the_ladder_peers_and_roofline(chat_doc):
    doc, _ = chat_doc
    steps = [r["step"] for r in doc["results"]]
    torchao = [s for s in steps if s.startswith("torchao_")]  # the quantized peers, where torchao is installed
    assert not torchao or importlib.util.find_spec("torchao") is not None
    assert [s for s in steps if s not in torchao] == ["no_kv_cache", "eager", "+int8", "+int4", "+one_at_a_time",
                                                      "+static_batching", "+continuous_batching", "hf_eager",
                                                      "hf_static", "roofline"]
    skipped = {s["step"] for s in doc["skipped"]}
    assert {"torchao_int8", "torchao_int4"} <= set(torchao) | skipped  # each run or skipped with its reason
    for r in doc["results"]:
        assert list(r)[:len(ROW_KEYS)] == list(ROW_KEYS)
        assert r["workload"] == "chat" and r["model"] == "pydoc-llama" and r["batch_size"] == 1
        assert r["weights"] == {"+int8": "int8", "+int4": "int4", "+int8_lm_head": "int8", "+int4_lm_head": "int4",
                                "torchao_int8": "int8", "torchao_int4": "int4"}.get(r["step"], "fp32")
        assert r["tokens_per_s"] > 0
        assert r["gpu_util"] is None and r["sm_active"] is None and r["peak_mem_GB"] is None  # not a GPU run
    rows = {r["step"]: r for r in doc["results"]}
    for step in ("no_kv_cache", "eager", "hf_eager", "hf_static"):
        r = rows[step]
        assert r["ttft_ms"] > 0 and 0 < r["tpot_ms_p50"] <= r["tpot_ms_p90"]
        assert 0 < r["mfu"] and 0 < r["mbu"]
        assert r["new_tokens"] == WORKLOADS["chat"].quick_new_tokens
    # fp32 on a CPU: the cached, uncached and transformers paths pick the same greedy tokens
    assert rows["no_kv_cache"]["tokens_match_eager"] is True
    assert rows["hf_eager"]["tokens_match_eager"] is True
    assert rows["+static_batching"]["tokens_match_eager"] is True  # one prompt: the same tokens on every path
    assert rows["+continuous_batching"]["tokens_match_eager"] is True
    assert rows["eager"]["settings"] == {"kv_cache": True}
    # nothing beats the bandwidth ceiling at batch 1
    assert rows["roofline"]["tokens_per_s"] > rows["eager"]["tokens_per_s"]
    skipped = {s["step"]: s["reason"] for s in doc["skipped"]}
    assert "+cuda_graphs" in skipped and skipped["+cuda_graphs"]
    assert not any(reason.startswith("failed") for reason in skipped.values()), skipped


def test_batch_workload_is_grouped_and_says_so():
    """64 mixed-length requests on a tiny random model: 4 equal-length groups for llmlab, one padded batch for HF."""
    llm = LLM(tiny_model(seed=0, max_seq_len=1024), name="tiny")
    doc = run_bench("batch", "tiny", steps=["eager", "+static_batching", "+continuous_batching"], peers=True,
                    out=None, quick=True, llm=llm, print_fn=lambda *a: None)
    validate_bench(bench_file._clean(doc))
    rows = {r["step"]: r for r in doc["results"]}
    assert rows["eager"]["batch_size"] == 64
    # one left-padded batch, and continuous batching, give every request its solo (grouped) greedy tokens
    assert rows["+static_batching"]["tokens_match_eager"] is True
    assert rows["+continuous_batching"]["tokens_match_eager"] is True
    notes = " ".join(doc["notes"])
    assert "4 batches of equal-length prompts" in notes and "16 x 512 tokens" in notes
    assert "left-padded" in notes
    # TTFT counts the wait for earlier groups: larger than the first group's own time to first token
    assert rows["eager"]["ttft_ms"] > rows["eager"]["tpot_ms_p50"]
    assert rows["hf_eager"]["tokens_match_eager"] is True  # the attention mask makes padding harmless
    # the roofline bounds every schedule: all 64 requests in ONE batch (weights read once per step), not the
    # grouped schedule's four reads per step, which the batching rungs can beat
    cfg, roof = llm.config, rows["roofline"]
    prompts, n_new, wbpp = make_prompts(WORKLOADS["batch"], cfg.vocab_size), roof["new_tokens"], 4  # fp32 weights, KV
    one, _ = decode_work(cfg, [len(p) for p in prompts], n_new, wbpp, wbpp, first_step=0)
    grouped = sum(decode_work(cfg, [len(prompts[i]) for i in g], n_new, wbpp, wbpp, first_step=0)[0]
                  for g in group_by_length(prompts))
    assert grouped > one  # four weight reads per step against one
    assert roof["tpot_ms_p50"] == pytest.approx(1e3 * one / (doc["peaks"]["copy_GBps"] * 1e9) / n_new)


def test_every_row_warms_up_on_the_whole_workload(monkeypatch):
    """The untimed warm-up generates as many tokens as the timed runs, for the eager rows and the HF peers too: a
    decode step's first meeting with a KV length has one-off costs that must not land in a timed run."""
    calls = []
    real_llmlab, real_hf = bench.run_llmlab, bench.run_hf
    monkeypatch.setattr(bench, "run_llmlab", lambda llm, kw, prompts, n: calls.append(("llmlab", n))
                        or real_llmlab(llm, kw, prompts, n))
    monkeypatch.setattr(bench, "run_hf", lambda hf, prompts, n, static, **kw: calls.append(("hf", n))
                        or real_hf(hf, prompts, n, static, **kw))
    llm = LLM(tiny_model(seed=0), name="tiny")
    doc = run_bench("chat", "tiny", steps=["no_kv_cache", "eager"], peers=True, out=None, quick=True, llm=llm,
                    repeats=1, print_fn=lambda *a: None)
    new_tokens = {n for _, n in calls}
    assert len(new_tokens) == 1, calls  # warm-up and timed runs alike
    assert [who for who, _ in calls] == ["llmlab"] * 4 + ["hf"] * 4  # 2 rows x (warm-up + 1 run), 2 peers
    assert "warm-up run of the whole workload" in " ".join(doc["notes"])


def test_peers_can_be_chosen_by_name_and_a_misspelt_one_is_refused_before_the_model_loads(monkeypatch, capsys):
    from llmlab.cli import main
    from llmlab.measure.peers import PEER_NAMES, select_peers

    llm = LLM(tiny_model(seed=0), name="tiny")
    doc = run_bench("chat", "tiny", steps=["eager"], peers="hf_static, hf_continuous,torchao_int8", out=None,
                    quick=True, llm=llm, repeats=1, print_fn=lambda *a: None)
    assert [r["step"] for r in doc["results"]] == ["eager", "hf_static", "roofline"]
    why = {s["step"]: s["reason"] for s in doc["skipped"]}  # asked for, but not for this run: said so
    assert "several requests; this one has 1" in why["hf_continuous"] and "+int8 rung" in why["torchao_int8"]
    assert select_peers(True) is None and select_peers("all") is None and select_peers(False) == frozenset()
    assert select_peers("ALL,hf_static") is None and select_peers(None) == frozenset()
    assert select_peers(["hf_eager", " torchao_int4", ""]) == {"hf_eager", "torchao_int4"} <= set(PEER_NAMES)
    with pytest.raises(ValueError, match=r"unknown peer\(s\) \['hf_statc'\]; give 'all' or some of hf_eager"):
        run_bench("chat", "tiny", steps=["eager"], peers="hf_eager,hf_statc", out=None, quick=True, llm=llm)
    for empty in ("", ","):
        with pytest.raises(ValueError, match="names no peer"):
            select_peers(empty)
    with pytest.raises(TypeError, match="peers=1"):
        select_peers(1)
    with pytest.raises(bench.NothingToRun, match="nothing to measure"):  # the one peer asked for does not apply
        run_bench("chat", "tiny", steps=["+cuda_graphs"], peers="hf_continuous", out=None, quick=True, llm=llm)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded for a command that names an unknown peer")

    monkeypatch.setattr(bench, "load_bench_model", no_model)
    assert main(["bench", "--quick", "--workload", "batch,batch", "--no-save", "--device", "cpu"]) == 2
    assert "names a workload twice" in capsys.readouterr().err
    assert main(["bench", "--quick", "--peers", "torchao_int3", "--no-save", "--device", "cpu"]) == 2
    assert "--peers: unknown peer(s) ['torchao_int3']" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["bench", "--quick", "--steps", "+cuda_graphs", "--peers", "hf_continuous", "--no-save",
                 "--device", "cpu"]) == 2
    assert "nothing to measure" in capsys.readouterr().err


def test_run_metrics_by_hand():
    cfg = tiny_model().config
    # two groups run one after the other: 2 requests of 4 tokens, then 1 request of 6 tokens; 3 new tokens each
    run = Run([Call([0, 1], [4, 4], [10.0, 2.0, 2.0], [[1, 2, 3], [4, 5, 6]]),
               Call([2], [6], [20.0, 4.0, 4.0], [[7, 8, 9]])])
    m = run_metrics(run, cfg, weight_bpp=4, kv_bytes=4, peak_bw=100.0, peak_tflops=1.0)
    assert m["tokens_per_s"] == pytest.approx(9 / 0.042)
    assert m["ttft_ms"] == pytest.approx((10 + 10 + (14 + 20)) / 3)
    assert m["tpot_ms_p50"] == pytest.approx(3.0)
    b1 = 2 * roofline.decode_step_bytes(cfg, 2, roofline.decode_mean_context_len(4, 3), 4, 4)
    b2 = 2 * roofline.decode_step_bytes(cfg, 1, roofline.decode_mean_context_len(6, 3), 4, 4)
    assert m["mbu"] == pytest.approx((b1 + b2) / 0.012 / 1e9 / 100.0)
    f1 = 2 * roofline.decode_step_flops(cfg, 2, roofline.decode_mean_context_len(4, 3))
    f2 = 2 * roofline.decode_step_flops(cfg, 1, roofline.decode_mean_context_len(6, 3))
    assert m["mfu"] == pytest.approx((f1 + f2) / 0.012 / 1e12)


def test_timed_reads_the_sampler_as_fractions():
    """gpu_util / sm_active come from the sampler running during the timed calls (a fake NVML here)."""
    import time

    class Fake:
        def open(self):
            pass

        def read(self):
            return {"gpu_util_pct": 40.0, "sm_active_pct": 12.0}

        def close(self):
            pass

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.03)
        return Run()

    runs, hw, warm = bench.timed(fn, torch.device("cpu"), repeats=2, sample=True, backend=Fake(), interval_s=0.005,
                                 min_sampled_s=0.0)
    assert len(calls) == 3 and len(runs) == 2 and warm >= 0.03  # one warm-up + two timed
    assert hw["gpu_util"] == pytest.approx(0.40) and hw["sm_active"] == pytest.approx(0.12)
    assert hw["peak_mem_GB"] is None  # not a CUDA device
    _, hw, _ = bench.timed(fn, torch.device("cpu"), repeats=1, sample=False)
    assert hw == {"gpu_util": None, "sm_active": None, "peak_mem_GB": None}
    # timed runs shorter than one sampling interval still get a reading (the sampler takes a final one at stop)
    _, hw, _ = bench.timed(fn, torch.device("cpu"), repeats=1, sample=True, backend=Fake(), interval_s=10.0,
                           min_sampled_s=0.0)
    assert hw["gpu_util"] == pytest.approx(0.40)


def test_sampled_rows_run_until_the_sampler_has_watched_long_enough():
    """With the sampler on, short runs repeat until they have taken min_sampled_s in all (NVML's GPU-Util window);
    without it, exactly `repeats` runs."""
    import time

    class Fake:
        def open(self):
            pass

        def read(self):
            return {"gpu_util_pct": 90.0}

        def close(self):
            pass

    def fn():
        time.sleep(0.02)
        return Run()

    t = time.perf_counter()
    runs, hw, _ = bench.timed(fn, torch.device("cpu"), repeats=2, sample=True, backend=Fake(), interval_s=0.01,
                              min_sampled_s=0.2)
    assert len(runs) >= 6 and time.perf_counter() - t >= 0.2 + 0.02  # the warm-up, then >= 0.2 s of timed runs
    assert len(runs) < bench.MAX_SAMPLED_RUNS and hw["gpu_util"] == pytest.approx(0.90)
    runs, _, _ = bench.timed(fn, torch.device("cpu"), repeats=2, sample=False, min_sampled_s=0.2)
    assert len(runs) == 2
    calls = []

    def instant():
        calls.append(1)
        return Run()

    runs, _, _ = bench.timed(instant, torch.device("cpu"), repeats=1, sample=True, backend=Fake(), interval_s=0.01,
                             min_sampled_s=60.0)
    assert len(runs) == bench.MAX_SAMPLED_RUNS and len(calls) == bench.MAX_SAMPLED_RUNS + 1  # capped


def test_decode_work_matches_the_roofline():
    cfg = tiny_model().config
    byts, flops = decode_work(cfg, [10, 10, 10], 5, 2, 2, first_step=0)
    ctx = 10 + 2  # steps 0..4 attend to 10..14 cached tokens: mean 12
    assert byts == pytest.approx(5 * roofline.decode_step_bytes(cfg, 3, ctx))
    assert flops == pytest.approx(5 * roofline.decode_step_flops(cfg, 3, ctx))
    assert decode_work(cfg, [10], 1, 2, 2) == (0.0, 0.0)  # one token = prefill only, no decode step


def test_workloads_and_prompts():
    assert WORKLOADS["chat"].prompt_lens == (128,) and WORKLOADS["chat"].new_tokens == 256
    assert WORKLOADS["batch"].n_requests == 64 and len(set(WORKLOADS["batch"].prompt_lens)) > 1
    assert WORKLOADS["long"].context_needed() == 8192
    prompts = make_prompts(WORKLOADS["batch"], 100)
    assert prompts == make_prompts(WORKLOADS["batch"], 100)  # seeded
    groups = group_by_length(prompts)
    assert [len(prompts[g[0]]) for g in groups] == [64, 128, 256, 512]
    assert sorted(i for g in groups for i in g) == list(range(64))


def test_hf_peer_shares_the_weights():
    llm = LLM(tiny_model(seed=3), name="tiny")
    hf = hf_peer_model(llm)
    ours_w, theirs_w = llm.model.layers[0].self_attn.q_proj.weight, hf.model.layers[0].self_attn.q_proj.weight
    assert theirs_w.data_ptr() == ours_w.data_ptr()  # the same storage: no second copy of the weights
    assert hf.lm_head.weight.data_ptr() == llm.model.embed_tokens.weight.data_ptr()  # tied
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = llm.model(ids)
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="peers run a float model, and this one's weights are int8: bench the "
                                           "float checkpoint"):
        hf_peer_model(llm.quantize("int8"))


def test_validate_bench_finds_the_problems():
    good = bench_document([result_row(workload="chat", model="m", step="eager", batch_size=1, weights="bf16",
                                      tokens_per_s=10.0)], device="d", peaks={"copy_GBps": 1.0, "bf16_TFLOPs": 1.0})
    validate_bench(good)
    # a kernel micro-benchmark row: no tokens/s, but bw_fraction
    kernel = result_row(workload="rmsnorm", model="-", step="triton", batch_size=None, weights="bf16",
                        bw_fraction=0.8)
    validate_bench({**good, "results": [kernel]})
    with pytest.raises(ValueError, match="missing top-level key 'peaks'"):
        validate_bench({k: v for k, v in good.items() if k != "peaks"})
    bad_row = dict(good["results"][0], mbu="high")
    del bad_row["sm_active"]
    with pytest.raises(ValueError) as e:
        validate_bench({**good, "results": [bad_row]})
    assert "misses ['sm_active']" in str(e.value) and "mbu must be a number" in str(e.value)
    with pytest.raises(ValueError, match="has no tokens_per_s"):
        validate_bench({**good, "results": [dict(good["results"][0], tokens_per_s=None)]})
    with pytest.raises(ValueError, match="peaks.copy_GBps"):
        validate_bench({**good, "peaks": {"bf16_TFLOPs": 1.0}})
    with pytest.raises(ValueError, match="format is 'other'"):
        validate_bench({**good, "format": "other"})
    with pytest.raises(ValueError, match="version 99: this llmlab reads versions 1..1"):
        validate_bench({**good, "version": 99})
    with pytest.raises(ValueError, match=r"tokens_per_s is negative \(-5.0\)"):
        validate_bench({**good, "results": [dict(good["results"][0], tokens_per_s=-5.0)]})
    validate_bench({k: v for k, v in good.items() if k not in ("format", "version")})  # files from before them


def test_list_bench_skips_invalid_files(tmp_path):
    doc = bench_document([result_row(workload="chat", model="m", step="eager", batch_size=1, weights="bf16",
                                     tokens_per_s=float("nan"))], device="NVIDIA H200",
                         peaks={"copy_GBps": 4277.0, "bf16_TFLOPs": 804.0})
    with pytest.raises(ValueError, match="has no tokens_per_s"):  # NaN is written as null
        save_bench(doc, tmp_path / "a.json")
    doc["results"][0]["tokens_per_s"] = 12.5
    save_bench(doc, tmp_path / "a.json")
    (tmp_path / "b.json").write_text("{not json")
    (tmp_path / "c.json").write_text(json.dumps({"hello": 1}))
    docs = list_bench(tmp_path)
    assert [d["results"][0]["tokens_per_s"] for d in docs] == [12.5]
    assert list_bench(tmp_path, device_contains="h200") and not list_bench(tmp_path, device_contains="A100")
    undated = json.loads((tmp_path / "a.json").read_text()) | {"date": None}
    (tmp_path / "d.json").write_text(json.dumps(undated))  # valid, but no date: sorts first instead of crashing
    assert [d["date"] for d in list_bench(tmp_path)][0] is None and len(list_bench(tmp_path)) == 2


def test_latest_ladder_skips_partial_and_cpu_runs(tmp_path):
    """Labs replay the newest FULL ladder of a workload: a later run of two rungs only, or a CPU run, is skipped."""
    peaks = {"copy_GBps": 4277.0, "bf16_TFLOPs": 804.0}

    def doc(device, date, steps, workload="chat", model="llama-3.2-1b"):
        rows = [result_row(workload=workload, model=model, step=s, batch_size=1, weights="bf16", tokens_per_s=1.0)
                for s in steps]
        d = bench_document(rows, device=device, peaks=peaks)
        d["date"], d["workload"], d["model"] = date, {"name": workload}, {"id": model}
        return d

    save_bench(doc("NVIDIA H200", "2026-01-01T00:00:00Z", ["eager", "+cuda_graphs"]), tmp_path / "full.json")
    save_bench(doc("NVIDIA H200", "2026-01-02T00:00:00Z", ["+cuda_graphs", "+triton_kernels"]), tmp_path / "p.json")
    save_bench(doc("cpu", "2026-01-03T00:00:00Z", ["eager"]), tmp_path / "cpu.json")
    save_bench(doc("NVIDIA H200", "2026-01-04T00:00:00Z", ["eager"], model="other"), tmp_path / "o.json")
    assert bench_file.latest_ladder("chat", "llama-3.2-1b", tmp_path)["path"].endswith("full.json")
    assert bench_file.latest_ladder("chat", None, tmp_path)["path"].endswith("o.json")
    assert bench_file.latest_ladder("long", None, tmp_path) is None


def test_cli_errors(capsys, tmp_path):
    assert main(["bench", "--workload", "nope", "--no-save"]) == 2
    assert "unknown workload 'nope'; known workloads: chat, batch, long" in capsys.readouterr().err
    assert main(["bench", "--model", "llama-9b", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'llama-9b'" in err and "llama-3.2-1b" in err
    assert main(["bench", "--steps", "eager,warp", "--no-save", "--device", "cpu"]) == 2
    assert "unknown ladder step 'warp'" in capsys.readouterr().err
    assert main(["bench", "--workload", "long", "--no-save", "--device", "cpu"]) == 2
    assert "needs a context of 8192 tokens but pydoc-llama has 1024: it does not fit" in capsys.readouterr().err
    assert main(["bench", "--workload", ",", "--no-save", "--device", "cpu"]) == 2
    assert "names no workload" in capsys.readouterr().err
    assert main(["bench", "--quick", "--no-save", "--out", str(tmp_path)]) == 2
    assert "--no-save writes no file, so --out has nothing to name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["bench", "--steps", " , ", "--no-save", "--device", "cpu"]) == 2
    assert "names no ladder step" in capsys.readouterr().err


def test_rows_that_convert_the_weights_get_a_memory_note():
    rows = [{"step": "+prefill_graphs", "weights": "bf16", "peak_mem_GB": 17.6, "weights_allocated_GB": 16.1},
            {"step": "+int8", "weights": "int8", "peak_mem_GB": 26.8, "weights_allocated_GB": 9.09},
            {"step": "torchao_int8", "weights": "int8", "peak_mem_GB": 25.8},
            {"step": "+int4", "weights": "int4", "peak_mem_GB": None, "weights_allocated_GB": 5.8}]
    note = bench_table.converted_weights_mem_note(rows, "bf16")
    assert "loaded bf16 model" in note and note.endswith("+int8 9.09")  # not the peer, not a CPU row
    assert bench_table.converted_weights_mem_note(rows[:1], "bf16") is None


def test_mbu_above_the_roofline_gets_a_note():
    rows = [{"step": "eager", "mbu": 1.3}, {"step": "+cuda_graphs", "mbu": 0.4}, {"step": "roofline", "mbu": 1.0}]
    note = bench_table.mbu_above_roofline_note(rows)
    assert note.startswith("MBU above 100% (eager)") and "caches" in note
    assert bench_table.mbu_above_roofline_note(rows[1:]) is None
    assert bench_table.mbu_above_roofline_note([{"step": "x", "mbu": None}]) is None


@pytest.mark.parametrize("budget", ["-1", "nan"])
def test_cli_rejects_a_negative_time_budget(budget, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--time-budget", budget, "--no-save"])
    assert e.value.code == 2 and f"{budget} is not a number of seconds >= 0" in capsys.readouterr().err


def test_cli_checks_out_before_loading_the_model(tmp_path, capsys, monkeypatch):
    """An --out that cannot be written is found before the model loads and the first row runs."""
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(bench, "load_bench_model", no_load)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["bench", "--out", str(blocker / "sub"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"--out {blocker / 'sub'} cannot be written to" in err and "writable folder" in err
    assert main(["bench", "--out", str(blocker), "--device", "cpu"]) == 2
    assert "is a file" in capsys.readouterr().err
    new = tmp_path / "new" / "folder"
    with pytest.raises(AssertionError, match="before --out was checked"):  # a good --out passes, and is created
        main(["bench", "--out", str(new), "--device", "cpu"])
    assert new.is_dir() and not list(new.iterdir())


def test_cli_bench_prints_the_table(tmp_path, capsys, monkeypatch):
    """... and --refresh-peaks measures the peaks again, rewriting a cache that holds (low) ones measured earlier."""
    from llmlab.measure import peaks

    cache = tmp_path / "peaks.json"
    monkeypatch.setenv("LLMLAB_PEAKS_CACHE", str(cache))

    def fake_machine(copy_gb_s, matmul_tflops):  # steady timed repeats at these rates
        monkeypatch.setattr(peaks, "time_copy", lambda *a, **k: peaks.Timing(copy_gb_s * 1e9, (1.0,) * 5, 0.0))
        monkeypatch.setattr(peaks, "time_matmul", lambda *a, **k: peaks.Timing(matmul_tflops * 1e12, (1.0,) * 5, 0.0))

    fake_machine(1.5, 0.0025)  # a steady load that went unnoticed: low, and judged steady
    peaks.measure_peaks("cpu")
    fake_machine(12.5, 0.25)
    out_dir = tmp_path / "out"
    assert main(["bench", "--workload", "chat", "--quick", "--steps", "eager", "--device", "cpu",
                 "--out", str(out_dir), "--refresh-peaks"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "roofline" in out and "eager" in out
    assert (f"peaks: copy 12 GB/s, matmul 0.25 TFLOP/s (float32), measured now, saved to {cache}; spread 0% (copy), "
            f"0% (matmul) over 5 repeats: steady\n") in out
    files = list(out_dir.glob("*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["peaks"]["copy_GBps"] == 12.5 and doc["peaks"]["cached"] is False
    assert doc["peaks"]["verdict"] == "steady" and doc["peaks"]["copy_spread"] == 0.0
    assert peaks.measure_peaks("cpu").copy_bw_gb_s == 12.5  # the cache was rewritten


def _fake_peaks(**fields):
    from llmlab.measure.peaks import Peaks

    return Peaks(**{"device_name": "CPU: test", "torch_version": torch.__version__, "copy_bw_gb_s": 10.0,
                    "matmul_tflops": 0.1, "matmul_dtype": "float32", "measured_at": "2026-01-02T03:04:05Z",
                    "cached": True, "cache_path": "/cache/peaks.json", "copy_spread": 0.03, "matmul_spread": 0.01,
                    "repeats": 5, "attempts": 1, "verdict": "steady", **fields})


def test_the_peaks_line_says_where_the_peaks_come_from(tmp_path):
    """... and how far to trust them: the repeats' spread and the verdict; a noisy measurement is also noted in
    the file."""
    llm = LLM(tiny_model(seed=0), name="tiny")
    lines = []
    doc = run_bench("chat", "tiny", steps=["eager"], peers=False, out=None, quick=True, llm=llm,
                    print_fn=lines.append, measured_peaks=_fake_peaks())
    assert lines[1] == ("peaks: copy 10 GB/s, matmul 0.10 TFLOP/s (float32), read from /cache/peaks.json (measured "
                        "2026-01-02T03:04:05Z); spread 3% (copy), 1% (matmul) over 5 repeats: steady; "
                        "--refresh-peaks measures them again")
    assert doc["peaks"]["verdict"] == "steady" and not any("looked busy" in n for n in doc["notes"])
    lines.clear()
    doc = run_bench("chat", "tiny", steps=["eager"], peers=False, out=None, quick=True, llm=llm,
                    print_fn=lines.append, measured_peaks=_fake_peaks(
                        cached=False, copy_spread=0.6, attempts=3, verdict="noisy",
                        noise_reasons=("copy spread 60%",)))
    assert lines[1] == ("peaks: copy 10 GB/s, matmul 0.10 TFLOP/s (float32), measured now, saved to /cache/peaks.json "
                        "marked noisy: measured again next time; spread 60% (copy), 1% (matmul) over 5 repeats, 3 "
                        "attempts: noisy (copy spread 60%): the machine looks busy, MBU and MFU may read high; "
                        "measure again when it is idle")
    assert doc["peaks"]["verdict"] == "noisy" and doc["peaks"]["noise_reasons"] == ["copy spread 60%"]
    assert ("the peaks were measured while the machine looked busy (copy spread 60%): they may read low, and "
            "mbu/mfu high") in doc["notes"]
    lines.clear()
    doc = run_bench("chat", "tiny", steps=["eager"], peers=False, out=None, quick=True, llm=llm,
                    print_fn=lines.append, peaks_cache=tmp_path / "peaks.json")  # measured here: any verdict
    assert f"(float32), measured now, saved to {tmp_path / 'peaks.json'}" in lines[1]
    assert re.search(r"over 5 repeats(, \d attempts)?: (steady|noisy)", lines[1]), lines[1]
    assert doc["peaks"]["cached"] is False and doc["peaks"]["verdict"] in ("steady", "noisy")


def test_a_zero_time_budget_still_runs_the_first_row():
    """--time-budget 0 used to skip every row, the first too, and write a file of the roofline alone."""
    llm = LLM(tiny_model(seed=0), name="tiny")
    doc = run_bench("chat", "tiny", steps=["no_kv_cache", "eager"], peers=False, out=None, quick=True, llm=llm,
                    print_fn=lambda *a: None, measured_peaks=_fake_peaks(), time_budget_s=0)
    assert [r["step"] for r in doc["results"] if r["step"] != "roofline"] == ["no_kv_cache"]
    assert {"step": "eager", "reason": "time budget of 0 s used up"} in doc["skipped"]


def test_a_roofline_mfu_above_100_percent_is_explained_below_the_table():
    """The roofline row is a bandwidth-only ceiling: where doing the arithmetic at its speed would need more than
    the measured matmul rate (MFU > 100%), a note below the table says so and gives the compute ceiling."""
    llm = LLM(tiny_model(seed=0), name="tiny")
    lines = []
    doc = run_bench("chat", "tiny", steps=["eager"], peers=False, out=None, quick=True, llm=llm,
                    print_fn=lines.append, measured_peaks=_fake_peaks(matmul_tflops=1e-6))
    roof = next(r for r in doc["results"] if r["step"] == "roofline")
    assert roof["mfu"] > 1
    note = bench_table.roofline_mfu_note(doc["results"])
    assert note.startswith("MFU above 100% (roofline): the roofline row is a bandwidth-only ceiling")
    assert f"at most {roof['compute_ceiling_tokens_per_s']:.1f} tokens/s" in note
    table = lines.index(bench_table.format_table(doc["results"]))
    assert note in lines[table + 1:] and note in doc["notes"]
    lines.clear()
    doc = run_bench("chat", "tiny", steps=["eager"], peers=False, out=None, quick=True, llm=llm,
                    print_fn=lines.append, measured_peaks=_fake_peaks(matmul_tflops=1e3))
    assert bench_table.roofline_mfu_note(doc["results"]) is None and not any("MFU above" in line for line in lines)


def test_cli_refuses_a_run_where_none_of_the_steps_can_run(tmp_path, capsys, monkeypatch):
    """--steps +prefill_graphs on a CPU: every requested rung is skipped; exit 2 with the reasons and the fix, no
    file written, no peaks measured."""
    from llmlab.measure import peaks

    def no_peaks(*a, **k):
        raise AssertionError("the peaks were measured for a run that measures nothing")

    monkeypatch.setattr(peaks, "measure_peaks", no_peaks)
    assert main(["bench", "--quick", "--steps", "+prefill_graphs", "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmlab bench: none of the requested ladder steps can run here")
    assert "+prefill_graphs: prefill CUDA graphs: needs a CUDA GPU" in err
    runnable = "no_kv_cache, eager, +int8, +int4, +one_at_a_time, +static_batching, +continuous_batching;"
    assert "a CUDA GPU" in err and f"choose steps that run here ({runnable}" in err and "--peers" in err
    assert not list(tmp_path.iterdir())
    llm = LLM(tiny_model(seed=0), name="tiny")
    with pytest.raises(bench.NothingToRun, match="nothing to measure"):
        run_bench("chat", "tiny", steps=["+cuda_graphs"], peers=False, out=tmp_path, quick=True, llm=llm)
    assert not list(tmp_path.iterdir())
    assert bench.plan_steps(llm, ["+cuda_graphs"], peers=True)[0] == []  # the peers still run
    assert main(["bench", "--steps", "cuda_graphs", "--no-save", "--device", "cpu"]) == 2
    assert "unknown ladder step 'cuda_graphs' (did you mean '+cuda_graphs'?)" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_chat_quick_fills_the_gpu_columns(tmp_path):
    doc = run_bench("chat", "default", peers=True, out=tmp_path, quick=True, device="cuda", print_fn=print)
    rows = {r["step"]: r for r in doc["results"]}
    assert rows["eager"]["weights"] == "bf16"
    assert rows["eager"]["peak_mem_GB"] > 0
    from llmlab.telemetry.nvml_sampler import nvml_available

    if nvml_available()[0]:
        assert rows["eager"]["gpu_util"] is not None
    assert "hf_eager" in rows and "hf_static" in rows
    assert not [s for s in doc["skipped"] if s["reason"].startswith("failed")], doc["skipped"]


@pytest.mark.slow  # ~45 s: generate_batch sets up its manager and worker thread
def test_hf_continuous_batching_peer_gives_the_solo_tokens():
    """transformers' own continuous batching (`generate_batch`) on the same weights: each request's greedy tokens
    equal llmlab's solo run, and the TTFTs lie within the call; its logger's warnings about what the peer asks for
    on purpose (a kept manager, EOS off) stay out of the bench's output, and the logger's level is restored."""
    import logging

    from llmlab.measure.peers import close_hf_continuous, hf_peer_model, run_hf_continuous

    llm = LLM(tiny_model(seed=2), name="tiny")
    hf = hf_peer_model(llm)
    if not hasattr(hf, "generate_batch"):
        pytest.skip("this transformers has no generate_batch (continuous batching)")
    prompts = [[5, 6, 7], list(range(10, 30)), [9] * 11]
    cb_log = logging.getLogger("ContinuousBatchingLogger")  # it has a handler of its own and may not propagate
    level, heard = cb_log.level, []
    listener = logging.Handler(logging.WARNING)
    listener.emit = heard.append
    cb_log.addHandler(listener)
    try:
        run = run_hf_continuous(hf, prompts, 5)
    finally:
        close_hf_continuous(hf)
        cb_log.removeHandler(listener)
    assert not heard and cb_log.level == level, [r.getMessage() for r in heard]
    want = [llm.generate([p], max_new_tokens=5, stop_at_eos=False).token_ids[0] for p in prompts]
    (call,) = run.calls
    assert call.tokens == want
    assert len(call.step_ms) == 1 and all(0 < t <= call.step_ms[0] for t in call.ttft_ms)


def test_torchao_peer_quantizes_a_copy_and_leaves_the_shared_weights_alone():
    """The torchao int8 peer: a copy of the Hugging Face peer with torchao's weight-only layers in the decoder
    (lm_head untouched), greedy tokens close to llmlab's own int8 rung, and the llmlab weights it shared unchanged."""
    pytest.importorskip("torchao", reason="torchao is optional (a quantized peer of the +int8 / +int4 rungs)")
    from llmlab.measure.peers import hf_peer_model, run_hf, torchao_peer_model

    llm = LLM(tiny_model(seed=5), name="tiny")
    before = {k: v.clone() for k, v in llm.model.state_dict().items()}
    hf = hf_peer_model(llm)
    q, how = torchao_peer_model(hf, "int8")
    assert "Int8WeightOnlyConfig" in how
    assert type(q.model.layers[0].mlp.gate_proj.weight).__name__ != "Parameter"  # a torchao tensor subclass
    assert type(q.lm_head.weight).__name__ == "Parameter"
    assert all(torch.equal(before[k], v) for k, v in llm.model.state_dict().items())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():  # both int8 roundings of the same weights move the logits by the same order
        theirs, ours, exact = q(ids).logits, llm.quantize("int8").model(ids), llm.model(ids)
    their_error, our_error = (theirs - exact).abs().max(), (ours - exact).abs().max()
    assert 0 < their_error < 2 * our_error
    assert len(run_hf(q, [[5, 6, 7, 8]], 4, static=False).calls[0].tokens[0]) == 4
    with pytest.raises(ValueError, match="int8' or 'int4"):
        torchao_peer_model(hf, "int2")
