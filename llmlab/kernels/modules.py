"""The Triton kernels as drop-in modules: `swap_in(model)` replaces a `llmlab.model.Transformer`'s RMSNorm, MLP
and Attention modules by the subclasses below; `swap_out(model)` puts the PyTorch classes back. (gpt-fast and
Liger-Kernel install their kernels the same way: module replacement, not patched methods.)

A swapped-in module holds the original's parameters — the same Parameter objects — so `state_dict` keys and values
do not change and the swap is reversible. Each subclass keeps its PyTorch class's forward (`llmlab.model`, the
reference) and calls it where a kernel cannot take the tensors (a CPU tensor without Triton's interpreter, bf16 in
the interpreter), with one warning saying why. What changes, per layer:

* RMSNorm (`TritonRMSNorm`): one kernel instead of ~6 (square, mean, add eps, rsqrt, two products, casts);
* q, k, v projections (`TritonAttention`): ONE matmul over the three weights concatenated (gate/up likewise,
  `TritonMLP`): fewer, larger GEMVs, which use the memory bus better than three small ones. On first use the
  weights are moved into one tensor and each layer's parameter becomes a view of its rows (no extra memory;
  in-place edits of a weight reach the fused tensor); a weight replaced or moved afterwards makes it rebuild
  (`fuse`). The fused tensor is the module's `fused` attribute (not a parameter: not saved, not moved by `.to()`);
* RoPE: q and k rotated in place by one launch (they sit side by side in the fused projection's output); in a
  decode step on a static cache the same launch also writes K and V into the cache (`static_decode`);
* SwiGLU: silu(gate) * up in one kernel, reading the two halves of the fused output;
* decode attention (one new token, a KV cache: `llmlab.model.attention_path`): the flash-decoding kernel, over only
  the filled part of a static cache; a paged cache (`llmlab.cache.paged_cache.PagedKVCache`) attends from its block
  pool with the paged kernel.

What stays in PyTorch: the other matmuls (cuBLAS) and attention over more than one new token (prefill: SDPA's
flash kernels) or with a sliding window. The model-level pieces — each residual add folded into the next RMSNorm,
the batch-1 decode step with the small ops inside the GEMVs, the greedy token in one launch, the step-tuned tiles —
are `llmlab.kernels.decode_step.KernelDecodeStep`, which the decode runner is given explicitly.
"""

from __future__ import annotations

import copy
import functools
import types
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmlab.cache.static_cache import row_positions
from llmlab.model import (DECODE, PAGED_DECODE, STATIC_DECODE, MLP, Attention, RMSNorm, attention_path, repeat_kv,
                          sdpa_attention)
from llmlab.quant.fused import FusedQuantized, all_quantized, fuse_quantized

from ._util import interpret_mode, triton_status

_warned: set[str] = set()
# The decode step's RoPE and K/V write inside the attention's launch (True), or in a launch of their own before it
# (False: the baseline it is measured against, docs/results.md). Read when a step runs or is captured.
ROPE_IN_ATTENTION = True


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"Triton kernels: falling back to PyTorch: {reason}", stacklevel=3)


def kernel_ok(x: torch.Tensor) -> bool:
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
def ops() -> types.SimpleNamespace:
    """The kernel wrappers the modules and the decode step call, imported on first use (importing this module needs
    no triton). Each is wrapped in `torch.compiler.disable`: the wrappers read shapes and device properties in
    Python, which torch.compile must not trace into."""
    from . import (argmax, decode_attention, fused_gemv, fused_quant_gemv, rmsnorm, rope, rope_attention,
                   rope_cache, swiglu)

    disable = torch.compiler.disable
    return types.SimpleNamespace(rmsnorm=disable(rmsnorm.rmsnorm), swiglu=disable(swiglu.swiglu),
                                 rope_=disable(rope.rope_), rope_one=disable(rope.rope_one),
                                 rope_and_cache_=disable(rope_cache.rope_and_cache_),
                                 decode_attention=disable(decode_attention.decode_attention),
                                 rope_cache_attention=disable(rope_attention.rope_cache_attention),
                                 fused_gemv=disable(fused_gemv.fused_gemv),
                                 fused_quant_gemv=disable(fused_quant_gemv.fused_quant_gemv),
                                 argmax=disable(argmax.argmax))


class FusedWeights(NamedTuple):
    """Linear layers that read one input, as one weight: their rows concatenated (sum of N, K), the biases likewise
    (or None), each layer's number of rows, and the addresses of the layers' parameters when they were fused."""

    addresses: tuple
    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple


def fuse(linears, fused: FusedWeights | None = None) -> FusedWeights:
    """`fused` while the layers' parameters still live in it, else the layers fused anew.

    The layers' weights (and biases) are copied into one tensor and each layer's parameter is made a VIEW of its
    rows: no second copy, and whatever writes a weight in place — `w.mul_()`, `w.data.copy_()`, `load_state_dict` —
    writes the fused tensor too. A parameter replaced, or moved by `.to()`, no longer lives there: fused again."""
    params = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
    if fused is not None and fused.addresses == tuple(p.data_ptr() for p in params):
        return fused
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
    return FusedWeights(tuple(p.data_ptr() for p in params), weight, bias,
                        tuple(lin.out_features for lin in linears))


class TritonRMSNorm(RMSNorm):
    """`llmlab.model.RMSNorm` in one kernel (`llmlab/kernels/rmsnorm.py`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not kernel_ok(x) or self.weight.dtype != x.dtype:
            return super().forward(x)
        return ops().rmsnorm(x, self.weight, self.eps)


class TritonMLP(MLP):
    """`llmlab.model.MLP` with gate and up as one GEMV and SwiGLU in one kernel (`llmlab/kernels/swiglu.py`)."""

    fused: FusedWeights | FusedQuantized | None = None  # [gate; up] (`gate_up_weight`, `gate_up`)

    def gate_up_weight(self) -> torch.Tensor:
        """(2 I, D): the gate and up weights as one tensor (`fuse`). Float layers only."""
        self.fused = fuse((self.gate_proj, self.up_proj), self.fused)
        return self.fused.weight

    def quantized_gate_up(self):
        """The gate and up projections of a weight-only quantized model as ONE quantized layer (N = 2 I;
        `llmlab.quant.fused.fuse_quantized`)."""
        layers = (self.gate_proj, self.up_proj)
        self.fused = fuse_quantized(layers, self.fused if isinstance(self.fused, FusedQuantized) else None)
        return self.fused.layer

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, T, 2 I) = [gate(x) | up(x)] in ONE matmul: over the fused float weight, or, for a
        weight-only quantized model, one quantized layer over the fused packed weights
        (`llmlab.quant.fused.fuse_quantized`)."""
        if all_quantized((self.gate_proj, self.up_proj)):
            return self.quantized_gate_up()(x)
        return F.linear(x, self.gate_up_weight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not kernel_ok(x):
            return super().forward(x)
        gate_up = self.gate_up(x)  # (B, T, 2 I): one GEMV for both projections
        n_gate = self.gate_proj.out_features
        return self.down_proj(ops().swiglu(gate_up[..., :n_gate], gate_up[..., n_gate:]))


class TritonAttention(Attention):
    """`llmlab.model.Attention` with fused q/k/v, RoPE in place and, for one new token, flash-decoding attention
    (contiguous, static or paged cache)."""

    fused: FusedWeights | FusedQuantized | None = None  # [q; k; v] (`qkv_weight`, `qkv`)

    def qkv_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """((H + 2 Hkv) hd, D) weight and bias (or None): the q, k and v projections as one (`fuse`). Float layers
        only."""
        self.fused = fuse((self.q_proj, self.k_proj, self.v_proj), self.fused)
        return self.fused.weight, self.fused.bias

    def quantized_qkv(self):
        """The q, k and v projections of a weight-only quantized model as ONE quantized layer (N = (H + 2 Hkv) hd;
        `llmlab.quant.fused.fuse_quantized`)."""
        layers = (self.q_proj, self.k_proj, self.v_proj)
        self.fused = fuse_quantized(layers, self.fused if isinstance(self.fused, FusedQuantized) else None)
        return self.fused.layer

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, T, (H + 2 Hkv) hd) = [q | k | v] in ONE matmul: over the fused float weight, or, for
        a weight-only quantized model, one quantized layer over the fused packed weights
        (`llmlab.quant.fused.fuse_quantized`)."""
        if all_quantized((self.q_proj, self.k_proj, self.v_proj)):
            return self.quantized_qkv()(x)
        return F.linear(x, *self.qkv_weight())

    def forward(self, x, cos, sin, positions, kv_cache=None, mask=None) -> torch.Tensor:
        if not kernel_ok(x):
            return super().forward(x, cos, sin, positions, kv_cache, mask)
        K = ops()
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x).view(B, T, H + 2 * Hkv, hd)  # one GEMV for q, k and v
        path = attention_path(T, kv_cache, mask, self.sliding_window)
        if path == STATIC_DECODE:
            y = self.static_decode(qkv[:, 0], positions, kv_cache, cos=cos, sin=sin)  # (B, H, hd)
            return self.o_proj(y.reshape(B, 1, H * hd))
        qk = qkv[:, :, :H + Hkv].transpose(1, 2)  # (B, H + Hkv, T, hd): q's heads, then k's
        K.rope_one(qk, cos.contiguous(), sin.contiguous())  # q and k rotated in place, one launch
        q, k = qk[:, :H], qk[:, H:]  # (B, H, T, hd), (B, Hkv, T, hd)
        v = qkv[:, :, H + Hkv:].transpose(1, 2)  # (B, Hkv, T, hd)
        if path == PAGED_DECODE:  # attend straight from the cache's block pool
            kv_cache.write(self.layer_idx, positions, k, v)
            y = kv_cache.decode_attention(self.layer_idx, q)  # (B, H, 1, hd)
        else:
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer_idx, positions, k, v)  # (B, Hkv, S, hd)
            if path == DECODE:
                y = K.decode_attention(q, k, v, check_lens=False)  # (B, H, 1, hd)
            else:
                y = sdpa_attention(path, q, repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep), positions, mask,
                                   kv_cache is not None, self.sliding_window)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def static_decode(self, qkv: torch.Tensor, positions, kv_cache, cos=None, sin=None, inv_freq=None,
                      config=None) -> torch.Tensor:
        """One decode step's attention on a static cache: RoPE, the K/V write and flash-decoding attention over the
        filled slots. qkv: (B, H + 2 Hkv, hd), one token per row -> (B, H, hd).

        The angles come as cos/sin, or (cos = sin = None) as `inv_freq` for the kernels to compute: then, with
        `ROPE_IN_ATTENTION`, the attention's own launch applies RoPE and writes the cache
        (`rope_attention.rope_cache_attention`); otherwise RoPE and the K/V write take a launch of their own
        (`rope_cache.rope_and_cache_`) before the attention. config: the attention's split config chosen by step
        tuning (None: the autotuner's)."""
        K = ops()
        B, hd, H = qkv.shape[0], self.head_dim, self.n_heads
        k_all, v_all = kv_cache.k[self.layer_idx][:B], kv_cache.v[self.layer_idx][:B]  # (B, Hkv, S, hd) views
        lens = kv_cache.decode_lengths(positions, B)  # first: it checks the positions before anything is written
        if inv_freq is not None and ROPE_IN_ATTENTION:  # trigger_next and prefetch_kv: as below
            return K.rope_cache_attention(qkv, inv_freq, lens, k_all, v_all, n_heads=H, config=config,
                                          trigger_next=True, prefetch_kv=True)  # (B, H, hd)
        pos = row_positions(positions, B)
        if inv_freq is None:
            cos, sin = cos.reshape(-1, hd).expand(B, hd), sin.reshape(-1, hd).expand(B, hd)  # one angle row per row
        K.rope_and_cache_(qkv, cos, sin, pos, k_all, v_all, n_heads=H, inv_freq=inv_freq)
        # trigger_next: the next kernel is the o projection, at batch 1 a GEMV that loads its weights before it
        # waits (`fused_gemv`), so it may launch during the merge (with more rows it is cuBLAS's, not launched
        # early anyway). prefetch_kv: the kernel just before (rope_and_cache_) writes only the newest K/V slot and
        # the lengths come from a kernel before the layers, so the split programs may load their first K/V tile
        # before they wait for it.
        return K.decode_attention(qkv[:, :H], k_all, v_all, seq_lens=lens, check_lens=False, trigger_next=True,
                                  prefetch_kv=True, config=config)  # (B, H, hd)


SWAPS = {RMSNorm: TritonRMSNorm, MLP: TritonMLP, Attention: TritonAttention}  # PyTorch class -> kernel class
KERNEL_STATE = ("fused",)  # what a kernel module holds beyond its PyTorch class's state (dropped by swap_out)


def _rebuilt(cls, module: torch.nn.Module, drop=()) -> torch.nn.Module:
    """A `cls` instance holding `module`'s state — the same parameters, buffers, submodules and attributes, in
    containers of its own — minus the attributes in `drop`. No __init__: nothing is allocated or initialised."""
    new = cls.__new__(cls)
    for key, value in module.__dict__.items():
        if key not in drop:
            new.__dict__[key] = copy.copy(value) if key in ("_parameters", "_buffers", "_modules") else value
    return new


def _replace(root: torch.nn.Module, mapping: dict) -> torch.nn.Module:
    """Replace every module of a type in `mapping` (exact type) by `mapping[type](module)`, in its parent; a
    module met twice is replaced by one new module. Returns root, or its replacement."""
    done: dict[int, torch.nn.Module] = {}

    def swapped(module):
        make = mapping.get(type(module))
        if make is None:
            return module
        if id(module) not in done:
            done[id(module)] = make(module)
        return done[id(module)]

    def walk(parent):
        for name, child in list(parent.named_children()):
            new = swapped(child)
            if new is not child:
                setattr(parent, name, new)
            walk(new)

    root = swapped(root)
    walk(root)
    return root


def swap_in(model: torch.nn.Module) -> torch.nn.Module:
    """Replace the model's RMSNorm, MLP and Attention modules by `TritonRMSNorm`, `TritonMLP`, `TritonAttention`
    (in place; the same parameters). Modules already swapped, and subclasses of their own, are left as they are.

    Returns the model. Raises RuntimeError (with the reason) where Triton cannot run: no triton, or no CUDA GPU
    and no TRITON_INTERPRET=1.
    """
    ok, why = triton_status()
    if not ok:
        raise RuntimeError(f"Triton kernels cannot run here: {why}")
    return _replace(model, {torch_cls: lambda m, cls=kernel_cls: _rebuilt(cls, m)
                            for torch_cls, kernel_cls in SWAPS.items()})


def swap_out(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `swap_in`: the PyTorch modules again, holding the same parameters (q/k/v and gate/up stay views of the
    fused tensors: that storage is the weights' own memory, nothing extra to free). Returns the model."""
    return _replace(model, {kernel_cls: lambda m, cls=torch_cls: _rebuilt(cls, m, drop=KERNEL_STATE)
                            for torch_cls, kernel_cls in SWAPS.items()})


def is_swapped(model: torch.nn.Module) -> bool:
    """True if any module of `model` is one of the kernel modules (`swap_in` is in effect)."""
    kernel_types = tuple(SWAPS.values())
    return any(isinstance(m, kernel_types) for m in model.modules())
