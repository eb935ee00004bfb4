"""The continuous-batching engine's paged decode step (`llmlab.batching.paged_graphs`): with the Triton kernel modules
swapped in, the decode rows attend in place through the block tables from static buffers (graph-captured on a GPU),
and the padding rows of a bucket write only the pool's spare block.

Claims, at fp32: every request's greedy tokens equal the engine's eager reference path (the gathering
`PagedBatchView` and the PyTorch modules) token for token, with and without preemption; a padding row changes no
real row's K/V. CPU: Triton's interpreter (TRITON_INTERPRET=1 from conftest.py); on a GPU the buckets are captured.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmlab.batching.continuous import generate_continuous
from llmlab.batching.engine import BatchEngine, paged_step_reason
from llmlab.batching.paged_graphs import PagedDecodeBatch, PagedDecodeGraphs, batch_buckets
from llmlab.cache.paged_cache import PagedKVCache
from llmlab.kernels._util import interpret_mode
from llmlab.kernels.modules import swap_in
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not interpret_mode(),
                                reason="no CUDA GPU and TRITON_INTERPRET is not set")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7], list(range(10, 30)), [9] * 17, [3]]  # 1 to 2 blocks of 16, a 1-token prompt


@pytest.fixture(scope="module")
def models():
    ref = tiny_model(seed=4).to(DEV)
    return ref, swap_in(copy.deepcopy(ref))


def test_buckets_double_up_to_max_batch():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)


def test_the_paged_step_gives_the_reference_tokens(models):
    ref, fast = models
    want = generate_continuous(ref, PROMPTS, max_new_tokens=6).token_ids
    got = generate_continuous(fast, PROMPTS, max_new_tokens=6)
    assert got.token_ids == want
    engine_kinds = got.extra["engine"]
    assert engine_kinds["finished"] == len(PROMPTS)


@pytest.mark.slow  # ~60 s in the CPU interpreter
def test_the_paged_step_with_preemption_gives_the_reference_tokens(models):
    ref, fast = models
    want = generate_continuous(ref, PROMPTS, max_new_tokens=14).token_ids
    got = generate_continuous(fast, PROMPTS, max_new_tokens=14, num_blocks=3)  # 48 slots for 4 requests
    assert got.token_ids == want
    assert sum(r["preemptions"] for r in got.extra["requests"]) > 0


def test_the_engine_picks_the_paged_step_only_with_the_kernel_modules(models):
    ref, fast = models
    assert BatchEngine(ref, max_batch=4, max_seq_len=64).decode_step is None
    engine = BatchEngine(fast, max_batch=4, max_seq_len=64)
    assert isinstance(engine.decode_step, PagedDecodeGraphs)
    assert engine.pool.spare == [engine.pool.num_blocks]  # one block past the managed ones
    assert "triton_kernels" in paged_step_reason(ref, None)
    with pytest.raises(ValueError, match="cuda_graphs=True"):
        BatchEngine(ref, max_batch=4, max_seq_len=64, cuda_graphs=True)
    if DEV != "cuda":  # on a CPU the reason is the device, not a switch that cannot help there
        for model in (ref, fast):
            with pytest.raises(ValueError, match="CUDA graphs need a CUDA GPU") as e:
                paged_step_reason(model, True)
            assert "triton_kernels" not in str(e.value)
    assert BatchEngine(ref, max_batch=4, max_seq_len=64).decode_step is None  # a refused engine left nothing


def test_padding_rows_write_only_the_spare_block(models):
    _, fast = models
    config = fast.config
    pool = PagedKVCache(config, 4, 64, torch.float32, DEV, num_blocks=8, spare_blocks=1)
    step = PagedDecodeGraphs(fast, pool, max_batch=4, width=4, cuda_graphs=False)
    pool.blocks.allocate("a", 5)
    before = [t.clone() for t in pool.k]
    logits, tokens = step.step([(7, 4, pool.blocks.block_table("a"))])  # one real row in a bucket of 1
    assert logits.shape == (1, config.vocab_size) and tokens.shape == (1,)
    step.batch.fill([(7, 4, pool.blocks.block_table("a"))], 4)  # the same row in a bucket of 4: 3 padding rows
    step.batch.rows = 4
    real_block = pool.blocks.block_table("a")[0]
    for layer, t in enumerate(pool.k):
        changed = (t != before[layer]).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= {real_block}  # the first step wrote slot 4 of the row's block, nothing else
    out = step._forward(4)
    for layer, t in enumerate(pool.k):
        changed = (t != before[layer]).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= {real_block, pool.spare[0]}
    # the real row's logits do not see the padding (a batch of 4 may round its matmuls differently from 1)
    torch.testing.assert_close(step.outputs[4][0][0], logits[0], atol=1e-5, rtol=1e-5)
    assert out is None


def test_fill_refuses_what_does_not_fit(models):
    _, fast = models
    pool = PagedKVCache(fast.config, 2, 64, torch.float32, DEV, num_blocks=8, spare_blocks=1)
    batch = PagedDecodeBatch(pool, max_rows=2, width=2)
    with pytest.raises(ValueError, match="rows in a bucket"):
        batch.fill([(1, 0, [0])] * 3, 2)
    with pytest.raises(ValueError, match="wider"):
        batch.fill([(1, 0, [0, 1, 2])], 2)
    with pytest.raises(ValueError, match="outside its 1 blocks"):
        batch.fill([(1, 16, [0])], 2)
    with pytest.raises(ValueError, match="spare block"):
        PagedDecodeBatch(PagedKVCache(fast.config, 2, 64, torch.float32, DEV, num_blocks=8), 2, 2)


# -- overlapped steps (llmlab.batching.overlap) ------------------------------------------------------------------
def test_overlapped_steps_give_the_reference_tokens_and_free_every_block(models):
    """Greedy tokens equal the synchronous engine's, no placeholder is left, every block goes back."""
    ref, fast = models
    want = generate_continuous(ref, PROMPTS, max_new_tokens=6).token_ids
    engine = BatchEngine(fast, max_batch=4, max_seq_len=64, overlap=True)
    seqs = [engine.add_request(p, 6, stop_at_eos=False) for p in PROMPTS]
    done = engine.run_until_done()
    assert [s.output for s in seqs] == want
    assert sorted(s.seq_id for s in done) == sorted(s.seq_id for s in seqs)  # each reported finished once
    assert engine.pool.blocks.num_used == 0 and not engine.has_work()
    assert engine.summary()["sampled"] == sum(len(w) for w in want)


def test_an_overlapped_step_reports_its_tokens_one_step_later(models):
    ref, fast = models
    engine = BatchEngine(fast, max_batch=4, max_seq_len=64, overlap=True)
    seq = engine.add_request([5, 6, 7], 4, stop_at_eos=False)
    first = engine.step()  # the prefill: synchronous, its token read at once
    assert list(first.tokens.values()) == seq.output and len(seq.output) == 1
    second = engine.step()  # a greedy decode: launched, not read back
    assert second.tokens == {} and seq.output[1] == -1 and engine.overlap.in_flight is not None
    third = engine.step()  # launches the next one (its input token still on the device), reads the second back
    assert third.tokens == {} and third.read_back == {seq.seq_id: seq.output[1]}
    assert seq.output[1] >= 0 and seq.output[2] == -1
    engine.run_until_done()
    assert seq.output == generate_continuous(ref, [[5, 6, 7]], max_new_tokens=4).token_ids[0]


def test_an_eos_read_back_late_ends_the_request_where_the_synchronous_engine_does(models):
    """A request whose EOS is read one step late: its extra token is cut off and its finish reason is "eos"."""
    ref, fast = models
    plain = generate_continuous(ref, PROMPTS, max_new_tokens=8).token_ids
    eos = plain[1][2]  # the third token of the second request: it ends there (others may too)
    want = generate_continuous(ref, PROMPTS, max_new_tokens=8, eos_token_id=eos).token_ids
    engine = BatchEngine(fast, max_batch=4, max_seq_len=64, overlap=True)
    engine.eos_ids = frozenset([eos])
    seqs = [engine.add_request(p, 8) for p in PROMPTS]
    engine.run_until_done()
    assert [s.output for s in seqs] == want
    assert seqs[1].finish_reason == "eos" and len(seqs[1].output) <= 3
    assert engine.pool.blocks.num_used == 0


def test_a_sampled_request_makes_the_overlapped_engine_wait(models):
    """A row with temperature > 0 is sampled on the host: those steps run synchronously; every token as without
    overlap (the same seeds)."""
    _, fast = models
    runs = []
    for overlap in (False, True):
        engine = BatchEngine(fast, max_batch=4, max_seq_len=64, overlap=overlap)
        seqs = [engine.add_request(PROMPTS[0], 5, stop_at_eos=False),
                engine.add_request(PROMPTS[1], 5, temperature=0.8, seed=3, stop_at_eos=False)]
        engine.run_until_done()
        runs.append([s.output for s in seqs])
    assert runs[0] == runs[1]


def test_overlap_needs_the_paged_step_and_a_server_refuses_it(models):
    ref, fast = models
    from llmlab.batching.requests import Server

    with pytest.raises(ValueError, match="overlap=True"):
        BatchEngine(ref, max_batch=4, max_seq_len=64, overlap=True)
    with pytest.raises(ValueError, match="overlap=False"):
        Server(BatchEngine(fast, max_batch=4, max_seq_len=64, overlap=True))


@pytest.mark.slow  # ~60 s in the CPU interpreter
@pytest.mark.parametrize("with_eos", [False, True])
def test_overlapped_steps_with_preemption_give_the_reference_tokens(models, with_eos):
    """A pool too small for all four requests: preemptions (and, with an EOS, requests ending one step late) while
    steps overlap; every token as the synchronous reference's, every block back in the pool."""
    ref, fast = models
    eos = generate_continuous(ref, PROMPTS, max_new_tokens=14).token_ids[2][5] if with_eos else None
    want = generate_continuous(ref, PROMPTS, max_new_tokens=14, eos_token_id=eos).token_ids
    got = generate_continuous(fast, PROMPTS, max_new_tokens=14, num_blocks=3, overlap=True, eos_token_id=eos)
    assert got.token_ids == want
    assert sum(r["preemptions"] for r in got.extra["requests"]) > 0
    assert got.extra["engine"]["finished"] == len(PROMPTS)
    if with_eos:
        assert len(want[2]) <= 6


@pytest.mark.slow  # ~40 s in the CPU interpreter
@pytest.mark.parametrize("seed", [0, 1])
def test_overlapped_and_synchronous_engines_agree_on_random_requests(models, seed):
    """Seeded random prompts, lengths, EOS and a pool that forces preemption: the overlapped engine's outputs,
    finish reasons and block accounting equal the synchronous engine's on the same model."""
    _, fast = models
    g = torch.Generator().manual_seed(seed)
    reqs = [(torch.randint(0, 256, (int(torch.randint(1, 30, (), generator=g)),), generator=g).tolist(),
             int(torch.randint(1, 12, (), generator=g))) for _ in range(6)]
    results, eos = [], None
    for overlap in (False, False, True):  # the first run picks an EOS its outputs contain: some requests end early
        engine = BatchEngine(fast, num_blocks=4, max_batch=4, max_seq_len=48, overlap=overlap)
        engine.eos_ids = frozenset() if eos is None else frozenset([eos])
        seqs = [engine.add_request(p, n) for p, n in reqs]
        done = engine.run_until_done()
        assert sorted(s.seq_id for s in done) == sorted(s.seq_id for s in seqs)
        assert engine.pool.blocks.num_used == 0 and all(-1 not in s.output for s in seqs)
        results.append([(s.output, s.finish_reason) for s in seqs])
        if eos is None:
            longest = max((s.output for s in seqs), key=len)
            eos = longest[len(longest) // 2]
    assert "eos" in [reason for _, reason in results[1]]
    assert results[1] == results[2]


def test_cancel_interrupt_and_a_synchronous_step_after_an_overlapped_one_lose_no_token(models):
    """Every token reaches a StepResult exactly once (as `tokens` or `read_back`), whatever interrupts the
    overlapped steps: a cancel while a step is in flight (no placeholder left in what it returns, its reason stays
    "cancelled"), an interrupt inside a launch, a request added (a synchronous prefill step) while a step is in
    flight. Outputs equal the synchronous engine's."""
    ref, fast = models

    want = generate_continuous(ref, PROMPTS + [[4, 4]], max_new_tokens=6).token_ids
    engine = BatchEngine(fast, max_batch=5, max_seq_len=64, overlap=True)
    real_step, calls = engine.decode_step.step, []

    def interrupting_step(rows, sources=None):  # the 4th decode step is interrupted (Ctrl-C) as it launches
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(rows, sources)

    engine.decode_step.step = interrupting_step
    seqs = [engine.add_request(p, 6, stop_at_eos=False) for p in PROMPTS]
    reported = {s.seq_id: [] for s in seqs}
    finished = []

    def take(result):
        for d in (result.read_back, result.tokens):  # read_back first: it holds the older tokens
            for sid, t in d.items():
                reported[sid].append(t)
        finished.extend(result.finished)

    take(engine.step())  # the prefill
    take(engine.step())  # an overlapped decode: in flight
    cancelled = engine.cancel(seqs[3].seq_id)
    assert -1 not in cancelled.output and cancelled.finish_reason == "cancelled"
    late = engine.add_request([4, 4], 6, stop_at_eos=False)  # a prefill: the next step runs synchronously
    reported[late.seq_id] = []
    seqs.append(late)
    take(engine.step())
    interrupted = False
    while engine.has_work():
        try:
            take(engine.step())
        except KeyboardInterrupt:
            interrupted = True
    assert interrupted
    assert [s.output for s in seqs if s is not cancelled] == [w for s, w in zip(seqs, want) if s is not cancelled]
    assert cancelled.output == want[3][:len(cancelled.output)] and cancelled.finish_reason == "cancelled"
    assert all(reported[s.seq_id] == s.output for s in seqs)  # each token reported once, in order
    # every other request finished through a step's result (a cancelled one comes back from cancel)
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs if s is not cancelled)
    assert engine.pool.blocks.num_used == 0


def test_generate_continuous_takes_tensor_prompts(models):
    ref, _ = models
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    want = generate_continuous(ref, ids.tolist(), max_new_tokens=3).token_ids
    assert generate_continuous(ref, ids, max_new_tokens=3).token_ids == want
    assert generate_continuous(ref, ids[0], max_new_tokens=3).token_ids == want[:1]
