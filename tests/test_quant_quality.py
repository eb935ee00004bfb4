"""Quantization quality on the shipped model (llmlab.load(): 7.7M parameters, trained on Python's docs, loaded
offline): perplexity on held-out text (whole pydoc topics the training split left out, `llmlab.train.corpus.is_val`)
is finite, and int8's is within 1% of fp32's."""

from __future__ import annotations

import copy
import math

import pytest

import llmlab
from llmlab.quant import greedy_agreement, perplexity, quantize_model
from llmlab.train.corpus import EOT, is_val, topic_documents

N_TOKENS = 300


@pytest.fixture(scope="module")
def default_and_ids():
    llm = llmlab.load(device="cpu", dtype="fp32")
    held_out = [d for d in topic_documents() if is_val(d.name)]
    assert held_out, "no held-out pydoc topic on this Python"
    ids = llm.tokenizer.encode(EOT.join(d.text for d in held_out)).ids[:N_TOKENS]
    assert len(ids) >= 200, len(ids)
    return llm.model, ids


def test_int8_perplexity_within_one_percent_of_fp32(default_and_ids):
    model, ids = default_and_ids
    p32 = perplexity(model, ids, context=256, stride=128)
    assert math.isfinite(p32) and 1 < p32 < 1000
    q8 = quantize_model(copy.deepcopy(model), "int8")
    p8 = perplexity(q8, ids, context=256, stride=128)
    assert abs(p8 / p32 - 1) < 0.01, (p32, p8)
    assert greedy_agreement(model, q8, [ids[:16]], n_tokens=8) >= 0.5
