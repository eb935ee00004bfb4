"""Triton flash-decoding GQA attention against SDPA over repeat_kv'd K/V (llmlab.model.repeat_kv).

CPU: Triton's interpreter in fp32 (TRITON_INTERPRET=1 from conftest.py), small head counts to keep it quick;
fp16/bf16 run on a GPU only.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float16, torch.bfloat16)]


def _qkv(B, H, Hkv, S, hd, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, hd, generator=g).to(DEV, dtype)
    k = torch.randn(B, Hkv, S, hd, generator=g).to(DEV, dtype)
    v = torch.randn(B, Hkv, S, hd, generator=g).to(DEV, dtype)
    return q, k, v


@pytest.mark.parametrize("S", [1, 7, 17, 999, 1001, 4095])
def test_matches_sdpa_over_context_lengths(S):
    q, k, v = _qkv(1, 4, 2, S, 16, seed=S)
    torch.testing.assert_close(decode_attention(q, k, v, num_splits=3), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, *GPU_DTYPES])
@pytest.mark.parametrize("H,Hkv,hd", [(4, 4, 16), (6, 2, 24), (8, 1, 64)])
def test_gqa_ratios_head_dims_and_per_sequence_lengths(H, Hkv, hd, dtype):
    q, k, v = _qkv(3, H, Hkv, 130, hd, dtype, seed=H * hd)
    seq_lens = torch.tensor([130, 1, 77], device=DEV)
    out = decode_attention(q, k, v, seq_lens=seq_lens, num_splits=4)
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, seq_lens), **TOL[dtype])


@pytest.mark.parametrize("splits", [1, 2, 5, 64])
def test_split_count_does_not_change_the_answer(splits):
    q, k, v = _qkv(2, 2, 1, 300, 16, seed=splits)
    torch.testing.assert_close(decode_attention(q, k, v, num_splits=splits), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])


def test_cache_positions_past_seq_len_never_leak():
    # the unwritten tail of the cache holds NaN/inf: with seq_lens it must weigh exactly nothing
    q, k, v = _qkv(2, 4, 2, 200, 16)
    k[:, :, 150:], v[:, :, 150:] = float("nan"), float("inf")
    lens = torch.tensor([150, 3], device=DEV)
    out = decode_attention(q, k, v, seq_lens=lens, num_splits=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, lens), **TOL[torch.float32])


def test_strided_cache_views_and_4d_query():
    # KVCache.update returns k[:B, :, :end] views of a (max_batch, Hkv, max_seq, hd) buffer
    q, kbuf, vbuf = _qkv(3, 4, 2, 64, 16)
    k, v = kbuf[:2, :, :40], vbuf[:2, :, :40]
    q4 = q[:2, :, None]  # (B, H, 1, hd) as the model's decode step
    out = decode_attention(q4, k, v)
    assert out.shape == q4.shape
    torch.testing.assert_close(out[:, :, 0], decode_attention_reference(q[:2], k, v), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.gpu)])
def test_softmax_weights_sum_to_one_at_long_context(dtype):
    # with V = 1 everywhere the output is the sum of the softmax weights
    q, k, _ = _qkv(1, 2, 1, 2048, 16, dtype)
    q = q * 4  # peaky scores
    v = torch.ones_like(k)
    out = decode_attention(q, k, v, num_splits=4).float()
    assert torch.allclose(out, torch.ones_like(out), atol=1e-3)


def test_rejects_bad_inputs():
    q, k, v = _qkv(1, 3, 2, 8, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(q, k, v)
    q, k, v = _qkv(1, 4, 2, 8, 16)
    with pytest.raises(ValueError, match="one query token"):
        decode_attention(q[:, :, None].expand(1, 4, 2, 16), k, v)
    with pytest.raises(ValueError, match="seq_lens must lie in 1..8"):
        decode_attention(q, k, v, seq_lens=torch.tensor([9], device=DEV))
    with pytest.raises(ValueError, match="seq_lens must lie"):
        decode_attention(q, k, v, seq_lens=torch.tensor([0], device=DEV))
    with pytest.raises(TypeError, match="share one dtype"):
        decode_attention(q.double().half() if DEV == "cuda" else q, k.to(torch.float16), v)
    with pytest.raises(ValueError, match="empty"):
        decode_attention(q, k[:, :, :0], v[:, :, :0])
