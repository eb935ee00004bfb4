"""quantize_model / dequantize_model / is_quantized / weight_bytes (llmlab/quant/quantize.py) on tiny random models
(tests/tiny_models.py: dim 128, intermediate 192, tied embeddings), fp32 on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from llmlab.generate import generate
from llmlab.quant import (Int4Linear, Int8Linear, dequantize_model, greedy_agreement,
                          is_quantized, perplexity, quantize_model, quantized_layers, weight_bytes)
from tiny_models import prompt_ids, tiny_model

LINEAR_NAMES = {f"layers.{i}.{p}" for i in range(2) for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
CASES = [("int8", 128), ("int4", 32), ("int4", 64)]  # the tiny model's K are 128 and 192: 128 does not divide 192


def _dequantized_reference(original: nn.Module, quantized: nn.Module) -> nn.Module:
    """An unquantized copy of `original` whose quantized layers' weights are replaced by their dequantized values:
    a plain-PyTorch x @ dequant(W)^T model. Each weight is a new Parameter (not copied into the old one), so a
    quantized lm_head tied to the embedding does not overwrite the embedding here either."""
    ref = copy.deepcopy(original)
    for name, q in quantized_layers(quantized).items():
        ref.get_submodule(name).weight = nn.Parameter(q.dequantize(torch.float32), requires_grad=False)
    return ref


@pytest.mark.parametrize("scheme,G", CASES)
def test_quantized_greedy_tokens_equal_the_dequantized_reference(scheme, G):
    original = tiny_model(seed=3)
    model = quantize_model(copy.deepcopy(original), scheme, group_size=G)
    assert set(quantized_layers(model)) == LINEAR_NAMES
    cls = Int8Linear if scheme == "int8" else Int4Linear
    assert all(type(m) is cls for m in quantized_layers(model).values())
    ref = _dequantized_reference(original, model)
    ids = prompt_ids(batch=2, length=12)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=1e-5, rtol=1e-5)
    got = generate(model, ids, max_new_tokens=12).token_ids
    want = generate(ref, ids, max_new_tokens=12).token_ids
    assert got == want
    # and the quantized model stays close to the original
    assert 0.0 <= greedy_agreement(original, model, [ids[0].tolist()], n_tokens=8) <= 1.0


def test_quantizing_twice_is_refused():
    model = quantize_model(tiny_model(), "int8")
    with pytest.raises(ValueError, match="already quantized.*dequantize_model"):
        quantize_model(model, "int4", group_size=32)


def test_bad_group_size_and_scheme_are_refused_before_any_swap():
    model = tiny_model()
    # group_size=128 does not divide down_proj's K = 192: no longer refused, padded (tests/test_quant_padding.py)
    with pytest.raises(ValueError, match=r"group_size=48 .*use one of \(32, 64, 128\).*32, 64 divide every layer's K"):
        quantize_model(model, "int4", group_size=48)
    with pytest.raises(TypeError, match="group_size must be an int"):
        quantize_model(model, "int4", group_size=64.0)
    with pytest.raises(ValueError, match="unknown scheme 'int3'"):
        quantize_model(model, "int3")
    with pytest.raises(TypeError, match="pass llm.model"):
        quantize_model(type("LLM", (), {"model": model})(), "int8")
    assert not is_quantized(model)  # nothing was swapped by the refused calls


def test_lm_head_untouched_unless_asked_and_embedding_never_touched():
    original = tiny_model()
    model = quantize_model(copy.deepcopy(original), "int8")
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight  # still tied
    assert type(model.embed_tokens) is nn.Embedding
    torch.testing.assert_close(model.embed_tokens.weight, original.embed_tokens.weight, atol=0, rtol=0)

    model = quantize_model(copy.deepcopy(original), "int8", include_lm_head=True)
    assert isinstance(model.lm_head, Int8Linear)
    assert type(model.embed_tokens) is nn.Embedding
    torch.testing.assert_close(model.embed_tokens.weight, original.embed_tokens.weight, atol=0, rtol=0)
    ref = _dequantized_reference(original, model)
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=1e-5, rtol=1e-5)


def test_dequantize_model_unswaps_and_reties_the_lm_head():
    original = tiny_model()
    model = quantize_model(copy.deepcopy(original), "int4", group_size=64, include_lm_head=True)
    ref = _dequantized_reference(original, model)
    ref.lm_head.weight = ref.embed_tokens.weight  # the tie, as dequantize_model restores it
    dequantize_model(model)
    assert not is_quantized(model)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in LINEAR_NAMES)
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=1e-5, rtol=1e-5)
    quantize_model(model, "int8")  # a dequantized model may be quantized again


def test_weight_bytes_int8_about_half_of_bf16():
    model = tiny_model().to(torch.bfloat16)
    before = weight_bytes(model)
    assert before == sum(p.numel() * 2 for p in model.parameters())  # tied weight counted once
    dense = {n: model.get_submodule(n).weight.numel() * 2 for n in LINEAR_NAMES}
    quantize_model(model, "int8")
    packed = {n: m.weight_bytes() for n, m in quantized_layers(model).items()}
    ratio = sum(packed.values()) / sum(dense.values())
    assert 0.5 < ratio < 0.52, ratio  # N*K + 4*N (fp32 scales) over 2*N*K, K = 128 or 192
    assert weight_bytes(model) == before - sum(dense.values()) + sum(packed.values())
    # int4 at G = 32: 0.5 + 4/32 bytes per weight
    model4 = quantize_model(tiny_model().to(torch.bfloat16), "int4", group_size=32)
    ratio4 = sum(m.weight_bytes() for m in quantized_layers(model4).values()) / sum(dense.values())
    assert ratio4 == pytest.approx((0.5 + 4 / 32) / 2)


def test_quantized_bf16_model_runs_on_cpu():
    model = quantize_model(tiny_model().to(torch.bfloat16), "int8")
    with torch.no_grad():
        logits = model(prompt_ids(batch=1, length=6))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_perplexity_scores_every_token_once():
    model = tiny_model()
    ids = prompt_ids(batch=1, length=40)[0]
    with torch.no_grad():
        logits = model(ids[None])[0].float()
    direct = torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).exp().item()
    assert perplexity(model, ids, context=64) == pytest.approx(direct, rel=1e-5)
    assert perplexity(model, ids.tolist(), context=40, stride=5) == pytest.approx(direct, rel=1e-5)
    windowed = perplexity(model, ids, context=16, stride=8)  # shorter histories: a different but finite value
    assert windowed > 1 and windowed == pytest.approx(perplexity(model, ids, context=16, stride=8))


def test_perplexity_and_agreement_refuse_bad_input():
    model = tiny_model()
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(model, [5])
    with pytest.raises(ValueError, match="stride=16"):
        perplexity(model, list(range(20)), context=16, stride=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        perplexity(model, [1, 2, 999])
    with pytest.raises(TypeError, match=r"got text \('hello world'\); encode it first: llm.encode\(text\)"):
        perplexity(model, "hello world")
    with pytest.raises(ValueError, match="n_tokens"):
        greedy_agreement(model, model, [[1, 2]], n_tokens=0)
    with pytest.raises(TypeError, match="n_tokens must be a positive int, got 2.5"):
        greedy_agreement(model, model, [[1, 2]], n_tokens=2.5)
    with pytest.raises(ValueError, match=r"^greedy_agreement: prompt 1: .*empty"):
        greedy_agreement(model, model, [[1, 2], []], n_tokens=2)
    with pytest.raises(ValueError, match=r"^greedy_agreement: prompt 0: .*max_new_tokens"):
        greedy_agreement(model, model, [[1, 2]], n_tokens=5000)
    with pytest.raises(ValueError, match="non-empty list of prompts"):
        greedy_agreement(model, model, [1, 2, 3], n_tokens=2)
    assert greedy_agreement(model, model, [[1, 2, 3], [4, 5]], n_tokens=4) == 1.0
    with pytest.raises(ValueError, match="context=300 is longer than the model's max_seq_len 256"):
        perplexity(model, list(range(40)), context=300)
    with pytest.raises(TypeError, match="model_b must be a llmlab Transformer or an LLM"):
        greedy_agreement(model, "int8", [[1, 2]])
    with pytest.raises(TypeError, match=r"a list holding text; encode each text first: llm.encode\(text\)"):
        perplexity(model, ["hello", "world"])
    for text in ("The list", ["The list"]):  # a prompt given as text, alone or in the list
        with pytest.raises(TypeError, match=r"got text; encode it first: \[llm.encode\(text\)\]"):
            greedy_agreement(model, model, text, n_tokens=2)
    other = tiny_model(vocab_size=300)
    with pytest.raises(ValueError, match="vocabularies of 256 and 300 tokens"):
        greedy_agreement(model, other, [[1, 2]], n_tokens=2)


def test_the_quality_functions_take_an_llm_as_its_model():
    from llmlab.engine import LLM

    model = tiny_model()
    llm = LLM(model, None, name="tiny")
    ids = prompt_ids(batch=1, length=30)[0]
    assert perplexity(llm, ids) == perplexity(model, ids)
    assert greedy_agreement(llm, model, [[1, 2, 3]], n_tokens=3) == 1.0


def test_llm_quantize_returns_a_quantized_copy_and_keeps_the_original():
    import llmlab
    from llmlab.quant import is_quantized

    llm = llmlab.load()
    q = llm.quantize("int8")
    assert is_quantized(q.model) and not is_quantized(llm.model)
    assert len(q.generate("The list", max_new_tokens=4).token_ids[0]) == 4  # decodes
    with pytest.raises(ValueError, match="already"):
        q.quantize("int8")
    assert len(q.generate("The list", max_new_tokens=2).token_ids[0]) == 2  # still usable after the refusal
    with pytest.raises(ValueError, match="group_size"):
        llm.quantize("int4", group_size=48)  # not a multiple of 32: refused before any change
    assert not is_quantized(llm.model)
    q4 = llm.quantize("int4", group_size=128)  # 704-wide MLP input: 128 does not divide it, padded to 768
    assert q4.model.layers[0].mlp.down_proj.padded_in_features == 768 and not is_quantized(llm.model)


def test_the_tour_header_names_a_quantized_models_weight_format():
    import llmlab
    from llmlab.tour import device_line

    llm = llmlab.load()
    assert "weights:" not in device_line(llm)
    assert "| dtype: float32 | weights: int4 g64 |" in device_line(llm.quantize("int4", group_size=64))
