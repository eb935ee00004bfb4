"""Grouped-query attention: query head h reads KV head h // (n_heads / n_kv_heads).

`llmlab.model.Attention` is compared with a reference written as a plain per-head Python loop — its own RoPE
(angle = position * theta^(-2j/hd) on channel pairs (j, j + hd/2)), its own causal (and sliding-window) mask and an
explicit softmax(q k^T / sqrt(hd)) v — with and without the KV cache.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmlab.config import ModelConfig
from llmlab.cache.kv_cache import KVCache
from llmlab.model import Attention, RotaryEmbedding
from tiny_models import randomize_

HEAD_DIM, THETA = 8, 10000.0


def make(n_heads: int, n_kv_heads: int, bias: bool = False, window: int | None = None, seed: int = 0):
    config = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         head_dim=HEAD_DIM, intermediate_size=16, rope_theta=THETA, max_seq_len=64,
                         attention_bias=bias, sliding_window=window)
    attn = randomize_(Attention(config, layer_idx=0), std=0.3, seed=seed)
    return config, attn


def rope_ref(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x: (B, T, hd) one head; rotate each channel pair (j, j + hd/2) by pos * theta^(-2j/hd)."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for j in range(half):
        angle = pos.double() * THETA ** (-2.0 * j / x.shape[-1])  # (T,)
        c, s = angle.cos().float(), angle.sin().float()
        a, b = x[..., j], x[..., j + half]
        out[..., j] = a * c - b * s
        out[..., j + half] = b * c + a * s
    return out


def attention_ref(attn: Attention, x: torch.Tensor, window: int | None = None, head_map=None) -> torch.Tensor:
    """The reference: loop over query heads; head h uses KV head head_map(h) (default h // n_rep)."""
    B, T, _ = x.shape
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    head_map = head_map or (lambda h: h // (H // Hkv))
    q = attn.q_proj(x).view(B, T, H, hd)
    k = attn.k_proj(x).view(B, T, Hkv, hd)
    v = attn.v_proj(x).view(B, T, Hkv, hd)
    pos = torch.arange(T)
    allowed = pos[None, :] <= pos[:, None]  # (T, T): key j visible to query i if j <= i
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    out = torch.empty(B, T, H, hd)
    for h in range(H):
        g = head_map(h)
        qh, kh, vh = rope_ref(q[:, :, h], pos), rope_ref(k[:, :, g], pos), v[:, :, g]  # (B, T, hd)
        scores = qh @ kh.transpose(1, 2) / math.sqrt(hd)  # (B, T, T)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, :, h] = scores.softmax(-1) @ vh
    return attn.o_proj(out.reshape(B, T, H * hd))


def run_module(config: ModelConfig, attn: Attention, x: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(x.shape[1])
    cos, sin = RotaryEmbedding(config)(pos, x.dtype)
    return attn(x, cos, sin, pos)


SHAPES = [(8, 2), (8, 1), (8, 8), (6, 3), (12, 4), (4, 2)]


@pytest.mark.parametrize("n_heads,n_kv_heads", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_attention_matches_per_head_loop(n_heads, n_kv_heads, bias):
    config, attn = make(n_heads, n_kv_heads, bias)
    x = torch.randn(2, 11, config.dim, generator=torch.Generator().manual_seed(5))
    got, ref = run_module(config, attn, x), attention_ref(attn, x)
    assert got.shape == (2, 11, config.dim)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 2), (6, 3), (12, 4)])
@torch.no_grad()
def test_other_head_mapping_differs(n_heads, n_kv_heads):
    """Teeth: the `h % n_kv_heads` mapping (what `kv.repeat(1, n_rep, 1, 1)` would do) gives a different output."""
    config, attn = make(n_heads, n_kv_heads)
    x = torch.randn(2, 11, config.dim, generator=torch.Generator().manual_seed(5))
    wrong = attention_ref(attn, x, head_map=lambda h: h % n_kv_heads)
    assert (run_module(config, attn, x) - wrong).abs().max() > 1e-2


@pytest.mark.parametrize("window", [1, 3, 8])
@torch.no_grad()
def test_sliding_window_matches_reference(window):
    config, attn = make(8, 2, window=window)
    x = torch.randn(2, 11, config.dim, generator=torch.Generator().manual_seed(6))
    got = run_module(config, attn, x)
    torch.testing.assert_close(got, attention_ref(attn, x, window=window), rtol=1e-5, atol=1e-5)
    assert (got - attention_ref(attn, x, window=None)).abs().max() > 1e-2  # the window changed something


@pytest.mark.parametrize("n_heads,n_kv_heads,window", [(8, 2, None), (8, 1, None), (6, 3, 4)])
@torch.no_grad()
def test_attention_with_kv_cache_matches_reference(n_heads, n_kv_heads, window):
    """Prefill 6 tokens into the cache, then one token at a time: outputs equal the full-sequence reference."""
    config, attn = make(n_heads, n_kv_heads, window=window)
    T = 13
    x = torch.randn(2, T, config.dim, generator=torch.Generator().manual_seed(7))
    ref = attention_ref(attn, x, window=window)
    rope = RotaryEmbedding(config)
    cache = KVCache(config, batch_size=2, max_seq_len=T, dtype=torch.float32, device="cpu")
    outs = []
    for start, end in [(0, 6)] + [(t, t + 1) for t in range(6, T)]:
        pos = torch.arange(start, end)
        cos, sin = rope(pos, x.dtype)
        outs.append(attn(x[:, start:end], cos, sin, pos, kv_cache=cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, rtol=1e-5, atol=1e-5)
    assert cache.length == T
    # the cache holds Hkv heads, not H: GQA's memory saving
    assert cache.k[0].shape == (2, n_kv_heads, T, HEAD_DIM)


def test_kv_cache_bytes_shrink_with_gqa():
    mha = ModelConfig(dim=64, n_layers=3, n_heads=8, n_kv_heads=8, intermediate_size=32, vocab_size=16)
    gqa = ModelConfig(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, intermediate_size=32, vocab_size=16)
    assert KVCache.bytes_per_token(gqa, torch.bfloat16) == 2 * 3 * 2 * 8 * 2
    assert KVCache.bytes_per_token(mha, torch.bfloat16) == 4 * KVCache.bytes_per_token(gqa, torch.bfloat16)
    assert KVCache.bytes_per_token(gqa, torch.float32) == 2 * KVCache.bytes_per_token(gqa, torch.bfloat16)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 3), (6, 4), (4, 8)])
def test_heads_not_divisible_names_both_numbers(n_heads, n_kv_heads):
    with pytest.raises(ValueError) as e:
        ModelConfig(dim=8 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads)
    msg = str(e.value)
    assert f"n_heads={n_heads}" in msg and f"n_kv_heads={n_kv_heads}" in msg


def test_heads_not_divisible_from_hf_config():
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=64, num_hidden_layers=1,
              num_attention_heads=8, num_key_value_heads=3, intermediate_size=32)
    with pytest.raises(ValueError, match=r"n_heads=8.*n_kv_heads=3"):
        ModelConfig.from_hf_config(hf)
