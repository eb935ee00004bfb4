"""Static batching (llmlab.batching.static): prompts of different lengths left-padded into one batch.

The main claim: at fp32 on a CPU, every request's greedy tokens in a padded static batch equal the tokens it gets
alone (`llmlab.generate.generate`), token for token — on the shipped model, on tiny random models (with a sliding
window too), and against Hugging Face `generate` with left padding. The would-fail test shows that the same batch
with shared positions 0..T-1 (RoPE not restarted per row, pads visible) changes the logits.
"""

from __future__ import annotations

import pytest
import torch

import llmlab
from llmlab.batching.static import (PaddingStats, StaticGeneration, generate_static, is_ragged, left_pad,
                                    position_ids)
from llmlab.cache.static_cache import StaticKVCache
from llmlab.checkpoint import load_model
from llmlab.generate import generate
from llmlab.runtime.cuda_graphs import RunnerCache
from tiny_models import hf_model, tiny_model

LENGTHS = (3, 17, 40)


def random_prompts(vocab: int, lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def llm():
    return llmlab.load(device="cpu")


# -- the two pieces: left padding and per-row positions ------------------------------------------------------------


def test_left_pad_shapes_and_values():
    ids, mask = left_pad([[5, 6, 7], [1, 2, 3, 4, 5], [9]], pad_id=42)
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool and ids.shape == mask.shape == (3, 5)
    assert ids.tolist() == [[42, 42, 5, 6, 7], [1, 2, 3, 4, 5], [42, 42, 42, 42, 9]]
    assert mask.sum(dim=1).tolist() == [3, 5, 1]
    assert (ids[~mask] == 42).all() and mask[:, -1].all()  # every row ends on a real token


def test_position_ids_restart_per_row_and_park_pads_after_the_prompt():
    _, mask = left_pad([[5, 6, 7], [1, 2, 3, 4, 5], [9]])
    pos = position_ids(mask)
    assert pos.dtype == torch.int64 and pos.shape == (3, 5)
    assert pos.tolist() == [[3, 4, 0, 1, 2], [0, 1, 2, 3, 4], [1, 2, 3, 4, 0]]
    for row, m in zip(pos, mask):
        L = int(m.sum())
        assert row[m].tolist() == list(range(L))  # real tokens: the positions they have alone
        assert sorted(row.tolist()) == list(range(5))  # pads: distinct slots, none a real token's
    assert torch.equal(position_ids(mask.long()), pos)  # 0/1 integers work too


def test_position_ids_refuses_right_padding_and_bad_shapes():
    with pytest.raises(ValueError, match="not left-padded"):
        position_ids(torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        position_ids(torch.ones(4, dtype=torch.bool))


def test_shared_positions_would_change_the_short_rows(tiny):
    """The teeth: the padded prefill with position_ids gives each row its solo logits (1e-4); with positions 0..T-1
    shared by all rows (no per-row RoPE start, pads in slots the real tokens read) the short rows' logits move."""
    prompts = random_prompts(256)
    ids, mask = left_pad(prompts)
    B, T = ids.shape
    outs = {}
    for name, pos in (("per_row", position_ids(mask)), ("shared", torch.arange(T))):
        cache = StaticKVCache(tiny.config, B, T + 1, torch.float32, "cpu")
        with torch.no_grad():
            outs[name] = tiny(ids, pos, kv_cache=cache, last_only=True)[:, -1]
    with torch.no_grad():
        solo = torch.cat([tiny(torch.tensor([p]), last_only=True)[:, -1] for p in prompts])
    assert (outs["per_row"] - solo).abs().max() < 1e-4
    assert (outs["shared"][:2] - solo[:2]).abs().max() > 1e-1  # rows 0 and 1 are padded
    assert (outs["shared"][2] - solo[2]).abs().max() < 1e-4  # the longest row has no pads


# -- padded batch == solo, token for token ------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 8}], ids=["llama3-rope", "sliding-window"])
def test_padded_batch_equals_solo_tiny(overrides):
    model = tiny_model(seed=0, **overrides)
    prompts = random_prompts(256)
    g = generate_static(model, prompts, max_new_tokens=24)
    assert isinstance(g, StaticGeneration) and g.prompt_lens == list(LENGTHS) and g.prompt_len == max(LENGTHS)
    for p, got in zip(prompts, g.token_ids):
        assert got == generate(model, p, max_new_tokens=24).token_ids[0]
    assert all(len(set(t)) > 3 for t in g.token_ids)  # not one repeated token


def test_padded_batch_equals_solo_default_model(llm):
    prompts = random_prompts(llm.config.vocab_size, seed=2)
    g = generate_static(llm, prompts, max_new_tokens=16)
    for p, got in zip(prompts, g.token_ids):
        assert got == generate(llm.model, p, max_new_tokens=16).token_ids[0]


def test_greedy_equals_transformers_generate_left_padded(tmp_path):
    """Hugging Face `generate` on the same weights, its own left padding and attention mask: the same tokens."""
    hf = hf_model("llama", seed=0)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    prompts = random_prompts(256, seed=3)
    ids, mask = left_pad(prompts)
    n = 16
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask.long(), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    g = generate_static(ours, prompts, max_new_tokens=n)
    assert g.token_ids == theirs[:, ids.shape[1]:].tolist()


def test_reused_runner_with_a_poisoned_cache_still_equals_solo(tiny):
    """On a `RunnerCache` runner (the GPU modes' path, here its eager "static" mode) the batch runs in the rows it
    needs of a larger cache left dirty by an earlier request: NaN there would poison every row (-inf + NaN) unless
    the rows are cleared before the prefill."""
    runners = RunnerCache()
    prompts = random_prompts(256)
    generate_static(tiny, prompts + [[1, 2]], max_new_tokens=4, runners=runners)
    runner = runners["static"]
    for t in runner.cache.k + runner.cache.v:
        t.fill_(float("nan"))
    g = generate_static(tiny, prompts, max_new_tokens=12, runners=runners)
    assert runners["static"] is runner and runner.max_batch > len(prompts)  # reused, rows 0..2 of 4
    for p, got in zip(prompts, g.token_ids):
        assert got == generate(tiny, p, max_new_tokens=12).token_ids[0]


# -- EOS, sampling, callbacks -------------------------------------------------------------------------------------


def test_eos_per_row_matches_solo_and_counts_the_waste(tiny):
    prompts = random_prompts(256)
    free = generate_static(tiny, prompts, max_new_tokens=20).token_ids
    eos = free[0][3]  # row 0 ends at its 4th token (or earlier); the other rows at theirs, if any
    g = generate_static(tiny, prompts, max_new_tokens=20, eos_token_id=eos)
    for p, got in zip(prompts, g.token_ids):
        assert got == generate(tiny, p, max_new_tokens=20, eos_token_id=eos).token_ids[0]
    assert len(g.token_ids[0]) <= 4 and g.token_ids[0][-1] == eos
    s = g.padding
    assert s.new_tokens == tuple(len(t) for t in g.token_ids)
    assert s.decode_steps == max(s.new_tokens) - 1 == len(g.step_ms) - 1
    assert s.decode_wasted == sum(max(s.new_tokens) - n for n in s.new_tokens) > 0
    assert g.finish_reason == ("eos" if all(t[-1] == eos for t in g.token_ids) else "length")


def test_finished_rows_keep_being_computed_until_all_end(tiny):
    """Every row's token is reported every step (on_token), the finished rows' too: the static batch's waste."""
    prompts = random_prompts(256)
    eos = generate_static(tiny, prompts, max_new_tokens=8).token_ids[1][0]  # row 1 ends at its first token
    seen = []
    g = generate_static(tiny, prompts, max_new_tokens=8, eos_token_id=eos, on_token=lambda s, t: seen.append(t))
    assert g.token_ids[1] == [eos] and len(seen) == len(g.step_ms) and all(len(t) == 3 for t in seen)
    stopped = generate_static(tiny, prompts, max_new_tokens=8, on_token=lambda s, t: s == 2)
    assert stopped.finish_reason == "stopped" and all(len(t) == 3 for t in stopped.token_ids)


def test_sampled_batch_is_reproducible_with_a_seed(tiny):
    prompts = random_prompts(256)
    a = generate_static(tiny, prompts, max_new_tokens=12, temperature=1.0, top_k=50, seed=7).token_ids
    b = generate_static(tiny, prompts, max_new_tokens=12, temperature=1.0, top_k=50, seed=7).token_ids
    c = generate_static(tiny, prompts, max_new_tokens=12, temperature=1.0, top_k=50, seed=8).token_ids
    assert a == b and a != c


# -- low precision ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("which", ["tiny", "default"])
def test_low_precision_padded_batch_is_finite(dtype, which, llm):
    """bf16 and fp16 both run on a CPU in torch 2.13 (matmul and SDPA): every position's logits of the padded
    prefill (the pads' too) and of a few decode steps are finite, and generate_static runs."""
    model = tiny_model(seed=0).to(dtype) if which == "tiny" else llm.to(dtype=dtype).model
    prompts = random_prompts(model.config.vocab_size)
    ids, mask = left_pad(prompts)
    B, T = ids.shape
    cache = StaticKVCache(model.config, B, T + 4, dtype, "cpu")
    pos = position_ids(mask)
    with torch.no_grad():
        logits = model(ids, pos, kv_cache=cache)  # (B, T, V): pads included
        assert logits.dtype == dtype and torch.isfinite(logits).all()
        token = logits[:, -1].argmax(-1)
        step = mask.sum(dim=1)  # each row's next position
        for _ in range(3):
            logits = model(token[:, None], step[:, None], kv_cache=cache)
            assert torch.isfinite(logits).all()
            token, step = logits[:, -1].argmax(-1), step + 1
    g = generate_static(model, prompts, max_new_tokens=6)
    assert g.dtype == str(dtype).removeprefix("torch.")
    assert all(len(t) == 6 and 0 <= min(t) and max(t) < model.config.vocab_size for t in g.token_ids)


# -- the waste's arithmetic ---------------------------------------------------------------------------------------


def test_padding_stats_known_case():
    # rows of 3 and 5 prompt tokens; row 0 ends after 2 tokens, row 1 after 4; prefill 10 ms, decode 1, 2, 3 ms
    s = PaddingStats(prompt_lens=(3, 5), new_tokens=(2, 4), step_ms=(10.0, 1.0, 2.0, 3.0))
    assert (s.batch, s.padded_len, s.prompt_slots, s.prompt_useful, s.prompt_padded) == (2, 5, 10, 8, 2)
    assert (s.decode_steps, s.decode_slots, s.decode_useful, s.decode_wasted) == (3, 6, 4, 2)
    assert s.useful_share == pytest.approx(12 / 16)
    assert (s.prefill_ms, s.decode_ms) == (10.0, 6.0)
    assert s.padded_prefill_ms == pytest.approx(10.0 * 2 / 10)
    assert s.wasted_decode_ms == pytest.approx(2.0 / 2 + 3.0 / 2)  # row 0 is done in steps 2 and 3
    assert s.wasted_time_share == pytest.approx((2.0 + 2.5) / 16.0)
    assert s.summary()["decode_wasted"] == 2 and "useful share 75.0%" in str(s)


def test_padding_stats_refuses_impossible_counts():
    with pytest.raises(ValueError, match="one entry per row"):
        PaddingStats((3, 5), (2,), (1.0, 1.0))
    with pytest.raises(ValueError, match="impossible"):
        PaddingStats((3,), (3,), (1.0, 1.0))
    with pytest.raises(ValueError, match="step_ms"):
        PaddingStats((3,), (1,), ())


def test_no_padding_no_waste(tiny):
    prompts = random_prompts(256, lengths=(9, 9))
    s = generate_static(tiny, prompts, max_new_tokens=5).padding
    assert s.prompt_padded == 0 and s.decode_wasted == 0 and s.useful_share == 1.0 and s.wasted_ms == 0.0


# -- LLM.generate routes prompts of different lengths here --------------------------------------------------------


def test_is_ragged():
    assert is_ragged([[1, 2], [3]]) and is_ragged(([1], (2, 3)))
    assert not is_ragged([[1, 2], [3, 4]]) and not is_ragged([1, 2, 3]) and not is_ragged([[1, 2]])
    assert not is_ragged(torch.ones(2, 3)) and not is_ragged("ab")


def test_llm_generate_runs_ragged_prompts_as_one_static_batch(llm):
    prompts = [llm.encode("The list"), llm.encode("import os and then a few more words"), llm.encode("A")]
    assert is_ragged(prompts)
    g = llm.generate(prompts, max_new_tokens=12)
    assert isinstance(g, StaticGeneration) and g.padding.batch == 3 and len(g.texts) == 3
    for p, got, text in zip(prompts, g.token_ids, g.texts):
        solo = llm.generate(p, max_new_tokens=12)
        assert got == solo.token_ids[0] and text == solo.text  # EOS handled as alone (stop_at_eos)
    with pytest.raises(ValueError, match="use_cache=False"):
        llm.generate(prompts, max_new_tokens=4, use_cache=False)


# -- bad input: errors name the field, the engine stays usable ----------------------------------------------------


@pytest.mark.parametrize("prompts, kwargs, error, field", [
    ([], {}, ValueError, "prompts is empty"),
    ([[1, 2], []], {}, ValueError, r"prompts\[1\] is empty"),
    ([[1], [1] * 300], {}, ValueError, r"prompts\[1\] has 300 tokens"),
    ([[1], list(range(1, 250))], {"max_new_tokens": 10}, ValueError, r"prompts\[1\].*max_new_tokens"),
    ([[1], [2, 3]], {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ([[1], [2, 3]], {"max_new_tokens": -3}, ValueError, "max_new_tokens"),
    ([[1], [2, 3]], {"max_new_tokens": 2.5}, TypeError, "max_new_tokens"),
    ([[1], [2, 999]], {}, ValueError, r"prompts\[1\] holds token id 999"),
    ([[1], [2.0, 3.0]], {}, TypeError, r"prompts\[1\]"),
    ([[1], "ab"], {}, TypeError, r"prompts\[1\]"),
    ([[1], [2, 3]], {"pad_id": 256}, ValueError, "pad_id"),
    ([[1], [2, 3]], {"mode": "fast"}, ValueError, "mode"),
    ([[1], [2, 3]], {"mode": "graphs"}, ValueError, "CUDA"),
])
def test_bad_input_names_the_field(tiny, prompts, kwargs, error, field):
    with pytest.raises(error, match=field):
        generate_static(tiny, prompts, **{"max_new_tokens": 4, **kwargs})
    assert generate_static(tiny, [[1, 2, 3], [4]], max_new_tokens=2).padding.batch == 2  # still usable


def test_llm_generate_bad_ragged_input_leaves_it_usable(llm):
    C = llm.config.max_seq_len
    with pytest.raises(ValueError, match=r"prompts\[1\] has"):
        llm.generate([[1, 2], [3] * (C + 5)], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate([[1, 2], [3, 4, 5]], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        llm.generate([[], [3, 4, 5]], max_new_tokens=3)
    assert len(llm.generate([[5, 6], [7, 8, 9]], max_new_tokens=3).token_ids) == 2


def test_a_list_of_texts_runs_as_a_batch_with_one_text_per_row(llm):
    texts = ["def fibonacci(n):", "class Stack:", "import os"]
    g = llm.generate(texts, max_new_tokens=6, stop_at_eos=False)
    solo = [llm.generate(t, max_new_tokens=6, stop_at_eos=False) for t in texts]
    assert g.token_ids == [s.token_ids[0] for s in solo]
    assert g.texts == [s.text for s in solo]
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["def f():", "   "])
    assert llm.generate(texts[:1], max_new_tokens=2).texts
