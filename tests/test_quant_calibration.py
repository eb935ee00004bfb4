"""Calibration text for AWQ (`llmlab.quant.calibration`): the default model's held-out documents, cut into
calibration windows, and the evaluation tokens after them, disjoint from the windows; short text is refused with the
sizes in the message."""

from __future__ import annotations

import json

import pytest
import torch

import llmlab
from llmlab.checkpoint import DEFAULT_MODEL_DIR
from llmlab.quant import calibration_ids, evaluation_ids, heldout_text
from llmlab.quant.calibration import heldout_ids
from llmlab.train.corpus import EOT, is_val


@pytest.fixture(scope="module")
def llm():
    return llmlab.load(device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def text():
    return heldout_text()


def test_heldout_text_is_the_model_cards_held_out_documents(text):
    names = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())["corpus"]["val_documents"]
    assert all(is_val(n) for n in names)  # the card's list is the corpus's held-out split
    docs = text.split(EOT)
    assert 1 < len(docs) <= len(names)  # one document per held-out name this Python has
    modules = {d.splitlines()[0].removeprefix("module ") for d in docs if d.startswith("module ")}
    assert modules and all(f"module:{m}" in names for m in modules), modules
    assert "module bdb" in text and "class bdb.Bdb" in text  # bdb is held out; its docstrings are in the text
    assert "module json.decoder" not in text  # a training document is not


def test_calibration_windows_are_the_first_tokens_and_evaluation_the_rest(llm, text):
    ids = heldout_ids(llm, text)
    calib = calibration_ids(llm, text, n_samples=4, seq_len=64)
    assert calib.shape == (4, 64) and calib.dtype == torch.long
    rest = evaluation_ids(llm, text, n_samples=4, seq_len=64)
    assert torch.equal(calib.flatten(), ids[:256])
    assert torch.equal(torch.cat([calib.flatten(), rest]), ids)  # disjoint, and together the whole text
    assert rest.numel() == ids.numel() - 256 > 10_000


def test_default_calibration_is_the_held_out_text_and_any_tokenizer_works(llm, text):
    calib = calibration_ids(llm)  # text=None: heldout_text()
    assert calib.shape == (16, 256)
    assert torch.equal(calib, calibration_ids(llm.tokenizer, text))  # a tokenizers.Tokenizer gives the same ids
    assert (calib >= 0).all() and (calib < llm.config.vocab_size).all()


def test_text_shorter_than_the_context_is_refused_with_the_sizes(llm):
    short = "def f(x):\n    return x\n"
    n = len(llm.encode(short))
    with pytest.raises(ValueError, match=rf"{n} tokens long, shorter than one window of seq_len = 256"):
        calibration_ids(llm, short)
    some = "Return the list of items. " * 40  # a few hundred tokens: one window of 64, not 16
    n = len(llm.encode(some))
    with pytest.raises(ValueError, match=rf"{n} tokens long; n_samples = 16 windows of seq_len = 64 need 1024.*"
                                         rf"n_samples <= {n // 64}"):
        calibration_ids(llm, some, seq_len=64)
    assert calibration_ids(llm, some, n_samples=n // 64, seq_len=64).shape == (n // 64, 64)
    with pytest.raises(ValueError, match="at least 2 must be left"):
        evaluation_ids(llm, some, n_samples=1, seq_len=len(llm.encode(some)))


@pytest.mark.parametrize("kwargs", [dict(n_samples=0), dict(seq_len=1), dict(n_samples=True), dict(seq_len=2.5)])
def test_bad_sizes_are_refused(llm, text, kwargs):
    with pytest.raises(ValueError, match="n_samples|seq_len"):
        calibration_ids(llm, text, **kwargs)


def test_bad_text_or_tokenizer_is_refused(llm):
    with pytest.raises(TypeError, match="must be a str"):
        calibration_ids(llm, [1, 2, 3])
    with pytest.raises(TypeError, match="tokenizer"):
        calibration_ids(object(), "some text")
