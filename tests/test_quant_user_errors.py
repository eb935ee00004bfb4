"""What a user meets around a quantized model: the ladder and the tour on a model loaded from a quantized folder,
group sizes and int8 arguments `LLM.quantize` refuses, a quantized folder without its quant_config.json, and the
run metrics of a `Generation` (read like a request's), and the batching mode a refused option points to. CPU, the
shipped default model."""

from __future__ import annotations

import shutil

import pytest

import llmlab
from llmlab.ladder import available_steps
from llmlab.quant import is_quantized
from llmlab.quant.serialize import QUANT_CONFIG, save_quantized


@pytest.fixture(scope="module")
def llm():
    return llmlab.load(device="cpu")


@pytest.fixture(scope="module")
def int4_folder(llm, tmp_path_factory):
    return save_quantized(llm.quantize("int4"), tmp_path_factory.mktemp("int4"))


def test_the_weights_rungs_are_skipped_with_a_reason_on_an_already_quantized_model(llm, int4_folder):
    loaded = llmlab.load(int4_folder, device="cpu")
    runnable, skipped = available_steps(loaded, ["eager", "+int8", "+int4"])
    assert [r.step.name for r in runnable] == ["eager"]
    reasons = {step.name: why for step, why in skipped}
    assert set(reasons) == {"+int8", "+int4"}
    assert all("already quantized" in why and "float checkpoint" in why for why in reasons.values())
    # on the float model the same rungs run
    assert [r.step.name for r in available_steps(llm, ["+int8", "+int4"])[0]] == ["+int8", "+int4"]


def test_the_tour_runs_on_a_quantized_folder(int4_folder, capsys):
    from llmlab.cli import main

    assert main(["tour", "--model", str(int4_folder), "--max-new-tokens", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "already quantized" in out  # the int8 / int4 rows are listed as skipped, with the reason


def test_a_group_larger_than_a_layers_input_is_refused_before_any_change(llm):
    smallest_k = min(lin.in_features for name, lin in llm.model.named_modules()
                     if type(lin).__name__ == "Linear" and name != "lm_head")
    too_big = (smallest_k // 32 + 1) * 32
    with pytest.raises(ValueError, match=rf"^quantize: group_size={too_big} is larger than the input dimension "
                                         rf"K={smallest_k}.*at most {smallest_k}"):  # named as the call made
        llm.quantize("int4", group_size=too_big)
    with pytest.raises(ValueError, match=rf"group_size={too_big} is larger"):  # AWQ checks the same rule first
        llm.quantize("int4", group_size=too_big, method="awq", progress=False)
    assert not is_quantized(llm.model)
    assert llm.quantize("int4", group_size=smallest_k // 32 * 32).model is not llm.model  # the largest that fits


def test_int8_takes_no_group_size_and_the_name_says_lm_head(llm):
    with pytest.raises(ValueError, match=r"int8 keeps one scale per output channel.*group_size=64.*drop group_size"):
        llm.quantize("int8", group_size=64)
    assert llm.quantize("int4").model.layers[0].mlp.up_proj.group_size == 128  # None: the usual 128
    plain, with_head = llm.quantize("int8"), llm.quantize("int8", include_lm_head=True)
    assert plain.name != with_head.name and with_head.name.endswith("+lm_head")


def test_a_quantized_folder_without_its_config_names_the_missing_file(int4_folder, tmp_path):
    broken = shutil.copytree(int4_folder, tmp_path / "no-config")
    (broken / QUANT_CONFIG).unlink()
    with pytest.raises(ValueError, match=r"quantized layer's tensor.*no quant_config\.json.*save_quantized"):
        llmlab.load(broken, device="cpu")


def test_generation_metrics_is_read_like_a_requests(llm):
    g = llm.generate("The list", max_new_tokens=4, stop_at_eos=False)
    assert g.metrics.ttft_ms == g.ttft_ms > 0
    assert g.metrics.tpot_ms == g.tpot_ms > 0


def test_continuous_batching_names_a_batching_mode_that_takes_the_refused_option(llm):
    prompts = [[1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match=r"use_cache=False.*batching='one_at_a_time'$"):
        llm.generate(prompts, batching="continuous", use_cache=False, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"torch_compile.*batching='one_at_a_time' or batching='static'$"):
        llm.generate(prompts, batching="continuous", torch_compile=True, max_new_tokens=2)
    out = llm.generate(prompts, batching="one_at_a_time", use_cache=False, max_new_tokens=2)  # the advice works
    assert [len(t) for t in out.token_ids] == [2, 2]


def test_a_numpy_integer_group_size_is_taken_as_an_int(llm):
    import numpy as np

    q = llm.quantize("int4", group_size=np.int64(64))
    assert q.name.endswith("int4 g64") and {m.group_size for m in q.model.modules() if hasattr(m, "group_size")} == {64}
    assert all(type(m.group_size) is int for m in q.model.modules() if hasattr(m, "group_size"))
    with pytest.raises(TypeError, match="group_size must be an int"):
        llm.quantize("int4", group_size=np.float64(64))


def test_dequantize_model_takes_a_dtype_name_and_refuses_another_before_any_change():
    import torch

    from llmlab.quant import dequantize_model, is_quantized

    model = llmlab.load().quantize("int8").model
    with pytest.raises(ValueError, match="dequantize_model: dtype: unknown dtype 'int8'; use one of fp32, bf16"):
        dequantize_model(model, dtype="int8")
    assert is_quantized(model)  # nothing changed
    dequantize_model(model, dtype="bf16")
    assert not is_quantized(model) and model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


def test_rtn_in_place_refuses_a_non_finite_weight_before_any_layer_is_swapped():
    llm = llmlab.load()
    llm.model.layers[1].mlp.up_proj.weight.data[0, 0] = float("nan")  # a layer after the first ones it would swap
    with pytest.raises(ValueError, match=r"^quantize: the weight 'layers.1.mlp.up_proj.weight' is not finite"):
        llm.quantize("int8", inplace=True)
    assert not is_quantized(llm.model)  # no layer swapped: the model is still whole
    # re-quantizing a quantized model with round-to-nearest says why, without AWQ's reason
    llm.model.layers[1].mlp.up_proj.weight.data[0, 0] = 0.01
    q = llm.quantize("int8")
    with pytest.raises(ValueError, match=r"^quantize: the model is already quantized .*round the rounded weights "
                                         r"again") as info:
        q.quantize("int4")
    assert "AWQ" not in str(info.value)


def test_int4_in_place_refuses_a_weight_beyond_the_scale_range_before_any_layer_is_swapped():
    """A finite weight too large for the int4 GEMVs' scales (|w| / 7 >= 2^96) is refused by the pre-check, naming
    the layer and the call, with every layer still float; int8 (no such limit) quantizes it."""
    llm = llmlab.load()
    llm.model.layers[1].mlp.down_proj.weight.data[0, 0] = 1e30
    for method in ("rtn", "awq"):
        with pytest.raises(ValueError, match=r"^quantize: weights in layers.1.mlp.down_proj.weight up to 1e\+30 need "
                                             r"int4 scales of 2\^96"):
            llm.quantize("int4", method=method, inplace=True)
        assert not is_quantized(llm.model)
    llm.model.layers[1].mlp.down_proj.weight.data[0, 0] = 0.01  # put back: the same model quantizes now
    assert is_quantized(llm.quantize("int4", inplace=True).model)


def test_quantize_flags_perplexity_ids_and_save_folder_are_checked_by_type():
    """A string for an on/off argument ("no" would count as True), None for token ids and a number for the folder
    each get a TypeError that names the argument, and nothing changes."""
    from llmlab.quant import perplexity, save_quantized

    llm = llmlab.load()
    for kwargs in (dict(inplace="no"), dict(include_lm_head="yes"), dict(progress=1)):
        name = next(iter(kwargs))
        with pytest.raises(TypeError, match=rf"^quantize: {name} must be True or False, got"):
            llm.quantize("int8", **kwargs)
    assert not is_quantized(llm.model)
    with pytest.raises(TypeError, match=r"^perplexity: token_ids must be token ids .*got NoneType"):
        perplexity(llm, None)
    with pytest.raises(TypeError, match=r"^save_quantized: directory must be a folder path .*got int 5"):
        save_quantized(llm.quantize("int8"), 5)


def test_quantize_model_checks_every_weight_before_it_swaps_a_layer():
    """quantize_model called directly is all or nothing too: a NaN in a later layer (or, for int4, a weight beyond
    the scales' range) is refused with the layer's own count of values (not its padded one), and no layer was
    swapped."""
    from llmlab.quant import quantize_model

    llm = llmlab.load()
    w = llm.model.layers[1].mlp.down_proj.weight
    w.data[0, 0] = float("nan")
    for scheme in ("int8", "int4"):
        with pytest.raises(ValueError, match=rf"^quantize_model: the weight 'layers.1.mlp.down_proj.weight' is not "
                                             rf"finite: 1 of its {w.numel()} values"):
            quantize_model(llm.model, scheme)
        assert not is_quantized(llm.model)
    w.data[0, 0] = 1e30
    with pytest.raises(ValueError, match=r"^quantize_model: weights in layers.1.mlp.down_proj.weight up to 1e\+30"):
        quantize_model(llm.model, "int4")
    assert not is_quantized(llm.model)


def test_a_quantized_save_refuses_an_empty_folder_name_and_an_unwritable_folder(llm, tmp_path, monkeypatch):
    """Path("") is the current folder: an empty name is refused, not a model written where the user stands; a
    folder that cannot be created gets the project's error, naming it, with nothing written."""
    q = llm.quantize("int8")
    monkeypatch.chdir(tmp_path)
    for name in ("", "  "):
        with pytest.raises(ValueError, match="^save_quantized: the folder name is empty"):
            save_quantized(q, name)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"a_file/sub cannot be written to \(.*\); give a writable folder"):
        save_quantized(q, blocker / "sub")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_int4_names_int8_for_a_layer_narrower_than_one_group():
    import torch.nn as nn

    from llmlab.quant import quantize_model

    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 8))
    with pytest.raises(ValueError, match=r"K=16 is below 32.*scheme='int8'"):
        quantize_model(model, "int4", group_size=32)
    assert not is_quantized(model)
    assert is_quantized(quantize_model(model, "int8"))  # what the message offers runs


def test_quantizing_weights_on_the_meta_device_names_the_device(llm):
    import torch

    from llmlab.model import Transformer
    from llmlab.quant import quantize_model

    with torch.device("meta"):
        model = Transformer(llm.config)
    with pytest.raises(ValueError, match=r"on the meta device.*load the model's weights first"):
        quantize_model(model, "int8")
    assert not is_quantized(model)


def test_int4_linear_takes_a_numpy_group_size():
    import numpy as np
    import torch.nn as nn

    from llmlab.quant import Int4Linear

    layer = Int4Linear.from_linear(nn.Linear(128, 4), np.int64(64))
    assert layer.group_size == 64 and type(layer.group_size) is int
