"""The static KV cache and the graph runner's step, run on the CPU without capture ("eager static").

Everything a CUDA graph replays is here except the capture itself: the static buffers, per-row device-side
positions, the on-device mask, bucket padding, the host-side length checks, no host read per token. So the CPU
shows that the step is right; tests/test_cuda_graphs.py shows on a GPU that capturing it changes nothing.

The reference is always `llmlab.generate.generate` (eager, dynamic KVCache) at fp32, on the same random tiny model
as tests/test_generate.py (its greedy output is varied, so "equal tokens" means something).
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmlab.runtime import cuda_graphs
from llmlab.runtime.cuda_graphs import BUCKETS, GraphDecoder, RunnerCache, batch_buckets
from llmlab.engine import LLM
from llmlab.runtime.fast_generate import decode_mode, generate_fast
from llmlab.generate import generate
from llmlab.sampling import sample_from_probs
from llmlab.cache.static_cache import StaticKVCache
from llmlab.switches import apply_switches
from tiny_models import pad_row_logits, prompt_ids, tiny_config, tiny_model

PROMPT = prompt_ids(1, 12, seed=11)[0].tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def runner64(model):
    """One eager-static runner with every bucket up to 64 (no capture on a CPU)."""
    return GraphDecoder(model, max_batch=64, max_seq_len=80, cuda_graphs=False)


def greedy_rows(runner: GraphDecoder, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Decode n greedy tokens for prompts of any lengths: prefill each row, then step all rows together."""
    firsts = [runner.prefill(torch.tensor([p]), row=b).argmax(-1) for b, p in enumerate(prompts)]
    token = torch.cat(firsts)  # (B,)
    out = [token]
    runner.start(token, [len(p) for p in prompts])
    for _ in range(n - 1):
        _, token = runner.step()
        out.append(token.clone())
        runner.advance(token)
    return torch.stack(out, dim=1).tolist()


# -- the cache ----------------------------------------------------------------------------------------------------


def test_update_writes_each_row_at_its_own_position():
    cfg = tiny_config()
    cache = StaticKVCache(cfg, 3, 16, torch.float32, "cpu")
    k = torch.randn(2, cfg.n_kv_heads, 1, cfg.head_dim)
    v = torch.randn_like(k)
    k_all, v_all = cache.update(1, torch.tensor([[4], [9]]), k, v)
    assert k_all.shape == (2, cfg.n_kv_heads, 16, cfg.head_dim)  # the whole buffer, rows 0..B-1
    assert torch.equal(cache.k[1][0, :, 4], k[0, :, 0]) and torch.equal(cache.v[1][1, :, 9], v[1, :, 0])
    assert cache.k[1].count_nonzero() == k.count_nonzero()  # nothing else written
    assert cache.k[0].count_nonzero() == 0 and cache.k[1][2].count_nonzero() == 0  # other layer, row 2
    # a (T,) prefill: the same positions for every row
    kp = torch.randn(3, cfg.n_kv_heads, 5, cfg.head_dim)
    cache.update(0, torch.arange(5), kp, kp)
    assert torch.equal(cache.k[0][:, :, :5], kp)


def test_attention_mask_is_causal_per_row_and_windowed():
    cache = StaticKVCache(tiny_config(), 2, 8, torch.bfloat16, "cpu")
    m = cache.visible(torch.tensor([[2], [5]]))
    assert m.shape == (2, 1, 1, 8) and m.dtype == torch.bool
    assert m[0, 0, 0].tolist() == [True] * 3 + [False] * 5
    assert m[1, 0, 0].tolist() == [True] * 6 + [False] * 2
    p = cache.visible(torch.arange(4))  # a prefill: (1, 1, T, S), lower triangular
    assert p.shape == (1, 1, 4, 8) and torch.equal(p[0, 0, :, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    w = cache.visible(torch.tensor([[5]]), sliding_window=3)
    assert w[0, 0, 0].tolist() == [False] * 3 + [True] * 3 + [False] * 2
    add = cache.attention_mask(torch.tensor([[2], [5]]))  # what SDPA gets: additive, in the cache's dtype
    assert add.dtype == torch.bfloat16 and add.shape == (2, 1, 1, 8)
    assert torch.equal(add == 0, m) and torch.isneginf(add[~m]).all()


def test_rows_view_shares_the_buffers():
    cache = StaticKVCache(tiny_config(), 4, 8, torch.float32, "cpu")
    view = cache.rows(2, 3)
    k = torch.ones(1, cache.k[0].shape[1], 2, cache.k[0].shape[3])
    view.update(0, torch.arange(2), k, k)
    assert cache.k[0][2, :, :2].eq(1).all() and cache.k[0][[0, 1, 3]].count_nonzero() == 0
    with pytest.raises(ValueError, match="outside the cache"):
        cache.rows(3, 5)


@pytest.mark.parametrize("kind", ["plain", "sliding"])
@torch.no_grad()
def test_static_cache_forward_equals_no_cache_forward(kind):
    """Prefill 10 tokens into the static cache, then 6 single-token steps with (B, 1) positions: each step's
    logits equal the no-cache model's logits at that position (the mask hides the empty slots and the future)."""
    m = tiny_model(seed=1, sliding_window=4) if kind == "sliding" else tiny_model(seed=1)
    seq = prompt_ids(2, 16, seed=5)
    ref = m(seq)  # (2, 16, V)
    cache = StaticKVCache(m.config, 2, 32, torch.float32, "cpu")
    pre = m(seq[:, :10], torch.arange(10), kv_cache=cache)
    torch.testing.assert_close(pre, ref[:, :10], atol=1e-5, rtol=1e-5)
    for t in range(10, 16):
        got = m(seq[:, t:t + 1], torch.full((2, 1), t), kv_cache=cache)
        torch.testing.assert_close(got[:, 0], ref[:, t], atol=1e-5, rtol=1e-5)


# -- the runner ---------------------------------------------------------------------------------------------------


def test_buckets():
    assert batch_buckets(64) == BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(1) == (1,) and batch_buckets(5) == (1, 2, 4, 5)
    r = GraphDecoder(tiny_model(), max_batch=5, max_seq_len=32, cuda_graphs=False)
    assert [r.bucket(b) for b in range(1, 6)] == [1, 2, 4, 4, 5]
    assert r.graphs == {} and r.mode == "static"
    with pytest.raises(ValueError, match="exceeds this runner's max_batch 5"):
        r.bucket(6)
    with pytest.raises(ValueError, match="ascending"):
        GraphDecoder(tiny_model(), max_batch=4, max_seq_len=32, buckets=(2, 1, 4), cuda_graphs=False)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_static_decode_equals_eager_64_steps_at_every_bucket(model, runner64, bucket):
    """B = bucket // 2 + 1 real rows (so every bucket from 4 up runs with pad rows): 64 greedy tokens per row
    equal the eager `generate`'s."""
    B = bucket // 2 + 1
    prompts = prompt_ids(B, 12, seed=100 + bucket)
    ref = generate(model, prompts, max_new_tokens=64)
    got = generate_fast(model, prompts, max_new_tokens=64, runner=runner64)
    assert got.extra["bucket"] == bucket and got.extra["decode_mode"] == "static"
    assert got.token_ids == ref.token_ids
    assert len(set(got.token_ids[0])) >= 16  # varied output: the equality means something
    assert got.finish_reason == "length" and len(got.step_ms) == 64


def test_padded_rows_never_change_real_rows(model, runner64):
    """3 real rows in bucket 4: whatever the pad row holds (any token, any position, NaN in its cache row), the
    real rows' logits are bit-identical, step after step."""
    prompts = prompt_ids(3, 9, seed=3)

    def run(pad_token: int, pad_pos: int, poison: bool) -> list[torch.Tensor]:
        return pad_row_logits(runner64, prompts, pad_token, pad_pos, poison)

    clean = run(0, 0, poison=False)
    dirty = run(123, 77, poison=True)
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
    assert all(torch.isfinite(a).all() for a in clean)
    # the next request that uses row 3 as a real row: prefill clears the NaN the mask could not hide (-inf + NaN)
    again = generate_fast(model, prompt_ids(4, 9, seed=4), max_new_tokens=8, runner=runner64)
    assert again.token_ids == generate(model, prompt_ids(4, 9, seed=4), max_new_tokens=8).token_ids


def test_rows_at_different_positions(model, runner64):
    """Prompts of 12, 5 and 9 tokens decoded in one batch (per-row positions): each row equals its own run."""
    prompts = [prompt_ids(1, n, seed=40 + n)[0].tolist() for n in (12, 5, 9)]
    got = greedy_rows(runner64, prompts, 40)
    for p, row in zip(prompts, got):
        assert row == generate(model, p, max_new_tokens=40).token_ids[0]


def test_step_checks_positions_on_the_host(model):
    r = GraphDecoder(model, max_batch=2, max_seq_len=16, cuda_graphs=False)
    token = r.prefill(prompt_ids(2, 14, seed=0)).argmax(-1)
    r.start(token, 14)
    r.step()  # position 14
    r.advance(token)
    r.step()  # position 15: the last slot
    r.advance(token)
    with pytest.raises(ValueError, match="position 16 is outside this runner's 16-token cache"):
        r.step()
    with pytest.raises(ValueError, match="outside this runner's"):
        r.start(token, 16)
    with pytest.raises(ValueError, match="does not fit"):
        r.prefill(prompt_ids(1, 17))
    with pytest.raises(ValueError, match="start"):
        GraphDecoder(model, max_batch=1, max_seq_len=16, cuda_graphs=False).step()
    with pytest.raises(TypeError, match="integer tensor"):
        r.start(token.float(), 3)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        r.start(token[:, None], 3)
    r.start(token, 3)  # usable after the errors
    assert r.step()[1].shape == (2,)


def test_a_runner_given_by_hand_must_fit_the_model_and_the_request(model):
    from tiny_models import tiny_model

    runner = GraphDecoder(model, max_batch=1, max_seq_len=16, cuda_graphs=False)
    with pytest.raises(ValueError, match="built for another model"):
        generate_fast(tiny_model(seed=9), PROMPT[:4], max_new_tokens=2, runner=runner)
    with pytest.raises(ValueError, match=r"too small: 2 rows \(it has 1\)"):
        generate_fast(model, [PROMPT[:4], PROMPT[:4]], max_new_tokens=2, runner=runner)
    with pytest.raises(ValueError, match="its cache holds 16"):
        generate_fast(model, PROMPT[:4], max_new_tokens=20, runner=runner)
    assert len(generate_fast(model, PROMPT[:4], max_new_tokens=2, runner=runner).token_ids[0]) == 2


def test_generate_fast_checks_eos_check_every_and_max_batch(model):
    with pytest.raises(TypeError, match="whole number of steps"):
        generate_fast(model, PROMPT, max_new_tokens=4, mode="static", eos_check_every=2.5)
    for bad in (0, -1, "2"):
        with pytest.raises(ValueError, match="max_batch"):
            generate_fast(model, PROMPT, max_new_tokens=4, mode="static", max_batch=bad)
    assert len(generate_fast(model, PROMPT, max_new_tokens=4, mode="static").token_ids[0]) == 4


def test_graphs_need_a_gpu(model):
    with pytest.raises(ValueError, match="CUDA GPU"):
        GraphDecoder(model, max_batch=1, max_seq_len=16, cuda_graphs=True)
    with pytest.raises(ValueError, match="needs a model on a CUDA GPU"):
        generate_fast(model, PROMPT, max_new_tokens=4, mode="graphs")
    with pytest.raises(ValueError, match="unknown decode mode"):
        generate_fast(model, PROMPT, max_new_tokens=4, mode="fast")


# -- generate_fast ------------------------------------------------------------------------------------------------


def test_lengths_and_runner_reuse(monkeypatch):
    """Changing the prompt length and max_new_tokens reuses the cached runner while it fits and rebuilds a bigger
    one when it does not; every call equals the eager decode; impossible lengths fail before any work.
    (Runner sizes scaled down 16x from MIN_SEQ=1024 / SEQ_ROUND=512 to keep the test fast.)"""
    monkeypatch.setattr(cuda_graphs, "MIN_SEQ", 64)
    monkeypatch.setattr(cuda_graphs, "SEQ_ROUND", 32)
    m = tiny_model(seed=0)  # context 256
    runners = RunnerCache()  # what LLM.runners holds
    for T, n in [(12, 20), (5, 59), (40, 7), (3, 1)]:
        p = prompt_ids(1, T, seed=T)[0].tolist()
        assert generate_fast(m, p, max_new_tokens=n, mode="static", runners=runners).token_ids == \
            generate(m, p, max_new_tokens=n).token_ids
    first = runners["static"]
    assert (first.max_batch, first.max_seq_len) == (1, 64)  # one runner served all four calls
    p = prompt_ids(1, 60, seed=1)[0].tolist()
    assert generate_fast(m, p, max_new_tokens=30, mode="static", runners=runners).token_ids == \
        generate(m, p, max_new_tokens=30).token_ids
    grown = runners["static"]
    assert grown is not first and grown.max_seq_len == 96
    b = prompt_ids(3, 8, seed=2)  # more rows: 4 (a power of two), the length kept
    assert generate_fast(m, b, max_new_tokens=10, mode="static", runners=runners).token_ids == \
        generate(m, b, max_new_tokens=10).token_ids
    wide = runners["static"]
    assert (wide.max_batch, wide.max_seq_len, wide.buckets) == (4, 96, (1, 2, 4))
    generate_fast(m, PROMPT, max_new_tokens=5, mode="static", runners=runners)
    assert runners["static"] is wide  # smaller requests reuse it
    p = prompt_ids(1, 200, seed=3)[0].tolist()  # up to the context: 256, not 288
    assert generate_fast(m, p, max_new_tokens=56, mode="static", runners=runners).token_ids == \
        generate(m, p, max_new_tokens=56).token_ids
    full = runners["static"]
    assert full.max_seq_len == 256
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate_fast(m, PROMPT, max_new_tokens=256, mode="static", runners=runners)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate_fast(m, [1, 2, 256], max_new_tokens=5, mode="static", runners=runners)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_fast(m, [], max_new_tokens=5, mode="static", runners=runners)
    assert runners["static"] is full  # failed calls touch nothing


def test_fills_the_context_exactly():
    m = tiny_model(seed=0, max_seq_len=32)
    runners = RunnerCache()
    a = generate_fast(m, PROMPT, max_new_tokens=32 - len(PROMPT), mode="static", runners=runners)
    assert a.token_ids == generate(m, PROMPT, max_new_tokens=32 - len(PROMPT)).token_ids
    assert runners["static"].max_seq_len == 32  # capped at the context


def test_new_weights_rebuild_the_runner_and_copies_start_clean():
    m = tiny_model(seed=0)
    runners = RunnerCache()
    generate_fast(m, PROMPT, max_new_tokens=4, mode="static", runners=runners)
    old = runners["static"]
    assert len(copy.deepcopy(runners)) == 0  # a copy must not share (or try to copy) the runners
    llm = LLM(m)
    llm.generate(PROMPT, max_new_tokens=4, gpu_sampling=True)
    assert len(llm.runners) == 1
    llm2 = llm.to(dtype="bf16")  # a copy of the model: its LLM starts with no runners
    assert llm2.runners is not llm.runners and len(llm2.runners) == 0
    with torch.no_grad():
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight * -1.0)  # replaced (untied) weights
    got = generate_fast(m, PROMPT, max_new_tokens=16, mode="static", runners=runners)
    assert runners["static"] is not old
    assert got.token_ids == generate(m, PROMPT, max_new_tokens=16).token_ids


@pytest.mark.parametrize("every", [1, 5, 16, 1000])
def test_eos_every_n_steps_gives_the_eager_result(model, every):
    ref_full = generate(model, PROMPT, max_new_tokens=64).token_ids[0]
    eos = ref_full[10]
    ref = generate(model, PROMPT, max_new_tokens=64, eos_token_id=eos)
    got = generate_fast(model, PROMPT, max_new_tokens=64, eos_token_id=eos, mode="static", eos_check_every=every)
    assert got.token_ids == ref.token_ids and got.finish_reason == "eos" == ref.finish_reason
    assert len(got.step_ms) == len(ref.step_ms)
    read_at = min(64, -(-len(ref.step_ms) // every) * every)  # the first read that holds the EOS
    steps_run = 64 if read_at == 64 else read_at + 1  # looked at one step late (the last read: after the loop)
    assert got.extra["wasted_steps"] == steps_run - len(ref.step_ms)
    assert got.extra["host_reads"] == -(-read_at // every)


def test_reads_at_once_without_gpu_sampling_and_one_step_late_with_it(model):
    """gpu_sampling=False looks at each token at once (no wasted step); with it, a read is looked at after the
    next step is queued: an EOS at step 10 read at 16 costs steps 11..16 (6 wasted)."""
    eos = generate(model, PROMPT, max_new_tokens=64).token_ids[0][10]
    ref = generate(model, PROMPT, max_new_tokens=64, eos_token_id=eos)
    at_once = generate_fast(model, PROMPT, max_new_tokens=64, eos_token_id=eos, mode="static", gpu_sampling=False)
    late = generate_fast(model, PROMPT, max_new_tokens=64, eos_token_id=eos, mode="static", gpu_sampling=True)
    assert at_once.token_ids == late.token_ids == ref.token_ids
    assert at_once.extra["wasted_steps"] == 0 and at_once.extra["host_reads"] == 11
    assert late.extra["wasted_steps"] == 6 and late.extra["host_reads"] == 1


def test_eos_in_a_batch_and_no_sync_per_token_flag(model):
    batch = prompt_ids(2, 9, seed=21)
    full = generate(model, batch, max_new_tokens=40).token_ids
    eos = full[0][5]
    ref = generate(model, batch, max_new_tokens=40, eos_token_id=eos)
    for gpu_sampling in (True, False):
        got = generate_fast(model, batch, max_new_tokens=40, eos_token_id=eos, mode="static",
                            gpu_sampling=gpu_sampling)
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
        assert len(got.step_ms) == len(ref.step_ms)
        assert got.extra["eos_check_every"] == (16 if gpu_sampling else 1)


def test_on_token_sees_every_step_and_can_stop(model):
    seen_ref, seen = [], []
    ref = generate(model, PROMPT, max_new_tokens=30, on_token=lambda s, t: seen_ref.append((s, t)) or s == 20)
    got = generate_fast(model, PROMPT, max_new_tokens=30, mode="static",
                        on_token=lambda s, t: seen.append((s, t)) or s == 20)
    assert seen == seen_ref and got.token_ids == ref.token_ids
    assert got.finish_reason == "stopped" and len(got.step_ms) == 21 and got.extra["wasted_steps"] == 9  # read at 16, then at 30


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=20),
                                dict(temperature=1.2, top_p=0.9), dict(temperature=1.0, top_k=50, top_p=0.8)])
def test_seeded_sampling_equals_eager(model, kw):
    batch = prompt_ids(3, 7, seed=8)
    ref = generate(model, batch, max_new_tokens=40, seed=5, **kw)
    got = generate_fast(model, batch, max_new_tokens=40, seed=5, mode="static", **kw)
    assert got.token_ids == ref.token_ids
    assert ref.token_ids != generate(model, batch, max_new_tokens=40).token_ids  # it really sampled


def test_sample_from_probs_is_multinomial_without_the_sync():
    """Same generator state -> the same tokens as torch.multinomial, and the generator ends in the same state."""
    for seed in range(3):
        probs = torch.randn(64, 300, generator=torch.Generator().manual_seed(seed)).mul(3).softmax(-1)
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert torch.equal(sample_from_probs(probs, g1), torch.multinomial(probs, 1, generator=g2)[:, 0])
        assert torch.equal(g1.get_state(), g2.get_state())


def test_timings(model):
    g = generate_fast(model, prompt_ids(2, 9, seed=4), max_new_tokens=16, mode="static")
    assert len(g.step_ms) == 16 and all(ms > 0 for ms in g.step_ms)
    assert g.ttft_ms == g.step_ms[0] and g.tpot_ms > 0 and g.use_cache
    assert (g.device, g.dtype) == ("cpu", "float32")


# -- switches and LLM.generate ------------------------------------------------------------------------------------


def test_switches_route_llm_generate(model):
    llm = LLM(model)
    ref = llm.generate(PROMPT, max_new_tokens=24)
    for settings, mode in [({"gpu_sampling": True}, "static"), ({"gpu_sampling": True, "kv_cache": True}, "static")]:
        run, kwargs = apply_switches(llm, settings)
        assert kwargs["gpu_sampling"] is True and not ({"cuda_graphs", "torch_compile", "pin_memory"} & set(kwargs))
        g = run.generate(PROMPT, max_new_tokens=24, **kwargs)
        assert g.extra["decode_mode"] == mode and g.token_ids == ref.token_ids
    _, kwargs = apply_switches(llm, {})
    assert not ({"cuda_graphs", "torch_compile", "gpu_sampling", "pin_memory"} & set(kwargs))  # eager path alone
    assert "decode_mode" not in llm.generate(PROMPT, max_new_tokens=4).extra
    for key in ("cuda_graphs", "pinned_memory"):  # CUDA-only
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            apply_switches(llm, {key: True})
    with pytest.raises(ValueError, match="static KV cache"):
        llm.generate(PROMPT, max_new_tokens=4, use_cache=False, gpu_sampling=True)
    assert llm.generate(PROMPT, max_new_tokens=24, pin_memory=True).token_ids == ref.token_ids  # no effect on a CPU
    assert [decode_mode(g, c) for g in (False, True) for c in (False, True)] == \
        ["static", "compile", "graphs", "compile+graphs"]


def test_runner_for_rejects_bad_requests(model):
    runners = RunnerCache()
    with pytest.raises(ValueError, match="unknown decode mode"):
        runners.runner_for(model, "turbo", 1, 10)
    with pytest.raises(ValueError, match="exceed the model's context"):
        runners.runner_for(model, "static", 1, 10_000)
    assert len(runners) == 0 and "static" not in runners


# -- torch.compile on the CPU (Inductor's C++ backend; ~15 s) -------------------------------------------------------


@pytest.mark.slow
def test_compiled_step_equals_eager_on_cpu(model):
    """The compiled step, 3 real rows in one bucket of 4 (one compilation), 64 greedy tokens == eager."""
    import shutil

    if not shutil.which("g++") and not shutil.which("c++"):
        pytest.skip("torch.compile on a CPU needs a C++ compiler")
    runner = GraphDecoder(model, max_batch=4, max_seq_len=128, buckets=(4,), cuda_graphs=False, compile=True)
    assert runner.compile_mode == "default" and runner.mode == "compile"
    prompts = prompt_ids(3, 12, seed=9)
    got = generate_fast(model, prompts, max_new_tokens=64, runner=runner)
    assert got.extra["decode_mode"] == "compile" and got.extra["bucket"] == 4
    assert got.token_ids == generate(model, prompts, max_new_tokens=64).token_ids


# -- the bucketed prefill (what a prefill graph replays), run eagerly ------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 12, 16, 17, 40])
def test_bucketed_prefill_equals_the_plain_prefill(model, T):
    """Pad tokens first, at positions after the prompt: the last position's logits and the prompt's K/V slots
    equal the unpadded prefill's (fp32: only the matmuls' row counts differ)."""
    plain = GraphDecoder(model, max_batch=4, max_seq_len=80, cuda_graphs=False)
    padded = GraphDecoder(model, max_batch=4, max_seq_len=80, cuda_graphs=False)
    prompts = prompt_ids(3, T, seed=T)
    ref = plain.prefill(prompts)
    got = padded.prefill(prompts, bucketed=True)
    L = padded.prefill_length(3, T)
    assert L == next(n for n in cuda_graphs.PREFILL_LENGTHS if n >= T)
    assert got.shape == ref.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(plain.cache.k + plain.cache.v, padded.cache.k + padded.cache.v):
        torch.testing.assert_close(b[:3, :, :T], a[:3, :, :T], atol=1e-5, rtol=1e-5)
    padded.capture_prefill(prompts)  # nothing to capture without graphs
    assert not padded.prefill_graphs  # no capture on a CPU: the same padded forward ran eagerly


def test_bucketed_prefill_lengths_and_the_eager_fallback():
    m = tiny_model(seed=0, max_seq_len=700)
    r = GraphDecoder(m, max_batch=64, max_seq_len=300, cuda_graphs=False)
    assert [r.prefill_length(1, T) for T in (1, 16, 17, 128, 129, 256, 257)] == [16, 16, 32, 128, 256, 256, None]
    assert r.prefill_length(64, 128) == 128 and r.prefill_length(64, 129) is None  # 64 x 256 > PREFILL_MAX_TOKENS
    assert r.prefill_length(33, 100) == 128  # rows count by their bucket (64): 64 x 128 = 8192
    big = GraphDecoder(m, max_batch=128, max_seq_len=600, cuda_graphs=False)  # 128 rows x 600 slots > 65536
    assert big.prefill_length(1, 12) == 16 and big.prefill_length(65, 12) is None
    # a prompt beyond the buckets prefills eagerly, unpadded, and decodes the same
    p = prompt_ids(1, 600, seed=2)[0].tolist()
    got = generate_fast(m, p, max_new_tokens=8, mode="static", prefill_graph=True)
    assert got.extra["prefill_length"] is None and got.token_ids == generate(m, p, max_new_tokens=8).token_ids


@pytest.mark.parametrize("T,B", [(5, 1), (12, 1), (33, 3), (64, 2)])
def test_bucketed_prefill_decodes_like_generate(model, T, B):
    """64 greedy steps after a padded prefill: the pads' K/V sit in the slots the decode writes next, so no
    token changes."""
    prompts = prompt_ids(B, T, seed=50 + T)
    ref = generate(model, prompts, max_new_tokens=64).token_ids
    got = generate_fast(model, prompts, max_new_tokens=64, mode="static", prefill_graph=True)
    assert got.token_ids == ref and got.extra["prefill_length"] == next(
        n for n in cuda_graphs.PREFILL_LENGTHS if n >= T)
    assert len(set(got.token_ids[0])) >= 10


def test_prefill_graph_errors(model, monkeypatch):
    llm = LLM(model)
    # on a CPU model the fix is to turn it off: turning cuda_graphs on too would only fail next, for the same reason
    with pytest.raises(ValueError) as e:
        llm.generate(PROMPT, max_new_tokens=4, gpu_sampling=True, prefill_graphs=True)
    assert str(e.value) == "prefill_graphs=True needs a model on a CUDA GPU (this one is on cpu); turn it off"
    with pytest.raises(ValueError, match="cuda_graphs=True and prefill_graphs=True need a model on a CUDA GPU .*"
                                         "turn them off"):
        llm.generate(PROMPT, max_new_tokens=4, cuda_graphs=True, prefill_graphs=True)
    with monkeypatch.context() as m:  # a CUDA model (refused on the host, before anything touches the device)
        m.setattr(LLM, "device", property(lambda self: torch.device("cuda")))
        with pytest.raises(ValueError, match="turn cuda_graphs on too"):
            llm.generate(PROMPT, max_new_tokens=4, gpu_sampling=True, prefill_graphs=True)
    with pytest.raises(TypeError, match="prefill_graph='yes'"):
        generate_fast(model, PROMPT, max_new_tokens=4, mode="static", prefill_graph="yes")
    assert llm.generate(PROMPT, max_new_tokens=4).n_generated == 4  # still usable


def test_token_reads_copy_contiguous_blocks_of_steps(model, monkeypatch):
    """The late reads copy a block of steps for every row at once: it must be ONE contiguous run of the device
    buffer (steps-major), or on a GPU the non_blocking copy goes through a pageable temporary and the host waits
    for the whole queue at the request — no read would be late for a batch of 2 or more."""
    from llmlab.runtime import fast_generate

    blocks = []

    class Recorder(fast_generate._TokenReader):
        def request(self, start, stop):
            block = self.out[start:stop]
            blocks.append((tuple(block.shape), block.is_contiguous()))
            super().request(start, stop)

    monkeypatch.setattr(fast_generate, "_TokenReader", Recorder)
    prompts = prompt_ids(3, 10, seed=21)
    got = generate_fast(model, prompts, max_new_tokens=11, mode="static", eos_check_every=4)
    assert got.token_ids == generate(model, prompts, max_new_tokens=11).token_ids
    assert blocks == [((4, 3), True), ((4, 3), True), ((3, 3), True)]


@torch.no_grad()
def test_bucketed_prefill_runs_the_whole_row_bucket(model):
    """A bucketed prefill of 3 rows runs its bucket of 4: row 3 is zeroed and holds pads afterwards (documented),
    so a row prefilled on its own comes after it — and then all four rows decode like `generate`."""
    prompts = prompt_ids(3, 10, seed=31)
    last = prompt_ids(1, 6, seed=32)
    runner = GraphDecoder(model, max_batch=4, max_seq_len=64, cuda_graphs=False)
    runner.prefill(last, row=3)
    k3 = runner.cache.k[0][3].clone()
    runner.prefill(prompts, bucketed=True)
    assert not torch.equal(runner.cache.k[0][3], k3)  # row 3 was a pad row of the prefill's bucket
    first = torch.cat([runner.prefill(prompts, bucketed=True).argmax(-1), runner.prefill(last, row=3).argmax(-1)])
    runner.start(first, [10, 10, 10, 6])
    out = [first]
    for _ in range(7):
        _, token = runner.step()
        out.append(token.clone())
        runner.advance(token)
    got = torch.stack(out, dim=1).tolist()
    assert got[:3] == generate(model, prompts, max_new_tokens=8).token_ids
    assert got[3:] == generate(model, last, max_new_tokens=8).token_ids


def test_a_runner_runs_the_kernels_it_was_given_and_refuses_others(model):
    """The runner is given the step it runs (`kernels`: forward, greedy pick, fingerprint) explicitly; a request
    that names other kernels, or kernels of another model, is refused; the fingerprint names the kernels."""
    from llmlab.runtime.cuda_graphs import weights_fingerprint
    from llmlab.sampling import argmax_rows

    class Own:  # stands in for llmlab.kernels.KernelDecodeStep: the model's forward, counted
        def __init__(self, m):
            self.model, self.calls = m, 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            return self.model(*args, **kwargs)

        def greedy(self, logits):
            return argmax_rows(logits)

        def fingerprint(self):
            return ("Own",)

    own = Own(model)
    runner = GraphDecoder(model, max_batch=1, max_seq_len=32, cuda_graphs=False, kernels=own)
    got = generate_fast(model, PROMPT, max_new_tokens=8, runner=runner)
    assert got.token_ids == generate(model, PROMPT, max_new_tokens=8).token_ids and own.calls == 8
    with pytest.raises(ValueError, match="runs other kernels"):
        generate_fast(model, PROMPT, max_new_tokens=4, runner=runner, kernels=Own(model))
    with pytest.raises(ValueError, match="made for another model"):
        GraphDecoder(model, max_batch=1, max_seq_len=32, kernels=Own(tiny_model(seed=1)))
    assert weights_fingerprint(model, own) != weights_fingerprint(model)
