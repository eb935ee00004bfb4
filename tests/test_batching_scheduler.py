"""The continuous-batching scheduler alone (`llmlab.batching.scheduler`): plain Python, no model.

Each test plans steps and plays the model's part itself (a token for every sampled sequence), then checks the plan:
admission by free KV blocks, the token budget filled decode-first, chunked prefill, preemption by recompute and
resumption, requests leaving the batch the step they finish, cancellation. A seeded random loop runs thousands of
steps with submits and cancels against the invariants."""

import random

import pytest

from llmlab.batching.scheduler import FINISHED, RUNNING, WAITING, Scheduler, Sequence
from llmlab.cache.block_manager import BlockManager


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def make(num_blocks=8, block_size=4, **kw):
    return Scheduler(BlockManager(num_blocks, block_size), clock=FakeClock(), **kw)


def seq(i, prompt_len, max_new=4, eos=()):
    return Sequence(i, list(range(1, prompt_len + 1)), max_new, frozenset(eos))


def run_step(s: Scheduler, token=7):
    """Plan one step and finish it, every sampled sequence getting `token`. Returns (plan, finished)."""
    plan = s.schedule()
    finished = s.finish_step(plan, {q.seq_id: token for q in plan.sampled})
    s.check()
    return plan, finished


def test_admission_waits_for_free_blocks_first_come_first_served():
    s = make(num_blocks=4, block_size=4, token_budget=100, chunk=100)
    s.add(seq(0, 10))  # 3 blocks
    s.add(seq(1, 5))  # 2 blocks: does not fit beside the first
    s.add(seq(2, 1))  # 1 block would fit, but must not overtake seq 1
    plan = s.schedule()
    assert [(q.seq_id, start, n) for q, start, n in plan.prefill] == [(0, 0, 10)]
    assert [q.seq_id for q in s.waiting] == [1, 2]
    assert s.blocks.num_free == 1
    s.finish_step(plan, {0: 7})
    s.check()


def test_max_batch_limits_running_sequences():
    s = make(num_blocks=64, max_batch=2, token_budget=100, chunk=100)
    for i in range(4):
        s.add(seq(i, 3))
    plan, _ = run_step(s)
    assert len(s.running) == 2 and len(plan.prefill) == 2 and len(s.waiting) == 2


def test_chunked_prefill_under_the_token_budget_decodes_first():
    s = make(num_blocks=64, block_size=4, token_budget=6, chunk=4)
    s.add(seq(0, 2, max_new=10))
    run_step(s)  # seq 0 prefilled (2 tokens) and has its first token: in decode now
    s.add(seq(1, 11))
    plans = [run_step(s)[0] for _ in range(3)]
    for plan in plans:  # every step: seq 0's decode first, then a chunk of seq 1 in what is left of the budget
        assert [q.seq_id for q in plan.decode] == [0]
        assert plan.num_tokens <= 6
    assert [(start, n) for _, start, n in (p.prefill[0] for p in plans)] == [(0, 4), (4, 4), (8, 3)]
    assert [q.seq_id for q in plans[-1].sampled] == [0, 1]  # the last chunk gives seq 1 its first token
    assert s.live[1].output == [7] and s.live[1].num_computed == 11


def test_budget_caps_decodes_and_the_oldest_go_first():
    s = make(num_blocks=64, token_budget=2, chunk=8)
    for i in range(3):
        s.add(seq(i, 1, max_new=5))
    for _ in range(3):
        run_step(s)  # admissions, 2 tokens a step
    plan = s.schedule()
    assert [q.seq_id for q in plan.decode] == [0, 1] and not plan.prefill  # seq 2 waits: budget used up
    s.finish_step(plan, {0: 7, 1: 7})


def test_finished_sequences_leave_the_batch_and_free_their_blocks_that_step():
    s = make(num_blocks=8, block_size=4, token_budget=100, chunk=100)
    s.add(seq(0, 4, max_new=2))
    s.add(seq(1, 4, max_new=5, eos={9}))
    run_step(s)
    plan, finished = run_step(s, token=9)  # seq 0 reaches max_new_tokens, seq 1 samples its EOS
    assert {q.seq_id: q.finish_reason for q in finished} == {0: "length", 1: "eos"}
    assert not s.running and not s.live and s.blocks.num_free == 8
    assert all(q.status == FINISHED and q.finish_time is not None for q in finished)


def test_preemption_by_recompute_and_resumption():
    # 3 blocks of 2 tokens; two sequences of 2 prompt tokens fill 2 blocks; decoding, each needs a block at
    # every second token: the younger one is preempted, keeps its tokens, and is recomputed when it comes back
    s = make(num_blocks=3, block_size=2, token_budget=100, chunk=100)
    s.add(seq(0, 2, max_new=4))
    s.add(seq(1, 2, max_new=4))
    run_step(s, token=5)  # both prefilled: 2 blocks used, each has 1 output token
    plan, _ = run_step(s, token=6)  # both decode: seq 0 takes the last block, seq 1 has none
    assert [q.seq_id for q in plan.decode] == [0]
    assert [q.seq_id for q in plan.preempted] == [1]
    younger = plan.preempted[0]
    assert younger.status == WAITING and younger.num_computed == 0 and younger.output == [5]
    assert younger.num_preemptions == 1 and s.num_preemptions == 1
    assert list(s.waiting) == [younger]  # back at the front of the queue
    while 0 in s.live:
        run_step(s, token=6)
    plan = s.schedule()  # seq 1 back: its prompt + its one output token are prefilled again, then it samples
    assert [(q.seq_id, start, n) for q, start, n in plan.prefill] == [(1, 0, 3)]
    assert plan.sampled == [younger]
    s.finish_step(plan, {1: 8})
    assert younger.output == [5, 8] and younger.status == RUNNING and younger.admitted_time is not None


def test_a_sequence_preempted_this_step_is_not_readmitted_in_it():
    s = make(num_blocks=3, block_size=2, token_budget=100, chunk=100)
    s.add(seq(0, 2, max_new=4))
    s.add(seq(1, 2, max_new=4))
    run_step(s)
    plan = s.schedule()
    assert plan.preempted and all(q.status == WAITING for q in plan.preempted)
    assert not any(q in plan.preempted for q, _, _ in plan.prefill)
    s.finish_step(plan, {q.seq_id: 1 for q in plan.sampled})


def test_cancel_waiting_and_running():
    s = make(num_blocks=4, block_size=4, token_budget=100, chunk=100)
    s.add(seq(0, 8))
    s.add(seq(1, 8))
    s.add(seq(2, 8))
    run_step(s)  # 0 and 1 run, 2 waits
    assert s.cancel(2).finish_reason == "cancelled" and not s.waiting
    assert s.cancel(0).status == FINISHED and s.blocks.num_free == 2
    s.check()
    with pytest.raises(KeyError, match="seq_id=0"):
        s.cancel(0)  # already finished
    with pytest.raises(KeyError, match="seq_id=99"):
        s.cancel(99)


def test_cancel_and_schedule_refused_while_a_plan_is_open():
    s = make()
    s.add(seq(0, 3))
    plan = s.schedule()
    with pytest.raises(RuntimeError, match="finish_step"):
        s.cancel(0)
    with pytest.raises(RuntimeError, match="finish_step"):
        s.schedule()
    with pytest.raises(ValueError, match="one token for each sampled"):
        s.finish_step(plan, {})  # refused: nothing recorded, the plan stays open
    assert s.live[0].num_computed == 0
    s.finish_step(plan, {0: 1})


def test_abort_step_fails_the_planned_sequences_only():
    s = make(num_blocks=16, block_size=4, token_budget=4, chunk=4)
    s.add(seq(0, 4))
    s.add(seq(1, 8))  # admitted, but the budget is spent on seq 0
    plan = s.schedule()
    err = RuntimeError("boom")
    failed = s.abort_step(plan, err)
    assert [q.seq_id for q in failed] == [0] and failed[0].finish_reason == "error" and failed[0].error is err
    s.check()
    run_step(s)  # the scheduler goes on with seq 1
    assert s.live[1].status == RUNNING


def test_add_refuses_duplicates_and_used_sequences():
    s = make()
    s.add(seq(0, 3))
    with pytest.raises(ValueError, match="seq_id=0"):
        s.add(seq(0, 3))
    used = seq(1, 3)
    used.output.append(4)
    with pytest.raises(ValueError, match="not new"):
        s.add(used)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add(seq(2, 3, max_new=0))


@pytest.mark.parametrize("field", ["max_batch", "token_budget", "chunk"])
def test_sizes_are_checked_by_name(field):
    with pytest.raises(ValueError, match=field):
        make(**{field: 0})
    with pytest.raises(TypeError, match=field):
        make(**{field: 2.5})


class ManualClock:
    """A clock that moves only when the test says."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_admit_delay_holds_arrivals_while_others_decode_then_prefills_them_together():
    """With admit_delay=2, a request that arrives while another decodes waits until it has waited twice the last
    prefill step's time (10 s here); the requests that arrived meanwhile join it in one prefill step."""
    clock = ManualClock()
    s = Scheduler(BlockManager(64, 4), clock=clock, token_budget=100, chunk=100, admit_delay=2)
    s.add(seq(0, 5, max_new=50))
    plan = s.schedule()  # nothing decodes: admitted at once
    assert [q.seq_id for q, _, _ in plan.prefill] == [0]
    clock.t = 10.0  # the prefill step took 10 s
    s.finish_step(plan, {0: 7})
    assert s.prefill_s == 10.0
    s.add(seq(1, 3))  # arrives at t=10
    for t in (10.0, 15.0, 29.9):  # waited less than 2 x 10 s: seq 0 decodes alone
        clock.t = t
        plan = s.schedule()
        assert [q.seq_id for q in plan.decode] == [0] and not plan.prefill
        s.finish_step(plan, {0: 7})
        if t == 15.0:
            s.add(seq(2, 4))  # a later arrival queues behind it
    clock.t = 30.0
    plan = s.schedule()  # seq 1 has waited 20 s: it and seq 2 are prefilled in this step, beside seq 0's decode
    assert [q.seq_id for q in plan.decode] == [0]
    assert [(q.seq_id, start, n) for q, start, n in plan.prefill] == [(1, 0, 3), (2, 0, 4)]
    s.finish_step(plan, {0: 7, 1: 7, 2: 7})
    s.check()


def test_admit_delay_zero_admits_at_once_and_bad_values_are_named():
    clock = ManualClock()
    s = Scheduler(BlockManager(64, 4), clock=clock, token_budget=100, chunk=100)
    s.add(seq(0, 5, max_new=50))
    clock.t = 10.0
    s.finish_step(s.schedule(), {0: 7})
    s.add(seq(1, 3))
    plan = s.schedule()
    assert [q.seq_id for q in plan.decode] == [0] and [q.seq_id for q, _, _ in plan.prefill] == [1]
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="admit_delay"):
            make(admit_delay=bad)
    for bad in (True, "1", None):
        with pytest.raises(TypeError, match="admit_delay"):
            make(admit_delay=bad)


def test_metrics_times_are_ordered():
    s = make(num_blocks=8, token_budget=100, chunk=100)
    q = seq(0, 3, max_new=3)
    s.add(q)
    while s.has_work():
        run_step(s)
    assert q.arrival_time < q.admitted_time < q.first_token_time < q.last_token_time <= q.finish_time


def _stress(seed: int) -> int:
    """A seeded stress: random prompts, submits and cancels on a tiny pool (preemptions are frequent). Every
    request finishes exactly once (eos / length / cancelled), each plan stays within the budget and never runs a
    sequence twice, a sequence's tokens are what it was given, and every block is free at the end. Returns the
    number of preemptions."""
    rng = random.Random(seed)
    block_size, max_len = rng.choice([1, 2, 4]), 24
    s = make(num_blocks=-(-max_len // block_size) + rng.randint(0, 4), block_size=block_size,
             max_batch=rng.randint(1, 6), token_budget=rng.randint(1, 12), chunk=rng.randint(1, 8))
    seqs, finishes, next_id, preemptions = {}, {}, 0, 0
    for _ in range(600):
        r = rng.random()
        if r < 0.25 and next_id < 80:
            n = rng.randint(1, 12)
            q = seq(next_id, n, max_new=rng.randint(1, max_len - n), eos={rng.randint(0, 30)})
            s.add(q)
            seqs[next_id] = q
            next_id += 1
        elif r < 0.32 and s.live:
            sid = rng.choice(sorted(s.live))
            finishes[sid] = finishes.get(sid, 0) + 1
            assert s.cancel(sid).finish_reason == "cancelled"
        plan = s.schedule()
        assert plan.num_tokens <= s.token_budget
        ids = [q.seq_id for q in plan.decode] + [q.seq_id for q, _, _ in plan.prefill]
        assert len(ids) == len(set(ids)), "a sequence planned twice in one step"
        assert all(n <= s.chunk for _, _, n in plan.prefill)
        preemptions += len(plan.preempted)
        tokens = {q.seq_id: rng.randint(0, 30) for q in plan.sampled}
        expected = {sid: seqs[sid].output + [t] for sid, t in tokens.items()}
        for q in s.finish_step(plan, tokens):
            finishes[q.seq_id] = finishes.get(q.seq_id, 0) + 1
        for sid, out in expected.items():
            assert seqs[sid].output == out
        s.check()
    while s.has_work():  # drain
        plan = s.schedule()
        for q in s.finish_step(plan, {q.seq_id: rng.randint(0, 30) for q in plan.sampled}):
            finishes[q.seq_id] = finishes.get(q.seq_id, 0) + 1
        s.check()
    assert finishes == {sid: 1 for sid in seqs}, "a request finished more or less than once"
    assert all(q.finish_reason in ("eos", "length", "cancelled") for q in seqs.values())
    assert all(q.finish_reason != "length" or len(q.output) == q.max_new_tokens for q in seqs.values())
    assert s.blocks.num_free == s.blocks.num_blocks and not s.blocks.tables
    return preemptions


def test_random_submits_cancels_and_preemptions_keep_every_invariant():
    preemptions = [_stress(seed) for seed in range(8)]
    assert sum(preemptions) > 0, "the stress never preempted: it would not test resumption"
