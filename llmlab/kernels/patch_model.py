"""The "Triton kernels" switch: run an `llmlab.model.Transformer` with the kernels of this folder.

`enable(model)` gives the model and each of its RMSNorm, MLP and Attention modules a per-instance `forward` that
calls the Triton kernels; `disable(model)` deletes those attributes (and the fused weights below), so the classes'
own PyTorch `forward` — the reference path — runs again. What changes, per layer of a decode step:

* RMSNorm: one kernel instead of ~6 (square, mean, add eps, rsqrt, two products, casts), which also does the
  residual add before it (`h = h + attn` then `norm(h)`; the MLP's output is added by the next block's first norm,
  or by the final norm): no separate add kernels;
* q, k, v projections: ONE matmul over the three weights concatenated (and gate/up likewise): fewer, larger GEMVs,
  which use the memory bus better than three small ones. On first use the weights are moved into one tensor and
  each layer's parameter becomes a view of its rows (no extra memory; in-place edits of a weight reach the fused
  tensor); a weight replaced or moved afterwards makes it rebuild;
* RoPE: q and k rotated in place by one launch (they sit side by side in the fused projection's output); in a
  decode step on a static cache (CUDA graphs) the same launch also writes K and V into the cache;
* SwiGLU: silu(gate) * up in one kernel, reading the two halves of the fused output;
* decode attention (one new token, a KV cache): the flash-decoding kernel, over only the filled part of a static
  cache (the lengths are computed once per step, not per layer); over a paged cache with a `decode_attention`
  method (`llmlab.cache.paged_cache.PagedKVCache`) the paged kernel reads the block pool directly;
* a batch-1 decode step on a static cache (the CUDA-graph path at batch 1) goes further: the RMSNorms, SwiGLU and
  residual adds ride inside the GEMVs that read their outputs (`llmlab/kernels/fused_gemv.py`), seven launches per layer;
* the decode step's greedy token (`llmlab.runtime.cuda_graphs.decode_step`): one launch (`llmlab/kernels/argmax.py`) instead of
  ~6 PyTorch kernels (call AX, same-process A/B: 869 -> 855 us per step; 849 with the graph's outputs no longer
  copied, `llmlab.runtime.cuda_graphs`).

What stays in PyTorch: the other matmuls (cuBLAS), attention over more than one new token (prefill: SDPA's flash
kernels), a sliding window. A tensor a kernel cannot take (a CPU tensor without the interpreter, bf16 in the
interpreter) falls back to the PyTorch path with one warning saying why.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch
import torch.nn.functional as F

from ._util import interpret_mode, triton_status

_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"Triton kernels: falling back to PyTorch: {reason}", stacklevel=3)


def _kernel_ok(x: torch.Tensor) -> bool:
    """Can the kernels take this activation? Warns once (with the reason) when not."""
    if x.device.type == "cuda":
        return True
    if not interpret_mode():
        _warn_once(f"tensors on {x.device} (Triton needs a CUDA GPU, or TRITON_INTERPRET=1 on a CPU)")
        return False
    if x.dtype not in (torch.float32, torch.float16):
        _warn_once(f"{x.dtype} in Triton's CPU interpreter (no bf16 arithmetic there)")
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernels():
    # imported on first use so that `import llmlab.kernels.patch_model` needs no triton
    from . import argmax, decode_attention, fused_gemv, rmsnorm, rope, rope_cache, swiglu

    # the wrappers read shapes and device properties in Python: keep torch.compile from tracing into them
    disable = torch.compiler.disable
    return types.SimpleNamespace(rmsnorm=disable(rmsnorm.rmsnorm), swiglu=disable(swiglu.swiglu),
                                 rope_=disable(rope.rope_), rope_one=disable(rope.rope_one),
                                 rope_and_cache_=disable(rope_cache.rope_and_cache_),
                                 decode_attention=disable(decode_attention.decode_attention),
                                 fused_gemv=disable(fused_gemv.fused_gemv), argmax=disable(argmax.argmax))


def _rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _kernel_ok(x) or self.weight.dtype != x.dtype:
        return type(self).forward(self, x)
    return _kernels().rmsnorm(x, self.weight, self.eps)


_FUSED = {"_llmlab_fused_qkv": ("q_proj", "k_proj", "v_proj"), "_llmlab_fused_gate_up": ("gate_proj", "up_proj")}


def _fused_linear(owner: torch.nn.Module, attr: str) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """(weight, bias, split sizes) of owner's Linear layers `_FUSED[attr]` concatenated along the outputs.

    On first use the layers' weights (and biases) are copied into one tensor and each layer's parameter is made a
    VIEW of its rows: no second copy, and whatever writes a weight in place — `w.mul_()`, `w.data.copy_()`,
    `load_state_dict` — writes the fused tensor too. Kept in `owner.__dict__[attr]` (not a parameter: not saved,
    not moved by `.to()`); rebuilt when a parameter no longer lives there (replaced, or moved by `.to()`).
    """
    linears = [getattr(owner, name) for name in _FUSED[attr]]
    params = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
    cached = owner.__dict__.get(attr)
    if cached is not None and cached[0] == [p.data_ptr() for p in params]:  # still views of the fused tensors
        return cached[1:]
    with torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
        start = 0
        for lin in linears:  # each layer's weight becomes a view of its rows of the fused tensor
            rows = slice(start, start + lin.out_features)
            lin.weight.data = weight[rows]
            if bias is not None:
                lin.bias.data = bias[rows]
            start += lin.out_features
    sizes = [lin.out_features for lin in linears]
    owner.__dict__[attr] = ([p.data_ptr() for p in params], weight, bias, sizes)
    return weight, bias, sizes


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _kernel_ok(x):
        return type(self).forward(self, x)
    weight, _, (n_gate, _) = _fused_linear(self, "_llmlab_fused_gate_up")
    gate_up = F.linear(x, weight)  # (B, T, 2 * I): one GEMV for both projections
    return self.down_proj(_kernels().swiglu(gate_up[..., :n_gate], gate_up[..., n_gate:]))


def _row_positions(positions: torch.Tensor, B: int) -> torch.Tensor:
    """(B,) the cache slot of each row's (last) new token: positions is (B, T) with a static cache, else (T,)."""
    return positions[:, -1] if positions.dim() == 2 else positions[-1:].expand(B)


def _decode_lens(kv_cache, positions: torch.Tensor, B: int) -> torch.Tensor:
    """(B,) int64: how many slots of a static cache each row attends to (its position + 1). Computed once per
    forward pass — every layer gets the same `positions` tensor — and kept on the cache.

    Raises ValueError (before anything is written) for a position outside the cache's slots, as the PyTorch path's
    indexing does; the check reads the positions on the host, so it is skipped while a CUDA graph is captured (the
    graph runner checks its positions on the host before each replay)."""
    cached = getattr(kv_cache, "_llmlab_lens", None)
    if cached is not None and cached[0] is positions and cached[1] == positions._version:
        return cached[2]  # the same tensor, unchanged since (a loop that updates it in place bumps its version)
    pos = _row_positions(positions, B)
    S = kv_cache.k[0].shape[2]
    if not (pos.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= S:
            raise ValueError(f"position {hi if hi >= S else lo} is outside the static KV cache's {S} slots "
                             f"(0..{S - 1}): build the cache with a larger max_seq_len, or start a new sequence")
    lens = pos + 1
    kv_cache._llmlab_lens = (positions, positions._version, lens)
    return lens


def _static_decode_attention(attn, qkv: torch.Tensor, cos, sin, positions, kv_cache, inv_freq=None,
                             config=None) -> torch.Tensor:
    """One decode step's attention on a static cache: RoPE and the K/V write in one launch, then flash-decoding
    attention over the filled slots. qkv: (B, H + 2 Hkv, hd), one token per row -> (B, H, hd). The angles come as
    cos/sin, or (cos = sin = None) as `inv_freq` for the kernel to compute. config: the attention's split config
    chosen by step tuning (None: the autotuner's)."""
    K = _kernels()
    B, hd, H = qkv.shape[0], attn.head_dim, attn.n_heads
    k_all, v_all = kv_cache.k[attn.layer_idx][:B], kv_cache.v[attn.layer_idx][:B]  # (B, Hkv, S, hd) views
    pos = _row_positions(positions, B)
    lens = _decode_lens(kv_cache, positions, B)  # first: it checks the positions before anything is written
    if inv_freq is None:
        cos, sin = cos.reshape(-1, hd).expand(B, hd), sin.reshape(-1, hd).expand(B, hd)  # one angle row per row
    K.rope_and_cache_(qkv, cos, sin, pos, k_all, v_all, n_heads=H, inv_freq=inv_freq)
    # the next kernel is the o projection: at batch 1 (`_one_token_decode`) a GEMV that loads its weights before it
    # waits, so let it launch during the merge; with more rows it is cuBLAS's, which is not launched early anyway.
    # The kernel just before (rope_and_cache_) writes only the newest K/V slot, and the lengths come from a kernel
    # before the layers: the split programs may load their first K/V tile before they wait (prefetch_kv; call AY,
    # same-process A/B at batch 1: chat 851 -> 844 us per step, 8K context unchanged; the same holds, untimed, for
    # the static-cache decode of several rows, which comes here too)
    return K.decode_attention(qkv[:, :H], k_all, v_all, seq_lens=lens, check_lens=False, trigger_next=True,
                              prefetch_kv=True, config=config)  # (B, H, hd)


def _attention_forward(self, x, cos, sin, positions, kv_cache=None, mask=None) -> torch.Tensor:
    """`llmlab.model.Attention.forward` with fused q/k/v, RoPE in place and, for one new token, flash-decoding
    attention (contiguous, static or paged cache)."""
    from llmlab.model import attention_mask, repeat_kv
    from llmlab.cache.static_cache import StaticKVCache

    if not _kernel_ok(x):
        return type(self).forward(self, x, cos, sin, positions, kv_cache, mask)
    K = _kernels()
    B, T, _ = x.shape
    H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
    weight, bias, _ = _fused_linear(self, "_llmlab_fused_qkv")
    qkv = F.linear(x, weight, bias).view(B, T, H + 2 * Hkv, hd)  # one GEMV for q, k and v
    if T == 1 and mask is not None and self.sliding_window is None and isinstance(kv_cache, StaticKVCache):
        y = _static_decode_attention(self, qkv[:, 0], cos, sin, positions, kv_cache)  # (B, H, hd)
        return self.o_proj(y.reshape(B, 1, H * hd))
    qk = qkv[:, :, :H + Hkv].transpose(1, 2)  # (B, H + Hkv, T, hd): q's heads, then k's
    K.rope_one(qk, cos.contiguous(), sin.contiguous())  # q and k rotated in place, one launch
    q, k = qk[:, :H], qk[:, H:]  # (B, H, T, hd), (B, Hkv, T, hd)
    v = qkv[:, :, H + Hkv:].transpose(1, 2)  # (B, Hkv, T, hd)

    decode = kv_cache is not None and T == 1 and self.sliding_window is None
    if decode and hasattr(kv_cache, "decode_attention"):  # a paged cache: attend straight from its block pool
        kv_cache.write(self.layer_idx, positions, k, v)
        y = kv_cache.decode_attention(self.layer_idx, q)  # (B, H, 1, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))
    if kv_cache is not None:
        k, v = kv_cache.update(self.layer_idx, positions, k, v)  # (B, Hkv, S, hd)
    S = k.shape[2]
    if decode:
        # a static cache (mask given) holds max_seq_len slots: attend only to the filled ones
        seq_lens = _decode_lens(kv_cache, positions, B) if mask is not None else None
        y = K.decode_attention(q, k, v, seq_lens=seq_lens, check_lens=False)  # (B, H, 1, hd)
    else:
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, H, S, hd)
        if mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.sliding_window is None and T == 1:
            y = F.scaled_dot_product_attention(q, k, v)
        elif self.sliding_window is None and S == T:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k_pos = positions if kv_cache is None else torch.arange(S, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v,
                                               attn_mask=attention_mask(positions, k_pos, self.sliding_window))
    y = y.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, H*hd)
    return self.o_proj(y)


def _transformer_forward(self, input_ids, positions=None, kv_cache=None, last_only=False):
    """`llmlab.model.Transformer.forward` with each residual add folded into the next RMSNorm.

    A block's output is the residual stream h plus the MLP's output m. Instead of adding them (one more pass over
    the row), the block hands both on: the next block's first RMSNorm adds and normalizes in one kernel, and the
    last block's pair goes into the final norm the same way. One kernel per layer fewer."""
    B, T = input_ids.shape
    x = self.embed_tokens.weight[:1]
    if T == 0 or not _kernel_ok(x) or self.norm.weight.dtype != x.dtype:
        return type(self).forward(self, input_ids, positions, kv_cache, last_only)
    if positions is None:
        positions = torch.arange(T, device=input_ids.device)
    rms = _kernels().rmsnorm
    h = self.embed_tokens(input_ids)  # (B, T, D): the residual stream
    static = hasattr(kv_cache, "attention_mask")  # a static cache (`llmlab.cache.static_cache.StaticKVCache`)
    if B * T == 1 and static and _one_token_fusable(self, h):  # no mask, no cos/sin: its kernels need neither
        return _one_token_decode(self, h, positions, kv_cache)
    cos, sin = self.rope(positions, h.dtype)
    mask = None
    if static:  # one mask for all layers (as Transformer.forward)
        mask = kv_cache.attention_mask(positions, self.config.sliding_window)
    m = None  # the previous block's MLP output, not yet added to h
    for layer in self.layers:
        n1 = layer.input_layernorm
        normed = rms(h, n1.weight, n1.eps) if m is None else None
        if m is not None:
            normed, h = rms(m, n1.weight, n1.eps, residual=h)  # h += m; normed = norm(h)
        a = layer.self_attn(normed, cos, sin, positions, kv_cache, mask)
        n2 = layer.post_attention_layernorm
        normed, h = rms(a, n2.weight, n2.eps, residual=h)  # h += attention; normed = norm(h)
        m = layer.mlp(normed)
    if last_only:
        h, m = h[:, -1:], m[:, -1:]
    normed, _ = rms(m, self.norm.weight, self.norm.eps, residual=h)
    return self.lm_head(normed)  # (B, T, V)


def _one_token_fusable(model, h: torch.Tensor) -> bool:
    """Can `_one_token_decode` run this model? Llama-shaped layers only: no biases, no sliding window, one dtype."""
    cfg = model.config
    if cfg.attention_bias or cfg.o_proj_bias or cfg.sliding_window is not None:
        return False
    return all(p.dtype == h.dtype for p in model.layers.parameters())


def _one_token_decode(model, h, positions, kv_cache) -> torch.Tensor:
    """A batch-1 decode step on a static cache with every small op inside a GEMV (`llmlab/kernels/fused_gemv.py`).

    Per layer, seven launches instead of ten: RMSNorm + q/k/v GEMV; RoPE (angles computed in the kernel) + K/V
    cache write; attention (split and merge); o GEMV + residual add; RMSNorm + gate/up GEMV + SwiGLU (the epilogue
    writes silu(gate) * up: call AS, TPOT 0.861 -> 0.838 ms against the SwiGLU prologue in the down GEMV); down
    GEMV + residual add. The q/k/v and o GEMVs load their weights before they wait for the kernel before them
    (`fused_gemv`'s whole-row configs), the attention lets the o GEMV launch during its merge (trigger_next) and
    loads its first K/V tile before it waits for the RoPE launch (prefetch_kv). (RoPE and the K/V write as the
    q/k/v GEMV's epilogue instead of their own launch measured slower, call AX: 849 -> 884 us per step.)
    h: (1, 1, D) the embedded token -> logits (1, 1, V)."""
    K = _kernels()
    inv_freq = model.rope.inv_freq  # (hd/2,) fp32
    tiles = model.__dict__.get(STEP_TILES_ATTR, {})  # {role: triton.Config} chosen in the step (step_tuning)
    attention_tile = tiles.get(attention_role(kv_cache.k[0].shape[2]))
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        w_qkv, _, _ = _fused_linear(attn, "_llmlab_fused_qkv")
        qkv = K.fused_gemv(h, w_qkv, norm_weight=n1.weight, eps=n1.eps,
                           config=tiles.get("qkv"))  # (1, 1, (H + 2 Hkv) hd)
        y = _static_decode_attention(attn, qkv.view(1, -1, attn.head_dim), None, None, positions, kv_cache,
                                     inv_freq=inv_freq, config=attention_tile)
        h = K.fused_gemv(y.view(1, 1, -1), attn.o_proj.weight, residual=h, config=tiles.get("o"))  # h + o_proj(y)
        w_gate_up, _, _ = _fused_linear(mlp, "_llmlab_fused_gate_up")
        act = K.fused_gemv(h, w_gate_up, norm_weight=n2.weight, eps=n2.eps, swiglu_out=True,
                           config=tiles.get("gate_up"))  # (1, 1, I)
        h = K.fused_gemv(act, mlp.down_proj.weight, residual=h, config=tiles.get("down"))  # h + down(swiglu)
    return model.lm_head(K.rmsnorm(h, model.norm.weight, model.norm.eps))  # (1, 1, V)


# The batch-1 decode step's four GEMVs per layer (`_one_token_decode`), by role, and its attention. `step_tuning`
# may choose a tile (a split config for the attention) for each by timing the whole captured step; the choices live
# in the model's __dict__ under STEP_TILES_ATTR (forgotten by `disable`), and
# `llmlab.runtime.cuda_graphs.weights_fingerprint` includes them, so graphs captured with other tiles are not reused. The
# attention's best split depends on the static cache's size, so its role names it: "attention@1024" for caches of
# 513..1024 slots (the attention autotuner's own key rounds the same way); other sizes keep the autotuner's pick.
GEMV_ROLES = ("qkv", "o", "gate_up", "down")
STEP_TILES_ATTR = "_llmlab_step_tiles"


def attention_role(slots: int) -> str:
    """The step-tuning role of the attention over a static cache of `slots` slots per row: "attention@<power of 2
    >= slots>"."""
    return f"attention@{1 << max(0, int(slots) - 1).bit_length()}"


def gemv_weights(model) -> dict:
    """{role: (weight of layer 0, swiglu_out)} of the batch-1 decode step's GEMVs (the layers share shapes)."""
    layer = model.layers[0]
    w_qkv, _, _ = _fused_linear(layer.self_attn, "_llmlab_fused_qkv")
    w_gate_up, _, _ = _fused_linear(layer.mlp, "_llmlab_fused_gate_up")
    return {"qkv": (w_qkv, False), "o": (layer.self_attn.o_proj.weight, False), "gate_up": (w_gate_up, True),
            "down": (layer.mlp.down_proj.weight, False)}


def _greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The decode step's greedy pick (`llmlab.runtime.cuda_graphs.decode_step` calls it while the switch is on):
    (B, V) logits -> (B,) int64, in one launch (`llmlab/kernels/argmax.py`) instead of ~6 PyTorch kernels."""
    from llmlab.sampling import argmax_rows

    if not _kernel_ok(logits):
        return argmax_rows(logits)
    return _kernels().argmax(logits)


def _targets():
    from llmlab.model import MLP, Attention, RMSNorm, Transformer

    return {RMSNorm: _rmsnorm_forward, MLP: _mlp_forward, Attention: _attention_forward,
            Transformer: _transformer_forward}


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Route the model's RMSNorm, SwiGLU, RoPE and decode attention through the Triton kernels (in place).

    Returns the model. Raises RuntimeError (with the reason) where Triton cannot run: no triton, or no CUDA GPU
    and no TRITON_INTERPRET=1.
    """
    ok, why = triton_status()
    if not ok:
        raise RuntimeError(f"Triton kernels cannot run here: {why}")
    targets = _targets()
    for module in model.modules():
        fn = targets.get(type(module))
        if fn is not None:
            module.forward = types.MethodType(fn, module)
        if fn is _transformer_forward:
            module.__dict__["_llmlab_argmax"] = _greedy_tokens  # read by llmlab.runtime.cuda_graphs.decode_step
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `enable`: the PyTorch forward of every module runs again. Returns the model."""
    targets = _targets()
    for module in model.modules():
        if type(module) in targets and "forward" in module.__dict__:
            del module.forward
        module.__dict__.pop("_llmlab_argmax", None)
        module.__dict__.pop(STEP_TILES_ATTR, None)
        for attr in _FUSED:
            module.__dict__.pop(attr, None)  # forget the fused tensor (the layers' weights stay views of it: the
            # concatenated storage is the weights' own memory, nothing extra to free)
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """True if `enable(model)` is in effect."""
    targets = _targets()
    return any(type(m) in targets and "forward" in m.__dict__ for m in model.modules())
