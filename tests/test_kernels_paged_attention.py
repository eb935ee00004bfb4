"""Triton paged decode attention (block tables) against gather + SDPA.

CPU: Triton's interpreter in fp32 (TRITON_INTERPRET=1 from conftest.py); fp16/bf16 on a GPU only.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels.decode_attention import decode_attention_reference  # noqa: E402
from llmlab.kernels.paged_decode_attention import (  # noqa: E402
    paged_decode_attention, paged_decode_attention_reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float16, torch.bfloat16)]


def _paged(lens, H=4, Hkv=2, hd=16, bs=16, dtype=torch.float32, seed=0, poison=True):
    """A shuffled pool holding len(lens) sequences; unused pool slots hold NaN when `poison`."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // bs) for n in lens]
    n_blocks = sum(nbs) + 3  # spare blocks never referenced
    fill = float("nan") if poison else 0.0
    k_pool = torch.full((n_blocks, Hkv, bs, hd), fill)
    v_pool = torch.full((n_blocks, Hkv, bs, hd), fill)
    perm = torch.randperm(n_blocks, generator=g)
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
    i = 0
    for b, (n, nb) in enumerate(zip(lens, nbs)):
        blocks = perm[i:i + nb]
        i += nb
        tables[b, :nb] = blocks.int()
        for j, blk in enumerate(blocks.tolist()):
            used = min(bs, n - j * bs)  # the tail of the last block stays poisoned
            k_pool[blk, :, :used] = torch.randn(Hkv, used, hd, generator=g)
            v_pool[blk, :, :used] = torch.randn(Hkv, used, hd, generator=g)
    q = torch.randn(len(lens), H, hd, generator=g)
    to = dict(device=DEV, dtype=dtype)
    return q.to(**to), k_pool.to(**to), v_pool.to(**to), tables.to(DEV), torch.tensor(lens, device=DEV)


@pytest.mark.parametrize("S", [1, 7, 17, 999, 1001, 4095])
def test_matches_gather_and_sdpa_over_context_lengths(S):
    q, kp, vp, tables, lens = _paged([S], H=2, Hkv=1, bs=64, seed=S)
    out = paged_decode_attention(q, kp, vp, tables, lens, num_splits=3)
    assert torch.isfinite(out).all()  # NaN in unused slots and spare blocks never leaks in
    torch.testing.assert_close(out, paged_decode_attention_reference(q, kp, vp, tables, lens), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, *GPU_DTYPES])
@pytest.mark.parametrize("bs", [1, 8, 16, 32])
def test_block_sizes_gqa_and_ragged_batches(bs, dtype):
    q, kp, vp, tables, lens = _paged([50, 1, 33], H=6, Hkv=2, hd=24, bs=bs, dtype=dtype, seed=bs)
    out = paged_decode_attention(q, kp, vp, tables, lens, num_splits=2)
    torch.testing.assert_close(out, paged_decode_attention_reference(q, kp, vp, tables, lens), **TOL[dtype])


def test_equals_contiguous_decode_attention_on_the_same_tokens():
    q, kp, vp, tables, lens = _paged([40], seed=7, poison=False)
    k = kp[tables[0].long()].permute(1, 0, 2, 3).reshape(1, 2, -1, 16)[:, :, :40]
    v = vp[tables[0].long()].permute(1, 0, 2, 3).reshape(1, 2, -1, 16)[:, :, :40]
    torch.testing.assert_close(paged_decode_attention(q, kp, vp, tables, lens), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])


def test_rejects_bad_inputs():
    q, kp, vp, tables, lens = _paged([20])
    with pytest.raises(ValueError, match="seq_lens must lie in 1..32"):
        paged_decode_attention(q, kp, vp, tables, torch.tensor([33], device=DEV))
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kp, vp, tables.float(), lens)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q[:, :3], kp, vp, tables, lens)
    with pytest.raises(ValueError, match="block_tables has no columns"):
        paged_decode_attention(q, kp, vp, tables[:, :0], lens, check_lens=False)
    with pytest.raises(TypeError, match="scale must be a number"):
        paged_decode_attention(q, kp, vp, tables, lens, scale="x")
    with pytest.raises(TypeError, match="check_lens must be True or False"):
        paged_decode_attention(q, kp, vp, tables, lens, check_lens="no")


def test_strided_block_tables_and_lengths_are_read_as_their_values():
    """A transposed or sliced block table, and a strided int32 lengths view, mean what their values say."""
    q, kp, vp, tables, lens = _paged([40, 7, 33], seed=11)
    want = paged_decode_attention_reference(q, kp, vp, tables, lens)
    transposed = tables.t().contiguous().t()  # same values, stride (1, B)
    wide = torch.zeros(tables.shape[0], 2 * tables.shape[1], dtype=tables.dtype, device=DEV)
    wide[:, ::2] = tables  # a [:, ::2] view: stride (2 max_blocks, 2)
    spread = torch.zeros(2 * len(lens), dtype=torch.int32, device=DEV)
    spread[::2] = lens
    for t, n in ((transposed, lens), (wide[:, ::2], lens), (tables, spread[::2])):
        torch.testing.assert_close(paged_decode_attention(q, kp, vp, t, n, num_splits=2), want, **TOL[torch.float32])


def test_block_ids_outside_the_pool_and_bad_split_counts_are_refused():
    q, kp, vp, tables, lens = _paged([20])
    for bad_id in (kp.shape[0], -1):
        bad = tables.clone()
        bad[0, 1] = bad_id  # block 1 holds tokens 16..19: read
        with pytest.raises(ValueError, match=f"outside the pool's {kp.shape[0]} blocks"):
            paged_decode_attention(q, kp, vp, bad, lens)
    past = torch.cat([tables, torch.full_like(tables[:, :1], -1)], dim=1)  # an entry past the length: never read
    torch.testing.assert_close(paged_decode_attention(q, kp, vp, past, lens),
                               paged_decode_attention(q, kp, vp, tables, lens))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="num_splits must be a whole number"):
            paged_decode_attention(q, kp, vp, tables, lens, num_splits=bad)
    with pytest.raises(TypeError, match="must be int tensors"):
        paged_decode_attention(q, kp, vp, tables.tolist(), lens)
    assert torch.isfinite(paged_decode_attention(q, kp, vp, tables, lens)).all()  # still usable


def test_zero_kv_heads_and_small_int_lengths():
    q, kp, vp, tables, lens = _paged([20])
    with pytest.raises(ValueError, match="must be >= 1"):
        paged_decode_attention(q, kp[:, :0], vp[:, :0], tables, lens)
    want = paged_decode_attention(q, kp, vp, tables, lens)
    torch.testing.assert_close(paged_decode_attention(q, kp, vp, tables, lens.to(torch.uint8)), want)
