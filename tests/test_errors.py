"""Bad input gives an error that names the problem, and leaves what was loaded before fully usable.

Every test ends with `still_works`: the model loaded at the start of the module generates exactly what it
generated before any error was raised.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmlab.checkpoint import load_model, load_tokenizer
from llmlab.cli import main
from llmlab.config import PRESETS, ModelConfig
from llmlab.engine import LLM, pick_device, pick_dtype
from llmlab.generate import check_lengths, generate
from llmlab.kv_cache import KVCache
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


def test_missing_tokenizer(good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(folder)
    llm = LLM.load(folder, device="cpu")  # a model without a tokenizer still loads: prompts must be ids
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")
    assert llm.generate([5, 6, 7], max_new_tokens=3).n_generated == 3
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
                                    [[1, 2], [3]], ["a", "b"]],
                         ids=["None", "floats", "whole-floats", "float-tensor", "bools", "ragged", "strings"])
def test_prompt_that_is_not_token_ids(good, prompt):
    """Float ids are refused, not truncated to ints; None and ragged rows get the same message, not torch's."""
    with pytest.raises(TypeError, match="give token ids|not token ids"):
        good[1].generate(prompt)
    with pytest.raises(TypeError, match="give token ids|not token ids"):
        generate(good[1].model, prompt)
    still_works(good)


def test_tensor_prompts(good):
    """A 2-D tensor is a batch, like a list of equal-length lists; other shapes are refused by name."""
    llm = good[1]
    rows = [[5, 6, 7], [8, 9, 10]]
    got = llm.generate(torch.tensor(rows), max_new_tokens=4, stop_at_eos=False).token_ids
    assert len(got) == 2 and got == llm.generate(rows, max_new_tokens=4, stop_at_eos=False).token_ids
    assert llm.generate(torch.tensor(rows[0]), max_new_tokens=4, stop_at_eos=False).token_ids == [got[0]]
    for bad in (torch.ones(1, 1, 3, dtype=torch.long), torch.tensor(5)):
        with pytest.raises(ValueError, match=r"the prompt has shape \("):
            llm.generate(bad)
    still_works(good)


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
    with pytest.raises(ValueError, match="must be positive"):
        KVCache(config, 0, 8, torch.float32, "cpu")
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
    code = main(["generate", "def ", "--model", str(good[0]), "--device", "cpu", "--temperature", "1",
                 "--top-p", "1.5"])
    _, err = capsys.readouterr()
    assert code == 2 and "top_p=1.5" in err
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


# --- found by a fresh user's run (session 7): each refused with a message that names the argument -----------------

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
    from llmlab.paged_cache import PagedKVCache
    from llmlab.switches import apply_switches

    _, llm, before = good
    with pytest.raises(ValueError, match="cache_factory builds the KV cache, but use_cache=False"):
        llm.generate(PROMPT, use_cache=False, cache_factory=PagedKVCache)
    run_llm, kwargs = apply_switches(llm, {"kv_cache": False, "paged_kv": True})  # a dashboard can ask for both
    assert "cache_factory" not in kwargs
    assert run_llm.generate(PROMPT, max_new_tokens=16, stop_at_eos=False, **kwargs).token_ids == before
    still_works(good)


def test_counts_and_kinds_of_the_memory_helpers():
    from llmlab import kv_memory, kv_quant
    from llmlab.kernels.dequant_matmul import quantize_int4

    cfg = ModelConfig.from_preset("llama-3.2-1b")
    with pytest.raises(ValueError, match="tokens=-5: must be a whole number >= 0"):
        kv_memory.cache_bytes(cfg, -5)
    with pytest.raises(ValueError, match="context=-1"):
        kv_memory.calculator(["llama-3.2-1b"], context=-1)
    with pytest.raises(ValueError, match="block_size=0: must be a whole number >= 1"):
        kv_memory.waste([5, 9], 16, block_size=0)
    assert kv_memory.cache_bytes(cfg, 0) == 0
    with pytest.raises(ValueError, match="unknown KV quantization 'int4'"):
        kv_quant.quantize(torch.randn(2, 8), "int4")
    with pytest.raises(TypeError, match="group_size must be an int"):
        quantize_int4(torch.randn(4, 128), 64.0)


def test_cli_counts_below_one_are_refused_before_any_work(capsys):
    for argv in (["profile", "--batch", "0"], ["tour", "--max-new-tokens", "0"], ["profile", "--steps", "-1"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "is not a positive whole number" in capsys.readouterr().err


# --- found by a fresh user's run (session 12): weights larger than the memory, corrupt weight files --------------

@pytest.fixture
def little_memory(monkeypatch):
    """The machine claims 1 MB free (host and GPU): every model but the tiniest is refused before allocation.

    Building a preset's weights fails the test instead of allocating them (without the check, 30 GB)."""
    import llmlab.engine
    from llmlab import kv_memory

    def no_building(*a, **k):
        raise AssertionError("the weights were built before checking that they fit")

    monkeypatch.setattr(kv_memory, "available_memory", lambda device: (10**6, "host memory is available"))
    monkeypatch.setattr(llmlab.engine, "Transformer", no_building)


def test_preset_larger_than_memory_is_refused_before_building(good, little_memory):
    with pytest.raises(MemoryError) as e:
        LLM.from_preset("qwen2.5-7b", device="cpu", dtype="bf16")
    msg = str(e.value)
    assert "'qwen2.5-7b'" in msg and "7.62B parameters" in msg and "float32" in msg  # built in fp32, then cast
    assert "needs 30.46 GB but only 1.0 MB of host memory" in msg and "--model default" in msg
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
    assert str(file) in msg and "not a valid safetensors file" in msg and "truncated" in msg and "again" in msg
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
