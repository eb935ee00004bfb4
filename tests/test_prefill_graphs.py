"""Fixed-shape prefill passes of the continuous-batching engine (`llmlab.batching.prefill_graphs`).

Claims, at fp32: an engine whose prefill chunks run as bucketed fixed-shape passes gives every request the same
greedy tokens as the engine's variable-shape passes, token for token, with chunked prefill and with preemption,
and frees every block; the padding rows and tokens of a pass write only the pool's spare block; each chunk lands in
the smallest token bucket that holds it, exactly once; bad input is refused by name. On a GPU (marked `gpu`) the
buckets are captured as CUDA graphs and the replays give the same tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmlab.batching.engine import BatchEngine
from llmlab.batching.prefill_graphs import PagedPrefillBatch, PagedPrefillGraphs, token_buckets
from llmlab.cache.paged_cache import PagedKVCache
from tiny_models import tiny_model

SETTINGS = dict(max_batch=6, token_budget=128, chunk=40, max_seq_len=128)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def requests(model, n=10, seed=0):
    """n prompts of 1..90 tokens (so chunk=40 splits the long ones) and 1..20 new tokens each."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(1, 90))], rng.randint(1, 20)) for _ in range(n)]


def serve(model, reqs, **kw):
    engine = BatchEngine(model, **{**SETTINGS, **kw})
    seqs = [engine.add_request(p, n, stop_at_eos=False) for p, n in reqs]
    engine.run_until_done()
    return [s.output for s in seqs], engine


def test_token_buckets_double_from_16_up_to_the_chunk():
    assert token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert token_buckets(100) == (16, 32, 64, 100)
    assert token_buckets(16) == (16,)
    assert token_buckets(8) == (8,)
    with pytest.raises(ValueError, match="chunk=0"):
        token_buckets(0)


def test_each_chunk_lands_once_in_the_smallest_bucket_that_holds_it(model):
    pool = PagedKVCache(model.config, 4, 128, torch.float32, "cpu", block_size=16, spare_blocks=1)
    graphs = PagedPrefillGraphs(model, pool, chunk=100, token_budget=256, max_rows=8, width=8, cuda_graphs=False)
    assert graphs.buckets == {16: (1, 2, 4, 8), 32: (1, 2, 4, 8), 64: (1, 2, 4), 100: (1, 2)}
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 30))]
        seen = []
        for idx, B, T in graphs.plan(lengths):
            assert B in graphs.buckets[T] and len(idx) <= B and (B == 1 or B * T <= 256)
            for i in idx:
                assert T == min(t for t in graphs.buckets if t >= lengths[i])  # the smallest that holds it
            seen += idx
        assert sorted(seen) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="a chunk of 101 tokens"):
        graphs.plan([5, 101])


def test_fixed_shape_prefill_gives_the_variable_shape_tokens(model):
    reqs = requests(model)
    want, _ = serve(model, reqs)
    got, engine = serve(model, reqs, prefill_graphs=True)
    assert engine.prefill is not None and not engine.prefill.graphs  # a CPU: the same passes, eagerly
    assert got == want
    assert engine.pool.blocks.num_free == engine.pool.num_blocks  # every block back in the pool


def test_fixed_shape_prefill_with_preemption_gives_the_same_tokens(model):
    reqs = requests(model, seed=2)
    want, _ = serve(model, reqs)
    got, engine = serve(model, reqs, prefill_graphs=True, num_blocks=10)  # 160 slots: preemptions
    assert engine.counters["preemptions"] > 0
    assert got == want
    assert engine.pool.blocks.num_free == engine.pool.num_blocks


def test_padding_rows_and_tokens_write_only_the_spare_block(model):
    pool = PagedKVCache(model.config, 4, 64, torch.float32, "cpu", block_size=16, spare_blocks=1)
    pool.blocks.allocate("a", 20)  # two blocks
    table = pool.blocks.block_table("a")
    for k in pool.k + pool.v:
        k.normal_()
    before = [k.clone() for k in pool.k + pool.v]
    graphs = PagedPrefillGraphs(model, pool, chunk=32, token_budget=128, max_rows=4, width=4, cuda_graphs=False)
    graphs.run([(list(range(1, 21)), 0, table)], B=4, T=32)  # 12 padding tokens in the row, 3 padding rows
    written = set(table) | {pool.spare[0]}
    for old, new in zip(before, pool.k + pool.v):
        for blk in range(pool.num_blocks):
            if blk not in written:
                assert torch.equal(old[blk], new[blk]), f"block {blk} changed"
        assert not torch.equal(old[table[0]], new[table[0]])  # the real tokens were written


def test_bad_passes_are_refused_by_name(model):
    pool = PagedKVCache(model.config, 2, 64, torch.float32, "cpu", block_size=16, spare_blocks=1)
    batch = PagedPrefillBatch(pool, max_rows=2, max_tokens=32, width=4)
    with pytest.raises(ValueError, match="3 rows in a bucket of 2"):
        batch.fill([([1], 0, [0])] * 3, 2, 16)
    with pytest.raises(ValueError, match="17 new tokens in a bucket of 16"):
        batch.fill([([1] * 17, 0, [0, 1])], 1, 16)
    with pytest.raises(ValueError, match="block table of 1 blocks"):
        batch.fill([([1] * 4, 14, [0])], 1, 16)  # tokens 14..17 need a second block
    with pytest.raises(ValueError, match="does not fit the buffers"):
        batch.use(3, 16)
    bare = PagedKVCache(model.config, 2, 64, torch.float32, "cpu", block_size=16)
    with pytest.raises(ValueError, match="spare_blocks=1"):
        PagedPrefillBatch(bare, 2, 16, 4)
    with pytest.raises(TypeError, match="prefill_graphs='yes'"):
        BatchEngine(model, prefill_graphs="yes")
    with pytest.raises(ValueError, match="CUDA graphs need a model on a CUDA GPU"):
        PagedPrefillGraphs(model, pool, chunk=16, token_budget=32, max_rows=2, width=4, cuda_graphs=True)


def test_one_token_chunks_do_not_take_a_fixed_shape_pass(model, monkeypatch):
    """Without the paged decode step (PyTorch modules) the decode rows are one-token chunks: they run in one
    (k, 1) pass, not padded to a 16-token bucket."""
    engine = BatchEngine(model, **SETTINGS, prefill_graphs=True)
    planned = []
    plan = engine.prefill.plan
    monkeypatch.setattr(engine.prefill, "plan", lambda lengths: planned.append(list(lengths)) or plan(lengths))
    for p, n in requests(model, n=4, seed=6):
        engine.add_request(p, n, stop_at_eos=False)
    engine.run_until_done()
    assert planned and all(n > 1 for lengths in planned for n in lengths)
    assert engine.counters["decode_tokens"] > 0


def test_buckets_stop_at_the_largest_chunk_the_scheduler_can_plan(model):
    engine = BatchEngine(model, max_batch=16, token_budget=256, chunk=2_000_000, max_seq_len=100, prefill_graphs=True)
    assert max(engine.prefill.buckets) == 100  # min(chunk, token_budget, max_seq_len)
    assert engine.prefill.batch.max_tokens == max(rows[-1] * T for T, rows in engine.prefill.buckets.items())
    assert engine.prefill.batch.max_tokens <= 256


def test_a_poisoned_spare_block_does_not_reach_real_rows(model):
    """Padding tokens write the spare block; the masked columns of a row's table point at its own first block, so
    whatever the spare block holds (here NaN) never enters a real row's attention."""
    reqs = requests(model, n=3, seed=7)
    want, _ = serve(model, reqs)
    engine = BatchEngine(model, **SETTINGS, prefill_graphs=True)
    spare = engine.pool.spare[0]
    for pool in engine.pool.k + engine.pool.v:
        pool[spare] = float("nan")
    seqs = [engine.add_request(p, n, stop_at_eos=False) for p, n in reqs]
    engine.run_until_done()
    assert [s.output for s in seqs] == want


@pytest.mark.gpu
def test_captured_prefill_passes_give_the_eager_tokens_on_a_gpu(model):
    gpu_model = tiny_model(seed=5).cuda()
    reqs = requests(gpu_model, seed=3)
    want, _ = serve(gpu_model, reqs)
    got, engine = serve(gpu_model, reqs, prefill_graphs=True)
    assert len(engine.prefill.graphs) == sum(len(rows) for rows in engine.prefill.buckets.values())
    assert got == want
    assert engine.pool.blocks.num_free == engine.pool.num_blocks
    _, eager = serve(gpu_model, reqs[:2], prefill_graphs=True, cuda_graphs=False)
    assert eager.prefill is not None and not eager.prefill.graphs  # cuda_graphs=False: nothing captured


def test_a_trace_served_with_fixed_shape_prefill_gives_the_same_outputs(model):
    from llmlab.batching.trace_runner import serve_trace
    from llmlab.batching.workload import make_trace, trace_prompts

    trace = make_trace(8, 200.0, seed=4, max_context=96)
    prompts = trace_prompts(trace, model.config.vocab_size, seed=4)
    want = serve_trace(model, trace, prompts, "continuous", max_batch=4, chunk=32)
    got = serve_trace(model, trace, prompts, "continuous", max_batch=4, chunk=32, prefill_graphs=True)
    assert got.outputs == want.outputs
