"""`LLM.generate(..., batching=...)` and the batching switch: continuous batching behind the generate interface,
the form the tour, the dashboard and the bench's +continuous_batching rung use."""

from __future__ import annotations

import pytest
import torch

from llmlab.engine import LLM
from llmlab.switches import SWITCHES, apply_switches
from tiny_models import tiny_model

PROMPTS = [[5, 6, 7], list(range(10, 40)), [9] * 17, [1, 2]]


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model(seed=3), name="tiny")


def test_continuous_batching_gives_every_prompt_its_solo_tokens(llm):
    g = llm.generate(PROMPTS, max_new_tokens=6, stop_at_eos=False, batching="continuous")
    solo = [llm.generate(p, max_new_tokens=6, stop_at_eos=False).token_ids[0] for p in PROMPTS]
    assert g.token_ids == solo
    assert len(g.extra["requests"]) == len(PROMPTS) and g.extra["max_batch"] == len(PROMPTS)
    assert all(r["ttft_ms"] > 0 and r["queueing_ms"] >= 0 for r in g.extra["requests"])
    assert len(g.step_ms) >= 6 and g.extra["engine"]["finished"] == len(PROMPTS)


def test_generate_continuous_takes_an_llm_or_its_model(llm):
    from llmlab.batching.continuous import generate_continuous

    from_llm = generate_continuous(llm, PROMPTS, max_new_tokens=5)
    assert from_llm.token_ids == generate_continuous(llm.model, PROMPTS, max_new_tokens=5).token_ids
    with pytest.raises(TypeError, match="give an llmlab.LLM or an llmlab.model.Transformer"):
        generate_continuous("tiny", PROMPTS)


def test_a_tiny_kv_pool_preempts_and_still_gives_the_solo_tokens(llm):
    from llmlab.batching.continuous import generate_continuous

    solo = [llm.generate(p, max_new_tokens=8, stop_at_eos=False).token_ids[0] for p in PROMPTS]
    g = generate_continuous(llm.model, PROMPTS, max_new_tokens=8, num_blocks=3)  # 48 slots for 4 requests
    assert g.token_ids == solo
    assert sum(r["preemptions"] for r in g.extra["requests"]) > 0


def test_static_batching_is_the_padded_batch(llm):
    g = llm.generate(PROMPTS, max_new_tokens=4, stop_at_eos=False, batching="static")
    assert g.token_ids == llm.generate(PROMPTS, max_new_tokens=4, stop_at_eos=False).token_ids


def test_continuous_batching_refuses_what_it_cannot_run_and_the_llm_stays_usable(llm):
    with pytest.raises(ValueError, match="batching='fast'"):
        llm.generate(PROMPTS, batching="fast")
    with pytest.raises(ValueError, match="use_cache=False"):
        llm.generate(PROMPTS, use_cache=False, batching="continuous")
    with pytest.raises(ValueError, match="on_token"):
        llm.generate(PROMPTS, on_token=lambda step, toks: None, batching="continuous")
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate(PROMPTS, max_new_tokens=0, batching="continuous")
    from llmlab.batching.continuous import generate_continuous

    with pytest.raises(ValueError, match=r"num_blocks=1: .*longest request \(prompt \+ max_new_tokens = 38 tokens\): "
                                         r"give num_blocks >= 3") as e:  # 30 + 8 tokens need 3 blocks of 16
        generate_continuous(llm.model, PROMPTS, max_new_tokens=8, num_blocks=1)
    assert "max_seq_len" not in str(e.value)  # generate_continuous has no such argument to give
    assert llm.generate(PROMPTS[0], max_new_tokens=2, batching="continuous").token_ids


def test_the_batching_switch_sets_the_generate_argument(llm):
    assert SWITCHES["batching"].choices == (None, "static", "continuous", "one_at_a_time")
    same, kwargs = apply_switches(llm, {"batching": "continuous"})
    assert same is llm and kwargs["batching"] == "continuous"
    _, kwargs = apply_switches(llm, {"batching": None})
    assert "batching" not in kwargs
    g = llm.generate(PROMPTS[:2], max_new_tokens=3, stop_at_eos=False, **apply_switches(llm, {"batching": "continuous"})[1])
    assert [len(t) for t in g.token_ids] == [3, 3]


def test_sampled_requests_are_reproducible_with_a_seed(llm):
    a = llm.generate(PROMPTS, max_new_tokens=5, temperature=0.9, seed=7, stop_at_eos=False, batching="continuous")
    b = llm.generate(PROMPTS, max_new_tokens=5, temperature=0.9, seed=7, stop_at_eos=False, batching="continuous")
    assert a.token_ids == b.token_ids
    assert torch.tensor(a.token_ids).numel() == 20


def test_one_at_a_time_serves_each_prompt_alone_and_counts_the_wait(llm):
    g = llm.generate(PROMPTS, max_new_tokens=5, stop_at_eos=False, batching="one_at_a_time")
    solo = [llm.generate(p, max_new_tokens=5, stop_at_eos=False) for p in PROMPTS]
    assert g.token_ids == [s.token_ids[0] for s in solo]
    assert len(g.step_ms) == 5 * len(PROMPTS)  # every call's steps, in order
    ttft = [r["ttft_ms"] for r in g.extra["requests"]]
    assert ttft == sorted(ttft) and ttft[0] == g.step_ms[0]  # each waits for the ones before it
    assert ttft[-1] >= sum(g.step_ms[:5 * (len(PROMPTS) - 1)])
    with pytest.raises(ValueError, match="no token ids"):
        llm.generate([], batching="one_at_a_time")
    assert llm.generate(PROMPTS[0], max_new_tokens=2, batching="one_at_a_time").token_ids == [solo[0].token_ids[0][:2]]
