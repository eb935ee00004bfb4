"""`llmlab.measure.host_costs`: the tokenizer, host->device copy and sampling timings return sane dicts (no figures are
asserted beyond "positive and finite": the numbers depend on the machine)."""

from __future__ import annotations

import math

import pytest
import torch

from llmlab.measure.host_costs import h2d_copy_cost, sampling_cost, tokenizer_cost


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_tokenizer_cost_of_the_default_model():
    out = tokenizer_cost(repeats=3)
    rows = out["prompts"]
    assert len(rows) == 3
    assert [r["tokens"] for r in rows] == sorted(r["tokens"] for r in rows) and rows[0]["tokens"] > 10
    assert rows[-1]["tokens"] > 40 * rows[0]["tokens"]  # 64x the text
    for r in rows:
        assert positive(r["encode_ms"]) and positive(r["decode_ms"]) and positive(r["encode_us_per_token"])
    assert positive(out["decode_one_token_us"])
    assert "vocab 8192" in out["tokenizer"]


def test_tokenizer_cost_of_given_texts():
    from llmlab.checkpoint import load_tokenizer

    out = tokenizer_cost(load_tokenizer("default"), texts=["def f(x):", "return x"], repeats=2)
    assert [r["chars"] for r in out["prompts"]] == [9, 8]


def test_sampling_cost_on_cpu():
    out = sampling_cost(vocab_size=1000, batch=2, device="cpu", repeats=3)
    assert positive(out["cpu_ms"]) and positive(out["greedy_cpu_ms"])
    assert out["gpu_ms"] is None and out["greedy_gpu_then_host_ms"] is None and "no CUDA GPU" in out["reason"]
    assert (out["vocab_size"], out["batch"], out["top_k"]) == (1000, 2, 50)


def test_h2d_copy_cost_needs_a_gpu():
    out = h2d_copy_cost(device="cpu")
    assert out == {"available": False, "reason": "host->device copies need a CUDA GPU", "rows": []}


@pytest.mark.gpu
def test_h2d_and_sampling_cost_on_gpu():
    out = h2d_copy_cost(sizes=(8, 1 << 20, 16 << 20), repeats=5)
    assert out["available"] and len(out["rows"]) == 3
    for r in out["rows"]:
        for k in ("pageable_host_ms", "pageable_total_ms", "pinned_host_ms", "pinned_total_ms", "pinned_gb_s"):
            assert positive(r[k]), (k, r)
    big = out["rows"][-1]
    assert big["pinned_gb_s"] > 1.0  # PCIe/NVLink-C2C: tens of GB/s; 1 GB/s would mean something is off
    s = sampling_cost(vocab_size=128256, repeats=5)
    assert all(positive(s[k]) for k in ("gpu_ms", "gpu_then_host_ms", "cpu_ms", "greedy_gpu_ms"))
    assert s["device"].startswith("cuda")
    torch.cuda.synchronize()
