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


def test_timings_of_a_run_timed_by_request_are_the_requests_own(llm):
    """Continuous batching prefills in chunks over several steps and one_at_a_time strings every call's steps
    together: step 0 is no request's TTFT there, so ttft_ms / tpot_ms / metrics read the requests' own timings."""
    long = [[7] * 200] * 3
    for mode in ("continuous", "one_at_a_time"):
        g = llm.generate(long, max_new_tokens=1, stop_at_eos=False, batching=mode)
        ttfts = [r["ttft_ms"] for r in g.extra["requests"]]
        assert g.ttft_ms == pytest.approx(sum(ttfts) / len(ttfts)) and min(ttfts) > 0
        assert g.tpot_ms != g.tpot_ms  # NaN: one token a request, no decode step
        assert g.metrics.timed == "requests" and g.metrics.batch == 3
        assert g.metrics.tokens_per_s == pytest.approx(3 / (sum(g.step_ms) / 1e3))
        assert g.metrics.mbu(llm.config, 200, 1000.0) != g.metrics.mbu(llm.config, 200, 1000.0)  # NaN
    g = llm.generate(PROMPTS, max_new_tokens=5, stop_at_eos=False, batching="continuous")
    tpots = [r["tpot_ms"] for r in g.extra["requests"]]
    assert g.tpot_ms == pytest.approx(sum(tpots) / len(tpots))
    assert "4 requests, up to 5 tokens each" in str(g.metrics)
    plain = llm.generate(PROMPTS[0], max_new_tokens=5, stop_at_eos=False)  # one batch: its steps are its tokens
    assert plain.metrics.timed == "steps" and plain.ttft_ms == plain.step_ms[0]


def test_one_at_a_time_checks_every_prompt_before_the_first_call(llm):
    calls = []
    bad = [[5, 6, 7]] * 3 + [[1, 2, 10**6]]
    with pytest.raises(ValueError, match=r"^prompts\[3\] holds token id 1000000, outside the model's vocabulary"):
        llm.generate(bad, max_new_tokens=2, batching="one_at_a_time", on_token=lambda *a: calls.append(a))
    assert calls == []  # no prompt ran
    with pytest.raises(TypeError, match=r"prompts\[0\] holds float32 values, not token ids"):
        llm.generate([[1.9, 2.2]], max_new_tokens=2, batching="one_at_a_time")
    for mode in ("one_at_a_time", "continuous", "static"):
        with pytest.raises(TypeError, match=r"prompts\[1\]\[0\] is str 'a', not a token id"):
            llm.generate([[1, 2], ["a", "b", "c"]], max_new_tokens=2, batching=mode)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds a token id too large to read .*outside the model's "
                                         r"vocabulary"):
        llm.generate([[1, 2**70]], max_new_tokens=2, batching="one_at_a_time")
    import numpy as np  # NumPy prompts run as lists do

    ref = llm.generate([[5, 6, 7], [8, 9, 10]], max_new_tokens=3, stop_at_eos=False).token_ids
    for prompts in (np.array([[5, 6, 7], [8, 9, 10]]), [np.array([5, 6, 7]), np.array([8, 9, 10])]):
        assert llm.generate(prompts, max_new_tokens=3, stop_at_eos=False, batching="one_at_a_time").token_ids == ref
    assert llm.generate(np.array([5, 6, 7]), max_new_tokens=3, stop_at_eos=False,
                        batching="one_at_a_time").token_ids == ref[:1]


def test_finish_reason_is_one_of_the_documented_values(llm):
    eos = llm.generate([5, 6, 7], max_new_tokens=3, stop_at_eos=False).token_ids[0][0]
    llm.config.eos_token_id, before = eos, llm.config.eos_token_id
    try:
        prompts = [[5, 6, 7], [9, 9, 9, 9]]
        solo = [llm.generate(p, max_new_tokens=3).finish_reason for p in prompts]
        assert set(solo) == {"eos", "length"}, solo  # one row stops at EOS, the other does not
        for mode in ("one_at_a_time", "continuous"):
            g = llm.generate(prompts, max_new_tokens=3, batching=mode)
            assert g.finish_reason == "length" and [r["finish_reason"] for r in g.extra["requests"]] == solo
        assert llm.generate([prompts[0]] * 2, max_new_tokens=3, batching="one_at_a_time").finish_reason == "eos"
    finally:
        llm.config.eos_token_id = before


def test_a_seed_near_the_top_of_the_range_serves_every_request():
    import numpy as np

    llm = LLM(tiny_model(seed=3), name="tiny")
    g = llm.generate(PROMPTS[:3], max_new_tokens=3, temperature=0.8, seed=2**64 - 1, batching="continuous")
    solo = llm.generate(PROMPTS[2], max_new_tokens=3, temperature=0.8, seed=1)  # request 2: (2**64 - 1 + 2) % 2**64
    assert g.token_ids[2] == solo.token_ids[0]
    seeded = llm.generate(PROMPTS[:2], max_new_tokens=3, temperature=0.8, seed=7, batching="continuous").token_ids
    for s in (np.int64(7), np.uint64(7), np.int32(7)):  # NumPy seeds: the same requests
        assert llm.generate(PROMPTS[:2], max_new_tokens=3, temperature=0.8, seed=s,
                            batching="continuous").token_ids == seeded
    for s in (2**70, -2**70):  # the seed given is checked before it wraps, as in every other mode
        with pytest.raises(ValueError, match=r"outside the range a torch generator takes"):
            llm.generate(PROMPTS[:2], max_new_tokens=3, temperature=0.8, seed=s, batching="continuous")


def test_static_batching_of_equal_length_prompts_reports_zero_padding(llm):
    g = llm.generate([[5, 6, 7], [8, 9, 10]], max_new_tokens=4, stop_at_eos=False, batching="static")
    assert g.prompt_lens == [3, 3] and g.padding.prompt_lens == (3, 3)
    batch = llm.generate([[5, 6, 7], [8, 9, 10]], max_new_tokens=4, stop_at_eos=False)
    assert g.padding.prompt_padded == 0 and g.token_ids == batch.token_ids
