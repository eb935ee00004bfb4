"""AWQ (`llmlab.quant.awq`): the fold of the scales leaves the float model's function unchanged (GQA's o_proj scales
included), the search lowers the rounding error where some input channels carry large activations, the progress bar
can be turned off, and bad input (a quantized model, Triton kernel modules, bad ids or scales, an unknown method of
`LLM.quantize`) is refused before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import llmlab
from llmlab.engine import LLM
from llmlab.quant import (Int4Linear, Int8Linear, apply_awq, awq_scales, is_quantized, quantize_awq,
                          quantize_model)
from llmlab.quant.awq import GROUPS, fake_quantize
from tiny_models import tiny_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _ids(seed: int, shape=(2, 32), vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _outlier_model(seed: int = 1) -> nn.Module:
    """A tiny random model whose norms make 4 of the 128 input channels ~20x larger than the rest (what trained
    LLMs show in a few channels, and what AWQ is for)."""
    model = tiny_model(seed=seed)
    channels = torch.randperm(model.config.dim, generator=torch.Generator().manual_seed(seed))[:4]
    with torch.no_grad():
        for layer in model.layers:
            layer.input_layernorm.weight[channels] *= 20
            layer.post_attention_layernorm.weight[channels] *= 20
    return model


def _random_scales(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Scales of every AWQ key, drawn log-uniformly in [0.1, 10]."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    sizes = {"input_layernorm": cfg.dim, "post_attention_layernorm": cfg.dim, "mlp.up_proj": cfg.intermediate_size,
             "self_attn.v_proj": cfg.n_kv_heads * cfg.head_dim}
    return {f"layers.{i}.{key}": torch.exp(torch.empty(sizes[key]).uniform_(-2.3, 2.3, generator=gen))
            for i in range(cfg.n_layers) for key, _ in GROUPS}


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}, {"n_kv_heads": 8}])
def test_fold_without_quantization_preserves_the_function(overrides):
    model = tiny_model(seed=3, **overrides)
    ids = _ids(0)
    ref = model(ids)
    folded = apply_awq(copy.deepcopy(model), _random_scales(model))
    assert not torch.equal(folded.layers[0].self_attn.o_proj.weight, model.layers[0].self_attn.o_proj.weight)
    torch.testing.assert_close(folded(ids), ref, atol=2e-4, rtol=1e-4)


def test_o_proj_scales_follow_the_gqa_head_mapping():
    """Query head h reads KV head h // n_rep: scaling v_proj's rows of KV head 0 must be undone in o_proj's columns
    of query heads 0..n_rep-1 only. A mapping h % n_kv_heads would break the function."""
    model = tiny_model(seed=4)  # 8 query heads, 2 KV heads, head_dim 16
    cfg = model.config
    s = torch.ones(cfg.n_kv_heads * cfg.head_dim)
    s[:cfg.head_dim] = 4.0  # KV head 0
    folded = apply_awq(copy.deepcopy(model), {"layers.0.self_attn.v_proj": s})
    n_rep = cfg.n_heads // cfg.n_kv_heads
    ratio = folded.layers[0].self_attn.o_proj.weight / model.layers[0].self_attn.o_proj.weight  # (D, H*hd)
    expected = torch.ones(cfg.n_heads * cfg.head_dim)
    expected[:n_rep * cfg.head_dim] = 4.0
    torch.testing.assert_close(ratio, expected.expand_as(ratio))
    ids = _ids(1)
    torch.testing.assert_close(folded(ids), model(ids), atol=2e-4, rtol=1e-4)


def test_awq_lowers_the_output_error_of_rtn_with_outlier_channels():
    model = _outlier_model()
    calib, held = _ids(10, (4, 64)), _ids(11, (4, 64))  # disjoint draws: the error is measured off calibration
    ref = model(held)
    rtn = quantize_model(copy.deepcopy(model), "int4", group_size=32)
    awq = quantize_awq(copy.deepcopy(model), calib, "int4", group_size=32, grid=10, progress=False)
    err_rtn = (rtn(held) - ref).pow(2).mean().item()
    err_awq = (awq(held) - ref).pow(2).mean().item()
    assert err_awq < 0.85 * err_rtn, (err_rtn, err_awq)
    assert all(type(getattr(getattr(layer, part), name)) is Int4Linear
               for layer in awq.layers for part, names in (("self_attn", LINEARS[:4]), ("mlp", LINEARS[4:]))
               for name in names)


def test_search_never_does_worse_than_rtn_on_calibration_and_leaves_the_model_alone():
    model = _outlier_model(seed=2)
    before = copy.deepcopy(model.state_dict())
    scales = awq_scales(model, _ids(12), "int4", group_size=32, grid=5, progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the search changes nothing
    assert len(scales) == 4 * model.config.n_layers == len(scales.search)
    assert all(r["mse"] <= r["mse_rtn"] and r["alpha"] in (0.0, 0.2, 0.4, 0.6, 0.8) for r in scales.search)
    qkv = [r for r in scales.search if r["key"].endswith("input_layernorm")]
    assert all(r["alpha"] > 0 and r["mse"] < 0.9 * r["mse_rtn"] for r in qkv), qkv  # the outliers are found


def test_fake_quantize_is_what_the_quantized_layers_store():
    lin = nn.Linear(96, 5)
    torch.testing.assert_close(fake_quantize(lin.weight, "int4", 32), Int4Linear.from_linear(lin, 32).dequantize())
    torch.testing.assert_close(fake_quantize(lin.weight, "int8"), Int8Linear.from_linear(lin).dequantize())
    w = torch.randn(4, 80)  # K not a multiple of the group size: padded with zeros, the padding cut off
    padded = fake_quantize(torch.nn.functional.pad(w, (0, 16)), "int4", 32)
    torch.testing.assert_close(fake_quantize(w, "int4", 32), padded[:, :80])


def test_progress_bar_can_be_turned_off(capsys):
    model = tiny_model(seed=5, n_layers=1)
    ids = _ids(13, (1, 16))
    awq_scales(model, ids, "int8", grid=2, progress=False)
    assert capsys.readouterr().err == ""
    awq_scales(model, ids, "int8", grid=2, progress=True)
    assert "AWQ int8" in capsys.readouterr().err


def test_bf16_model_is_calibrated_in_fp32_and_keeps_its_dtype():
    model = tiny_model(seed=6, n_layers=1).to(torch.bfloat16)
    quantize_awq(model, _ids(14), "int4", group_size=32, grid=4, progress=False)
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert model.layers[0].self_attn.q_proj.orig_dtype == torch.bfloat16
    assert torch.isfinite(model(_ids(15)).float()).all()


def test_refusals_leave_the_model_unchanged():
    model = tiny_model(seed=7, n_layers=1)
    before = copy.deepcopy(model.state_dict())
    ids = _ids(16)
    with pytest.raises(ValueError, match="unknown scheme"):
        quantize_awq(model, ids, "int3", progress=False)
    with pytest.raises(ValueError, match="group_size=48"):
        quantize_awq(model, ids, "int4", group_size=48, progress=False)
    with pytest.raises(TypeError, match="integer token ids"):
        quantize_awq(model, ids.float(), progress=False)
    with pytest.raises(ValueError, match="max_seq_len = 256"):
        quantize_awq(model, _ids(17, (1, 300)), progress=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        quantize_awq(model, ids + 256, progress=False)
    with pytest.raises(ValueError, match="grid"):
        quantize_awq(model, ids, grid=0, progress=False)
    with pytest.raises(TypeError, match="llm.model"):
        quantize_awq(LLM(model), ids, progress=False)
    with pytest.raises(ValueError, match="unknown key"):
        apply_awq(model, {"layers.0.self_attn.q_proj": torch.ones(128)})
    with pytest.raises(ValueError, match=r"shape \(128,\)"):
        apply_awq(model, {"layers.0.input_layernorm": torch.ones(64)})
    with pytest.raises(ValueError, match="positive and finite"):
        apply_awq(model, {"layers.0.input_layernorm": torch.ones(128),
                          "layers.0.mlp.up_proj": -torch.ones(192)})  # the first key is not applied either
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not is_quantized(model)
    broken = copy.deepcopy(model)
    broken.layers[0].mlp.up_proj.weight.data[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"quantize_awq: the weight 'layers.0.mlp.up_proj.weight' is not finite"):
        quantize_awq(broken, ids, "int4", group_size=32, progress=False)
    assert not is_quantized(broken)


def test_quantized_and_kernel_swapped_models_are_refused():
    from llmlab.kernels.modules import TritonRMSNorm

    quantized = quantize_model(tiny_model(seed=8, n_layers=1), "int8")
    for call in (lambda m: awq_scales(m, _ids(18), progress=False), lambda m: apply_awq(m, {}),
                 lambda m: quantize_awq(m, _ids(18), progress=False)):
        with pytest.raises(ValueError, match="already quantized"):
            call(quantized)
    swapped = tiny_model(seed=8, n_layers=1)
    swapped.norm.__class__ = TritonRMSNorm  # what llmlab.kernels.modules.swap_in puts in (it needs Triton to run)
    with pytest.raises(ValueError, match="swap_out"):
        quantize_awq(swapped, _ids(18), progress=False)


def test_a_failure_after_the_fold_restores_the_float_model(monkeypatch):
    import llmlab.quant.awq as awq

    model = tiny_model(seed=9, n_layers=1)
    before = copy.deepcopy(model.state_dict())

    def swap_one_then_fail(m, *args, **kwargs):
        m.layers[0].mlp.down_proj = Int8Linear.from_linear(m.layers[0].mlp.down_proj)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(awq, "quantize_model", swap_one_then_fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        quantize_awq(model, _ids(19), "int8", grid=2, progress=False)
    assert type(model.layers[0].mlp.down_proj) is nn.Linear
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# -- LLM.quantize(method="awq") -------------------------------------------------------------------------------------
def test_llm_quantize_awq_with_ids_names_it_and_keeps_the_original():
    llm = LLM(tiny_model(seed=10, n_layers=1), name="tiny")
    q = llm.quantize("int4", group_size=32, method="awq", calibration=_ids(20), progress=False)
    assert q.name == "tiny int4 g32 awq" and is_quantized(q.model) and not is_quantized(llm.model)
    same = llm.quantize("int8", method="awq", calibration=_ids(20), inplace=True, progress=False)
    assert same is llm and llm.name == "tiny int8 awq" and is_quantized(llm.model)


def test_llm_quantize_refuses_bad_method_and_calibration_before_any_change():
    llm = LLM(tiny_model(seed=11, n_layers=1), name="tiny")
    before = copy.deepcopy(llm.model.state_dict())
    with pytest.raises(ValueError, match="unknown method 'gptq'"):
        llm.quantize("int4", group_size=32, method="gptq", inplace=True)
    with pytest.raises(ValueError, match="method='awq' only"):
        llm.quantize("int4", group_size=32, calibration=_ids(21), inplace=True)
    with pytest.raises(TypeError, match="no tokenizer"):
        llm.quantize("int4", group_size=32, method="awq", calibration="some text", inplace=True)
    with pytest.raises(TypeError, match="calibration must be text"):
        llm.quantize("int4", group_size=32, method="awq", calibration=[1, 2, 3], inplace=True)
    with pytest.raises(ValueError, match="group_size=48"):
        llm.quantize("int4", group_size=48, method="awq", calibration=_ids(21), inplace=True)
    assert llm.name == "tiny" and not is_quantized(llm.model)
    assert all(torch.equal(v, before[k]) for k, v in llm.model.state_dict().items())


def test_llm_quantize_awq_refuses_short_calibration_text_on_the_default_model():
    llm = llmlab.load(device="cpu", dtype="fp32")
    with pytest.raises(ValueError, match="shorter than one window of seq_len = 256"):
        llm.quantize("int4", group_size=64, method="awq", calibration="import os", inplace=True)
    assert llm.name == "pydoc-llama" and not is_quantized(llm.model)


@pytest.mark.slow
def test_llm_quantize_awq_on_the_default_model_with_its_held_out_text():
    """The whole path on the shipped model: held-out calibration text, the search over 8 layers, the swap. Its
    perplexity on held-out tokens after the calibration windows stays within 5% of the float model's (either way:
    on 1,024 tokens rounding may as well lower it), and its logits are not the float model's."""
    from llmlab.quant import evaluation_ids, perplexity

    llm = llmlab.load(device="cpu", dtype="fp32")
    q = llm.quantize("int4", group_size=64, method="awq", progress=False)
    assert q.name == "pydoc-llama int4 g64 awq"
    ids = evaluation_ids(llm)[:1024]
    p_float, p_awq = perplexity(llm.model, ids, context=512), perplexity(q.model, ids, context=512)
    assert abs(p_awq / p_float - 1) < 0.05, (p_float, p_awq)
    assert not torch.equal(q.model(ids[None, :64]), llm.model(ids[None, :64]))
