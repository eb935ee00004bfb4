"""Continuous batching on a model (`llmlab.batching.engine`, `llmlab.batching.paged_batch`), fp32 on the CPU.

The main claim: under continuous batching — chunked prefill mixed with decodes, preemption forced by a tiny KV
pool, recompute on resumption — every request's greedy tokens equal its solo run (`llmlab.generate.generate` on a
contiguous KV cache) token for token, and a seeded sampled request equals its solo run with the same seed."""

import pytest
import torch

from llmlab.batching.engine import BatchEngine, pack_chunks
from llmlab.batching.paged_batch import PagedBatchView
from llmlab.cache.paged_cache import PagedKVCache
from llmlab.generate import generate
from tiny_models import tiny_model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small matrices on a shared CPU run fastest, and steadiest, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=64)


def prompts(n, seed=0, lo=1, hi=20, max_new=(1, 16)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (), generator=g))
        new = int(torch.randint(max_new[0], max_new[1] + 1, (), generator=g))
        out.append((torch.randint(0, 256, (length,), generator=g).tolist(), new))
    return out


def solo(model, prompt, max_new, **kw):
    return generate(model, prompt, max_new_tokens=max_new, **kw).token_ids[0]


@pytest.mark.parametrize("window", [None, 5])
def test_view_rows_at_their_own_positions_match_the_uncached_model(window):
    """Three sequences prefilled in chunks through views, then one (3, 1) decode batch with per-row positions:
    logits equal the model run on each whole sequence without a cache (a sliding window too)."""
    m = tiny_model(max_seq_len=64, sliding_window=window)
    pool = PagedKVCache(m.config, 3, 32, torch.float32, "cpu", block_size=4, num_blocks=20)
    seqs = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 11, 17)]
    with torch.no_grad():
        for sid, s in enumerate(seqs):
            pool.blocks.allocate(sid, len(s))
            for start in range(0, len(s) - 1, 4):  # chunks of 4, the last token left for the decode batch
                n = min(4, len(s) - 1 - start)
                view = PagedBatchView(pool, [sid], [start], n)
                m(torch.tensor([s[start:start + n]]), view.positions, kv_cache=view)
        view = PagedBatchView(pool, [0, 1, 2], [len(s) - 1 for s in seqs], 1)
        assert view.positions.tolist() == [[5], [10], [16]]
        out = m(torch.tensor([[s[-1]] for s in seqs]), view.positions, kv_cache=view)[:, -1]  # (3, V)
        for b, s in enumerate(seqs):
            ref = m(torch.tensor([s]))[0, -1]
            torch.testing.assert_close(out[b], ref, atol=1e-4, rtol=1e-4)


def test_view_refuses_unreserved_tokens():
    m = tiny_model(max_seq_len=64)
    pool = PagedKVCache(m.config, 1, 32, torch.float32, "cpu", block_size=4, num_blocks=4)
    pool.blocks.allocate("a", 5)
    with pytest.raises(ValueError, match="reserve"):
        PagedBatchView(pool, ["a"], [4], 2)
    with pytest.raises(KeyError):
        PagedBatchView(pool, ["b"], [0], 1)


@pytest.mark.parametrize("window", [None, 5])
def test_left_padded_pass_of_chunks_of_different_lengths_matches_the_uncached_model(window):
    """Chunks of 3, 7 and 12 tokens (two fresh prompts, one after 5 cached tokens) in ONE left-padded (3, 12)
    pass: each row's last logits equal the model on the whole sequence, the padding wrote only the spare block,
    and a decode step after it sees exactly the real tokens."""
    m = tiny_model(max_seq_len=64, sliding_window=window)
    pool = PagedKVCache(m.config, 3, 32, torch.float32, "cpu", block_size=4, num_blocks=20, spare_blocks=1)
    seqs = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 8, 18)]
    starts, counts = [0, 0, 5], [3, 7, 12]  # each chunk ends one token before its sequence's last
    with torch.no_grad():
        for sid, s in enumerate(seqs):
            pool.blocks.allocate(sid, len(s))
        first = PagedBatchView(pool, [2], [0], 5)  # sequence 2's first 5 tokens are cached before the pass
        m(torch.tensor([seqs[2][:5]]), first.positions, kv_cache=first)
        view = PagedBatchView(pool, [0, 1, 2], starts, 12, counts)
        assert view.padding == 3 * 12 - sum(counts)
        assert view.positions[0].tolist() == [0] * 9 + [0, 1, 2]  # padding sits at the row's first position
        assert view.positions[2].tolist() == list(range(5, 17))
        ids = torch.tensor([[0] * (12 - n) + s[p:p + n] for s, p, n in zip(seqs, starts, counts)])
        out = m(ids, view.positions, kv_cache=view, last_only=True)[:, -1]
        for b, s in enumerate(seqs):
            ref = m(torch.tensor([s[:-1]]))[0, -1]
            torch.testing.assert_close(out[b], ref, atol=1e-4, rtol=1e-4)
        decode = PagedBatchView(pool, [0, 1, 2], [len(s) - 1 for s in seqs], 1)
        out = m(torch.tensor([[s[-1]] for s in seqs]), decode.positions, kv_cache=decode)[:, -1]
        for b, s in enumerate(seqs):
            torch.testing.assert_close(out[b], m(torch.tensor([s]))[0, -1], atol=1e-4, rtol=1e-4)


def test_left_padding_needs_a_spare_block_and_counts_within_T():
    m = tiny_model(max_seq_len=64)
    pool = PagedKVCache(m.config, 2, 32, torch.float32, "cpu", block_size=4, num_blocks=8)
    pool.blocks.allocate("a", 5)
    pool.blocks.allocate("b", 3)
    with pytest.raises(ValueError, match="spare_blocks=1"):
        PagedBatchView(pool, ["a", "b"], [0, 0], 5, [5, 3])
    with pytest.raises(ValueError, match="between 1 and T"):
        PagedBatchView(pool, ["a", "b"], [0, 0], 4, [5, 3])
    PagedBatchView(pool, ["a", "b"], [0, 0], 3, [3, 3])  # equal lengths: no padding, no spare block needed


def test_pack_chunks_and_the_view_refuse_bad_input():
    with pytest.raises(ValueError, match="n >= 1"):
        pack_chunks([("a", 0, 0)])
    with pytest.raises(ValueError, match="slack"):
        pack_chunks([("a", 0, 3)], slack=float("nan"))
    m = tiny_model(max_seq_len=64)
    pool = PagedKVCache(m.config, 2, 32, torch.float32, "cpu", block_size=4, num_blocks=8, spare_blocks=1)
    pool.blocks.allocate("a", 5)
    with pytest.raises(ValueError, match=">= 0"):
        PagedBatchView(pool, ["a"], [-1], 2)
    with pytest.raises(TypeError, match="whole numbers"):
        PagedBatchView(pool, ["a"], [0], 3, [2.0])


def test_pack_chunks_bounds_the_padding():
    """Longest first; each pass's padding within the slack of its real tokens; every chunk in exactly one pass."""
    g = torch.Generator().manual_seed(3)
    chunks = [(i, 0, int(n)) for i, n in enumerate(torch.randint(1, 513, (40,), generator=g))]
    for slack in (0.0, 0.25, 1.0):
        groups = pack_chunks(chunks, slack)
        assert sorted(c for grp in groups for c in grp) == sorted(chunks)
        for grp in groups:
            T, real = grp[0][2], sum(n for _, _, n in grp)
            assert all(n <= T for _, _, n in grp)
            assert len(grp) == 1 or len(grp) * T <= (1 + slack) * real
    assert len(pack_chunks(chunks, 0.25)) < len({n for _, _, n in chunks})  # fewer passes than distinct lengths
    assert len(pack_chunks([(0, 0, 300)] + [(i, 0, 1) for i in range(1, 9)], 0.25)) == 2  # decode rows apart


def test_greedy_outputs_equal_solo_under_preemption_and_chunked_prefill(model):
    reqs = prompts(10, seed=1)
    expected = [solo(model, p, n) for p, n in reqs]
    engine = BatchEngine(model, num_blocks=12, block_size=4, max_batch=6, token_budget=16, chunk=5, max_seq_len=40)
    seqs = [engine.add_request(p, n, stop_at_eos=False) for p, n in reqs]
    while engine.has_work():
        result = engine.step()
        for q in result.finished:  # a finished request leaves the batch, and gives back its blocks, that step
            assert q not in engine.scheduler.running and q.seq_id not in engine.pool.blocks.tables
        engine.scheduler.check()
    assert [q.output for q in seqs] == expected
    assert all(q.finish_reason == "length" for q in seqs)
    hist = list(engine.history)
    assert engine.counters["preemptions"] > 0 and sum(q.num_preemptions for q in seqs) > 0
    assert any(h.decode_rows and h.prefill_chunks for h in hist), "no step mixed decodes and prefill chunks"
    assert any(h.decode_rows > 1 for h in hist), "no step batched several decodes"
    assert engine.pool.blocks.num_free == 12 and not engine.pool.blocks.tables


def test_an_admission_delay_batches_arrivals_into_fewer_prefill_steps_with_the_same_tokens(model):
    """Requests arrive one per step while others decode. With admit_delay=10 (on a clock that moves 0.1 s per
    reading, a prefill step reads 0.1 s) an arrival waits a few steps and shares its prefill step with the ones that
    came meanwhile: fewer steps with a prefill, and every request still gets its solo tokens."""
    reqs = prompts(9, seed=4, max_new=(6, 12))
    expected = [solo(model, p, n) for p, n in reqs]
    steps_with_prefill = {}
    for delay in (0.0, 10.0):
        ticks = iter(range(10**6))
        engine = BatchEngine(model, block_size=4, max_batch=9, token_budget=64, chunk=64, max_seq_len=40,
                             clock=lambda: 0.1 * next(ticks), admit_delay=delay)
        seqs = []
        while len(seqs) < len(reqs) or engine.has_work():
            if len(seqs) < len(reqs):
                seqs.append(engine.add_request(*reqs[len(seqs)], stop_at_eos=False))  # one arrival per step
            assert engine.step().error is None
        assert [q.output for q in seqs] == expected
        steps_with_prefill[delay] = sum(1 for h in engine.history if h.prefill_chunks)
        assert engine.pool.blocks.num_free == engine.pool.num_blocks
    assert steps_with_prefill[0.0] == len(reqs) and steps_with_prefill[10.0] <= len(reqs) // 2
    with pytest.raises(ValueError, match="admit_delay=-1"):  # checked with the sizes, before the pool is allocated
        BatchEngine(model, num_blocks=10**9, admit_delay=-1)


def test_seeded_sampling_equals_its_solo_run(model):
    reqs = prompts(6, seed=2)
    settings = [dict(temperature=0.9, seed=10 + i, top_k=[None, 40][i % 2], top_p=[0.9, None][i % 2])
                for i in range(len(reqs))]
    expected = [solo(model, p, n, **kw) for (p, n), kw in zip(reqs, settings)]
    engine = BatchEngine(model, num_blocks=10, block_size=4, max_batch=4, token_budget=12, chunk=6, max_seq_len=40)
    seqs = [engine.add_request(p, n, stop_at_eos=False, **kw) for (p, n), kw in zip(reqs, settings)]
    engine.run_until_done()
    assert [q.output for q in seqs] == expected
    assert len({tuple(e) for e in expected}) > 1


def test_eos_ends_a_request_unless_told_not_to():
    m = tiny_model(max_seq_len=64)
    prompt = list(range(3, 12))
    free_run = solo(m, prompt, 12)
    eos = free_run[4]
    cut = free_run.index(eos) + 1
    m.config.eos_token_id = eos
    engine = BatchEngine(m, num_blocks=16, block_size=4, max_seq_len=40)
    stops = engine.add_request(prompt, 12)
    runs_on = engine.add_request(prompt, 12, stop_at_eos=False)
    engine.run_until_done()
    assert stops.output == free_run[:cut] and stops.finish_reason == "eos"
    assert runs_on.output == free_run and runs_on.finish_reason == "length"


def test_a_kv_budget_too_small_for_one_request_is_refused_at_start(model):
    with pytest.raises(ValueError, match=r"num_blocks=2 .*max_seq_len=40.*num_blocks >= 10"):
        BatchEngine(model, num_blocks=2, block_size=4, max_seq_len=40)
    with pytest.raises(ValueError, match="max_seq_len=65"):
        BatchEngine(model, max_seq_len=65)  # beyond the model's context of 64
    for name in ("num_blocks", "block_size", "max_batch", "token_budget", "chunk"):
        with pytest.raises(ValueError, match=name):
            BatchEngine(model, **{name: 0})


BAD_REQUESTS = [
    (dict(prompt_ids=[]), ValueError, "prompt"),
    (dict(prompt_ids=[1] * 64), ValueError, "prompt"),  # fills the model's context
    (dict(prompt_ids=[1] * 35, max_new_tokens=6), ValueError, "max_new_tokens"),  # beyond max_seq_len=40
    (dict(prompt_ids=[999]), ValueError, "vocabulary"),
    (dict(prompt_ids=[[1, 2], [3, 4]]), ValueError, "prompt"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=-3), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(seed=2 ** 70), ValueError, "seed"),
    (dict(stop_at_eos="no"), TypeError, "stop_at_eos"),
]


@pytest.mark.parametrize("bad, error, field", BAD_REQUESTS)
def test_bad_requests_name_the_field_and_the_engine_keeps_serving(model, bad, error, field):
    engine = BatchEngine(model, num_blocks=10, block_size=4, max_seq_len=40)
    good = engine.add_request([5, 6, 7], 4)
    engine.step()
    before = (dict(engine.scheduler.live), engine.pool.blocks.num_free, len(engine.history))
    args = dict(prompt_ids=[1, 2, 3], max_new_tokens=4) | bad
    with pytest.raises(error, match=field):
        engine.add_request(**args)
    assert (dict(engine.scheduler.live), engine.pool.blocks.num_free, len(engine.history)) == before
    engine.run_until_done()
    assert good.output == solo(model, [5, 6, 7], 4)


class Flaky(torch.nn.Module):
    """The model, failing on chosen forward calls (an injected fault)."""

    def __init__(self, inner, fail_calls, error=RuntimeError):
        super().__init__()
        self.inner, self.config, self.fail_calls, self.calls = inner, inner.config, set(fail_calls), 0
        self.error = error

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise self.error("injected fault")
        return self.inner(*args, **kwargs)


def test_a_failing_step_fails_its_requests_only_and_the_engine_serves_on(model):
    reqs = prompts(5, seed=3)
    flaky = Flaky(model, fail_calls={4})
    engine = BatchEngine(flaky, num_blocks=10, block_size=4, max_batch=4, token_budget=16, chunk=8, max_seq_len=40)
    seqs = [engine.add_request(p, n, stop_at_eos=False) for p, n in reqs]
    errors = []
    while engine.has_work():
        result = engine.step()
        if result.error is not None:
            errors.append(result)
            assert all(q.finish_reason == "error" and q.error is result.error for q in result.finished)
        engine.scheduler.check()
    assert len(errors) == 1 and engine.counters["errors"] == 1
    failed = {q.seq_id for q in errors[0].finished}
    assert failed
    for q, (p, n) in zip(seqs, reqs):
        if q.seq_id not in failed:
            assert q.finish_reason == "length" and q.output == solo(model, p, n)
    assert engine.pool.blocks.num_free == 10
    again = engine.add_request(reqs[0][0], reqs[0][1], stop_at_eos=False)  # still serving
    engine.run_until_done()
    assert again.output == solo(model, *reqs[0])


def test_an_interrupted_step_is_undone_and_runs_again(model):
    """Ctrl-C during a step (a notebook's interrupt): the step is forgotten, nothing is lost, and the next steps
    give every request its solo output."""
    reqs = prompts(5, seed=5)
    engine = BatchEngine(Flaky(model, fail_calls={3, 7}, error=KeyboardInterrupt), num_blocks=10, block_size=4,
                         max_batch=4, token_budget=10, chunk=4, max_seq_len=40)
    seqs = [engine.add_request(p, n, stop_at_eos=False) for p, n in reqs]
    interrupts = 0
    while engine.has_work():
        try:
            engine.step()
        except KeyboardInterrupt:
            interrupts += 1
        engine.scheduler.check()
    assert interrupts == 2 and engine.counters["errors"] == 0
    assert [q.output for q in seqs] == [solo(model, p, n) for p, n in reqs]
    assert engine.pool.blocks.num_free == 10


def test_cancel_frees_blocks_and_unknown_ids_are_refused(model):
    engine = BatchEngine(model, num_blocks=10, block_size=4, max_seq_len=40)
    a = engine.add_request([1, 2, 3, 4, 5], 8)
    engine.step()
    assert engine.pool.blocks.num_used > 0
    assert engine.cancel(a.seq_id).finish_reason == "cancelled"
    assert engine.pool.blocks.num_free == 10 and not engine.has_work()
    with pytest.raises(ValueError, match=f"seq_id={a.seq_id}"):
        engine.cancel(a.seq_id)
    with pytest.raises(ValueError, match="seq_id=12345"):
        engine.cancel(12345)


def test_add_takes_only_this_engines_requests_and_the_engine_keeps_serving(model):
    a, b = (BatchEngine(model, num_blocks=10, block_size=4, max_seq_len=40) for _ in range(2))
    with pytest.raises(ValueError, match="not made by this engine's make_request.*engine.make_request"):
        b.add(a.make_request([1, 2, 3], 4))  # a's ids would clash with b's own next one
    with pytest.raises(TypeError, match="add takes a Sequence.*add_request"):
        b.add([1, 2, 3])
    seq = b.add_request([1, 2, 3], 4)  # b's first id: nothing of a's is queued in b
    while b.has_work():
        b.step()
    assert seq.finish_reason == "length" and len(seq.output) == 4


def test_step_stats_add_up(model):
    reqs = prompts(8, seed=4)
    engine = BatchEngine(model, num_blocks=14, block_size=4, max_batch=5, token_budget=10, chunk=4, max_seq_len=40)
    for p, n in reqs:
        engine.add_request(p, n, stop_at_eos=False)
    engine.run_until_done()
    hist = list(engine.history)
    assert all(h.tokens == h.decode_rows + h.prefill_tokens <= 10 for h in hist)
    assert all(h.blocks_used + h.blocks_free == 14 and h.running <= 5 and h.ms >= 0 for h in hist)
    assert sum(h.sampled for h in hist) == sum(n for _, n in reqs) == engine.counters["sampled"]
    assert sum(h.finished for h in hist) == len(reqs)
    assert engine.counters["prefill_tokens"] >= sum(len(p) for p, _ in reqs)  # more if something was recomputed
    assert hist[-1].running == 0 and hist[-1].blocks_used == 0
    summary = engine.summary()
    assert 0 < summary["mean_budget_used"] <= 1 and summary["steps"] == len(hist)
