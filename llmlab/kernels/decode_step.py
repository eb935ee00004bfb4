"""The Triton kernels' model-level pieces, as one object the decode runner is given: `KernelDecodeStep(model)`.

The kernel modules (`llmlab.kernels.modules`, installed by `swap_in`) replace one module each. What crosses module
boundaries lives here:

* `forward`: `llmlab.model.Transformer.forward` with each residual add folded into the next RMSNorm. A block's
  output is the residual stream h plus the MLP's output m; instead of adding them (one more pass over the row),
  the block hands both on: the next block's first RMSNorm adds and normalizes in one kernel, and the last block's
  pair goes into the final norm the same way. One kernel per layer fewer;
* `one_token`: a batch-1 decode step on a static cache (the CUDA-graph path at batch 1) with the RMSNorms, SwiGLU
  and residual adds inside the GEMVs that read their outputs (`llmlab/kernels/fused_gemv.py`; for a weight-only
  quantized model `llmlab/kernels/fused_quant_gemv.py`) and RoPE with the K/V write inside the attention's launch:
  six launches per layer instead of ten (five where the attention's splits merge themselves; one more for an int8
  step whose down GEMV walks K: its SwiGLU is a launch of its own);
* `greedy`: the decode step's greedy token in one launch (`llmlab/kernels/argmax.py`) instead of ~6 PyTorch kernels;
* `tiles`: the kernel configs `llmlab.kernels.step_tuning` chose by timing the whole captured step, by role.

The runner (`llmlab.runtime.cuda_graphs.GraphDecoder(model, ..., kernels=KernelDecodeStep(model))`) calls `forward`
for the prefill and each decode step and `greedy` for the step's token, and keys its captured graphs on
`fingerprint()` (which names the tiles): graphs captured with other tiles are not reused.

    from llmlab.kernels import KernelDecodeStep, swap_in
    step = KernelDecodeStep(swap_in(model))
    logits = step(input_ids, positions, kv_cache=cache)   # as model(input_ids, positions, kv_cache=cache)
"""

from __future__ import annotations

import torch

from llmlab.model import default_positions
from llmlab.sampling import argmax_rows

from .modules import TritonAttention, TritonMLP, is_swapped, kernel_ok, ops

# The batch-1 decode step's four GEMVs per layer (`KernelDecodeStep.one_token`), by role, and its attention, whose
# best split depends on the static cache's size, so its role names it (`attention_role`).
GEMV_ROLES = ("qkv", "o", "gate_up", "down")


def attention_role(slots: int) -> str:
    """The step-tuning role of the attention over a static cache of `slots` slots per row: "attention@<power of 2
    >= slots>" ("attention@1024" for 513..1024 slots, as the attention autotuner's own key rounds); caches of other
    sizes keep the autotuner's pick."""
    return f"attention@{1 << max(0, int(slots) - 1).bit_length()}"


def float_projections(model) -> bool:
    """Are all the layers' projections plain float `nn.Linear`s? (False for a weight-only quantized model:
    `llmlab.quant`.)"""
    return all(type(m) is torch.nn.Linear for layer in model.layers for m in layer.modules()
               if hasattr(m, "in_features"))


def quantized_projections(model) -> bool:
    """Are all the layers' projections weight-only quantized layers (`llmlab.quant`) of one scheme and group size,
    with no bias and no padded rows — what `fused_quant_gemv` takes?"""
    from llmlab.quant.linear import QuantizedLinear

    linears = [m for layer in model.layers for m in layer.modules() if hasattr(m, "in_features")]
    if not linears or not all(isinstance(m, QuantizedLinear) for m in linears):
        return False
    formats = {(type(m), getattr(m, "group_size", None)) for m in linears}
    return len(formats) == 1 and all(m.bias is None and m.padded_in_features == m.in_features for m in linears)


def fusable_shape(model, dtype: torch.dtype) -> bool:
    """Can `one_token` run this model's batch-1 step, once the kernel modules are in? Llama-shaped layers only (no
    biases, no sliding window), float projections (`fused_gemv`) or weight-only quantized ones of one format
    (`quantized_projections`, `fused_quant_gemv`), every layer parameter and the final norm in `dtype`."""
    cfg = model.config
    if cfg.attention_bias or cfg.o_proj_bias or cfg.sliding_window is not None or model.norm.weight.dtype != dtype:
        return False
    projections = float_projections(model) or quantized_projections(model)
    return projections and all(p.dtype == dtype for p in model.layers.parameters())


def runs_fused(model, dtype: torch.dtype) -> bool:
    """Does `one_token` run this model's batch-1 step: `fusable_shape`, with the kernel attention and MLP in?"""
    swapped = all(isinstance(layer.self_attn, TritonAttention) and isinstance(layer.mlp, TritonMLP)
                  for layer in model.layers)
    return swapped and fusable_shape(model, dtype)


class KernelDecodeStep:
    """The Triton kernels' forward, batch-1 decode step and greedy pick for one `Transformer`.

    Args:
        model: a Transformer with the kernel modules swapped in (`llmlab.kernels.modules.swap_in`).
        tiles: {role: triton.Config} for the batch-1 step's GEMVs (`GEMV_ROLES`) and its attention
            (`attention_role`), as `llmlab.kernels.step_tuning` chooses them; missing roles use the autotuner's.
        fuse_step: False runs the batch-1 step module by module (RMSNorm, SwiGLU in launches of their own), as a
            model `one_token` cannot take does: the baseline the fused step is measured against.

    Raises:
        ValueError: a model without the kernel modules.
    """

    def __init__(self, model, tiles: dict | None = None, fuse_step: bool = True):
        if not is_swapped(model):
            raise ValueError("KernelDecodeStep: swap the kernel modules in first (llmlab.kernels.swap_in(model), "
                             "or the triton_kernels switch)")
        self.model = model
        self.tiles = dict(tiles or {})
        self.fuse_step = bool(fuse_step)

    def for_model(self, model) -> "KernelDecodeStep":
        """The same step (a copy of the tiles) for another model, e.g. a copy of this one (`LLM.to`)."""
        return type(self)(model, self.tiles, self.fuse_step)

    def fingerprint(self) -> tuple:
        """What a captured step depends on besides the weights: the kind of step and the chosen tiles."""
        return (type(self).__qualname__, self.fuse_step,
                tuple(sorted((role, str(c)) for role, c in self.tiles.items())))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, kv_cache=None,
                last_only: bool = False) -> torch.Tensor:
        """`Transformer.forward` (same arguments, same logits) with each residual add folded into the next
        RMSNorm, and a batch-1 step on a static cache run by `one_token`. Falls back to the model's own forward
        where the kernels cannot run."""
        model = self.model
        B, T = input_ids.shape
        x = model.embed_tokens.weight[:1]
        if T == 0 or not kernel_ok(x) or model.norm.weight.dtype != x.dtype:
            return model(input_ids, positions, kv_cache, last_only)
        if positions is None:
            positions = default_positions(T, kv_cache, input_ids.device)
        rms = ops().rmsnorm
        h = model.embed_tokens(input_ids)  # (B, T, D): the residual stream
        static = hasattr(kv_cache, "attention_mask")  # a static cache (`llmlab.cache.static_cache.StaticKVCache`)
        # no mask, no cos/sin for one_token: its kernels need neither
        if B * T == 1 and static and self.fuse_step and runs_fused(model, h.dtype):
            return self.one_token(h, positions, kv_cache)
        cos, sin = model.rope(positions, h.dtype)
        mask = None
        if static:  # one mask for all layers (as Transformer.forward)
            mask = kv_cache.attention_mask(positions, model.config.sliding_window)
        m = None  # the previous block's MLP output, not yet added to h
        for layer in model.layers:
            n1 = layer.input_layernorm
            if m is None:
                normed = rms(h, n1.weight, n1.eps)
            else:
                normed, h = rms(m, n1.weight, n1.eps, residual=h)  # h += m; normed = norm(h)
            a = layer.self_attn(normed, cos, sin, positions, kv_cache, mask)
            n2 = layer.post_attention_layernorm
            normed, h = rms(a, n2.weight, n2.eps, residual=h)  # h += attention; normed = norm(h)
            m = layer.mlp(normed)
        if last_only:
            h, m = h[:, -1:], m[:, -1:]
        normed, _ = rms(m, model.norm.weight, model.norm.eps, residual=h)
        return model.lm_head(normed)  # (B, T, V)

    __call__ = forward

    def one_token(self, h: torch.Tensor, positions: torch.Tensor, kv_cache) -> torch.Tensor:
        """A batch-1 decode step on a static cache with every small op inside a GEMV. h: (1, 1, D) the embedded
        token -> logits (1, 1, V).

        Per layer, six launches instead of ten: RMSNorm + q/k/v GEMV; RoPE (angles computed in the kernel), the
        K/V cache write and the attention's splits in one launch (`rope_attention.py`), then their merge (none
        where step tuning chose a split config that merges in the split kernel); o GEMV + residual add; RMSNorm +
        gate/up GEMV + SwiGLU (the epilogue writes silu(gate) * up: each sigmoid is computed once, where a SwiGLU
        prologue in the down GEMV would recompute all of them in every program); down GEMV + residual add. The
        q/k/v and o GEMVs load their weights before they wait for the kernel before them (`fused_gemv`'s whole-row
        configs); the attention lets the o GEMV launch during its merge and, since nothing before it writes the
        cache, loads its first K/V tile before it waits for the q/k/v GEMV (`TritonAttention.static_decode`).
        RoPE as the q/k/v GEMV's epilogue instead made the step slower (`docs/results.md`).

        A weight-only quantized model (`quantized_projections`) runs the same step with the quantized GEMVs of
        `fused_quant_gemv`; SwiGLU is the down GEMV's prologue where that GEMV is input-stationary (int4's, and
        int8's when step tuning chose an input-stationary config for the down role), else a launch of its own
        (seven launches a layer; see there). The GEMVs run the step-tuned configs of their roles (int8: the
        K-walking or input-stationary GEMV and its tile; int4: the Gluon GEMV's rows per chunk and depth)."""
        K = ops()
        model, tiles = self.model, self.tiles
        if not float_projections(model):
            return self._quantized_token(h, positions, kv_cache)
        inv_freq = model.rope.inv_freq  # (hd/2,) fp32
        attention_tile = tiles.get(attention_role(kv_cache.k[0].shape[2]))
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            w_qkv, _ = attn.qkv_weight()
            qkv = K.fused_gemv(h, w_qkv, norm_weight=n1.weight, eps=n1.eps,
                               config=tiles.get("qkv"))  # (1, 1, (H + 2 Hkv) hd)
            y = attn.static_decode(qkv.view(1, -1, attn.head_dim), positions, kv_cache, inv_freq=inv_freq,
                                   config=attention_tile)  # (1, H, hd)
            h = K.fused_gemv(y.view(1, 1, -1), attn.o_proj.weight, residual=h, config=tiles.get("o"))  # h + o(y)
            act = K.fused_gemv(h, mlp.gate_up_weight(), norm_weight=n2.weight, eps=n2.eps, swiglu_out=True,
                               config=tiles.get("gate_up"))  # (1, 1, I)
            h = K.fused_gemv(act, mlp.down_proj.weight, residual=h, config=tiles.get("down"))  # h + down(act)
        return model.lm_head(K.rmsnorm(h, model.norm.weight, model.norm.eps))  # (1, 1, V)

    def _quantized_token(self, h: torch.Tensor, positions: torch.Tensor, kv_cache) -> torch.Tensor:
        """`one_token` for a weight-only quantized model: the norms, SwiGLU and residual adds inside the quantized
        GEMVs (`llmlab/kernels/fused_quant_gemv.py`). h: (1, 1, D) -> logits (1, 1, V)."""
        from . import int8_matmul

        K = ops()
        model, tiles = self.model, self.tiles
        attention_tile = tiles.get(attention_role(kv_cache.k[0].shape[2]))
        int8 = model.layers[0].mlp.down_proj.scheme == "int8"  # one scheme throughout (`quantized_projections`)
        # SwiGLU as the down GEMV's prologue: int4's GEMV, and int8's input-stationary one, run one wave of programs
        # that compute the sigmoids once each; the int8 K-walking GEMV keeps it a launch of its own (module notes)
        swiglu_inside = not int8 or int8_matmul.input_stationary(tiles.get("down"))

        def gemv(x, layer, role, **fused):  # each GEMV runs its role's step-tuned config, if one was chosen
            return K.fused_quant_gemv(x, layer, config=tiles.get(role), **fused)

        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            qkv = gemv(h, attn.quantized_qkv(), "qkv", norm_weight=n1.weight, eps=n1.eps)  # (1, 1, (H + 2 Hkv) hd)
            y = attn.static_decode(qkv.view(1, -1, attn.head_dim), positions, kv_cache,
                                   inv_freq=model.rope.inv_freq, config=attention_tile)  # (1, H, hd)
            h = gemv(y.view(1, 1, -1), attn.o_proj, "o", residual=h)  # h + o(y)
            gate_up = gemv(h, mlp.quantized_gate_up(), "gate_up", norm_weight=n2.weight, eps=n2.eps)  # (1, 1, 2 I)
            if swiglu_inside:
                h = gemv(gate_up, mlp.down_proj, "down", swiglu=True, residual=h)  # h + down(silu(gate) * up)
            else:  # SwiGLU in a launch of its own (`fused_quant_gemv`'s notes)
                n_gate = gate_up.shape[-1] // 2
                h = gemv(K.swiglu(gate_up[..., :n_gate], gate_up[..., n_gate:]), mlp.down_proj, "down", residual=h)
        return model.lm_head(K.rmsnorm(h, model.norm.weight, model.norm.eps))  # (1, 1, V)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The decode step's greedy pick: (B, V) logits -> (B,) int64, in one launch (`llmlab/kernels/argmax.py`)
        instead of ~6 PyTorch kernels (`llmlab.sampling.argmax_rows`, used where the kernel cannot run)."""
        if not kernel_ok(logits):
            return argmax_rows(logits)
        return ops().argmax(logits)

    def quantized_gemv_layers(self) -> dict:
        """{role: layer 0's quantized layer for it} of a weight-only quantized model's batch-1 step (the q/k/v and
        gate/up layers fused as the step runs them, `llmlab.quant.fused`; the layers share shapes). ValueError for a
        model `quantized_projections` refuses."""
        if not quantized_projections(self.model):
            raise ValueError("quantized_gemv_layers: the model's projections are not weight-only quantized layers of "
                             "one format (gemv_weights gives a float model's)")
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        return {"qkv": attn.quantized_qkv(), "o": attn.o_proj, "gate_up": mlp.quantized_gate_up(),
                "down": mlp.down_proj}

    def gemv_weights(self) -> dict:
        """{role: (weight of layer 0, swiglu_out)} of the batch-1 step's GEMVs (the layers share shapes). Float
        projections only (`quantized_gemv_layers` for a quantized model)."""
        layer = self.model.layers[0]
        return {"qkv": (layer.self_attn.qkv_weight()[0], False), "o": (layer.self_attn.o_proj.weight, False),
                "gate_up": (layer.mlp.gate_up_weight(), True), "down": (layer.mlp.down_proj.weight, False)}

    def __repr__(self) -> str:
        return f"KernelDecodeStep(tiles={ {role: str(c) for role, c in self.tiles.items()} })"
