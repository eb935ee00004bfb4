"""save_quantized / load_quantized (llmlab/quant/serialize.py): the round trip gives the same logits (the default
model in int8, int4 g64, int4 g128 with down_proj padded; a tiny model with lm_head quantized), and a folder whose
quant_config.json disagrees with its tensors (a scheme swapped, a layer removed, a group size changed, a shape or a
dtype) is refused with a message naming the layer and the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import llmlab
from llmlab.checkpoint import DEFAULT_MODEL_DIR, save_model
from llmlab.quant import (Int4Linear, Int8Linear, dequantize_model, is_quantized, quantize_model,
                          quantized_layers)
from llmlab.quant.serialize import QUANT_CONFIG, is_quantized_checkpoint, load_quantized, save_quantized
from tiny_models import prompt_ids, tiny_model


@pytest.fixture(scope="module")
def llm():
    return llmlab.load(device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def saved(llm, tmp_path_factory):
    """{(scheme, group size): (quantized LLM, folder it was saved to)}, made once for the module."""
    out = {}
    for scheme, G in (("int8", None), ("int4", 64), ("int4", 128)):
        q = llm.quantize(scheme, group_size=G)
        out[scheme, G] = q, save_quantized(q, tmp_path_factory.mktemp(f"{scheme}-g{G}"))
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("scheme,G", [("int8", None), ("int4", 64), ("int4", 128)])
def test_round_trip_gives_identical_logits(llm, saved, scheme, G):
    q, folder = saved[scheme, G]
    assert is_quantized_checkpoint(folder) and not is_quantized_checkpoint(DEFAULT_MODEL_DIR)
    loaded = load_quantized(folder, device="cpu")
    cls = Int8Linear if scheme == "int8" else Int4Linear
    layers, original = quantized_layers(loaded.model), quantized_layers(q.model)
    assert set(layers) == set(original) and len(layers) == 7 * llm.config.n_layers
    assert all(type(m) is cls for m in layers.values())
    for name, m in layers.items():
        o = original[name]
        assert (m.in_features, m.padded_in_features, m.orig_dtype) == (o.in_features, o.padded_in_features,
                                                                       o.orig_dtype)
        assert all(torch.equal(a, b) for a, b in zip(m.packed_tensors(), o.packed_tensors()))
    down = loaded.model.layers[0].mlp.down_proj
    assert down.padded_in_features == (768 if G == 128 else 704)
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight  # the tie is restored
    ids = torch.tensor([llm.encode("import os\nfor name in")])
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(q.model, ids), atol=0, rtol=0)
    assert loaded.tokenizer is not None and loaded.quant_method == "rtn"
    assert loaded.decode(loaded.encode("import os")) == "import os"
    qc = json.loads((folder / QUANT_CONFIG).read_text())
    assert (qc["scheme"], qc["group_size"], qc["include_lm_head"], qc["method"]) == (scheme, G, False, "rtn")
    assert qc["layers"]["layers.0.mlp.down_proj"]["in_features"] == 704
    assert qc["layers"]["layers.0.mlp.down_proj"]["padded_in_features"] == down.padded_in_features
    float_bytes = (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size * 2  # the shipped file is bf16
    assert (folder / "model.safetensors").stat().st_size < float_bytes


def test_a_bare_model_with_a_quantized_lm_head_and_its_method(tmp_path):
    model = quantize_model(tiny_model(seed=2), "int4", group_size=128, include_lm_head=True)  # K = 192 padded
    model.quant_method = "awq"
    save_quantized(model, tmp_path)
    loaded = load_quantized(tmp_path, device="cpu")
    assert loaded.tokenizer is None and loaded.quant_method == "awq"
    assert isinstance(loaded.model.lm_head, Int4Linear)
    ids = prompt_ids(batch=2, length=9)
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(model, ids), atol=0, rtol=0)
    torch.testing.assert_close(loaded.model.embed_tokens.weight, model.embed_tokens.weight, atol=0, rtol=0)
    qc = json.loads((tmp_path / QUANT_CONFIG).read_text())
    assert qc["include_lm_head"] and "lm_head" in qc["layers"] and qc["method"] == "awq"


def test_dtype_casts_the_unquantized_tensors_only(saved):
    _, folder = saved["int4", 64]
    loaded = load_quantized(folder, device="cpu", dtype="bf16")
    down = loaded.model.layers[0].mlp.down_proj
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16 and down.orig_dtype == torch.bfloat16
    assert down.scales.dtype == torch.float32 and down.packed.dtype == torch.uint8
    assert torch.isfinite(_logits(loaded.model, torch.tensor([[1, 2, 3]])).float()).all()


def test_another_dtype_moves_the_scales_and_keeps_the_method(saved, tmp_path):
    """LLM.to(dtype=...) on a quantized LLM: the fp32 scales are moved, not rounded; the layers' orig_dtype and the
    LLM's quant_method follow, so it saves, loads and dequantizes as a bf16 model."""
    q = saved["int4", 64][0]
    q.quant_method = "awq"
    try:
        b = q.to(dtype="bf16")
    finally:
        q.quant_method = "rtn"
    down, orig = b.model.layers[0].mlp.down_proj, q.model.layers[0].mlp.down_proj
    assert down.scales.dtype == torch.float32 and torch.equal(down.scales, orig.scales)
    assert down.orig_dtype == torch.bfloat16 and orig.orig_dtype == torch.float32  # the original is untouched
    assert b.quant_method == "awq" and b.model.embed_tokens.weight.dtype == torch.bfloat16
    folder = save_quantized(b, tmp_path / "bf16")
    qc = json.loads((folder / QUANT_CONFIG).read_text())
    assert qc["method"] == "awq" and qc["dtype"] == "bfloat16"
    assert {info["dtype"] for info in qc["layers"].values()} == {"bfloat16"}
    back = b.to(dtype="fp32")
    assert back.model.layers[0].mlp.down_proj.orig_dtype == torch.float32 and back.quant_method == "awq"
    dequantize_model(b.model)
    assert b.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(_logits(b.model, torch.tensor([[1, 2, 3]])).float()).all()


def _tampered(folder, tmp_path, edit_config=None, edit_tensors=None):
    """A copy of the saved folder with its quant_config.json dict and/or tensors {name: tensor} edited in place."""
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    if edit_config:
        qc = json.loads((tmp_path / QUANT_CONFIG).read_text())
        edit_config(qc)
        (tmp_path / QUANT_CONFIG).write_text(json.dumps(qc))
    if edit_tensors:
        tensors = load_file(str(tmp_path / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def _swap_to_int8(qc):
    qc["scheme"], qc["group_size"] = "int8", None


def _swap_to_int4(qc):
    qc["scheme"], qc["group_size"] = "int4", 64


def _set(key, value):
    return lambda qc: qc.__setitem__(key, value)


def _layer(name, key, value):
    return lambda qc: qc["layers"][name].__setitem__(key, value)


TAMPERED = [  # (saved as, edit of quant_config.json, the message expected)
    (("int4", 64), _swap_to_int8,
     r"layer '(layers\.\d\.[a-z_.]+)': quant_config.json says scheme 'int8' \(tensors w_q and scales\), but "
     r"model.safetensors holds '\1.packed', a tensor of int4"),
    (("int8", None), _swap_to_int4, r"scheme 'int4' .*holds '(layers\.\d\.[a-z_.]+).w_q', a tensor of int8"),
    (("int4", 128), lambda qc: qc["layers"].pop("layers.3.mlp.up_proj"),
     r"layer 'layers.3.mlp.up_proj' is quantized in model.safetensors .*quant_config.json does not list it"),
    (("int4", 64), _set("group_size", 32),
     r"layer 'layers.0.self_attn.q_proj': scales \(256, 4\) over Kp = 256 make groups of 64 weights, but "
     r"quant_config.json says group_size 32"),
    (("int4", 64), _set("group_size", 128),
     r"layer 'layers.0.mlp.down_proj': quant_config.json gives padded_in_features 704, but K = 704 at group_size "
     r"128 pads to 768"),
    (("int4", 128), _set("group_size", 64), r"down_proj.*padded_in_features 768, but K = 704 at group_size 64"),
    (("int4", 64), _layer("layers.1.mlp.gate_proj", "out_features", 700),
     r"layer 'layers.1.mlp.gate_proj': quant_config.json says in_features 256, out_features 700.*config.json's "
     r"model has 256, 704"),
    (("int4", 64), lambda qc: qc["layers"].__setitem__("layers.9.mlp.up_proj", qc["layers"]["layers.0.mlp.up_proj"]),
     r"lists layer 'layers.9.mlp.up_proj', which is not a linear layer"),
    (("int8", None), _set("include_lm_head", True), r"\"include_lm_head\" is True but lm_head is not in \"layers\""),
    (("int8", None), _set("scheme", "int3"), r"\"scheme\" is 'int3'"),
    (("int8", None), _set("format_version", 2), r"\"format_version\" 2 is not one this llmlab"),
    (("int8", None), _set("format_version", 0), r"\"format_version\" 0 is not one this llmlab .*\(1 to 1;"),
    (("int4", 64), _set("symmetric", False), r"\"symmetric\" is False; these formats are symmetric"),
    (("int4", 64), _layer("layers.1.mlp.up_proj", "dtype", "bfloat16"),
     r"layer 'layers.1.mlp.up_proj' has \"dtype\" 'bfloat16', the model 'float32'"),
]


@pytest.mark.parametrize("key,edit,match", TAMPERED, ids=[
    "int4-as-int8", "int8-as-int4", "layer-removed", "group-64-as-32", "group-64-as-128", "group-128-as-64",
    "wrong-out-features", "unknown-layer", "lm-head-flag", "unknown-scheme", "newer-format", "format-0",
    "asymmetric", "layer-dtype"])
def test_a_config_that_disagrees_with_the_tensors_is_refused(saved, tmp_path, key, edit, match):
    folder = _tampered(saved[key][1], tmp_path, edit_config=edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(folder, device="cpu")


def test_tensors_that_disagree_with_the_config_are_refused(saved, tmp_path_factory):
    folder = saved["int4", 128][1]
    cases = [
        (lambda t: t.__setitem__("model.layers.2.mlp.down_proj.scales", t["model.layers.2.mlp.down_proj.scales"]
                                 .half()),
         r"layer 'layers.2.mlp.down_proj': 'layers.2.mlp.down_proj.scales' in model.safetensors is float16, "
         r"expected float32"),
        (lambda t: t.pop("model.layers.1.self_attn.v_proj.packed"),
         r"layer 'layers.1.self_attn.v_proj' \(int4 in quant_config.json\): its 'packed' is missing"),
        (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.packed",
                                 t["model.layers.0.mlp.up_proj.packed"][:, :64].clone()),
         r"'layers.0.mlp.up_proj.packed' in model.safetensors has shape \(704, 64\).*imply \(704, 128\)"),
        (lambda t: t.pop("model.norm.weight"), r"'norm.weight' is missing from model.safetensors"),
        (lambda t: t.__setitem__("model.extra", torch.zeros(2)), r"unexpected tensor 'extra' in model.safetensors"),
        (lambda t: t["model.layers.3.self_attn.o_proj.scales"].neg_(),
         r"layer 'layers.3.self_attn.o_proj': model.safetensors holds a scale of -[0-9.e-]+; the quantizers write "
         r"positive scales only"),
        (lambda t: t["model.layers.0.mlp.gate_proj.scales"][5].zero_(), r"'layers.0.mlp.gate_proj'.* scale of 0;"),
        (lambda t: t["model.layers.1.mlp.up_proj.scales"][0, 0].fill_(1e38),
         r"layer 'layers.1.mlp.up_proj': model.safetensors holds an int4 scale of 1e\+38, at or above 2\^96"),
        (lambda t: t["model.layers.2.mlp.down_proj.scales"][1, 0].fill_(float("nan")),
         r"layer 'layers.2.mlp.down_proj': model.safetensors holds 1 NaN or inf scale\(s\); the quantizers write "
         r"finite scales only"),
    ]
    for i, (edit, match) in enumerate(cases):
        bad = _tampered(folder, tmp_path_factory.mktemp(f"bad{i}"), edit_tensors=edit)
        with pytest.raises(ValueError, match=match):
            load_quantized(bad, device="cpu")


def test_missing_files_are_named(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="has no quant_config.json"):
        load_quantized(DEFAULT_MODEL_DIR, device="cpu")
    folder = _tampered(saved["int8", None][1], tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_quantized(folder, device="cpu")
    (folder / QUANT_CONFIG).write_text("{not json")
    with pytest.raises(ValueError, match="quant_config.json is not valid JSON"):
        load_quantized(folder, device="cpu")


def test_save_refuses_what_it_cannot_load_back_and_never_overwrites_a_float_model(tmp_path):
    with pytest.raises(ValueError, match="no quantized layer"):
        save_quantized(tiny_model(), tmp_path / "a")
    with pytest.raises(TypeError, match="expected an LLM or its model"):
        save_quantized("model", tmp_path / "a")
    mixed = quantize_model(tiny_model(), "int8")
    mixed.layers[1].mlp.up_proj = Int4Linear.from_linear(tiny_model().layers[1].mlp.up_proj, group_size=64)
    with pytest.raises(ValueError, match=r"differ in \(scheme, group size\)"):
        save_quantized(mixed, tmp_path / "a")
    halved = quantize_model(tiny_model(), "int8")
    halved.layers[0].mlp.up_proj.half()  # one layer's dtype, not the model's
    with pytest.raises(ValueError, match=r"layer 'layers.0.mlp.up_proj' stands for a float16 weight in a float32"):
        save_quantized(halved, tmp_path / "a")
    assert not (tmp_path / "a").exists()  # nothing written by a refused call
    float_dir = save_model(tiny_model(), tmp_path / "float")
    before = (float_dir / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already holds a model"):
        save_quantized(quantize_model(tiny_model(), "int8"), float_dir)
    assert (float_dir / "model.safetensors").read_bytes() == before and not is_quantized_checkpoint(float_dir)
    q = quantize_model(tiny_model(), "int8")
    save_quantized(q, tmp_path / "q")
    save_quantized(quantize_model(tiny_model(), "int4", group_size=32), tmp_path / "q")  # a quantized save: replaced
    assert json.loads((tmp_path / "q" / QUANT_CONFIG).read_text())["scheme"] == "int4"
    assert is_quantized(load_quantized(tmp_path / "q", device="cpu").model)


def test_save_model_refuses_a_quantized_model_and_a_quantized_folder(tmp_path):
    q = quantize_model(tiny_model(), "int8")
    with pytest.raises(ValueError, match="quantized: save it with llmlab.quant.save_quantized"):
        save_model(q, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    folder = save_quantized(q, tmp_path / "q")
    before = (folder / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"holds a quantized save \(quant_config.json\); save the float model"):
        save_model(tiny_model(), folder)
    assert (folder / "model.safetensors").read_bytes() == before
    assert is_quantized(load_quantized(folder, device="cpu").model)  # still loads


def test_llmlab_load_reads_a_saved_quantized_folder(tmp_path):
    """`llmlab.load(folder)` routes a folder with quant_config.json to load_quantized: the same logits, and the
    method recorded by LLM.quantize."""
    import llmlab
    from llmlab.quant.serialize import save_quantized

    llm = llmlab.load(device="cpu", dtype="fp32")
    q = llm.quantize("int8")
    assert q.quant_method == "rtn"
    save_quantized(q, tmp_path / "q8")
    back = llmlab.load(tmp_path / "q8", device="cpu")
    assert back.quant_method == "rtn" and back.tokenizer is not None
    ids = torch.tensor([[1, 5, 9, 200, 31]])
    torch.testing.assert_close(back.model(ids), q.model(ids), rtol=0, atol=0)


def test_replacing_a_quantized_save_with_a_model_without_tokenizer_drops_the_old_tokenizer(llm, tmp_path):
    """The old save's tokenizer.json would be read with the new model's ids: a replaced save takes it away."""
    folder = save_quantized(llm.quantize("int8"), tmp_path / "q")
    assert (folder / "tokenizer.json").is_file()
    save_quantized(quantize_model(tiny_model(), "int4", group_size=32), folder)  # a bare model: no tokenizer
    assert not (folder / "tokenizer.json").exists()
    back = llmlab.load(folder, device="cpu")
    assert back.tokenizer is None and back.model.config.vocab_size == tiny_model().config.vocab_size
    save_quantized(llm.quantize("int8"), folder)  # with a tokenizer again: written again
    assert llmlab.load(folder, device="cpu").tokenizer is not None
