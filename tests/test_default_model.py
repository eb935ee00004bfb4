"""The shipped default model (data/models/pydoc-llama): it must be there, load both ways, and generate.

Until the model is trained and committed, every test here FAILS with a message saying so: the course promises a
model that works offline out of the box, so its absence is an error, not a skip.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from llmlab.checkpoint import DEFAULT_MODEL_DIR, load_model, load_tokenizer, save_model
from llmlab.engine import LLM
from llmlab.generate import generate

SOURCE = '''import os


def read_lines(path: str, strip: bool = True) -> list[str]:
    """Return the lines of a text file, optionally stripped of whitespace."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    if strip:
        return [line.strip() for line in lines]
    return lines


class Counter(dict):
    def add(self, key, n=1):
        self[key] = self.get(key, 0) + n
'''


@pytest.fixture(scope="module")
def folder():
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the default model is missing: {DEFAULT_MODEL_DIR}/config.json does not exist. It must ship "
                    f"with the repository (train it, then save it there with llmlab.checkpoint.save_model and "
                    f"add tokenizer.json)", pytrace=False)
    return DEFAULT_MODEL_DIR


@pytest.fixture(scope="module")
def model(folder):
    return load_model(folder)  # fp32, CPU


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def ids(tokenizer, model):
    ids = tokenizer.encode(SOURCE).ids[:64]
    assert len(ids) >= 16
    return torch.tensor([ids])


def test_tokenizer_round_trips_python_source(tokenizer):
    for text in (SOURCE, "def f(x):\n\treturn x  # tab-indented\n", "    \n\n  x = {'a': [1, 2.5]}\n"):
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_logits_match_transformers_loading_the_folder(folder, model, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids)
    assert (got - ref).abs().max().item() <= 1e-4


def test_logits_match_transformers_loading_llmlab_save(model, ids, tmp_path):
    save_model(model, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (model(ids) - hf.eval()(ids).logits).abs().max().item() <= 1e-4


def test_greedy_64_with_and_without_cache(model, ids):
    prompt = ids[0, :16].tolist()
    a = generate(model, prompt, max_new_tokens=64, use_cache=True).token_ids
    b = generate(model, prompt, max_new_tokens=64, use_cache=False).token_ids
    assert a == b


def test_generate_text_from_def(folder):
    llm = LLM.load(folder, device="cpu")
    g = llm.generate("def ", max_new_tokens=32)
    assert isinstance(g.text, str) and g.text.strip(), f"empty continuation: {g.token_ids}"
    assert g.ttft_ms > 0


def test_save_model_of_an_llm_keeps_its_tokenizer(folder, tmp_path):
    # an LLM (not only its Transformer) saves with its tokenizer: the copy loads and continues text as the original
    import llmlab

    llm = LLM.load(folder, device="cpu")
    assert save_model(llm, tmp_path / "copy") == tmp_path / "copy"
    assert (tmp_path / "copy" / "tokenizer.json").is_file()
    again = llmlab.load(tmp_path / "copy", device="cpu")
    assert again.generate("def f(", max_new_tokens=8).text == llm.generate("def f(", max_new_tokens=8).text
    save_model(llm.model, tmp_path / "bare")  # the Transformer alone: weights and config, no tokenizer
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(TypeError, match="save_model: expected an LLM or its model"):
        save_model("my-model", tmp_path / "x")
