"""config.json values that used to load silently wrong or fail with a bare Python error are refused with a message
that names the field, the file and the fix: quoted booleans, zero or negative counts and windows, a llama3 RoPE
without its keys, non-string preset names; and config.json shapes that transformers reads are read the same way
(a one-name "architectures", Qwen2's per-layer sliding window).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from llmlab.checkpoint import load_model
from llmlab.config import ModelConfig
from llmlab.model import Transformer
from tiny_models import LLAMA3_ROPE, _rope_kwargs, model_folder, prompt_ids, randomize_, tiny_config

# A minimal Llama config.json: 2 layers, 4 heads of 16
BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny llmlab model folder (untied, so lm_head is a weight of its own), no tokenizer."""
    return model_folder(tmp_path_factory.mktemp("cfg"), seed=0, tokenizer=False, tie_embeddings=False)[0]


def with_config(folder, tmp_path, **changes):
    """A copy of `folder` in tmp_path with `changes` applied to config.json (None deletes the key)."""
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


# -- booleans -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["tie_word_embeddings", "use_sliding_window", "attention_bias"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_boolean_fields_must_be_json_booleans(key, value):
    with pytest.raises(ValueError, match=rf'config.json: "{key}" is .*, not true or false; write it unquoted'):
        ModelConfig.from_hf_config({**BASE, key: value})


def test_quoted_false_tie_word_embeddings_names_the_file(folder, tmp_path):
    """'false' is a truthy string: it used to count as tied and skip the checkpoint's own lm_head silently."""
    bad = with_config(folder, tmp_path, tie_word_embeddings="false")
    with pytest.raises(ValueError, match="tie_word_embeddings") as e:
        load_model(bad)
    assert str(bad / "config.json") in str(e.value)
    model = load_model(folder)  # a real false: the checkpoint's own lm_head
    assert model.lm_head.weight is not model.embed_tokens.weight


@pytest.mark.parametrize("field", ["tie_embeddings", "attention_bias"])
def test_model_config_booleans_must_be_bools(field):
    with pytest.raises(ValueError, match=rf"{field}='false' \(str\): it must be True or False"):
        tiny_config(**{field: "false"})


# -- counts, windows ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [
    ("num_attention_heads", 0), ("num_attention_heads", -4), ("hidden_size", 0), ("num_hidden_layers", "2"),
    ("vocab_size", 0), ("intermediate_size", 32.0), ("num_key_value_heads", 0), ("head_dim", 0),
    ("max_position_embeddings", 0), ("max_position_embeddings", None),
])
def test_counts_must_be_whole_numbers_at_least_one(key, value):
    """num_attention_heads 0 without head_dim divided by zero; num_key_value_heads 0 silently meant 'as many as the
    query heads'."""
    with pytest.raises(ValueError, match=rf'config.json: "{key}" is .*; it must be a whole number >= 1'):
        ModelConfig.from_hf_config({**BASE, key: value})


def test_null_kv_heads_and_head_dim_are_derived_as_transformers_does():
    c = ModelConfig.from_hf_config({**BASE, "num_key_value_heads": None, "head_dim": None})
    assert (c.n_kv_heads, c.head_dim) == (4, 16)


@pytest.mark.parametrize("window", [0, -8, 2.5, True, "8"])
def test_sliding_window_must_be_none_or_positive(window):
    with pytest.raises(ValueError, match=r"sliding_window=.*: the local attention window is a number of tokens >= 1"):
        tiny_config(sliding_window=window)


def test_sliding_window_zero_in_config_json_names_the_file():
    hf = {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 0}
    with pytest.raises(ValueError, match=r"^my/config.json: sliding_window=0: the local attention window"):
        ModelConfig.from_hf_config(hf, source="my/config.json")


# -- llama3 RoPE ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])
@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_without_a_key_is_refused_when_read(key, rope_key):
    """It used to load, then fail at model build with a bare KeyError."""
    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != key}
    with pytest.raises(ValueError, match=rf"config.json: \"{rope_key}\" of type 'llama3' lacks '{key}'"):
        ModelConfig.from_hf_config({**BASE, rope_key: rope})
    with pytest.raises(ValueError, match=rf"rope_scaling of type 'llama3' lacks '{key}'"):
        tiny_config(rope_scaling=rope)


@pytest.mark.parametrize("key,value", [("factor", "8"), ("factor", 0), ("low_freq_factor", None),
                                       ("original_max_position_embeddings", float("inf")), ("high_freq_factor", True)])
def test_llama3_rope_values_must_be_positive_numbers(key, value):
    """A string factor used to give a TypeError about Tensor and str at model build."""
    with pytest.raises(ValueError, match=rf'"rope_scaling" has {key}=.*it must be a finite number > 0'):
        ModelConfig.from_hf_config({**BASE, "rope_scaling": {**LLAMA3_ROPE, key: value}})


def test_llama3_rope_high_freq_factor_must_exceed_low():
    with pytest.raises(ValueError, match=r"high_freq_factor=1.0 <= low_freq_factor=1.0"):
        tiny_config(rope_scaling={**LLAMA3_ROPE, "high_freq_factor": 1.0})


def test_rope_scaling_that_is_not_an_object():
    with pytest.raises(ValueError, match=r'"rope_scaling" is \'llama3\'; it must be an object'):
        ModelConfig.from_hf_config({**BASE, "rope_scaling": "llama3"})
    with pytest.raises(ValueError, match=r"rope_scaling='llama3': it must be a dict"):
        tiny_config(rope_scaling="llama3")


def test_valid_llama3_rope_still_builds():
    Transformer(ModelConfig.from_hf_config({**BASE, "rope_scaling": dict(LLAMA3_ROPE)}))


# -- presets, architectures -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, 5, ["llama-3.2-1b"]])
def test_from_preset_with_a_non_string_lists_the_presets(name):
    with pytest.raises(TypeError, match=r"the preset name is .*; give one of the known presets as a string: "
                                        r"llama-2-7b, .*smollm2-360m"):
        ModelConfig.from_preset(name)


def test_architectures_as_a_single_string_is_read_as_a_list():
    """It used to read the string's first letter: "architecture 'L' is not supported"."""
    for arch in ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]:
        assert ModelConfig.from_hf_config({**BASE, "architectures": arch}) == \
            ModelConfig.from_hf_config({**BASE, "architectures": [arch]})
    with pytest.raises(ValueError, match=r"config.json: architecture 'GPT2LMHeadModel' is not supported"):
        ModelConfig.from_hf_config({**BASE, "architectures": "GPT2LMHeadModel"})
    with pytest.raises(ValueError, match=r'"architectures" is \{.*\}; it must be a list of class names'):
        ModelConfig.from_hf_config({**BASE, "architectures": {"name": "LlamaForCausalLM"}})


# -- sliding windows as transformers applies them ---------------------------------------------------------------------

QWEN2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8}


@pytest.mark.parametrize("extra", [dict(max_window_layers=1), dict(layer_types=["full_attention", "sliding_attention"]),
                                   dict(layer_types=["sliding_attention", "full_attention"], max_window_layers=0)])
def test_qwen2_window_on_some_layers_only_is_refused(extra):
    """transformers windows only layers >= max_window_layers (or those layer_types marks); llmlab used to window all."""
    with pytest.raises(ValueError, match=r"use_sliding_window is true and .* gives 1 of the 2 layers .* this per-layer "
                                         r"mix is not supported.*set \"use_sliding_window\": false"):
        ModelConfig.from_hf_config({**QWEN2, "use_sliding_window": True, **extra})


@pytest.mark.parametrize("extra,window", [
    (dict(use_sliding_window=True, max_window_layers=2), None),  # no layer reaches max_window_layers
    (dict(use_sliding_window=True), None),  # Qwen2Config's default max_window_layers is 28
    (dict(use_sliding_window=True, max_window_layers=0), 8),  # every layer
    (dict(use_sliding_window=True, layer_types=["sliding_attention"] * 2, max_window_layers=5), 8),
    (dict(use_sliding_window=False, max_window_layers=0), None),
    (dict(), None),
])
def test_qwen2_sliding_window_follows_transformers(extra, window):
    hf = {**QWEN2, **extra}
    assert ModelConfig.from_hf_config(hf).sliding_window == window
    kwargs = {k: v for k, v in hf.items() if k != "architectures"}
    assert transformers.Qwen2Config(**kwargs).sliding_window in (window, 8)
    if window is None:  # transformers keeps the number but windows no layer
        assert "sliding_attention" not in transformers.Qwen2Config(**kwargs).layer_types


def test_mistral_windows_every_layer_and_llama_none():
    assert ModelConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 8,
                                       "use_sliding_window": False}).sliding_window == 8
    assert ModelConfig.from_hf_config({**BASE, "sliding_window": 8, "use_sliding_window": True}).sliding_window is None


def test_qwen2_with_every_layer_windowed_matches_transformers(tmp_path):
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    cfg = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                                   **_rope_kwargs(None, 10000.0))
    cfg._attn_implementation = "eager"
    hf = randomize_(transformers.Qwen2ForCausalLM(cfg), seed=3).eval()
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.sliding_window == 8
    ids = prompt_ids()  # 40 tokens: the window of 8 matters
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() <= 1e-4
    # and llmlab writes it back so that transformers windows every layer too
    back = ours.config.to_hf_config()
    assert ModelConfig.from_hf_config(back, name=ours.config.name) == ours.config
    kwargs = {k: v for k, v in back.items() if k not in ("architectures", "model_type")}
    assert transformers.Qwen2Config(**kwargs).layer_types == ["sliding_attention"] * 2
