"""int8 / fp8 KV-cache quantization (`llmlab.cache.kv_quant`): the quantizer's error bound, the residual window's edge
(prompts longer than R, windows crossed while decoding), and the quality on the default model."""

from __future__ import annotations

import pytest
import torch

from llmlab.generate import generate
from llmlab.cache.kv_cache import KVCache
from llmlab.cache.kv_quant import (QuantizedKVCache, dequantize, greedy_agreement, perplexity, quality_report, quantize,
                                   quantized_cache)
from tiny_models import prompt_ids, tiny_config, tiny_model


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_error_is_within_half_a_step(kind):
    torch.manual_seed(0)
    x = torch.randn(3, 2, 50, 16) * torch.rand(3, 2, 50, 1) * 10
    q, s = quantize(x, kind)
    assert s.shape == (3, 2, 50, 1)
    err = (dequantize(q, s, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":
        assert (err <= s / 2 + 1e-6).all()  # round to nearest: half a quantization step, per token per head
    else:
        assert (err <= amax * 2 ** -4 + 1e-6).all()  # e4m3: 3 mantissa bits, relative error <= 2^-4


@pytest.mark.parametrize("residual", [0, 4, 8])
@pytest.mark.parametrize("prompt_len", [3, 8, 9, 20])
def test_residual_window_edge(residual, prompt_len):
    """Tokens older than the last R are stored quantized; the last R (and this call's tokens) stay exact."""
    config = tiny_config(n_layers=1)
    torch.manual_seed(prompt_len)
    cache = QuantizedKVCache(config, 2, 40, torch.float32, "cpu", residual=residual)
    k = torch.randn(2, config.n_kv_heads, prompt_len + 5, config.head_dim)
    k_all, _ = cache.update(0, torch.arange(prompt_len), k[:, :, :prompt_len], k[:, :, :prompt_len])
    assert torch.equal(k_all, k[:, :, :prompt_len])  # the prefill attends over its own fresh, exact K/V
    assert cache.n_quant == max(0, prompt_len - residual) and cache.length == prompt_len
    for t in range(prompt_len, prompt_len + 5):
        k_all, _ = cache.update(0, torch.tensor([t]), k[:, :, t:t + 1], k[:, :, t:t + 1])
        n_q = max(0, t - residual)  # quantized before this step
        exact, approx = k_all[:, :, n_q:], k_all[:, :, :n_q]
        assert torch.equal(exact, k[:, :, n_q:t + 1])
        if n_q:
            q, s = quantize(k[:, :, :n_q])
            assert torch.equal(approx, dequantize(q, s, torch.float32))
            assert not torch.equal(approx, k[:, :, :n_q])
    assert cache.length == prompt_len + 5 and cache.n_quant == max(0, prompt_len + 5 - residual)


def test_large_residual_equals_full_precision():
    model = tiny_model(seed=0)
    prompt = prompt_ids(2, 20, seed=2)
    ref = generate(model, prompt, max_new_tokens=30)
    got = generate(model, prompt, max_new_tokens=30, cache_factory=quantized_cache(residual=64))
    assert got.token_ids == ref.token_ids  # nothing ever leaves the window: exactly the contiguous cache


def test_quantized_cache_is_smaller():
    config = tiny_config()
    full = KVCache(config, 1, 256, torch.bfloat16, "cpu")
    q = QuantizedKVCache(config, 1, 256, torch.bfloat16, "cpu", residual=32)
    # int8 values + one fp32 scale per 16-dim vector: (16 + 4) / (16 x 2) of bf16, plus the 32-token tail
    assert q.nbytes < 0.8 * full.nbytes
    assert q.nbytes == 2 * 2 * 2 * (256 * 16 + 256 * 4 + 32 * 16 * 2)


def test_writes_must_continue_the_cache():
    cache = QuantizedKVCache(tiny_config(n_layers=1), 1, 16, torch.float32, "cpu")
    k = torch.randn(1, 2, 2, 16)
    with pytest.raises(ValueError, match="continue"):
        cache.update(0, torch.tensor([3, 4]), k, k)
    with pytest.raises(ValueError, match="unknown KV quantization"):
        QuantizedKVCache(tiny_config(), 1, 16, torch.float32, "cpu", kind="int4")


def test_int8_kv_on_the_default_model():
    """Greedy agreement over 64 tokens and the perplexity change of int8 KV (R = 32) on the shipped model; the
    prompt of the perplexity run (256 tokens) is far longer than R. Measured numbers: llmlab/solutions/lab03.py."""
    import llmlab

    llm = llmlab.load(device="cpu")
    prompt = "def fibonacci(n):\n    " + "Return the n-th Fibonacci number. " * 4  # > 32 tokens: crosses R
    assert len(llm.encode(prompt)) > 32
    ref = llm.generate(prompt, max_new_tokens=64, stop_at_eos=False)
    got = llm.generate(prompt, max_new_tokens=64, stop_at_eos=False, cache_factory=quantized_cache(32, "int8"))
    agree = greedy_agreement(ref.token_ids[0], got.token_ids[0])
    assert agree["tokens"] == 64 and agree["agreement"] >= 0.5, agree
    from llmlab.cache.kv_quant import heldout_text

    ids = llm.encode(heldout_text())[:160]
    p_full = perplexity(llm.model, ids)
    p_int8 = perplexity(llm.model, ids, quantized_cache(32, "int8"))
    assert abs(p_int8 / p_full - 1) < 0.05, (p_full, p_int8)
    assert perplexity(llm.model, ids[:40], prefill=20) == pytest.approx(perplexity(llm.model, ids[:40]), rel=1e-4)
    context = llm.config.max_seq_len
    for bad in (ids[:1], [], ids * 20):  # one token used to give NaN; none, an error blaming max_seq_len
        with pytest.raises(ValueError, match=rf"perplexity needs 2 to {context} token ids \(the model's context\)"):
            perplexity(llm.model, bad)
    with pytest.raises(ValueError, match=r"prefill=40: give 1 to 39 tokens"):
        perplexity(llm.model, ids[:40], prefill=40)
    for bad in (0, 1, context + 1):
        with pytest.raises(ValueError, match=rf"eval_tokens={bad}: perplexity is measured on 2 to {context} tokens"):
            quality_report(llm, eval_tokens=bad)
    with pytest.raises(ValueError, match=r"new_tokens=0: give a whole number of tokens, 1 or more"):
        quality_report(llm, new_tokens=0)


@pytest.mark.parametrize("cache_cls", ["quantized", "contiguous"])
def test_a_forward_pass_cut_short_leaves_the_cache_as_it_was(cache_cls):
    """An exception in layer 1 of a decode step (or Ctrl-C) must not leave layer 0's new token in the cache: the
    retried step gives the logits of a clean run (the quantized cache used to append it twice to layer 0's tail)."""
    model = tiny_model(seed=3, n_layers=3)
    ids = prompt_ids(1, 10)
    make = (lambda: QuantizedKVCache(model.config, 1, 64, torch.float32, "cpu", residual=4)) \
        if cache_cls == "quantized" else (lambda: KVCache(model.config, 1, 64, torch.float32, "cpu"))
    clean, cut = make(), make()
    for cache in (clean, cut):
        model(ids, torch.arange(10), kv_cache=cache)
    token, pos = torch.tensor([[5]]), torch.tensor([10])
    want = model(token, pos, kv_cache=clean)

    def fail(*_):
        raise RuntimeError("interrupted")

    hook = model.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="interrupted"):
            model(token, pos, kv_cache=cut)
    finally:
        hook.remove()
    assert cut.length == 10
    torch.testing.assert_close(model(token, pos, kv_cache=cut), want, rtol=0, atol=0)


def test_a_contiguous_cache_refuses_a_gap():
    model = tiny_model(seed=3, n_layers=2)
    cache = KVCache(model.config, 1, 64, torch.float32, "cpu")
    model(prompt_ids(1, 10), torch.arange(10), kv_cache=cache)
    with pytest.raises(ValueError, match="holds 10 tokens; a write at position 13 would leave a gap"):
        model(torch.tensor([[5]]), torch.tensor([13]), kv_cache=cache)
    assert cache.length == 10
    model(torch.tensor([[5]]), torch.tensor([10]), kv_cache=cache)
    assert cache.length == 11


@pytest.mark.parametrize("cache_cls", ["contiguous", "quantized"])
def test_a_cache_that_holds_tokens_needs_positions(cache_cls):
    """Without positions the next token defaulted to position 0: the contiguous cache took that as a rewrite, kept
    one token and gave wrong logits without a word."""
    model = tiny_model(seed=3, n_layers=2)
    make = KVCache if cache_cls == "contiguous" else quantized_cache(4, "int8")
    cache = make(model.config, 1, 64, torch.float32, "cpu")
    model(prompt_ids(1, 10), kv_cache=cache)  # a fresh cache: 0..T-1 is right
    with pytest.raises(ValueError, match=r"the KV cache already holds 10 tokens and no positions were given: pass "
                                         r"positions=torch.arange\(10, 10 \+ T\)"):
        model(torch.tensor([[5]]), kv_cache=cache)
    assert cache.length == 10
    want = model(torch.cat([prompt_ids(1, 10), torch.tensor([[5]])], 1))[:, -1:]
    tol = 0.05 if cache_cls == "quantized" else 1e-5  # int8 K/V round; the contiguous cache is the same math
    torch.testing.assert_close(model(torch.tensor([[5]]), torch.tensor([10]), kv_cache=cache), want, rtol=tol, atol=tol)
