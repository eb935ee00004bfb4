"""`PagedKVCache.write` + `PagedKVCache.decode_attention` (the Triton paged kernel reading the pool in place) give
the attention of `update` + SDPA over the gathered K/V: fp32, within 1e-5, block sizes 16 and 32, rows of different
lengths, forked rows; the block tables are built once per decode step, not once per layer.

CPU: Triton's interpreter in fp32 (TRITON_INTERPRET=1 from conftest.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels._util import interpret_mode
from llmlab.model import repeat_kv
from llmlab.cache.paged_cache import PagedKVCache
from tiny_models import tiny_config

needs_kernel = pytest.mark.skipif(not torch.cuda.is_available() and not interpret_mode(),
                                  reason="no CUDA GPU and TRITON_INTERPRET is not set")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = tiny_config(n_layers=2, max_seq_len=512)  # 8 query heads, 2 KV heads (GQA), head_dim 16
TOL = dict(atol=1e-5, rtol=1e-5)


def _cache(block_size: int, max_len: int, seed: int, batch: int = 2, dtype=torch.float32,
           config=CONFIG) -> PagedKVCache:
    """A paged cache whose free list is shuffled (a row's blocks are scattered in the pool) and whose pool is NaN:
    a slot the kernel reads without having been written shows up in the output."""
    n_blocks = batch * (-(-max_len // block_size)) + 5
    cache = PagedKVCache(config, batch, max_len, dtype, DEV, block_size=block_size, num_blocks=n_blocks)
    for pool in (*cache.k, *cache.v):
        pool.fill_(float("nan"))
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    cache.blocks.free_list.clear()
    cache.blocks.free_list.extend(order)
    return cache


def _kv(B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per layer: k, v (L, B, Hkv, T, hd) and decode queries q (L, B, H, 1, hd), fp32."""
    g = torch.Generator().manual_seed(seed)
    L, Hkv, H, hd = CONFIG.n_layers, CONFIG.n_kv_heads, CONFIG.n_heads, CONFIG.head_dim
    k, v = torch.randn(L, B, Hkv, T, hd, generator=g), torch.randn(L, B, Hkv, T, hd, generator=g)
    q = torch.randn(L, B, H, 1, hd, generator=g)
    return k.to(DEV), v.to(DEV), q.to(DEV)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The model's decode attention: q (B, H, 1, hd) over k, v (B, Hkv, S, hd) -> (B, H, 1, hd)."""
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep))


def _count_calls(cache: PagedKVCache, method: str) -> list[int]:
    """Wrap one method of this cache object; the returned list grows by one item per call."""
    calls = []
    original = getattr(cache, method)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(cache, method, counted)
    return calls


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 33, 300])
def test_kernel_equals_update_and_sdpa_rows_of_different_lengths(block_size, length):
    short = max(1, length // 2)  # row 1 holds `short` tokens, row 0 `length`
    k, v, q = _kv(2, length, seed=length)
    ref, cache = _cache(block_size, length, seed=length), _cache(block_size, length, seed=length)
    gathered = {}  # (layer, row) -> that row's K, V (1, Hkv, S, hd) returned by update
    for start, end, rows in ((0, short, 2), (short, length, 1)):  # both rows, then row 0 alone
        if start == end:
            continue
        pos = torch.arange(start, end, device=DEV)
        for layer in range(CONFIG.n_layers):
            kk, vv = k[layer, :rows, :, start:end], v[layer, :rows, :, start:end]
            k_all, v_all = ref.update(layer, pos, kk, vv)
            cache.write(layer, pos, kk, vv)
            for b in range(rows):
                gathered[layer, b] = k_all[b:b + 1], v_all[b:b + 1]

    builds = _count_calls(cache, "block_tables")
    for layer in range(CONFIG.n_layers):
        out = cache.decode_attention(layer, q[layer])
        assert out.shape == q[layer].shape and out.dtype == torch.float32
        for b, n in enumerate((length, short)):
            k_ref, v_ref = gathered[layer, b]
            assert k_ref.shape[2] == n
            torch.testing.assert_close(out[b:b + 1], _sdpa(q[layer, b:b + 1], k_ref, v_ref), **TOL)
    assert len(builds) == 1  # one block-table tensor for both layers of the step


@needs_kernel
def test_decode_steps_across_a_block_boundary_rebuild_tables_once_per_step():
    """The model's order within a step (write layer 0, attend layer 0, write layer 1, ...): 15 -> 18 tokens with
    16-token blocks; a table kept from the previous step would miss the new block and the new token."""
    B, steps, prefill = 2, 3, 15
    k, v, q = _kv(B, prefill + steps, seed=1)
    ref, cache = _cache(16, prefill + steps, seed=1), _cache(16, prefill + steps, seed=1)
    builds = _count_calls(cache, "block_tables")
    pos = torch.arange(prefill, device=DEV)
    for layer in range(CONFIG.n_layers):
        ref.update(layer, pos, k[layer, :, :, :prefill], v[layer, :, :, :prefill])
        cache.write(layer, pos, k[layer, :, :, :prefill], v[layer, :, :, :prefill])
    for t in range(prefill, prefill + steps):
        pos = torch.tensor([t], device=DEV)
        for layer in range(CONFIG.n_layers):
            kt, vt = k[layer, :, :, t:t + 1], v[layer, :, :, t:t + 1]
            expected = _sdpa(q[layer], *ref.update(layer, pos, kt, vt))
            cache.write(layer, pos, kt, vt)
            torch.testing.assert_close(cache.decode_attention(layer, q[layer]), expected, **TOL)
    assert len(builds) == steps
    assert cache.length == ref.length == prefill + steps


@needs_kernel
def test_forked_row_reads_its_copy_on_write_block():
    """Row 1 forks row 0 at 20 tokens (sharing the half-full second block); writing token 20 copies that block for
    one row; both rows then read the shared prefix and their own token 20."""
    k, v, q = _kv(2, 21, seed=2)
    caches = _cache(16, 21, seed=2), _cache(16, 21, seed=2)
    pos = torch.arange(20, device=DEV)
    for cache in caches:
        for layer in range(CONFIG.n_layers):
            cache.write(layer, pos, k[layer, :1, :, :20], v[layer, :1, :, :20])
        cache.blocks.fork(0, 1)
        cache.batch_size = 2
    ref, cache = caches
    last = torch.tensor([20], device=DEV)
    for layer in range(CONFIG.n_layers):
        kt, vt = k[layer, :, :, 20:], v[layer, :, :, 20:]
        expected = _sdpa(q[layer], *ref.update(layer, last, kt, vt))
        cache.write(layer, last, kt, vt)
        torch.testing.assert_close(cache.decode_attention(layer, q[layer]), expected, **TOL)
    t0, t1 = cache.blocks.block_table(0), cache.blocks.block_table(1)
    assert t0[0] == t1[0] and t0[1] != t1[1]  # the first block is shared, the second was copied


@needs_kernel
@torch.no_grad()
@pytest.mark.parametrize("via", ["modules", "step"])
def test_triton_switch_decodes_from_the_pool_like_the_pytorch_path(via):
    """The kernel modules (llmlab.kernels.modules.swap_in), run by the model itself or by the kernels' decode step
    (KernelDecodeStep), on a paged cache: a decode step calls write + decode_attention in every layer, and the
    logits equal the PyTorch path's (update + SDPA)."""
    from llmlab.kernels.decode_step import KernelDecodeStep
    from llmlab.kernels.modules import swap_in, swap_out
    from tiny_models import tiny_model

    model = tiny_model(seed=0).to(DEV)
    ids = torch.randint(0, 256, (2, 15), generator=torch.Generator().manual_seed(0)).to(DEV)

    def prefill_then_decode(fwd, cache, steps=3):
        out = [fwd(ids, kv_cache=cache)[:, -1:]]
        for t in range(ids.shape[1], ids.shape[1] + steps):  # 15 -> 18 tokens: crosses a 16-token block
            out.append(fwd(out[-1].argmax(-1), torch.tensor([t], device=DEV), kv_cache=cache))
        return torch.cat(out, dim=1)

    ref = prefill_then_decode(model, _cache(16, 18, seed=6, config=model.config))
    cache = _cache(16, 18, seed=6, config=model.config)
    calls = _count_calls(cache, "decode_attention")
    swap_in(model)
    try:
        got = prefill_then_decode(model if via == "modules" else KernelDecodeStep(model), cache)
    finally:
        swap_out(model)
    assert len(calls) == 3 * model.config.n_layers
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_reset_drops_the_step_tables():
    k, v, q = _kv(1, 20, seed=3)
    cache = _cache(16, 20, seed=3, batch=1)
    cache.write(0, torch.arange(20, device=DEV), k[0, :, :, :20], v[0, :, :, :20])
    cache.decode_attention(0, q[0])
    cache.reset()
    with pytest.raises(ValueError, match=r"rows \[0\] of the batch hold no tokens; write their K/V"):
        cache.decode_attention(0, q[0])


def test_rejects_a_prefill_query():
    cache = _cache(16, 20, seed=4, batch=1)
    with pytest.raises(ValueError, match=r"\(B, H, 1, hd\).*use update"):
        cache.decode_attention(0, torch.zeros(1, CONFIG.n_heads, 3, CONFIG.head_dim, device=DEV))


def test_clear_error_when_triton_cannot_run(monkeypatch):
    cache = _cache(16, 20, seed=5, batch=1)
    q = torch.zeros(1, CONFIG.n_heads, 1, CONFIG.head_dim, device=DEV)
    monkeypatch.setattr("llmlab.kernels._util.triton_status", lambda: (False, "triton is not installed"))
    with pytest.raises(ValueError, match=r"cannot run here: triton is not installed; decode with "
                                         r"PagedKVCache.update \(gather \+ SDPA\) instead"):
        cache.decode_attention(0, q)


def test_clear_error_for_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at call time by llmlab.kernels._util
    cache = PagedKVCache(CONFIG, 1, 20, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"CUDA GPU.*PagedKVCache.update"):
        cache.decode_attention(0, torch.zeros(1, CONFIG.n_heads, 1, CONFIG.head_dim))


@pytest.mark.skipif(not interpret_mode(), reason="bf16 is refused only by Triton's CPU interpreter")
def test_clear_error_for_bf16_in_the_interpreter():
    cache = PagedKVCache(CONFIG, 1, 20, torch.bfloat16, "cpu")
    q = torch.zeros(1, CONFIG.n_heads, 1, CONFIG.head_dim, dtype=torch.bfloat16)
    cache.write(0, torch.arange(1), q[:, :2], q[:, :2])  # (1, Hkv, 1, hd)
    with pytest.raises(ValueError, match=r"no bf16 arithmetic; use fp32 on a CPU; or decode with "
                                         r"PagedKVCache.update"):
        cache.decode_attention(0, q)
