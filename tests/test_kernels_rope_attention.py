"""RoPE, the K/V write and decode attention in the attention's launch (llmlab/kernels/rope_attention.py) against
the ops one at a time: cos/sin as RotaryEmbedding computes them, RoPE, the cache write, SDPA."""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import decode_attention  # noqa: E402
from llmlab.kernels.rope_attention import rope_cache_attention, rope_cache_attention_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float16, torch.bfloat16)]
SPLITS = {  # one split; many splits and the merge kernel; a few splits merged by the last one
    "one": triton.Config({"BLOCK_N": 16, "SPLIT_N": 256, "FUSED_MERGE": False}),
    "merge": triton.Config({"BLOCK_N": 16, "SPLIT_N": 16, "FUSED_MERGE": False}),
    "fused": triton.Config({"BLOCK_N": 16, "SPLIT_N": 32, "FUSED_MERGE": True}),
}


def _case(B, H, Hkv, hd, S, dtype, lens=None, seed=0):
    """qkv, inv_freq, seq_lens and caches whose slots from each row's newest on hold NaN: the newest key and value
    must come from qkv, and no slot past it may be read."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, H + 2 * Hkv, hd, generator=g).to(DEV, dtype)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)).to(DEV)
    seq_lens = (torch.randint(1, S + 1, (B,), generator=g) if lens is None else torch.tensor(lens)).to(DEV)
    k_cache = torch.randn(B, Hkv, S, hd, generator=g).to(DEV, dtype)
    v_cache = torch.randn(B, Hkv, S, hd, generator=g).to(DEV, dtype)
    for b, n in enumerate(seq_lens.tolist()):
        k_cache[b, :, n - 1:] = float("nan")
        v_cache[b, :, n - 1:] = float("nan")
    return qkv, inv_freq, seq_lens, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, *GPU_DTYPES])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("B, H, Hkv, hd, S, lens", [
    (1, 4, 2, 16, 40, [40]), (1, 4, 2, 16, 40, [1]), (2, 8, 2, 32, 70, [17, 70]), (3, 4, 4, 6, 5, None),
    (1, 4, 1, 128, 130, [97])])
def test_equals_rope_then_cache_write_then_attention(B, H, Hkv, hd, S, lens, split, dtype):
    case = _case(B, H, Hkv, hd, S, dtype, lens)
    qkv, inv_freq, seq_lens, k_cache, v_cache = case
    ref = [t.clone() for t in case]
    before = qkv.clone()
    want = rope_cache_attention_reference(*ref[:3], ref[3], ref[4], n_heads=H)
    got = rope_cache_attention(qkv, inv_freq, seq_lens, k_cache, v_cache, n_heads=H, config=SPLITS[split])
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(k_cache, ref[3], equal_nan=True, **tol)  # each row's newest slot, rotated
    torch.testing.assert_close(v_cache, ref[4], equal_nan=True)
    assert int(torch.isnan(k_cache).sum()) == sum(S - n for n in seq_lens.tolist()) * Hkv * hd  # nothing past it
    assert torch.equal(qkv, before)  # the projection is read, not rotated in place


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_and_the_autotuned_split_give_the_same_answer(prefetch):
    case = _case(2, 8, 2, 64, 300, torch.float32, [300, 129], seed=3)
    ref = [t.clone() for t in case]
    want = rope_cache_attention_reference(*ref, n_heads=8)
    got = rope_cache_attention(*case, n_heads=8, prefetch_kv=prefetch)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(case[3], ref[3], equal_nan=True)


def test_equals_the_separate_launches_it_replaces():
    """The path the decode step took before: `rope_and_cache_` with inv_freq, then `decode_attention` on the
    rotated q — the same output and the same cache."""
    from llmlab.kernels.rope_cache import rope_and_cache_

    qkv, inv_freq, seq_lens, k_cache, v_cache = _case(1, 8, 2, 32, 50, torch.float32, [23], seed=5)
    q2, k2, v2 = qkv.clone(), k_cache.clone(), v_cache.clone()
    got = rope_cache_attention(qkv, inv_freq, seq_lens, k_cache, v_cache, n_heads=8)
    rope_and_cache_(q2, None, None, seq_lens - 1, k2, v2, n_heads=8, inv_freq=inv_freq)
    want = decode_attention.decode_attention(q2[:, :8], k2, v2, seq_lens=seq_lens)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(k_cache, k2, equal_nan=True)
    torch.testing.assert_close(v_cache, v2, equal_nan=True)


def test_bad_input_names_the_problem_and_leaves_the_cache_alone():
    qkv, inv_freq, seq_lens, k_cache, v_cache = _case(1, 4, 2, 16, 8, torch.float32, [5])
    kept = k_cache.clone()
    with pytest.raises(ValueError, match="q heads"):
        rope_cache_attention(qkv, inv_freq, seq_lens, k_cache, v_cache, n_heads=6)
    with pytest.raises(ValueError, match="inv_freq"):
        rope_cache_attention(qkv, inv_freq.double(), seq_lens, k_cache, v_cache, n_heads=4)
    with pytest.raises(ValueError, match="inv_freq"):
        rope_cache_attention(qkv, inv_freq[:4], seq_lens, k_cache, v_cache, n_heads=4)
    with pytest.raises(ValueError, match="seq_lens"):
        rope_cache_attention(qkv, inv_freq, seq_lens.float(), k_cache, v_cache, n_heads=4)
    with pytest.raises(ValueError, match="seq_lens"):
        rope_cache_attention(qkv, inv_freq, [5], k_cache, v_cache, n_heads=4)
    with pytest.raises(TypeError, match="one dtype"):
        rope_cache_attention(qkv.half(), inv_freq, seq_lens, k_cache, v_cache, n_heads=4)
    with pytest.raises(ValueError, match="contiguous"):
        strided = k_cache.transpose(2, 3).contiguous().transpose(2, 3)  # the same shape, hd not contiguous
        rope_cache_attention(qkv, inv_freq, seq_lens, strided, v_cache, n_heads=4)
    with pytest.raises(TypeError, match="config"):
        rope_cache_attention(qkv, inv_freq, seq_lens, k_cache, v_cache, n_heads=4, config={"BLOCK_N": 16})
    torch.testing.assert_close(k_cache, kept, equal_nan=True)
    rope_cache_attention(qkv, inv_freq, seq_lens, k_cache, v_cache, n_heads=4)  # and still works
