"""A Llama-family decoder written from scratch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The same code runs Llama 2/3, Mistral and Qwen2 checkpoints; their differences are config switches (GQA ratio,
tied embeddings, q/k/v bias, Llama-3 RoPE scaling, sliding window). Module and parameter names follow the Hugging
Face checkpoints (`layers.0.self_attn.q_proj.weight`, ...), so loading a checkpoint is a name-for-name copy.

Classes go bottom-up: RMSNorm -> RotaryEmbedding -> Attention -> MLP -> Block -> Transformer.

Shapes: B = batch, T = new tokens in this call, S = tokens attended to (cached + new), D = dim,
H = query heads, Hkv = KV heads, hd = head_dim, V = vocab.

Papers: Llama (Touvron et al. 2023, https://arxiv.org/abs/2302.13971), RMSNorm (Zhang & Sennrich 2019,
https://arxiv.org/abs/1910.07467), RoPE (Su et al. 2021, https://arxiv.org/abs/2104.09864), GQA (Ainslie et al.
2023, https://arxiv.org/abs/2305.13245), SwiGLU (Shazeer 2020, https://arxiv.org/abs/2002.05202).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab.config import ModelConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back to the input dtype.

    Cheaper than LayerNorm (no mean subtraction, no bias). x: (..., D) any float dtype -> same shape and dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/hd), i = 0..hd/2-1, with Llama-3 rescaling if configured. (hd/2,) fp32.

    Llama 3.1 stretches low frequencies (long wavelengths) by `factor`, keeps high ones, and blends in between
    (https://github.com/meta-llama/llama-models, `apply_scaling`).
    """
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = config.rope_scaling
    if rs is None or rs.get("rope_type", rs.get("type")) in (None, "default"):
        return inv_freq
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)  # long wavelengths: divide
    smooth = (old_ctx / wavelen - lo) / (hi - lo)  # 0 at the low edge, 1 at the high edge
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: rotates each (x_i, x_{i+hd/2}) channel pair by angle pos * inv_freq_i.

    Uses the "rotate half" channel pairing of the Hugging Face checkpoints. cos/sin are computed in fp32 per call
    from positions, so there is no table to outgrow.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) would round inv_freq to bf16 and shift every angle; recompute it in fp32 instead
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) or (B, T) int64 -> cos, sin: (..., T, hd) in `dtype`."""
        angles = positions.float()[..., None] * self.inv_freq  # (..., T, hd/2)
        angles = torch.cat([angles, angles], dim=-1)  # (..., T, hd)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, hd); cos/sin: (T, hd) or (B, T, hd) -> same shape as x."""
    if cos.dim() == 3:  # per-sequence positions: (B, T, hd) -> (B, 1, T, hd)
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, S, hd) -> (B, Hkv * n_rep, S, hd): query head i reads KV head i // n_rep.

    Written as expand + reshape (the same values as `repeat_interleave(n_rep, dim=1)`): the expand is a view, and
    the reshape copies it into n_rep x the KV bytes — a GPU kernel with fixed shapes and no host sync, so it can be
    captured in a CUDA graph. The fused decode kernels (`llmlab.kernels`) read each KV head once instead.
    """
    if n_rep == 1:
        return x
    B, Hkv, S, hd = x.shape
    return x[:, :, None].expand(B, Hkv, n_rep, S, hd).reshape(B, Hkv * n_rep, S, hd)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean mask, True where a query may attend to a key: causal (key pos <= query pos), optionally local.

    q_pos: (T,) positions of the new tokens, k_pos: (S,) positions of the keys -> (T, S) bool.
    """
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


# The attention paths (`attention_path`): which attention a layer runs
STATIC_DECODE, STATIC, PAGED_DECODE, DECODE, CAUSAL = "static_decode", "static", "paged_decode", "decode", "causal"


def attention_path(T: int, kv_cache, mask, sliding_window: int | None) -> str:
    """Which attention runs for T new tokens: the one rule that `Attention` and the Triton kernels' attention
    (`llmlab.kernels.modules.TritonAttention`) both follow.

        "static_decode"  one new token per row on a static cache (`mask` given), no sliding window
        "static"         a static cache otherwise: its whole buffer, `mask` hiding what a query may not see
        "paged_decode"   one new token, no sliding window, a cache that attends from its own block pool (it has
                         `decode_attention`: `llmlab.cache.paged_cache.PagedKVCache`)
        "decode"         one new token, no sliding window, another KV cache: it may see every cached token
        "causal"         anything else (a prompt, a chunk after cached tokens, a sliding window)

    PyTorch (`sdpa_attention`) runs a static path with the mask and the other decode paths unmasked; the kernels
    run the three decode paths with flash-decoding kernels that read only the filled part of the cache.
    """
    one_token = T == 1 and sliding_window is None
    if mask is not None:
        return STATIC_DECODE if one_token else STATIC
    if one_token and kv_cache is not None:
        return PAGED_DECODE if hasattr(kv_cache, "decode_attention") else DECODE
    return CAUSAL


def sdpa_attention(path: str, q, k, v, positions, mask=None, cached: bool = False,
                   sliding_window: int | None = None) -> torch.Tensor:
    """The attention of `path` (`attention_path`) with PyTorch's SDPA, scale 1/sqrt(hd).

    q: (B, H, T, hd); k, v: (B, H, S, hd), already repeated for GQA -> (B, H, T, hd). cached: k and v are a KV
    cache's (slot s = position s); positions: (T,) of the new tokens.
    """
    if path in (STATIC_DECODE, STATIC):  # every slot of the buffer, the unwritten ones masked out
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if path in (DECODE, PAGED_DECODE):  # the new token may see every cached token
        return F.scaled_dot_product_attention(q, k, v)
    T, S = q.shape[2], k.shape[2]
    if sliding_window is None and S == T:  # a fresh sequence: plain causal (lets SDPA use flash kernels)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # a chunk after cached tokens, or a sliding window: an explicit mask (T, S)
    k_pos = torch.arange(S, device=q.device) if cached else positions
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(positions, k_pos, sliding_window))


class Attention(nn.Module):
    """Grouped-query self-attention: H query heads share Hkv key/value heads (H % Hkv == 0)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.n_rep = config.n_rep
        self.sliding_window = config.sliding_window
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=bias)
        # Llama's attention_bias also biases the output projection; Qwen2's biases only q/k/v
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=config.o_proj_bias)

    def forward(self, x, cos, sin, positions, kv_cache=None, mask=None) -> torch.Tensor:
        """x: (B, T, D); positions: (T,) int64 absolute positions of the new tokens ((B, T) with a static cache).

        Without a cache the T tokens attend to each other (causally). With a cache, their K/V are written at
        `positions` and the queries attend to everything cached so far. `mask` (B or 1, 1, T, S) comes with a static
        cache (`llmlab.cache.static_cache`): its buffers are attended whole, the mask (additive: 0 or -inf) hides the
        slots a query may not see. Which attention runs is `attention_path`'s choice.
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        path = attention_path(T, kv_cache, mask, self.sliding_window)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, positions, k, v)  # (B, Hkv, S, hd), all cached tokens
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, H, S, hd)
        y = sdpa_attention(path, q, k, v, positions, mask, kv_cache is not None, self.sliding_window)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*hd)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). x: (B, T, D) -> (B, T, D)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, positions, kv_cache=None, mask=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, kv_cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def default_positions(T: int, kv_cache, device) -> torch.Tensor:
    """Positions 0..T-1 (T,) int64 for a forward pass given none: a fresh sequence.

    Raises ValueError when the cache already holds tokens: 0..T-1 would silently rewrite it from the start."""
    held = getattr(kv_cache, "length", 0)
    if isinstance(held, int) and held > 0:
        raise ValueError(f"the KV cache already holds {held} tokens and no positions were given: pass "
                         f"positions=torch.arange({held}, {held} + T) to continue the sequence (or positions "
                         f"from 0 to start it over)")
    return torch.arange(T, device=device)


class Transformer(nn.Module):
    """The decoder: token embedding -> n_layers Blocks -> RMSNorm -> lm_head (tied to the embedding or not).

    `Transformer(config)` has random weights (normal, std 0.02) — fine for measuring speed, meaningless as text.
    Load trained weights with `llmlab.checkpoint.load_model`.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(config)
        self.apply(self._init_weights)

    @staticmethod
    @torch.no_grad()
    def _init_weights(module: nn.Module) -> None:
        """normal(0, 0.02) matrices, zero biases, unit norms. Each matrix is drawn in fp32 and rounded to the
        parameter's dtype, so a model laid out in bf16 and initialised here (`llmlab.engine.random_model`) gets
        the weights of one built in fp32 and cast, without an fp32 copy of the whole model."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            w = module.weight
            w.copy_(torch.empty(w.shape, dtype=torch.float32, device=w.device).normal_(0.0, 0.02))
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        kv_cache=None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run the decoder over T new tokens.

        Args:
            input_ids: (B, T) int64 token ids.
            positions: (T,) int64 absolute positions of these tokens; default 0..T-1 (a fresh sequence: with a
                cache that already holds tokens, positions must be given). With a
                static cache also (B, T): one position per row (the rows of a decode batch may be at different
                lengths).
            kv_cache: None (attend only within input_ids: training, and the no-cache reference) or a cache object
                with `update(layer, positions, k, v) -> (k_all, v_all)` (`llmlab.cache.kv_cache.KVCache`). A cache that
                also has `attention_mask(positions, sliding_window)` (`llmlab.cache.static_cache.StaticKVCache`) returns
                its whole buffer and the mask, built once per call, hides the slots each query may not see.
            last_only: compute logits for the last position only (what generation needs; saves a (T, V) matmul).

        Returns:
            logits: (B, T, V), or (B, 1, V) with last_only, in the model's dtype.

        Raises:
            ValueError: empty input_ids; no positions with a KV cache that already holds tokens.
        """
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids is empty: give at least one token")
        if positions is None:
            positions = default_positions(T, kv_cache, input_ids.device)
        x = self.embed_tokens(input_ids)  # (B, T, D)
        cos, sin = self.rope(positions, x.dtype)  # (T, hd), or (B, T, hd) for per-row positions
        mask = None
        if hasattr(kv_cache, "attention_mask"):  # a static cache: one mask for all layers, built on the device
            mask = kv_cache.attention_mask(positions, self.config.sliding_window)  # (B or 1, 1, T, S)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, kv_cache, mask)
        if last_only:
            x = x[:, -1:, :]
        return self.lm_head(self.norm(x))  # (B, T, V)
