"""The paged KV cache (`llmlab.cache.paged_cache`) gives the same attention and the same greedy tokens as the contiguous
`KVCache`: fp32, within 1e-5, for lengths that cross block boundaries (block sizes 16 and 32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.generate import generate
from llmlab.cache.kv_cache import KVCache
from llmlab.model import repeat_kv
from llmlab.cache.paged_cache import PagedKVCache, gather, paged_attention
from tiny_models import prompt_ids, tiny_config, tiny_model

LENGTHS = [1, 15, 16, 17, 33, 1000]


def _scrambled_cache(config, block_size, length, batch=1):
    """A paged cache whose free list is shuffled, so a sequence's blocks are NOT consecutive in the pool."""
    n_blocks = batch * (-(-length // block_size)) + 7
    cache = PagedKVCache(config, batch, length, torch.float32, "cpu", block_size=block_size, num_blocks=n_blocks)
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(length)).tolist()
    cache.blocks.free_list.clear()
    cache.blocks.free_list.extend(order)
    return cache


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("length", LENGTHS)
def test_paged_attention_equals_contiguous(block_size, length):
    config = tiny_config(max_seq_len=1024, n_layers=1)
    torch.manual_seed(0)
    B, Hkv, H, hd = 2, config.n_kv_heads, config.n_heads, config.head_dim
    k = torch.randn(B, Hkv, length, hd)
    v = torch.randn(B, Hkv, length, hd)
    q = torch.randn(B, H, 1, hd)
    cache = _scrambled_cache(config, block_size, length, batch=B)
    # prefill all but the last token, then "decode" the last one: the write crosses into a new block at 16, 17, 33
    pos = torch.arange(length)
    if length > 1:
        cache.update(0, pos[:-1], k[:, :, :-1], v[:, :, :-1])
    k_all, v_all = cache.update(0, pos[-1:], k[:, :, -1:], v[:, :, -1:])
    assert torch.equal(k_all, k) and torch.equal(v_all, v)  # the gathered view is the contiguous cache, exactly
    tables = cache.block_tables(B)
    assert tables.shape[1] == -(-length // block_size)
    ref = F.scaled_dot_product_attention(q, repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv))[:, :, 0]  # (B, H, hd)
    out = paged_attention(q[:, :, 0], cache.k[0], cache.v[0], tables, [length] * B)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_paged_attention_rows_of_different_lengths():
    config = tiny_config(n_layers=1)
    torch.manual_seed(1)
    lens = [5, 40, 17]
    cache = PagedKVCache(config, 3, 64, torch.float32, "cpu", block_size=16)
    ks, vs = [], []
    for b, n in enumerate(lens):
        cache.blocks.allocate(b, n)
        k, v = torch.randn(config.n_kv_heads, n, config.head_dim), torch.randn(config.n_kv_heads, n, config.head_dim)
        blk, off = cache.slots(b, 0, n)
        cache.k[0][blk, :, off], cache.v[0][blk, :, off] = k.transpose(0, 1), v.transpose(0, 1)
        ks.append(k), vs.append(v)
    q = torch.randn(3, config.n_heads, config.head_dim)
    out = paged_attention(q, cache.k[0], cache.v[0], cache.block_tables(3), lens)
    for b in range(3):
        rep = config.n_heads // config.n_kv_heads
        ref = F.scaled_dot_product_attention(q[b, :, None], ks[b].repeat_interleave(rep, 0),
                                             vs[b].repeat_interleave(rep, 0))[:, 0]
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 33, 200])
def test_model_logits_paged_equal_contiguous(block_size, length):
    model = tiny_model(seed=0)
    ids = prompt_ids(1, length + 3, seed=length)
    with torch.inference_mode():
        logits = []
        for cache in (KVCache(model.config, 1, length + 3, torch.float32, "cpu"),
                      _scrambled_cache(model.config, block_size, length + 3)):
            a = model(ids[:, :length], kv_cache=cache)  # prefill
            steps = [model(ids[:, t:t + 1], torch.tensor([t]), kv_cache=cache) for t in range(length, length + 3)]
            logits.append(torch.cat([a, *steps], dim=1))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_greedy_paged_identical_tiny_model():
    model = tiny_model(seed=0)
    prompt = prompt_ids(2, 17, seed=3)
    ref = generate(model, prompt, max_new_tokens=40)
    for bs in (16, 32):
        got = generate(model, prompt, max_new_tokens=40,
                       cache_factory=lambda *a, bs=bs: PagedKVCache(*a, block_size=bs))
        assert got.token_ids == ref.token_ids


def test_greedy_paged_identical_default_model():
    import llmlab
    llm = llmlab.load(device="cpu")
    ref = llm.generate("def fibonacci(n):", max_new_tokens=64, stop_at_eos=False)
    got = llm.generate("def fibonacci(n):", max_new_tokens=64, stop_at_eos=False, cache_factory=PagedKVCache)
    assert got.token_ids == ref.token_ids


def test_fork_copy_on_write_copies_block_contents():
    config = tiny_config(n_layers=1)
    cache = PagedKVCache(config, 1, 64, torch.float32, "cpu", block_size=16)
    k = torch.randn(1, config.n_kv_heads, 20, config.head_dim)
    cache.update(0, torch.arange(20), k, k)
    cache.blocks.fork(0, 1)  # row 1 shares row 0's blocks, including the half-full second one
    cache.batch_size = 2
    k2 = torch.randn(2, config.n_kv_heads, 1, config.head_dim)
    k_all, _ = cache.update(0, torch.tensor([20]), k2, k2)
    assert torch.equal(k_all[0, :, :20], k[0]) and torch.equal(k_all[1, :, :20], k[0])
    assert torch.equal(k_all[:, :, 20:], k2)
    t0, t1 = cache.blocks.block_table(0), cache.blocks.block_table(1)
    assert t0[0] == t1[0] and t0[1] != t1[1]


def test_a_refused_write_changes_nothing_when_forks_need_copies():
    """Three rows share a half-full block and one block is free: each row's next token needs its own copy, so
    the write is refused before any row moves to a copy (found by a review: row 0 used to be moved first)."""
    from llmlab.cache.block_manager import OutOfBlocks

    config = tiny_config(n_layers=1)
    cache = PagedKVCache(config, 3, 16, torch.float32, "cpu", block_size=4, num_blocks=3)
    k = torch.randn(1, config.n_kv_heads, 6, config.head_dim)
    cache.update(0, torch.arange(6), k, k)  # row 0: blocks [0, 1], the second half full; block 2 free
    cache.blocks.fork(0, 1)
    cache.blocks.fork(0, 2)
    before = [list(cache.blocks.block_table(b)) for b in range(3)], [cache.blocks.length(b) for b in range(3)]
    k3 = torch.randn(3, config.n_kv_heads, 1, config.head_dim)
    with pytest.raises(OutOfBlocks):
        cache.update(0, torch.tensor([6]), k3, k3)
    assert ([list(cache.blocks.block_table(b)) for b in range(3)], [cache.blocks.length(b) for b in range(3)]) \
        == before
    k1 = torch.randn(1, config.n_kv_heads, 1, config.head_dim)
    k_all, _ = cache.update(0, torch.tensor([6]), k1, k1)  # one row fits: it still works
    assert torch.equal(k_all[0, :, :6], k[0]) and torch.equal(k_all[0, :, 6:], k1[0])


def test_gather_shape():
    pool = torch.arange(4 * 1 * 2 * 1, dtype=torch.float32).view(4, 1, 2, 1)
    out = gather(pool, torch.tensor([[3, 1]]), 3)
    assert out.flatten().tolist() == [6.0, 7.0, 2.0]


def test_cache_larger_than_memory_fails_before_allocating():
    config = tiny_config()
    with pytest.raises(MemoryError, match=r"needs .* GB but only .* GB of host memory is available; lower"):
        PagedKVCache(config, 1, 16, torch.float32, "cpu", block_size=16, num_blocks=10**12)
    with pytest.raises(MemoryError, match=r"KV cache .* needs .* GB but only .* GB of host memory"):
        KVCache(config.__class__(**{**config.to_dict(), "max_seq_len": 10**9}), 10**6, 10**9, torch.float32, "cpu")


def test_paged_kv_switch_and_side_rung():
    from llmlab import ladder
    from llmlab.engine import LLM
    from llmlab.switches import apply_switches

    llm = LLM(tiny_model(seed=0), name="tiny")
    run_llm, kwargs = apply_switches(llm, {"paged_kv": True})
    assert kwargs["cache_factory"] is PagedKVCache
    prompt = prompt_ids(1, 20, seed=5)[0].tolist()
    assert run_llm.generate(prompt, max_new_tokens=20, **kwargs).token_ids == llm.generate(
        prompt, max_new_tokens=20).token_ids
    step = ladder.get_step("+paged_kv")
    assert "paged" in step.name and not step.cumulative
    names = ladder.step_names()
    assert names.index("+paged_kv") == names.index("eager") + 1


def test_a_refused_write_changes_nothing_and_the_cache_stays_usable():
    """Bad writes raise a clear error BEFORE any block is reserved; the next good write gives the right K/V."""
    from llmlab.cache.block_manager import OutOfBlocks

    cfg = tiny_config()
    cache = PagedKVCache(cfg, 2, 64, torch.float32, "cpu", block_size=16, num_blocks=4)
    hd, Hkv = cfg.head_dim, cfg.n_kv_heads
    k = torch.randn(1, Hkv, 5, hd)
    pos = torch.arange(5)
    with pytest.raises(TypeError, match="pools hold torch.float32"):
        cache.update(0, pos, k.half(), k.half())
    with pytest.raises(ValueError, match="out of range"):
        cache.update(cfg.n_layers, pos, k, k)
    with pytest.raises(ValueError, match="write layer 0"):
        cache.update(1, pos, k, k)
    with pytest.raises(ValueError, match=r"\(B, "):
        cache.update(0, pos, k, k[:, :, :3])
    with pytest.raises(OutOfBlocks, match="needs 6 more KV blocks"):  # 2 rows x 3 blocks > 4 free
        cache.update(0, torch.arange(40), torch.randn(2, Hkv, 40, hd), torch.randn(2, Hkv, 40, hd))
    assert cache.blocks.num_free == 4 and not cache.blocks.tables and cache.length == 0
    k3 = torch.randn(1, Hkv, 3, hd)
    for layer in range(cfg.n_layers):
        k_all, v_all = cache.update(layer, torch.arange(3), k3, -k3)
    torch.testing.assert_close(k_all, k3)
    torch.testing.assert_close(v_all, -k3)
    cache.reset()
    with pytest.raises(ValueError, match="write layer 0"):  # reset forgets the last step's slots
        cache.write(1, torch.arange(3), k3, k3)


def test_a_write_that_would_leave_stale_tokens_is_refused():
    """Writing position 5 of a 12-token row would leave tokens 6..11 for the paged kernel to read: refused, and the
    row is left as it was."""
    cfg = tiny_config()
    cache = PagedKVCache(cfg, 1, 64, torch.float32, "cpu", block_size=4)
    k = torch.randn(1, cfg.n_kv_heads, 12, cfg.head_dim)
    for layer in range(cfg.n_layers):
        cache.update(layer, torch.arange(12), k, k)
    with pytest.raises(ValueError, match="stale tokens"):
        cache.update(0, torch.tensor([5]), k[:, :, :1], k[:, :, :1])
    assert cache.blocks.length(0) == 12 and cache.length == 12


def test_two_switches_that_both_pick_the_kv_cache_are_refused():
    """A second KV-cache switch (here a quantized one, registered as a later lesson would) on together with
    paged_kv: the row would run one cache while its label names both, so apply_switches refuses."""
    import functools

    from llmlab import switches
    from llmlab.engine import LLM
    from llmlab.cache.kv_quant import QuantizedKVCache

    def quant(llm, value, kwargs):
        if value:
            kwargs["cache_factory"] = functools.partial(QuantizedKVCache, residual=8)
        return llm

    switches.register(switches.Switch("test_quant_kv", "int8 KV", False, "int8 KV cache", quant))
    try:
        llm = LLM(tiny_model(seed=0), name="tiny")
        with pytest.raises(ValueError, match="'paged_kv' and 'test_quant_kv' both set generate's cache_factory"):
            switches.apply_switches(llm, {"paged_kv": True, "test_quant_kv": True})
        for one in ("paged_kv", "test_quant_kv"):
            assert "cache_factory" in switches.apply_switches(llm, {one: True})[1]
    finally:
        del switches.SWITCHES["test_quant_kv"]


def test_numpy_counts_build_the_caches():
    """generate takes numpy integers; the caches do too (their message used to say 'give a whole number')."""
    np = pytest.importorskip("numpy")
    from llmlab.cache.kv_quant import QuantizedKVCache, quantized_cache

    cfg = tiny_config()
    for cache in (KVCache(cfg, np.int64(2), np.int64(32), torch.float32, "cpu"),
                  PagedKVCache(cfg, np.int64(2), np.int64(32), torch.float32, "cpu", block_size=np.int64(8)),
                  QuantizedKVCache(cfg, np.int64(2), np.int64(32), torch.float32, "cpu"),
                  quantized_cache(np.int64(4))(cfg, 2, 32, torch.float32, "cpu")):
        assert type(cache.max_seq_len) is int and cache.max_seq_len == 32
    assert type(cache.residual) is int and cache.residual == 4
    with pytest.raises(TypeError, match="batch_size=2.5"):
        KVCache(cfg, 2.5, 32, torch.float32, "cpu")


def test_generate_refuses_a_pool_too_small_for_the_run_before_the_prefill():
    """One generate call cannot free or preempt a row: a fixed pool that cannot hold the whole run is refused up
    front, with the count that fits, and the same call with that count runs."""
    import functools

    model = tiny_model()
    ids = prompt_ids(2, 9)
    # the last token is sampled, never cached: 2 rows x ceil((9 + 4 - 1) / 4) = 6 blocks, exactly
    small = functools.partial(PagedKVCache, block_size=4, num_blocks=5)
    with pytest.raises(ValueError, match=r"num_blocks=5 blocks of 4 tokens, and this call needs 6: 2 rows x "
                                         r"ceil\(12 cached tokens .*give num_blocks >= 6"):
        generate(model, ids, max_new_tokens=4, cache_factory=small)
    fits = functools.partial(PagedKVCache, block_size=4, num_blocks=6)
    assert generate(model, ids, max_new_tokens=4, cache_factory=fits).token_ids == \
        generate(model, ids, max_new_tokens=4).token_ids
