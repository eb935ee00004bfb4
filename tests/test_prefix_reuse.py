"""Multi-turn prefix reuse (`llmlab.cache.prefix_reuse`): keeping the previous turns' KV changes no output, and the
prefill shrinks to the new message."""

from __future__ import annotations

import pytest

from llmlab.cache.block_manager import BlockManager
from llmlab.cache.prefix_reuse import Conversation, compare_ttft
from tiny_models import prompt_ids, tiny_model

MESSAGES = [prompt_ids(1, n, seed=20 + n)[0].tolist() for n in (37, 9, 21)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_second_turn_output_equals_no_reuse(model):
    convs = {mode: Conversation(model, mode) for mode in ("none", "contiguous", "paged")}
    turns = {mode: [c.say(m, max_new_tokens=12) for m in MESSAGES] for mode, c in convs.items()}
    for i in range(len(MESSAGES)):
        assert turns["contiguous"][i].reply == turns["none"][i].reply == turns["paged"][i].reply
    assert len(set(turns["none"][1].reply)) > 3  # a varied reply: the equality means something
    # turn 2 of the contiguous cache prefills only the last reply token + the new message
    t2 = turns["contiguous"][1]
    assert t2.prefilled == len(MESSAGES[1]) + 1 and t2.reused == t2.prompt_tokens - t2.prefilled
    assert turns["none"][1].prefilled == turns["none"][1].prompt_tokens
    # the paged cache reuses whole 16-token blocks of the prefix
    p2 = turns["paged"][1]
    assert p2.reused % 16 == 0 and p2.reused >= t2.reused - 15 and p2.reused > 0


def test_paged_prefix_shared_across_conversations(model):
    """Two chats with the same opening share its blocks (same pool); the replies still match."""
    a = Conversation(model, "paged")
    a.say(MESSAGES[0], max_new_tokens=4)
    b_ref = Conversation(model, "none").say(MESSAGES[0][:33] + [5, 6, 7], max_new_tokens=6)
    bm: BlockManager = a.cache.blocks
    bm.free(0)
    hit = bm.allocate(1, MESSAGES[0][:33] + [5, 6, 7])
    assert hit == 32  # two full blocks of the common opening
    bm.free(1)
    bm.check()
    assert b_ref.reply


def test_compare_ttft_rows(model):
    rows = compare_ttft(model, MESSAGES[:2], max_new_tokens=4, repeats=1)
    assert {r["mode"] for r in rows} == {"none", "contiguous", "paged"}
    turn2 = {r["mode"]: r for r in rows if r["turn"] == 2}
    assert turn2["contiguous"]["prefilled"] < turn2["none"]["prefilled"]
    assert all(r["same_reply"] for r in rows)


def test_conversation_too_long(model):
    c = Conversation(model, "contiguous", max_seq_len=40)
    with pytest.raises(ValueError, match="beyond max_seq_len=40"):
        c.say(MESSAGES[0], max_new_tokens=8)
    context = model.config.max_seq_len
    for bad in (0, -1, context + 1, 40.0, True):  # 0 used to mean "the whole context" without a word
        with pytest.raises(ValueError, match=rf"max_seq_len={bad!r}: give a whole number of tokens from 1 to the "
                                             rf"model's context \({context}\)"):
            Conversation(model, "paged", max_seq_len=bad)
    assert Conversation(model, "none").max_seq_len == context


@pytest.mark.parametrize("mode", ["none", "contiguous", "paged"])
def test_a_turn_interrupted_in_its_prefill_leaves_nothing_to_reuse(model, mode):
    """Ctrl-C (or an error) inside a turn's prefill: the paged cache had already hashed the prompt's blocks, whose
    K/V were never written — the retried turn must not reuse them, and must reply as an uninterrupted one."""
    want = Conversation(model, "none").say(MESSAGES[0], max_new_tokens=8).reply
    conv = Conversation(model, mode)
    layer = model.layers[1]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    layer.forward = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            conv.say(MESSAGES[0], max_new_tokens=8)
    finally:
        del layer.forward
    turn = conv.say(MESSAGES[0], max_new_tokens=8)
    assert turn.reply == want
    assert turn.reused == 0  # nothing of the interrupted turn was reused
    if mode == "paged":
        conv.cache.blocks.check()


def test_bad_messages_and_lengths_are_refused_and_the_conversation_goes_on(model):
    conv = Conversation(model, "paged")
    for bad, err, says in (("hello", TypeError, "the prompt is 'hello'"), ([], ValueError, "the prompt is empty"),
                           ([10 ** 6], ValueError, "outside the model's vocabulary"),
                           ([-1], ValueError, "outside the model's vocabulary"),
                           ([[1, 2], [3, 4]], ValueError, "one sequence")):
        with pytest.raises(err, match=says):
            conv.say(bad, max_new_tokens=4)
    for n, err in ((0, ValueError), (-2, ValueError), (2.5, TypeError)):
        with pytest.raises(err, match="max_new_tokens"):
            conv.say(MESSAGES[1], max_new_tokens=n)
    assert conv.say(MESSAGES[1], max_new_tokens=4).reply == Conversation(model, "none").say(
        MESSAGES[1], max_new_tokens=4).reply


def test_a_message_as_an_array_tensor_or_generator(model):
    import numpy as np
    import torch

    want = Conversation(model, "none").say(MESSAGES[1], max_new_tokens=4).reply
    for message in (np.array(MESSAGES[1]), torch.tensor(MESSAGES[1]), (t for t in MESSAGES[1])):
        assert Conversation(model, "paged").say(message, max_new_tokens=4).reply == want
    with pytest.raises(TypeError, match="holds float32 values"):
        Conversation(model, "paged").say(torch.tensor(MESSAGES[1]).float(), max_new_tokens=4)


def test_a_list_of_eos_ids_stops_the_reply_and_an_llm_is_accepted(model):
    """Llama-3 style models list several EOS ids: a list was compared with each token as a whole and never
    stopped the reply."""
    from llmlab.engine import LLM

    free = Conversation(model, "none").say(MESSAGES[0], max_new_tokens=8).reply
    stop_at = free[2]
    for eos in (stop_at, [10**6, stop_at], (stop_at,)):
        reply = Conversation(model, "contiguous").say(MESSAGES[0], max_new_tokens=8, eos_token_id=eos).reply
        assert reply == free[:free.index(stop_at) + 1], (eos, reply)
    assert Conversation(LLM(model, name="tiny"), "paged").say(MESSAGES[0], max_new_tokens=8).reply == free
    with pytest.raises(TypeError, match="model is a str: give an llmlab Transformer or LLM"):
        Conversation("llama", "none")

