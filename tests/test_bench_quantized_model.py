"""`llmlab bench` on a quantized folder (written by `llmlab.quant.serialize.save_quantized`, loaded with Int8Linear /
Int4Linear layers): every row and the roofline say the format that was loaded ("int8", "int4"; the model record
"int4 g128"), and the roofline reads the bytes of the packed tensors + scales the rows read, not the float dtype's.
Also the helpers behind it (`llmlab.measure.model_bytes`) and the batch sweep's bytes on such a model."""

from __future__ import annotations

import pytest
import torch

import llmlab
from llmlab.ladder import WEIGHT_BYTES
from llmlab.measure import roofline
from llmlab.measure.batch_sweep import batch_sweep
from llmlab.measure.bench import run_bench
from llmlab.measure.bench_metrics import decode_work
from llmlab.measure.bench_table import format_table
from llmlab.measure.model_bytes import bytes_per_param_read, describe_weights, loaded_weights, step_weight_bytes
from llmlab.measure.workloads import WORKLOADS, group_by_length, make_prompts
from llmlab.quant.serialize import save_quantized

FORMATS = {"int8": ("int8", None), "int4": ("int4", 128)}  # row label -> (scheme, group size) saved


def _fake_peaks():
    from llmlab.measure.peaks import Peaks

    return Peaks(device_name="CPU: test", torch_version=torch.__version__, copy_bw_gb_s=10.0, matmul_tflops=0.1,
                 matmul_dtype="float32", measured_at="2026-01-02T03:04:05Z", cached=True,
                 cache_path="/cache/peaks.json", copy_spread=0.03, matmul_spread=0.01, repeats=5, attempts=1,
                 verdict="steady")


@pytest.fixture(scope="module")
def float_llm():
    return llmlab.load(device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def folders(float_llm, tmp_path_factory):
    """{label: folder} of the shipped default model saved quantized, once for the module."""
    out = {}
    for label, (scheme, group) in FORMATS.items():
        q = float_llm.quantize(scheme, **({"group_size": group} if group else {}))
        out[label] = save_quantized(q, tmp_path_factory.mktemp(label))
    return out


@pytest.mark.parametrize("label", sorted(FORMATS))
def test_a_quantized_folder_is_labelled_and_its_roofline_reads_its_bytes(folders, label):
    lines = []
    doc = run_bench("chat", str(folders[label]), steps=["eager"], peers=False, out=None, quick=True, device="cpu",
                    measured_peaks=_fake_peaks(), print_fn=lines.append)
    rows = {r["step"]: r for r in doc["results"]}
    assert set(rows) == {"eager", "roofline"}, doc["skipped"]
    eager, roof = rows["eager"], rows["roofline"]
    assert eager["weights"] == roof["weights"] == label
    scheme, group = FORMATS[label]
    assert doc["model"]["weights"] == scheme + (f" g{group}" if group else "")
    assert f"{doc['model']['weights']} weights]" in lines[0]  # the header line says what was loaded
    table = format_table(doc["results"])
    assert "fp32" not in table and all(label in line for line in table.splitlines()[2:])

    # the roofline reads what the rows read: the packed weights + scales + the float layers kept (embedding/lm_head)
    llm = llmlab.load(folders[label], device="cpu")
    cfg = llm.config
    read = step_weight_bytes(llm.model)
    assert roof["weight_bytes_per_param"] == pytest.approx(read / roofline.weight_params_read(cfg))
    assert roof["weight_bytes_per_param"] == pytest.approx(eager["weight_bytes_per_param"])
    assert roof["weights_read_GB"] == pytest.approx(eager["weights_read_GB"]) == pytest.approx(read / 1e9)
    assert roof["weight_bytes_per_param"] < 0.5 * WEIGHT_BYTES["fp32"]  # not the fp32 weights it was made from

    # its step time, counted here from the bytes: the quantized bytes, and well below the fp32 ceiling
    wl = WORKLOADS["chat"]
    prompts, n = make_prompts(wl, cfg.vocab_size), wl.quick_new_tokens
    groups = group_by_length(prompts)

    def ceiling_ms(bpp):
        moved = sum(decode_work(cfg, [len(prompts[i]) for i in g], n, bpp, 4, first_step=0)[0] for g in groups)
        return 1e3 * moved / (10.0 * 1e9) / (n * len(groups))

    assert roof["tpot_ms_p50"] == pytest.approx(ceiling_ms(read / roofline.weight_params_read(cfg)))
    assert roof["tpot_ms_p50"] < 0.6 * ceiling_ms(WEIGHT_BYTES["fp32"])


def test_the_helpers_on_float_and_quantized_models(float_llm):
    model = float_llm.model
    assert loaded_weights(model, torch.float32) == describe_weights(model, torch.float32) == "fp32"
    assert loaded_weights(model, torch.bfloat16) == "bf16"
    assert bytes_per_param_read(model, float_llm.config, torch.float32) == WEIGHT_BYTES["fp32"]
    q = float_llm.quantize("int4", group_size=64, include_lm_head=True)
    assert loaded_weights(q.model, q.dtype) == "int4"
    assert describe_weights(q.model, q.dtype) == "int4 g64 + lm_head"
    bpp = bytes_per_param_read(q.model, q.config, q.dtype)
    assert bpp == pytest.approx(step_weight_bytes(q.model) / roofline.weight_params_read(q.config))
    assert 0.5 < bpp < 1  # 4 bits + a 4-byte scale per 64 weights, and the float embedding table read per token
    for fn, args in ((loaded_weights, (torch.float32,)), (describe_weights, (torch.float32,)),
                     (bytes_per_param_read, (float_llm.config, torch.float32))):
        with pytest.raises(TypeError, match=f"{fn.__name__}: expected an nn.Module"):
            fn(float_llm, *args)  # the LLM, not its .model


def test_the_batch_sweep_counts_a_quantized_model_s_bytes(folders):
    llm = llmlab.load(folders["int4"], device="cpu")
    cfg = llm.config
    row, = batch_sweep(llm, batch_sizes=(1,), prompt_len=8, new_tokens=3,
                       peaks={"copy_GBps": 10.0, "bf16_TFLOPs": 0.1})
    ctx = roofline.decode_mean_context_len(8, 3)
    bpp = step_weight_bytes(llm.model) / roofline.weight_params_read(cfg)
    assert row["achieved_GBps"] == pytest.approx(roofline.decode_step_bytes(cfg, 1, ctx, bpp, 4)
                                                 / (row["tpot_ms"] / 1e3) / 1e9)
    assert row["intensity"] > roofline.arithmetic_intensity(cfg, 1, ctx, WEIGHT_BYTES["fp32"], 4)
