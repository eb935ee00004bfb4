"""`llmlab.generate.generate`: the KV-cache path equals the recompute-everything reference token for token, calls
leave no state behind, sampling is reproducible, EOS stops a sequence, and the timings add up.

The model is a small random decoder with a large init std, so its greedy continuation is varied (checked: many
distinct tokens) rather than one token repeated, which would make "equal tokens" a weak statement.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmlab.generate import Generation, generate
from tiny_models import prompt_ids, tiny_model

PROMPT = prompt_ids(1, 12, seed=11)[0].tolist()
OTHER = prompt_ids(1, 5, seed=12)[0].tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def greedy64(model) -> list[int]:
    return generate(model, PROMPT, max_new_tokens=64).token_ids[0]


def test_greedy_cache_equals_no_cache_64_tokens(model, greedy64):
    ref = generate(model, PROMPT, max_new_tokens=64, use_cache=False)
    assert len(greedy64) == 64
    assert len(set(greedy64)) >= 16, f"degenerate greedy output {greedy64}: the check would mean little"
    assert ref.token_ids[0] == greedy64
    assert ref.finish_reason == "length" and not ref.use_cache


def test_greedy_tokens_are_argmax_of_full_forward(model, greedy64):
    """Independent of both generate paths: run the whole sequence once and read off each position's argmax."""
    seq = torch.tensor([PROMPT + greedy64])
    with torch.no_grad():
        logits = model(seq)  # (1, T + 64, V)
    T = len(PROMPT)
    assert logits[0, T - 1:T + 63].argmax(-1).tolist() == greedy64


def test_greedy_batch_rows_equal_single_runs(model):
    batch = prompt_ids(3, 9, seed=21)
    out = generate(model, batch, max_new_tokens=24)
    ref = generate(model, batch, max_new_tokens=24, use_cache=False)
    assert out.token_ids == ref.token_ids
    for b in range(3):
        assert generate(model, batch[b], max_new_tokens=24).token_ids[0] == out.token_ids[b]
    assert len({tuple(t) for t in out.token_ids}) == 3


def test_prompt_as_list_or_tensor(model):
    a = generate(model, PROMPT, max_new_tokens=8).token_ids
    b = generate(model, torch.tensor(PROMPT), max_new_tokens=8).token_ids
    c = generate(model, [PROMPT], max_new_tokens=8).token_ids
    assert a == b == c


def test_repeated_calls_leave_no_state(model):
    """A second call equals a fresh model's output, also after calls with another prompt, length and settings."""
    first = generate(model, PROMPT, max_new_tokens=32).token_ids
    generate(model, OTHER, max_new_tokens=50)  # shorter prompt, longer output
    generate(model, prompt_ids(2, 30, seed=3), max_new_tokens=7, use_cache=False)
    generate(model, OTHER, max_new_tokens=20, temperature=1.0, top_k=5, seed=1)
    again = generate(model, PROMPT, max_new_tokens=32).token_ids
    fresh = generate(tiny_model(seed=0), PROMPT, max_new_tokens=32).token_ids
    assert first == again == fresh


def test_generate_does_not_touch_the_weights(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generate(model, PROMPT, max_new_tokens=5)
    generate(model, PROMPT, max_new_tokens=5, temperature=1.0, seed=0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model.training


def test_fills_the_context_exactly():
    m = tiny_model(seed=0, max_seq_len=32)
    a = generate(m, PROMPT, max_new_tokens=32 - len(PROMPT))
    b = generate(m, PROMPT, max_new_tokens=32 - len(PROMPT), use_cache=False)
    assert a.token_ids == b.token_ids and len(a.token_ids[0]) == 20


# -- sampling -----------------------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(model, greedy64):
    kw = dict(max_new_tokens=40, temperature=1.0)
    a = generate(model, PROMPT, seed=7, **kw).token_ids
    b = generate(model, PROMPT, seed=7, **kw).token_ids
    c = generate(model, PROMPT, seed=8, **kw).token_ids
    assert a == b
    assert a != c  # the seed matters
    assert a[0] != greedy64[:40]  # sampling really sampled
    # the cache changes the work, not the distribution: same seed, same tokens without it
    assert generate(model, PROMPT, seed=7, use_cache=False, **kw).token_ids == a


def test_top_k_1_and_tiny_top_p_equal_greedy(model, greedy64):
    g = greedy64[:32]
    assert generate(model, PROMPT, max_new_tokens=32, temperature=1.0, top_k=1, seed=0).token_ids[0] == g
    assert generate(model, PROMPT, max_new_tokens=32, temperature=1.0, top_p=1e-6, seed=0).token_ids[0] == g
    assert generate(model, PROMPT, max_new_tokens=32, temperature=2.0, top_k=1, top_p=0.5, seed=3).token_ids[0] == g


def test_top_k_restricts_sampled_tokens(model):
    """With top_k=2 every sampled token is one of the two best under the full-sequence logits."""
    g = generate(model, PROMPT, max_new_tokens=24, temperature=5.0, top_k=2, seed=0).token_ids[0]
    seq = torch.tensor([PROMPT + g])
    with torch.no_grad():
        top2 = model(seq)[0, len(PROMPT) - 1:-1].topk(2, dim=-1).indices  # (24, 2)
    assert all(t in pair for t, pair in zip(g, top2.tolist()))
    assert any(t != pair[0] for t, pair in zip(g, top2.tolist()))  # at temperature 5 the runner-up gets picked


# -- EOS ----------------------------------------------------------------------------------------------------------


def test_stops_at_eos(model, greedy64):
    eos = greedy64[10]
    stop = greedy64.index(eos)  # its first occurrence
    out = generate(model, PROMPT, max_new_tokens=64, eos_token_id=eos)
    assert out.token_ids[0] == greedy64[:stop + 1]  # EOS included, nothing after it
    assert out.finish_reason == "eos"
    assert len(out.step_ms) == stop + 1
    out_nc = generate(model, PROMPT, max_new_tokens=64, eos_token_id=eos, use_cache=False)
    assert out_nc.token_ids == out.token_ids
    # a list of EOS ids: the first one produced stops
    other = greedy64[20]
    out2 = generate(model, PROMPT, max_new_tokens=64, eos_token_id=[other, eos])
    assert out2.token_ids[0] == greedy64[:min(stop, greedy64.index(other)) + 1]


def test_eos_absent_runs_to_length(model, greedy64):
    never = next(t for t in range(256) if t not in greedy64[:30])
    out = generate(model, PROMPT, max_new_tokens=30, eos_token_id=never)
    assert out.finish_reason == "length" and out.token_ids[0] == greedy64[:30]


def test_eos_in_a_batch_stops_each_row(model):
    batch = prompt_ids(2, 9, seed=21)
    full = generate(model, batch, max_new_tokens=40).token_ids
    eos = full[0][5]
    out = generate(model, batch, max_new_tokens=40, eos_token_id=eos)
    for row, ref in zip(out.token_ids, full):
        expected = ref[:ref.index(eos) + 1] if eos in ref else ref
        assert row == expected
    assert out.finish_reason == ("eos" if all(eos in r for r in full) else "length")
    assert len(out.step_ms) == max(len(r) for r in out.token_ids)


# -- timings ------------------------------------------------------------------------------------------------------


def test_timing_fields(model):
    g = generate(model, prompt_ids(2, 9, seed=4), max_new_tokens=16)
    assert isinstance(g, Generation)
    assert g.prompt_len == 9 and g.n_generated == 16
    assert len(g.step_ms) == 16 and all(ms > 0 for ms in g.step_ms)
    assert g.ttft_ms == g.step_ms[0] > 0
    assert g.tpot_ms == pytest.approx(sum(g.step_ms[1:]) / 15) and g.tpot_ms > 0
    assert g.total_ms == pytest.approx(sum(g.step_ms))
    assert g.tokens_per_s == pytest.approx(2 * 16 / (g.total_ms / 1e3))  # both sequences' tokens
    assert (g.device, g.dtype) == ("cpu", "float32")
    s = g.summary()
    assert s["ttft_ms"] == g.ttft_ms and s["tpot_ms"] == g.tpot_ms and s["new_tokens"] == 16
    assert s["prompt_tokens"] == 9 and s["use_cache"] is True


def test_one_token_has_ttft_but_no_tpot(model):
    g = generate(model, PROMPT, max_new_tokens=1)
    assert len(g.step_ms) == 1 and g.ttft_ms > 0
    assert math.isnan(g.tpot_ms)
    assert g.tokens_per_s > 0


def test_one_attention_rule_for_the_pytorch_path_and_the_kernels():
    """`attention_path` is the one place that picks a layer's attention, for `Attention` and the kernel modules."""
    from llmlab.model import attention_path

    class Paged:  # a cache that attends from its own pool (as llmlab.cache.paged_cache.PagedKVCache)
        def decode_attention(self, layer, q):
            raise NotImplementedError

    cache, mask = object(), torch.zeros(1, 1, 1, 8)
    assert attention_path(1, cache, mask, None) == "static_decode"
    assert attention_path(5, cache, mask, None) == attention_path(1, cache, mask, 4) == "static"
    assert attention_path(1, Paged(), None, None) == "paged_decode"
    assert attention_path(1, cache, None, None) == "decode"
    assert attention_path(1, cache, None, 4) == attention_path(1, None, None, None) == "causal"
    assert attention_path(7, cache, None, None) == attention_path(7, None, None, None) == "causal"


def test_generate_runs_every_forward_through_the_given_kernels(model, greedy64):
    """`kernels`: an object whose forward takes the model's arguments (the Triton kernels' decode step) runs every
    forward pass of the eager decode, with and without the KV cache."""
    calls = []

    class Recorder:
        def forward(self, input_ids, positions=None, kv_cache=None, last_only=False):
            calls.append(input_ids.shape[1])
            return model(input_ids, positions, kv_cache, last_only)

    for use_cache in (True, False):
        calls.clear()
        got = generate(model, PROMPT, max_new_tokens=8, use_cache=use_cache, kernels=Recorder())
        assert got.token_ids[0] == greedy64[:8] and len(calls) == 8
        assert calls[1:] == ([1] * 7 if use_cache else list(range(len(PROMPT) + 1, len(PROMPT) + 8)))
