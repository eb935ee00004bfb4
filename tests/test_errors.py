"""Bad input gives an error that names the problem, and leaves what was loaded before fully usable.

Every test ends with `still_works`: the model loaded at the start of the module generates exactly what it
generated before any error was raised.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys

import numpy
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmlab.checkpoint import load_model, load_tokenizer
from llmlab.cli import main
from llmlab.config import PRESETS, ModelConfig
from llmlab.engine import LLM, pick_device, pick_dtype
from llmlab.generate import check_lengths, generate
from llmlab.cache.kv_cache import KVCache
from tiny_models import model_folder

PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """(folder, llm, token ids it generates for PROMPT) — the reference every test compares against at its end."""
    folder, _ = model_folder(tmp_path_factory.mktemp("good"), seed=0)
    llm = LLM.load(folder, device="cpu")
    before = llm.generate(PROMPT, max_new_tokens=16, stop_at_eos=False).token_ids
    assert len(set(before[0])) > 4
    return folder, llm, before


def still_works(good) -> None:
    folder, llm, before = good
    assert llm.generate(PROMPT, max_new_tokens=16, stop_at_eos=False).token_ids == before
    assert llm.generate(PROMPT, max_new_tokens=16, stop_at_eos=False, use_cache=False).token_ids == before


def copy_of(good, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(good[0], dst)
    return dst


def edit_weights(folder, fn) -> None:
    file = folder / "model.safetensors"
    state = load_file(str(file))
    fn(state)
    save_file(state, str(file), metadata={"format": "pt"})


def edit_config(folder, fn) -> None:
    file = folder / "config.json"
    cfg = json.loads(file.read_text())
    fn(cfg)
    file.write_text(json.dumps(cfg))


# -- loading ------------------------------------------------------------------------------------------------------


def test_missing_folder(good, tmp_path):
    missing = tmp_path / "no-such-model"
    for load in (load_model, LLM.load):
        with pytest.raises(FileNotFoundError, match="does not exist") as e:
            load(missing)
        assert str(missing) in str(e.value)
    still_works(good)


def test_path_is_a_file(good, tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        load_model(file)
    still_works(good)


def test_folder_without_config(good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json") as e:
        LLM.load(folder)
    assert str(folder) in str(e.value)
    still_works(good)


def test_config_not_json(good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="not valid JSON") as e:
        load_model(folder)
    assert "config.json" in str(e.value)
    still_works(good)


def test_config_missing_key(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_config(folder, lambda c: c.pop("hidden_size"))
    with pytest.raises(ValueError, match="hidden_size"):
        load_model(folder)
    still_works(good)


def test_unsupported_architecture(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_config(folder, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        load_model(folder)
    assert "LlamaForCausalLM" in str(e.value)  # and says what is supported
    still_works(good)


def test_missing_weight(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_weights(folder, lambda s: s.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.down_proj\.weight") as e:
        load_model(folder)
    assert "missing" in str(e.value)
    still_works(good)


def test_several_missing_weights_are_counted(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_weights(folder, lambda s: [s.pop(k) for k in [k for k in s if k.startswith("model.layers.1.")]])
    with pytest.raises(KeyError, match=r"and 8 more"):
        load_model(folder)
    still_works(good)


def test_unexpected_extra_tensor(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_weights(folder, lambda s: s.update({"model.layers.0.self_attn.extra_scale": torch.ones(3)}))
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.extra_scale") as e:
        load_model(folder)
    assert "unexpected" in str(e.value)
    still_works(good)


def test_shape_mismatch_names_key_and_both_shapes(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_weights(folder, lambda s: s.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(191, 128)}))
    with pytest.raises(ValueError) as e:
        load_model(folder)
    msg = str(e.value)
    assert "model.layers.0.mlp.up_proj.weight" in msg
    assert "(191, 128)" in msg and "(192, 128)" in msg
    still_works(good)


def test_config_disagreeing_with_weights(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_config(folder, lambda c: c.update(intermediate_size=256))
    shapes = r"shape mismatch for '.*mlp\..*' .*\((192, 128|128, 192)\).*\((256, 128|128, 256)\)"
    with pytest.raises(ValueError, match=shapes):
        load_model(folder)
    still_works(good)


def test_only_pytorch_bin_is_refused_without_unpickling(good, tmp_path, monkeypatch):
    folder = copy_of(good, tmp_path)
    (folder / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")

    def no_unpickling(*a, **k):
        raise AssertionError("load_model must never unpickle a .bin file")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(FileNotFoundError) as e:
        load_model(folder)
    msg = str(e.value)
    assert "safetensors" in msg and "pytorch_model.bin" in msg and "never unpickles" in msg
    monkeypatch.undo()
    still_works(good)


def test_no_weights_at_all(good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(folder)
    still_works(good)


def test_missing_tokenizer(good, tmp_path, capsys):
    folder = copy_of(good, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(folder)
    llm = LLM.load(folder, device="cpu")  # a model without a tokenizer still loads: prompts must be ids
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")
    assert llm.generate([5, 6, 7], max_new_tokens=3).n_generated == 3
    assert main(["generate", "x", "--model", str(folder), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer.json" in err and "put the model's tokenizer.json in its folder" in err
    assert err.count("\n") == 1
    still_works(good)


def test_unknown_preset_lists_presets(good):
    for make in (ModelConfig.from_preset, LLM.from_preset):
        with pytest.raises(ValueError) as e:
            make("llama-3.2-1bb")
        msg = str(e.value)
        assert "'llama-3.2-1bb'" in msg and "Did you mean 'llama-3.2-1b'" in msg
        assert all(name in msg for name in PRESETS)
    still_works(good)


def test_bad_dtype_and_device(good):
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        pick_dtype("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"int8 / int4 are weight formats, not dtypes: llm.quantize\('int8'\)"):
        pick_dtype("int8", torch.device("cpu"))
    for dt in (torch.int8, torch.float64):
        with pytest.raises(ValueError, match=rf"dtype {dt} is not one llmlab runs a model in.*torch.bfloat16"):
            pick_dtype(dt, torch.device("cpu"))
    assert pick_dtype(torch.float16, torch.device("cpu")) is torch.float16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            pick_device("cuda")
    still_works(good)


# -- generation ---------------------------------------------------------------------------------------------------


def test_prompt_longer_than_context(good):
    llm = good[1]
    with pytest.raises(ValueError) as e:
        llm.generate([1] * 300, max_new_tokens=1)
    assert "300 tokens" in str(e.value) and "256" in str(e.value)
    still_works(good)


def test_prompt_plus_new_tokens_over_context(good):
    llm = good[1]
    with pytest.raises(ValueError) as e:
        llm.generate([1] * 200, max_new_tokens=100)
    msg = str(e.value)
    assert "200" in msg and "100" in msg and "256" in msg and "at most 56" in msg
    assert llm.generate([1] * 200, max_new_tokens=56).n_generated == 56  # the limit itself is fine
    still_works(good)


@pytest.mark.parametrize("top_p", [0, 0.0, -0.1, 1.5])
def test_top_p_outside_range(good, top_p):
    llm = good[1]
    with pytest.raises(ValueError, match=r"top_p=.*\(0, 1\]"):
        llm.generate(PROMPT, temperature=1.0, top_p=top_p)
    with pytest.raises(ValueError, match="top_p"):
        generate(llm.model, [1, 2, 3], temperature=1.0, top_p=top_p)
    still_works(good)


@pytest.mark.parametrize("temperature", [-1e-3, -1.0, float("nan")])
def test_bad_temperature(good, temperature):
    with pytest.raises(ValueError, match="temperature"):
        good[1].generate(PROMPT, temperature=temperature)
    still_works(good)


@pytest.mark.parametrize("top_k", [0, -1, 2.5])
def test_bad_top_k(good, top_k):
    with pytest.raises(ValueError, match="top_k"):
        good[1].generate(PROMPT, temperature=1.0, top_k=top_k)
    still_works(good)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(good, prompt):
    with pytest.raises(ValueError, match="empty"):
        good[1].generate(prompt)
    with pytest.raises(ValueError, match="empty"):
        generate(good[1].model, torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        good[1].model(torch.zeros(1, 0, dtype=torch.long))
    still_works(good)


def test_no_new_tokens(good):
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        good[1].generate(PROMPT, max_new_tokens=0)
    still_works(good)


@pytest.mark.parametrize("max_new_tokens", [2.5, "8", None, True])
def test_max_new_tokens_must_be_a_positive_int(good, max_new_tokens):
    llm = good[1]
    for call in (lambda: llm.generate(PROMPT, max_new_tokens=max_new_tokens),
                 lambda: llm.generate(PROMPT, max_new_tokens=max_new_tokens, gpu_sampling=True),
                 lambda: generate(llm.model, [1, 2, 3], max_new_tokens=max_new_tokens),
                 lambda: check_lengths(3, max_new_tokens, 256)):
        with pytest.raises(TypeError, match="max_new_tokens must be a positive int"):
            call()
    for bad in (0, -1):  # the right type, the wrong value: ValueError, as before
        with pytest.raises(ValueError, match=f"max_new_tokens={bad}: max_new_tokens must be a positive int"):
            llm.generate(PROMPT, max_new_tokens=bad)
    still_works(good)


def test_prompt_that_fills_the_context_says_so(good):
    """Not "lower max_new_tokens to at most 0": 0 is itself refused."""
    llm = good[1]
    for kw in ({}, {"gpu_sampling": True}):
        with pytest.raises(ValueError) as e:
            llm.generate([1] * 256, max_new_tokens=1, **kw)
        msg = str(e.value)
        assert "256 tokens and already fills the model's context of 256 tokens" in msg and "at most 0" not in msg
    still_works(good)


@pytest.mark.parametrize("seed", ["abc", 1.5, True])
def test_seed_must_be_an_int(good, seed):
    for kw in ({}, {"gpu_sampling": True}):
        with pytest.raises(TypeError, match=r"seed=.*: the seed must be an int"):
            good[1].generate(PROMPT, temperature=1.0, seed=seed, **kw)
    still_works(good)


@pytest.mark.parametrize("prompt", [None, [1.5, 2.0], [1.0, 2.0], torch.tensor([1.5, 2.0]), [True, False],
                                    ["a", "b"]],
                         ids=["None", "floats", "whole-floats", "float-tensor", "bools", "strings"])
def test_prompt_that_is_not_token_ids(good, prompt):
    """Float ids are refused, not truncated to ints; None gets the same message, not torch's. A list of texts is a
    batch for an LLM with a tokenizer (`test_batching_static`), never for the model-level `generate`, and without a
    tokenizer the LLM says so."""
    if prompt != ["a", "b"]:
        with pytest.raises(TypeError, match="give token ids|not token ids"):
            good[1].generate(prompt)
    else:
        no_tokenizer = LLM(good[1].model, tokenizer=None, name="bare")
        with pytest.raises(TypeError, match="bare has no tokenizer to encode a list of texts: give token ids"):
            no_tokenizer.generate(prompt)
    with pytest.raises(TypeError, match="give token ids|not token ids"):
        generate(good[1].model, prompt)
    still_works(good)


def test_batch_of_unequal_lengths_names_the_lengths(good):
    """Rows of different lengths are token ids, just not a batch the equal-length loop can run: its message says
    so and names the padded path; `LLM.generate` runs them as one left-padded batch."""
    with pytest.raises(ValueError, match=r"different lengths \(2, 1 tokens\).*generate_static.*one at a time"):
        generate(good[1].model, [[1, 2], [3]])
    assert len(good[1].generate([[1, 2], [3]], max_new_tokens=2).token_ids) == 2
    still_works(good)


def test_numpy_max_new_tokens_is_a_count(good):
    """A numpy integer is a whole number: it generates, and is not blamed on the KV cache's max_seq_len."""
    np = pytest.importorskip("numpy")
    g = good[1].generate([5, 6, 7], max_new_tokens=np.int64(4), stop_at_eos=False)
    assert g.n_generated == 4
    assert good[1].generate([5, 6, 7], max_new_tokens=4, stop_at_eos=False).token_ids == g.token_ids


def test_tensor_prompts(good):
    """A 2-D tensor is a batch, like a list of equal-length lists; other shapes are refused by name."""
    llm = good[1]
    rows = [[5, 6, 7], [8, 9, 10]]
    got = llm.generate(torch.tensor(rows), max_new_tokens=4, stop_at_eos=False).token_ids
    assert len(got) == 2 and got == llm.generate(rows, max_new_tokens=4, stop_at_eos=False).token_ids
    assert llm.generate(torch.tensor(rows[0]), max_new_tokens=4, stop_at_eos=False).token_ids == [got[0]]
    with pytest.raises(ValueError, match=r"the prompt has shape \(1, 1, 3\)"):
        llm.generate(torch.ones(1, 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"the prompt has shape \(0, 3\): a batch of no sequences"):
        llm.generate(torch.zeros(0, 3, dtype=torch.long))  # was a RuntimeError from min() of nothing
    for scalar in (torch.tensor(5), 123):
        with pytest.raises(ValueError, match=r"a single number .*also takes text"):
            llm.generate(scalar)
    still_works(good)


def test_preset_typo_as_model_names_the_preset(tmp_path):
    from llmlab.checkpoint import resolve

    with pytest.raises(FileNotFoundError, match=r"does not exist.*'llama-3.2-1b' is a preset"):
        resolve("lama-3.2-1b")
    with pytest.raises(FileNotFoundError, match=r"does not exist; check the path \(or pass a hub id 'org/name'\)$"):
        resolve(str(tmp_path / "nothing-here"))
    with pytest.raises(FileNotFoundError, match=r"pydoc-lama does not exist.*the shipped model is 'default'"):
        resolve("pydoc-lama")


@pytest.mark.parametrize("flag", ["use_cache", "stop_at_eos", "cuda_graphs", "torch_compile", "gpu_sampling",
                                  "pin_memory"])
def test_on_off_arguments_must_be_bools(good, flag):
    """use_cache='false' is truthy: it would run with the cache on. Refused like the switches refuse it."""
    with pytest.raises(TypeError, match=f"{flag}='false': this argument is on or off; give True or False"):
        good[1].generate(PROMPT, **{flag: "false"})
    if flag in ("use_cache", "pin_memory"):
        with pytest.raises(TypeError, match=f"{flag}=1: "):
            generate(good[1].model, [1, 2, 3], **{flag: 1})
    still_works(good)


def test_cuda_graphs_on_a_cpu_model_names_the_keyword(good):
    for kw in ({}, {"torch_compile": True}):
        with pytest.raises(ValueError) as e:
            good[1].generate(PROMPT, cuda_graphs=True, **kw)
        assert str(e.value) == "cuda_graphs=True needs a model on a CUDA GPU (this one is on cpu); turn it off"
    still_works(good)


@pytest.mark.parametrize("bad_id", [300, 10**6, -1])
def test_token_id_outside_vocabulary(good, bad_id):
    with pytest.raises(ValueError) as e:
        good[1].generate([5, bad_id, 7])
    assert str(bad_id) in str(e.value) and "0..299" in str(e.value)
    still_works(good)


def test_kv_cache_limits(good):
    config = good[1].config
    with pytest.raises(ValueError, match="exceeds the model's context length 256"):
        KVCache(config, 1, 257, torch.float32, "cpu")
    with pytest.raises(ValueError, match="batch_size=0: must be positive"):
        KVCache(config, 0, 8, torch.float32, "cpu")
    with pytest.raises(TypeError, match=r"batch_size='2' \(str\): give a whole number"):
        KVCache(config, "2", 8, torch.float32, "cpu")
    with pytest.raises(TypeError, match=r"max_seq_len=1.5 \(float\)"):
        KVCache(config, 1, 1.5, torch.float32, "cpu")
    with pytest.raises(TypeError, match=r"dtype='bf16': give a floating torch.dtype .*torch.bfloat16"):
        KVCache(config, 1, 8, "bf16", "cpu")
    from llmlab.cache.kv_quant import QuantizedKVCache
    from llmlab.cache.paged_cache import PagedKVCache

    with pytest.raises(ValueError, match="block_size=0: must be positive"):
        PagedKVCache(config, 1, 8, torch.float32, "cpu", block_size=0)
    with pytest.raises(TypeError, match=r"dtype=torch.int8: give a floating torch.dtype"):
        PagedKVCache(config, 1, 8, torch.int8, "cpu")
    with pytest.raises(ValueError, match="exceeds the model's context length 256"):
        QuantizedKVCache(config, 1, 257, torch.float32, "cpu")
    with pytest.raises(ValueError, match="residual=-1"):
        QuantizedKVCache(config, 1, 8, torch.float32, "cpu", residual=-1)
    cache = KVCache(config, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="holds 8 tokens but position 9"):
        good[1].model(torch.ones(1, 10, dtype=torch.long), torch.arange(10), kv_cache=cache)
    still_works(good)


# -- the command line ---------------------------------------------------------------------------------------------


def test_cli_missing_model_exits_2(good, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    code = main(["generate", "hello", "--model", str(missing), "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("llmlab: error:") and str(missing) in err and "does not exist" in err
    assert "Traceback" not in err and out == ""
    still_works(good)


def test_cli_bad_setting_exits_2(good, capsys):
    with pytest.raises(SystemExit) as e:  # refused while the arguments are parsed, before the model loads
        main(["generate", "def ", "--model", str(good[0]), "--device", "cpu", "--temperature", "1", "--top-p", "1.5"])
    _, err = capsys.readouterr()
    assert e.value.code == 2 and "argument --top-p: 1.5 is outside (0, 1]" in err
    code = main(["generate", "def ", "--model", str(good[0]), "--device", "cpu", "--max-new-tokens", "1000"])
    _, err = capsys.readouterr()
    assert code == 2 and "exceeds the model's context of 256 tokens" in err
    still_works(good)


def test_cli_process_exit_code(tmp_path):
    """The real process: `python -m llmlab.cli generate ... --model <missing>` exits with status 2."""
    missing = tmp_path / "nowhere"
    proc = subprocess.run([sys.executable, "-m", "llmlab.cli", "generate", "hi", "--model", str(missing)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "llmlab: error:" in proc.stderr and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr


# --- from a fresh user's run: each refused with a message that names the argument -----------------

@pytest.mark.parametrize("size", ["n_layers", "vocab_size", "dim", "max_seq_len", "intermediate_size"])
@pytest.mark.parametrize("bad", [0, -5])
def test_model_sizes_below_one_are_refused(size, bad):
    with pytest.raises(ValueError, match=f"{size}={bad}: model sizes must be whole numbers >= 1"):
        ModelConfig(**{size: bad})


def test_sampling_settings_that_are_not_numbers_or_infinite(good):
    _, llm, _ = good
    with pytest.raises(TypeError, match="temperature='0.8' is not a number"):
        llm.generate(PROMPT, temperature="0.8")
    with pytest.raises(TypeError, match="top_k='5' is not a number"):
        llm.generate(PROMPT, temperature=1.0, top_k="5")
    with pytest.raises(ValueError, match="temperature=inf is invalid"):
        llm.generate(PROMPT, temperature=float("inf"))
    still_works(good)


def test_a_cache_factory_without_the_cache_and_the_paged_switch_with_the_cache_off(good):
    from llmlab.cache.paged_cache import PagedKVCache
    from llmlab.switches import apply_switches

    _, llm, before = good
    with pytest.raises(ValueError, match="cache_factory builds the KV cache, but use_cache=False"):
        llm.generate(PROMPT, use_cache=False, cache_factory=PagedKVCache)
    with pytest.raises(TypeError, match="cache_factory='paged' is not callable: give a KV cache class"):
        llm.generate(PROMPT, cache_factory="paged")  # used to fail inside generate as "'str' object is not callable"
    run_llm, kwargs = apply_switches(llm, {"kv_cache": False, "paged_kv": True})  # a dashboard can ask for both
    assert "cache_factory" not in kwargs
    from llmlab.switches import describe
    assert describe({"kv_cache": False, "paged_kv": True}) == "no KV cache"  # its label names what runs
    assert describe({"paged_kv": True}) == "paged KV cache"
    assert run_llm.generate(PROMPT, max_new_tokens=16, stop_at_eos=False, **kwargs).token_ids == before
    still_works(good)


def test_a_cache_factory_with_a_static_cache_path_is_refused(good):
    """The fast paths decode on their own static KV cache: a cache_factory (the paged switch) with them used to be
    dropped without a word, so the row said "paged" and ran the static cache."""
    from llmlab.cache.paged_cache import PagedKVCache
    from llmlab.switches import apply_switches

    _, llm, _ = good
    for fast in ("gpu_sampling", "torch_compile"):
        with pytest.raises(ValueError, match=f"cache_factory runs on the eager path only, and cuda_graphs / "
                                             f"torch_compile / gpu_sampling decode on their own static KV cache"):
            llm.generate(PROMPT, max_new_tokens=2, cache_factory=PagedKVCache, **{fast: True})
        with pytest.raises(ValueError, match=f"switch 'paged_kv' picks a KV cache for the eager decode, and with "
                                             f"'{fast}' on the decode runs on its own static KV cache"):
            apply_switches(llm, {"paged_kv": True, fast: True})
    from llmlab.engine import check_fast_paths  # the shared check generate runs first, before the prompt is encoded

    with pytest.raises(ValueError, match="cache_factory runs on the eager path only"):
        check_fast_paths(llm.device, gpu_sampling=True, cache_factory=True)
    check_fast_paths(llm.device, cache_factory=True)  # the eager path takes a cache_factory
    still_works(good)


def test_counts_and_kinds_of_the_memory_helpers():
    from llmlab.cache import sizing, kv_quant
    from llmlab.measure import kv_costs
    from llmlab.kernels.weight_quant import quantize_int4, quantize_int8

    cfg = ModelConfig.from_preset("llama-3.2-1b")
    with pytest.raises(ValueError, match="tokens=-5: must be a whole number >= 0"):
        sizing.cache_bytes(cfg, -5)
    with pytest.raises(ValueError, match="context=-1"):
        sizing.calculator(["llama-3.2-1b"], context=-1)
    with pytest.raises(ValueError, match="block_size=0: must be a whole number >= 1"):
        sizing.waste([5, 9], 16, block_size=0)
    # a sequence longer than max_seq_len used to give the max-length layout a negative waste (-5%)
    with pytest.raises(ValueError, match=r"1 of the 2 lengths exceed max_seq_len=100 \(the longest: 200\); raise "
                                         r"max_seq_len to at least 200"):
        sizing.waste([10, 200], 100)
    with pytest.raises(ValueError, match="exceed max_seq_len=100"):
        kv_costs.measured_waste(cfg, [10, 200], 100)
    assert sizing.cache_bytes(cfg, 0) == 0
    with pytest.raises(ValueError, match="unknown KV quantization 'int4'"):
        kv_quant.quantize(torch.randn(2, 8), "int4")
    with pytest.raises(ValueError, match="unknown KV quantization 'fp4'"):  # up front, not at the first generate
        kv_quant.quantized_cache(kind="fp4")
    with pytest.raises(ValueError, match="residual=-1: the full-precision window must be a whole number"):
        kv_quant.quantized_cache(residual=-1)
    with pytest.raises(ValueError, match="residual=-1"):  # not every format skipped as "unavailable"
        kv_quant.quality_report(None, residual=-1)
    with pytest.raises(ValueError, match=r"\['int9'\] unknown"):  # not silently left out like an unstorable format
        kv_quant.quality_report(None, kinds=("int8", "int9"))
    with pytest.raises(ValueError, match="give a tuple of KV quantization formats"):
        kv_quant.quality_report(None, kinds="int8")
    with pytest.raises(TypeError, match="group_size must be an int"):
        quantize_int4(torch.randn(4, 128), 64.0)
    with pytest.raises(TypeError, match="quantize_int8: the weight is a list, not a tensor"):
        quantize_int8([[1.0]])
    for empty in (torch.randn(4, 0), torch.randn(0, 64)):  # were an IndexError / RuntimeError from amax
        with pytest.raises(ValueError, match=r"has shape \(\d+, \d+\), no values to quantize"):
            quantize_int8(empty)
        with pytest.raises(ValueError, match=r"has shape \(\d+, \d+\), no values to quantize"):
            quantize_int4(empty, 32)
    from llmlab.kernels.weight_quant import dequantize_int4, dequantize_int8

    w_q, scales = quantize_int8(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"dequantize_int8: w_q \(4, 64\) and scales \(3,\) do not match"):
        dequantize_int8(w_q, scales[:3])
    packed, scales4 = quantize_int4(torch.randn(4, 128), 32)
    with pytest.raises(ValueError, match=r"dequantize_int4: packed \(4, 64\) and scales \(4, 3\) do not match"):
        dequantize_int4(packed, scales4[:, :3])


def test_preset_overrides_and_seed_are_checked_before_building():
    from llmlab import LLM

    with pytest.raises(TypeError, match=r"unknown ModelConfig field\(s\) \['layers'\].*n_layers"):
        LLM.from_preset("llama-3.2-1b", layers=2)
    with pytest.raises(TypeError, match="seed='x': the seed must be an int"):
        LLM.from_preset("llama-3.2-1b", seed="x")


def test_cli_counts_below_one_are_refused_before_any_work(capsys):
    for argv in (["profile", "--batch", "0"], ["tour", "--max-new-tokens", "0"], ["profile", "--steps", "-1"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "is not a positive whole number" in capsys.readouterr().err


# --- from a fresh user's run: weights larger than the memory, corrupt weight files --------------

@pytest.fixture
def little_memory(monkeypatch):
    """The machine claims 1 MB free (host and GPU): every model but the tiniest is refused before allocation.

    Building a preset's weights fails the test instead of allocating them (without the check, 30 GB)."""
    import llmlab.engine
    from llmlab.cache import sizing

    def no_building(*a, **k):
        raise AssertionError("the weights were built before checking that they fit")

    monkeypatch.setattr(sizing, "available_memory", lambda device: (10**6, "host memory is available"))
    monkeypatch.setattr(llmlab.engine, "Transformer", no_building)


def test_preset_larger_than_memory_is_refused_before_building(good, little_memory):
    with pytest.raises(MemoryError) as e:
        LLM.from_preset("qwen2.5-7b", device="cpu", dtype="bf16")
    msg = str(e.value)
    assert "'qwen2.5-7b'" in msg and "7.62B parameters" in msg and "bfloat16" in msg  # built in bf16 directly
    assert "needs 15.23 GB but only 1.0 MB of host memory" in msg and "--model default" in msg
    still_works(good)


def test_checkpoint_larger_than_memory_is_refused(good, little_memory):
    with pytest.raises(MemoryError) as e:
        LLM.load(good[0], device="cpu")
    msg = str(e.value)
    assert f"loading the checkpoint '{good[0].name}'" in msg and "one copy in float32" in msg
    assert "but only 1.0 MB of host memory" in msg and "smaller dtype (bf16)" in msg and "llmlab.load()" in msg
    still_works(good)


def test_cli_preset_larger_than_memory_is_one_line(good, little_memory, capsys):
    code = main(["bench", "--workload", "chat", "--model", "qwen2.5-7b", "--quick", "--no-save", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("llmlab: error: building preset 'qwen2.5-7b'") and err.count("\n") == 1
    assert "Traceback" not in err
    still_works(good)


def test_truncated_weights_file_names_it_and_the_fix(good, tmp_path, capsys):
    folder = copy_of(good, tmp_path)
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])  # an interrupted download
    with pytest.raises(ValueError) as e:
        LLM.load(folder, device="cpu")
    msg = str(e.value)
    assert str(file) in msg and "not a valid safetensors file" in msg and "cut short" in msg and "again" in msg
    assert main(["generate", "x", "--model", str(folder), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("llmlab: error:") and err.count("\n") == 1 and str(file) in err and out == ""
    still_works(good)


def test_git_lfs_pointer_instead_of_weights_says_git_lfs_pull(good, tmp_path, capsys):
    folder = copy_of(good, tmp_path)
    file = folder / "model.safetensors"
    file.write_text("version https://git-lfs.github.com/spec/v1\n"
                    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 15483224\n")
    with pytest.raises(ValueError, match="is a git-lfs pointer .*`git lfs install && git lfs pull`"):
        load_model(folder)
    assert main(["generate", "x", "--model", str(folder), "--device", "cpu"]) == 2
    assert "git lfs pull" in capsys.readouterr().err
    still_works(good)


# --- found by a new user's report: GPU-only switches on a CPU, raw errors, greedy filters, one-token runs -------


def test_prefill_graphs_on_a_cpu_model_says_it_needs_a_gpu(good):
    """Not "turn cuda_graphs on too": that only led to "cuda_graphs=True needs a model on a CUDA GPU"."""
    with pytest.raises(ValueError) as e:
        good[1].generate(PROMPT, prefill_graphs=True)
    assert str(e.value) == "prefill_graphs=True needs a model on a CUDA GPU (this one is on cpu); turn it off"
    still_works(good)


def test_switches_not_available_here_name_the_fix(good, monkeypatch):
    from llmlab import switches

    for key, label in (("cuda_graphs", "CUDA graphs"), ("prefill_graphs", "prefill CUDA graphs"),
                       ("pinned_memory", "pinned memory")):
        with pytest.raises(ValueError) as e:
            switches.apply_switches(good[1], {key: True})
        assert str(e.value) == (f"switch {label!r} cannot be set to True here: needs a CUDA GPU; leave it off or "
                                f"load the model on a CUDA GPU (device='cuda', --device cuda)")
    monkeypatch.setitem(switches.SWITCHES, "test_mode", switches.Switch(
        "test_mode", "Test mode", "a", "a test choice", lambda m, v, kw: m, choices=("a", "b"),
        available=lambda m: (False, "needs a test rig")))
    with pytest.raises(ValueError, match=r"^switch 'Test mode' cannot be set to 'b' here: needs a test rig; leave it "
                                         r"at 'a'$"):
        switches.apply_switches(good[1], {"test_mode": "b"})
    still_works(good)


def test_apply_switches_refuses_what_generate_would_refuse_before_changing_anything(good, monkeypatch):
    """GPU sampling with the KV cache off passed `apply_switches` and failed only later, in the dashboard's run."""
    from llmlab import switches
    from llmlab.engine import check_fast_paths

    llm = good[1]
    with pytest.raises(ValueError) as by_generate:
        llm.generate(PROMPT, gpu_sampling=True, use_cache=False)
    applied = []
    for key, switch in switches.SWITCHES.items():  # record every switch that would change the model
        monkeypatch.setattr(switch, "apply", lambda m, v, kw, key=key: applied.append(key) or m)
    with pytest.raises(ValueError) as by_switches:
        switches.apply_switches(llm, {"gpu_sampling": True, "kv_cache": False, "dtype": "bf16"})
    assert str(by_switches.value) == str(by_generate.value)
    assert "turn the KV cache on (use_cache=True, the kv_cache switch) or turn gpu_sampling off" in str(
        by_generate.value)
    assert applied == []
    # the other fast paths too (on a CUDA model: on a CPU the graphs are refused for the device first)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"\(here: cuda_graphs=True, torch_compile=True\).* turn cuda_graphs and "
                                         r"torch_compile off"):
        check_fast_paths(cuda, use_cache=False, cuda_graphs=True, torch_compile=True)
    with pytest.raises(ValueError, match="turn cuda_graphs on too"):
        check_fast_paths(cuda, prefill_graphs=True)
    check_fast_paths(cuda, cuda_graphs=True, prefill_graphs=True, gpu_sampling=True)
    check_fast_paths(torch.device("cpu"), use_cache=False)
    monkeypatch.undo()
    run_llm, kwargs = switches.apply_switches(llm, {"gpu_sampling": True})
    assert kwargs == {"use_cache": True, "gpu_sampling": True} and run_llm is llm
    still_works(good)


@pytest.mark.parametrize("seed", [2**70, 2**64, -2**63 - 1])
def test_seed_outside_the_generators_range(good, seed):
    from llmlab.runtime.fast_generate import generate_fast

    llm = good[1]
    for call in (lambda: llm.generate(PROMPT, temperature=1.0, seed=seed),
                 lambda: llm.generate(PROMPT, temperature=1.0, seed=seed, gpu_sampling=True),
                 lambda: generate(llm.model, [1, 2, 3], seed=seed),
                 lambda: generate_fast(llm.model, [1, 2, 3], seed=seed, mode="static")):
        with pytest.raises(ValueError, match=rf"^seed={seed} is outside the range a torch generator takes "
                                             rf"\(-2\*\*63 \.\. 2\*\*64 - 1\); use an int in that range"):
            call()
    for edge in (2**64 - 1, -2**63):  # the ends of the range are fine
        assert llm.generate(PROMPT, max_new_tokens=2, temperature=1.0, seed=edge).n_generated == 2
    still_works(good)


@pytest.mark.parametrize("bad", [123, 1.5, ["default"], b"default"])
def test_load_with_a_model_that_is_not_a_name_or_path(good, bad):
    import llmlab
    from llmlab.checkpoint import resolve

    for call in (lambda: llmlab.load(bad), lambda: LLM.load(bad, device="cpu"), lambda: resolve(bad),
                 lambda: load_model(bad)):
        with pytest.raises(TypeError, match=rf"^the model is .* \({type(bad).__name__}\); give its name or path as "
                                            rf"a string: 'default' \(the shipped model\), a local model folder, or a "
                                            rf"hub id 'org/name'$"):
            call()
    still_works(good)


@pytest.mark.parametrize("empty", ["", "  "])
def test_load_with_an_empty_model_name(good, empty, capsys):
    import llmlab

    for call in (lambda: llmlab.load(empty), lambda: load_model(empty), lambda: load_tokenizer(empty)):
        with pytest.raises(ValueError, match=r"^the model name is empty \('.*'\); give 'default' \(the shipped "
                                             r"model\), a local model folder, or a hub id 'org/name'$"):
            call()
    assert main(["generate", "x", "--model", empty, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("llmlab: error: the model name is empty") and out == ""
    still_works(good)


@pytest.mark.parametrize("on_token", [5, "stop", [print]])
def test_on_token_that_is_not_callable(good, on_token):
    """Refused up front, not with "'int' object is not callable" after the first token."""
    from llmlab.runtime.fast_generate import generate_fast

    llm = good[1]
    for call in (lambda: llm.generate(PROMPT, on_token=on_token),
                 lambda: llm.generate(PROMPT, on_token=on_token, gpu_sampling=True),
                 lambda: generate(llm.model, [1, 2, 3], on_token=on_token),
                 lambda: generate_fast(llm.model, [1, 2, 3], on_token=on_token, mode="static")):
        with pytest.raises(TypeError, match=r"^on_token=.* is not callable: give a function on_token\(step, "
                                            r"tokens\) \(return True to stop\), or None$"):
            call()
    seen = []
    llm.generate(PROMPT, max_new_tokens=3, stop_at_eos=False, on_token=lambda step, tokens: seen.append(step))
    assert seen == [0, 1, 2]
    still_works(good)


@pytest.mark.parametrize("kwargs, named", [({"top_k": 5}, "top_k=5 has"), ({"top_p": 0.9}, "top_p=0.9 has"),
                                           ({"top_k": 5, "top_p": 0.9}, "top_k=5 and top_p=0.9 have")])
def test_top_k_and_top_p_at_temperature_0_warn_once_per_call(good, kwargs, named):
    """Greedy decoding takes the argmax: top_k / top_p are legal (as in Hugging Face) but change nothing."""
    import warnings

    from llmlab.runtime.fast_generate import generate_fast

    _, llm, before = good
    calls = [lambda: llm.generate(PROMPT, max_new_tokens=16, stop_at_eos=False, **kwargs),
             lambda: llm.generate(PROMPT, max_new_tokens=16, stop_at_eos=False, gpu_sampling=True, **kwargs),
             lambda: generate(llm.model, [1, 2, 3], max_new_tokens=4, **kwargs),
             lambda: generate_fast(llm.model, [1, 2, 3], max_new_tokens=4, mode="static", **kwargs)]
    for i, call in enumerate(calls):
        with pytest.warns(UserWarning, match=rf"^{named} no effect with greedy decoding \(temperature=0 .*\): set "
                                             rf"temperature > 0") as record:
            g = call()
        assert len(record) == 1 and record[0].filename == __file__  # one per call, pointing at the caller's line
        if i < 2:
            assert g.token_ids == before  # greedy: the same tokens as without them
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when they are used, or not given
        llm.generate(PROMPT, max_new_tokens=4, temperature=0.8, seed=0, **kwargs)
        llm.generate(PROMPT, max_new_tokens=4)
    still_works(good)


def test_cli_top_k_at_temperature_0_warns(good, capsys):
    """On the command line a warning is one line, without the source line Python would quote."""
    code = main(["generate", "def ", "--model", str(good[0]), "--device", "cpu", "--top-k", "5",
                 "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 0
    warning = [line for line in err.splitlines() if line.startswith("llmlab: warning:")]
    assert len(warning) == 1 and "top_k=5 has no effect with greedy decoding" in warning[0]
    assert "UserWarning" not in err and "main()" not in err
    with pytest.warns(UserWarning, match="top_k=5 has no effect"):  # main() gave the caller's warnings back
        good[1].generate(PROMPT, max_new_tokens=2, top_k=5)
    still_works(good)


def test_cli_names_where_another_packages_warning_came_from():
    """A warning raised inside another package (a peer's library compiling a module) names its kind and file; one
    of llmlab's own reads as its message alone."""
    import io

    from llmlab.cli import _warning_line

    out = io.StringIO()
    _warning_line(SyntaxWarning("invalid escape sequence '\\.'"), SyntaxWarning,
                  "/site-packages/somepeer/quant/api.py", 12, file=out)
    _warning_line(UserWarning("old API"), UserWarning, "/venv/lib/site-packages/peer/api.py", 3, file=out)
    _warning_line(UserWarning("top_k=5 has no effect"), UserWarning, "/home/me/notebook.py", 40, file=out)
    assert out.getvalue().splitlines() == [
        "llmlab: warning: invalid escape sequence '\\.' (SyntaxWarning from quant/api.py:12)",
        "llmlab: warning: old API (UserWarning from peer/api.py:3)",
        "llmlab: warning: top_k=5 has no effect"]


def test_one_token_runs_print_no_tpot(good):
    """max_new_tokens=1 has no decode step: TPOT is NaN (as in `RunMetrics`), and tables print "-", not "nan"."""
    import math

    from llmlab.generate import format_ms
    from llmlab.tour import run_tour

    g = good[1].generate(PROMPT, max_new_tokens=1)
    assert g.n_generated == 1 and math.isnan(g.tpot_ms) and g.ttft_ms > 0
    assert format_ms(g.tpot_ms) == "-" and format_ms(None, unit=" ms") == "-"
    assert format_ms(1.234) == "1.23" and format_ms(1.234, ".1f", " ms") == "1.2 ms"
    lines = []
    rows = run_tour(str(good[0]), device="cpu", max_new_tokens=1, repeats=1, print_fn=lines.append)
    # a table line: a setting's name, then its numbers (a skipped rung's line has "skipped:" there instead)
    table = [line for line in lines if any(re.match(re.escape(r["setting"]) + r"\s+\d", line) for r in rows)]
    assert len(table) == len(rows) and all(math.isnan(r["tpot_ms"]) for r in rows)
    assert all(line.split()[-4] == "-" for line in table) and not any("nan" in line for line in lines)
    still_works(good)


# --- from a fresh user's run: silent NaN weights, batch text, presets built in fp32 ----------------

def test_nan_weight_is_refused_by_name(good, tmp_path, capsys):
    """A NaN in the file makes every logit NaN and greedy decoding emit token 0 forever: refuse it at load."""
    folder = copy_of(good, tmp_path)
    edit_weights(folder, lambda state: state["model.layers.1.mlp.down_proj.weight"].view(-1)[7].fill_(float("nan")))
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=rf"'{name}' in model.safetensors holds 1 NaN or inf"):
        LLM.load(folder, device="cpu")
    assert main(["generate", "x", "--model", str(folder), "--device", "cpu"]) == 2
    assert "holds 1 NaN or inf value(s)" in capsys.readouterr().err
    still_works(good)


def test_weight_beyond_fp16_range_names_the_dtype(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_weights(folder, lambda state: state["model.norm.weight"].view(-1)[0].fill_(1e5))  # fine in fp32 and bf16
    with pytest.raises(ValueError, match=r"'model.norm.weight' .* overflows float16 .*100000.*bf16 or fp32"):
        LLM.load(folder, device="cpu", dtype="fp16")
    assert LLM.load(folder, device="cpu", dtype="bf16").model.norm.weight.max().item() > 9e4
    still_works(good)


def test_a_batch_has_one_text_per_row(good):
    llm = good[1]
    one = [llm.generate(p, max_new_tokens=6, stop_at_eos=False) for p in ([5, 6, 7], [9, 10, 11])]
    both = llm.generate([[5, 6, 7], [9, 10, 11]], max_new_tokens=6, stop_at_eos=False)
    assert both.texts == [one[0].text, one[1].text] and both.text == one[0].text
    assert one[0].texts == [one[0].text] and one[0].text != one[1].text
    still_works(good)


def test_lone_surrogate_prompt_is_named(good):
    with pytest.raises(ValueError, match=r"not valid Unicode text: '\\ud800' at position 3"):
        good[1].generate("abc\ud800def")
    still_works(good)


def test_cli_prints_an_empty_continuation_as_text(good, tmp_path, capsys, monkeypatch):
    """A run that ends at EOS at once prints the prompt alone (and says so), never the raw token ids."""
    from llmlab.generate import Generation

    real = LLM.generate

    def eos_at_once(self, prompt, **kwargs):
        g = real(self, prompt, **kwargs)
        return Generation(token_ids=[[0]], prompt_len=g.prompt_len, step_ms=g.step_ms[:1], finish_reason="eos",
                          use_cache=True, device="cpu", dtype="float32", text="", texts=[""])

    monkeypatch.setattr(LLM, "generate", eos_at_once)
    assert main(["generate", "The list", "--model", str(good[0]), "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out == "The list\n" and "ended at EOS" in err and "1 token |" in err


def test_preset_is_built_in_its_dtype(good, monkeypatch):
    """bf16 presets are built in bf16 (half the memory of building in fp32 and casting), with the same draws."""
    import llmlab.engine
    from llmlab.cache import sizing
    from llmlab.model import rope_inv_freq

    kw = dict(device="cpu", seed=3, n_layers=2, vocab_size=512, max_seq_len=256)
    f32 = LLM.from_preset("smollm2-135m", dtype="fp32", **kw).model
    b16_bytes = sum(p.numel() for p in f32.parameters()) * 2
    monkeypatch.setattr(sizing, "available_memory", lambda device: (int(b16_bytes * 1.5), "host memory"))
    b16 = LLM.from_preset("smollm2-135m", dtype="bf16", **kw).model  # fp32-then-cast would need 2x, refused
    assert all(p.dtype == torch.bfloat16 for p in b16.parameters())
    for (name, a), (_, b) in zip(f32.named_parameters(), b16.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), name
    assert torch.equal(b16.rope.inv_freq, rope_inv_freq(b16.config)) and b16.rope.inv_freq.dtype == torch.float32
    assert torch.equal(b16.norm.weight, torch.ones_like(b16.norm.weight))
    assert b16.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    monkeypatch.setattr(sizing, "available_memory", lambda device: (int(b16_bytes * 0.5), "host memory"))
    with pytest.raises(MemoryError, match="bfloat16"):
        LLM.from_preset("smollm2-135m", dtype="bf16", **kw)


def test_eos_ids_of_generation_config_stop_generation_too(good, tmp_path):
    """Chat models often list their end-of-turn id only in generation_config.json, where Hugging Face's generate
    reads it: it was never read, so generation ran past it."""
    folder = copy_of(good, tmp_path)
    _, _, before = good
    stop_at = before[0][3]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, stop_at]}))
    llm = LLM.load(folder, device="cpu")
    assert llm.eos_token_id == [0, stop_at]
    assert llm.generate(PROMPT, max_new_tokens=16).token_ids[0] == before[0][:before[0].index(stop_at) + 1]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert LLM.load(folder, device="cpu").eos_token_id == 0  # one id stays an int
    (folder / "generation_config.json").write_text("{nope")
    with pytest.raises(ValueError, match=r"generation_config.json is not a JSON object .*copy it again"):
        LLM.load(folder, device="cpu")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match=r"eos_token_id '2' .* is not a token id or a list of them"):
        LLM.load(folder, device="cpu")
    still_works(good)


def test_encode_and_decode_take_what_they_say(good):
    llm = good[1]
    ids = llm.encode("import os")
    assert llm.decode(torch.tensor(ids)) == llm.decode(ids) == llm.decode(numpy.array(ids))  # was a TypeError
    for bad in (123, b"import os"):
        with pytest.raises(TypeError, match=f"encode takes text \\(a str\\), not {type(bad).__name__}"):
            llm.encode(bad)
    with pytest.raises(ValueError, match="decode takes one sequence of ids, not a batch: decode each row"):
        llm.decode([ids, ids])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine WITHOUT a CUDA GPU")
def test_a_cuda_cache_on_a_machine_without_one_says_so():
    from llmlab.cache.paged_cache import PagedKVCache

    cfg = ModelConfig.from_preset("smollm2-135m")
    for cls in (KVCache, PagedKVCache):  # was torch's AssertionError "Torch not compiled with CUDA enabled"
        with pytest.raises(ValueError, match="device 'cuda': this machine has no CUDA GPU that PyTorch can use"):
            cls(cfg, 1, 16, torch.float32, "cuda")


def test_from_preset_leaves_the_callers_random_state_alone():
    """from_preset used to call torch.manual_seed(seed): every draw after it was the same whatever the caller had
    seeded. The weights still follow `seed`."""
    kw = dict(device="cpu", dtype="fp32", n_layers=1, vocab_size=256, max_seq_len=64)
    torch.manual_seed(1234)
    want = torch.rand(4)
    torch.manual_seed(1234)
    a = LLM.from_preset("smollm2-135m", seed=5, **kw).model
    assert torch.equal(torch.rand(4), want)
    torch.manual_seed(99)
    b = LLM.from_preset("smollm2-135m", seed=5, **kw).model
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = LLM.from_preset("smollm2-135m", seed=6, **kw).model
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


# --- from a fresh user's run --------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("rms_norm_eps", -1), ("rms_norm_eps", 0), ("rope_theta", -1.0),
                                       ("rope_theta", 0.0)])
def test_config_values_that_make_the_forward_pass_nan_are_refused(good, tmp_path, key, value):
    folder = copy_of(good, tmp_path)

    def edit(cfg):
        cfg[key] = value
        if key == "rope_theta":  # transformers 5 writes it in rope_parameters too, which is read first
            cfg["rope_parameters"]["rope_theta"] = value

    edit_config(folder, edit)
    name = {"rms_norm_eps": "norm_eps"}.get(key, key)
    with pytest.raises(ValueError, match=rf"{name}={value!r}: .* finite number > 0"):
        LLM.load(folder, device="cpu")
    with pytest.raises(ValueError, match="norm_eps=nan"):
        LLM.from_preset("smollm2-135m", device="cpu", norm_eps=float("nan"), n_layers=1, vocab_size=64)
    still_works(good)


def test_an_activation_other_than_silu_is_refused(good, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_config(folder, lambda cfg: cfg.update({"hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act 'gelu'.*only 'silu'"):
        LLM.load(folder, device="cpu")
    still_works(good)


@pytest.mark.parametrize("text", ["[]", "null", '"x"'])
def test_config_json_that_is_not_an_object_names_the_file(good, tmp_path, text):
    folder = copy_of(good, tmp_path)
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config.json holds a JSON \w+, not an object"):
        LLM.load(folder, device="cpu")
    still_works(good)


def test_damaged_tokenizer_and_index_files_are_named(good, tmp_path, capsys):
    folder = copy_of(good, tmp_path)
    (folder / "tokenizer.json").write_text("garbage")
    with pytest.raises(ValueError, match=r"tokenizer.json could not be read as a tokenizer"):
        LLM.load(folder, device="cpu")
    assert main(["generate", "x", "--model", str(folder), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmlab: error:") and "tokenizer.json" in err and err.count("\n") == 1
    (folder / "tokenizer.json").unlink()
    for text, why in (("garbage", "is not valid JSON"), ("{}", 'has no "weight_map"')):
        (folder / "model.safetensors.index.json").write_text(text)
        with pytest.raises(ValueError, match=f"model.safetensors.index.json {why}"):
            LLM.load(folder, device="cpu")
    still_works(good)


def test_a_folder_named_like_a_weights_file_is_not_read(good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        LLM.load(folder, device="cpu")
    still_works(good)


def test_a_mistyped_local_path_is_named_as_one(good, tmp_path, monkeypatch):
    """'data/pydoc-llama' looks like a hub id 'org/name'; offline the hub fails, and the message says that no
    such local folder exists either, naming the nearest model folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(good[0], tmp_path / "data" / "models" / "tiny-llama")
    with pytest.raises(FileNotFoundError, match=r"'data/tiny-lama' does not exist either .*'data/models/tiny-llama'"):
        LLM.load("data/tiny-lama", device="cpu")
    still_works(good)


def test_a_cache_factory_must_return_a_cache(good):
    with pytest.raises(TypeError, match="cache_factory returned NoneType, not a KV cache"):
        good[1].generate(PROMPT, max_new_tokens=4, cache_factory=lambda *a: None)
    still_works(good)


def test_on_token_sees_the_step_that_ends_at_eos(good):
    """on_token is called after every step, the one whose token is EOS included, as `token_ids` holds it."""
    llm = good[1]
    seen = []
    g = llm.generate(PROMPT, max_new_tokens=40, stop_at_eos=False)
    eos_at = g.token_ids[0][5]  # make the 6th generated token the "EOS": the run ends there
    llm.config.eos_token_id, old = eos_at, llm.config.eos_token_id
    try:
        g = llm.generate(PROMPT, max_new_tokens=40, on_token=lambda step, toks: seen.append(toks[0]))
    finally:
        llm.config.eos_token_id = old
    assert g.finish_reason == "eos" and seen == g.token_ids[0] and seen[-1] == eos_at
    still_works(good)


def test_nan_logits_are_an_error_not_token_0(good):
    llm = LLM(copy.deepcopy(good[1].model), good[1].tokenizer, name="nan")
    with torch.no_grad():
        llm.model.norm.weight[3] = float("nan")
    with pytest.raises(ValueError, match="logits hold NaN or inf"):
        llm.generate(PROMPT, max_new_tokens=4)
    still_works(good)


def test_decode_names_ids_outside_the_vocabulary_and_refuses_text(good):
    llm = good[1]
    top = llm.model.config.vocab_size - 1
    assert llm.decode([1, 2]) == llm.tokenizer.decode([1, 2]) == llm.decode([numpy.int64(1), numpy.int32(2)])
    for ids in ([top + 1], [-1], [5, top + 7]):
        with pytest.raises(ValueError, match=rf"token id -?\d+ is outside the model's vocabulary \(ids 0\.\.{top}\)"):
            llm.decode(ids)
    with pytest.raises(TypeError, match="decode takes token ids .*got str 'abc'.*through encode"):
        llm.decode("abc")
    with pytest.raises(TypeError, match="decode takes token ids \\(ints\\), got float 1.5"):
        llm.decode([1, 1.5])
    still_works(good)


def test_apply_switches_asks_for_a_dict(good):
    from llmlab.switches import apply_switches

    with pytest.raises(TypeError, match=r"settings must be a dict of switch names to values, e\.g\. \{'kv_cache': "
                                        r"False\}, got list \['kv_cache'\]"):
        apply_switches(good[1], ["kv_cache"])
    still_works(good)


def test_ctrl_c_in_the_cli_is_one_line_and_exit_130(good, monkeypatch, capsys):
    import llmlab.cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(llmlab.cli, "_main", interrupted)
    assert main(["tour"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "llmlab: interrupted" and "Traceback" not in err
    assert main(["bench", "--quick"]) == 130  # only a bench has rows to keep, and says so
    assert "the bench keeps the rows it finished" in capsys.readouterr().err


def test_a_default_model_env_var_pointing_nowhere_is_named(monkeypatch, tmp_path):
    from llmlab.checkpoint import default_model_dir

    monkeypatch.setenv("LLMLAB_MODEL", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="where LLMLAB_MODEL points.*unset it"):
        default_model_dir()


def test_the_cli_says_a_seed_changes_nothing_under_greedy_decoding(good, capsys):
    args = ["generate", PROMPT, "--model", str(good[0]), "--device", "cpu", "--max-new-tokens", "2", "--seed", "3"]
    assert main(args) == 0
    assert "llmlab: warning: --seed has no effect with greedy decoding" in capsys.readouterr().err
    assert main(args + ["--temperature", "0.8"]) == 0  # sampling: the seed matters, no warning
    assert "--seed has no effect" not in capsys.readouterr().err


def test_save_model_refuses_an_empty_folder_name_and_an_unwritable_folder(good, tmp_path, monkeypatch):
    from llmlab.checkpoint import save_model

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^save_model: the folder name is empty"):
        save_model(good[1].model, "")
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ValueError, match=r"a_file/sub cannot be written to \(.*\); give a writable folder"):
        save_model(good[1].model, tmp_path / "a_file" / "sub")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    still_works(good)
