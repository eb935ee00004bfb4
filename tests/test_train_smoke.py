"""The training pipeline end to end on a CPU: corpus determinism, held-out split, smoke training, reloading.

The smoke run (`python -m llmlab.train --smoke`) trains a 0.1M-parameter model for 30 steps on a slice of the
corpus (a few seconds); these tests check the plumbing, not the text quality.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from llmlab.checkpoint import load_model, load_tokenizer
from llmlab.train.corpus import EOT, build_corpus, is_val


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    from llmlab.train.__main__ import main

    out = tmp_path_factory.mktemp("smoke-model")
    main(["--smoke", "--out", str(out), "--device", "cpu"])
    return out


def test_corpus_is_deterministic_and_split_is_disjoint():
    train1, val1, stats1 = build_corpus()
    train2, val2, stats2 = build_corpus()
    assert stats1.sha256 == stats2.sha256
    assert [d.text for d in train1 + val1] == [d.text for d in train2 + val2]
    train_names, val_names = {d.name for d in train1}, {d.name for d in val1}
    assert val_names and train_names and not (train_names & val_names)
    assert len(train_names) + len(val_names) == stats1.n_documents  # names are unique
    assert all(is_val(n) for n in val_names) and not any(is_val(n) for n in train_names)
    assert 0.01 < stats1.val_chars / stats1.chars < 0.10
    assert stats1.n_topics > 0 and stats1.n_modules > 100
    assert not any(EOT in d.text for d in train1 + val1)
    assert "antigravity" not in sys.modules  # docstrings come from ast, modules are never imported
    names = [d.name for d in train1 + val1]
    assert "module:json" in names and "topic:assert" in names
    assert not any(".test." in n or n.startswith("module:test.") for n in names)


def test_smoke_model_loads_in_llmlab_and_transformers(smoke_dir):
    from transformers import AutoModelForCausalLM

    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "README.md", "training.json"):
        assert (smoke_dir / f).is_file(), f
    ours = load_model(smoke_dir)  # fp32
    hf = AutoModelForCausalLM.from_pretrained(smoke_dir, dtype=torch.float32).eval()
    ids = load_tokenizer(smoke_dir).encode("def json.dumps(obj)\nSerialize ``obj``").ids
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = ours(x), hf(x).logits
    assert a.shape == b.shape == (1, len(ids), ours.config.vocab_size)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_smoke_tokenizer_round_trips_and_loads_in_transformers(smoke_dir):
    from transformers import AutoTokenizer

    ours = load_tokenizer(smoke_dir)
    hf = AutoTokenizer.from_pretrained(smoke_dir)
    text = "class Foo:\n\tdef bar(self, x=1):\n        return  x  # ünïcode ✓\n\n"
    ids = ours.encode(text).ids
    assert ids[0] == ours.token_to_id(EOT) == hf.bos_token_id == hf.eos_token_id
    assert hf(text).input_ids == ids
    assert ours.decode(ids) == text and hf.decode(ids, skip_special_tokens=True) == text


def test_smoke_facts(smoke_dir):
    facts = json.loads((smoke_dir / "training.json").read_text())
    assert facts["training"]["steps"] == 30
    assert facts["eval_saved_weights"]["val_perplexity"] > 1
    assert facts["corpus"]["sha256"] in (smoke_dir / "README.md").read_text()
    assert len(facts["samples_greedy"]) == 3
    gen = json.loads((smoke_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == gen["bos_token_id"] == facts["model_config"]["eos_token_id"]


def test_refuses_to_overwrite_a_model_before_training(tmp_path, monkeypatch):
    """A folder holding model.safetensors (the shipped model by default) is kept unless --overwrite is given."""
    import llmlab.train.__main__ as cli
    from llmlab.checkpoint import DEFAULT_MODEL_DIR

    def no_training(*a, **k):
        raise AssertionError("training started before the output folder was checked")

    monkeypatch.setattr(cli, "prepare_data", no_training)
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path), "--smoke", "--device", "cpu"])
    msg = str(e.value)
    assert str(tmp_path) in msg and "--overwrite" in msg and "--out <new folder>" in msg
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"
    with pytest.raises(SystemExit, match="shipped default model"):  # the default --out is the shipped model
        cli.main(["--device", "cpu"])
    assert (DEFAULT_MODEL_DIR / "model.safetensors").is_file()
    with pytest.raises(AssertionError, match="training started"):  # --overwrite lets it through
        cli.main(["--out", str(tmp_path), "--smoke", "--device", "cpu", "--overwrite"])
    sharded = tmp_path / "hub"  # a hub checkpoint's shards and config, no model.safetensors
    sharded.mkdir()
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"shard")
    with pytest.raises(SystemExit, match="already holds a model"):
        cli.main(["--out", str(sharded), "--smoke", "--device", "cpu"])
    (sharded / "model-00001-of-00002.safetensors").unlink()
    (sharded / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="already holds a model"):
        cli.main(["--out", str(sharded), "--smoke", "--device", "cpu"])
    (sharded / "config.json").unlink()
    with pytest.raises(AssertionError, match="training started"):  # an empty folder is free to use
        cli.main(["--out", str(sharded), "--smoke", "--device", "cpu"])


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--steps", "-3"], ["--batch-size", "0"], ["--seq-len", "0"],
                                  ["--lr", "-1"], ["--lr", "nan"], ["--epochs", "0"], ["--time-budget-s", "0"],
                                  ["--eval-every", "0"], ["--patience", "0"]])
def test_bad_counts_are_refused_before_training(argv, tmp_path, monkeypatch, capsys):
    """--steps 0 used to mean the default (2611 steps, the whole time budget) and --steps -3 trained nothing and
    saved the untrained model; each bad count or rate is refused by argparse, naming the flag, before any work."""
    import llmlab.train.__main__ as cli

    def no_training(*a, **k):
        raise AssertionError("training started with a bad argument")

    monkeypatch.setattr(cli, "prepare_data", no_training)
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path / "m"), "--smoke", "--device", "cpu", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and argv[1] in err
    assert not (tmp_path / "m").exists()


def test_seq_len_beyond_the_context_names_the_fix(tmp_path):
    import llmlab.train.__main__ as cli

    with pytest.raises(SystemExit, match=r"--seq-len 5000 exceeds the model's context length 1024; use --seq-len "
                                         r"1024 or less"):
        cli.main(["--out", str(tmp_path / "m"), "--device", "cpu", "--seq-len", "5000"])


def test_bad_out_and_device_are_refused_before_training(tmp_path, monkeypatch):
    """An --out that is a file or cannot be written, and a --device that is not one, used to fail after training
    (the model lost) or with a raw traceback; now they are refused before any work."""
    import llmlab.train.__main__ as cli

    def no_training(*a, **k):
        raise AssertionError("training started with a bad argument")

    monkeypatch.setattr(cli, "prepare_data", no_training)
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(SystemExit, match="is a file; give a folder"):
        cli.main(["--out", str(a_file), "--smoke", "--device", "cpu"])
    with pytest.raises(SystemExit, match="cannot write the model to"):
        cli.main(["--out", str(a_file / "below"), "--smoke", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--device: unknown device 'gpu'"):
        cli.main(["--out", str(tmp_path / "m"), "--smoke", "--device", "gpu"])
    assert not list((tmp_path / "m").glob(".llmlab-write-test"))  # the probe file is removed
