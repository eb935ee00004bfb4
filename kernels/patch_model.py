"""The "Triton kernels" switch: run an `llmlab.model.Transformer` with the kernels of this folder.

`enable(model)` gives every RMSNorm, MLP and Attention module of the model a per-instance `forward` that calls
the Triton kernels (RMSNorm, SwiGLU, RoPE in place, flash-decoding attention for a single-token decode step);
`disable(model)` deletes those attributes, so the classes' own PyTorch `forward` — the reference path — runs
again. The weights are untouched: nothing is copied.

What stays in PyTorch: the matmuls (cuBLAS), attention over more than one new token (prefill: SDPA's flash
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
    from . import decode_attention, rmsnorm, rope, swiglu

    # the wrappers read shapes and device properties in Python: keep torch.compile from tracing into them
    disable = torch.compiler.disable
    return types.SimpleNamespace(rmsnorm=disable(rmsnorm.rmsnorm), swiglu=disable(swiglu.swiglu),
                                 rope_=disable(rope.rope_), decode_attention=disable(decode_attention.decode_attention))


def _rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _kernel_ok(x) or self.weight.dtype != x.dtype:
        return type(self).forward(self, x)
    return _kernels().rmsnorm(x, self.weight, self.eps)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _kernel_ok(x):
        return type(self).forward(self, x)
    return self.down_proj(_kernels().swiglu(self.gate_proj(x), self.up_proj(x)))


def _attention_forward(self, x, cos, sin, positions, kv_cache=None, mask=None) -> torch.Tensor:
    """`llmlab.model.Attention.forward` with RoPE in place and, for one new token, flash-decoding attention."""
    from llmlab.model import attention_mask, repeat_kv

    if not _kernel_ok(x):
        return type(self).forward(self, x, cos, sin, positions, kv_cache, mask)
    K = _kernels()
    B, T, _ = x.shape
    q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
    k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
    v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
    K.rope_(q, k, cos.contiguous(), sin.contiguous())  # in place

    if kv_cache is not None:
        k, v = kv_cache.update(self.layer_idx, positions, k, v)  # (B, Hkv, S, hd)
    S = k.shape[2]
    if kv_cache is not None and T == 1 and self.sliding_window is None:
        seq_lens = None
        if mask is not None:  # a static cache: slot s is visible iff s <= position -> attend to position + 1 slots
            pos = (positions[:, -1] if positions.dim() == 2 else positions[-1:]).expand(B)  # (B,)
            seq_lens = (pos + 1).clamp(max=S).to(torch.int32)
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
    y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*hd)
    return self.o_proj(y)


def _targets():
    from llmlab.model import MLP, Attention, RMSNorm

    return {RMSNorm: _rmsnorm_forward, MLP: _mlp_forward, Attention: _attention_forward}


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
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `enable`: the PyTorch forward of every module runs again. Returns the model."""
    targets = _targets()
    for module in model.modules():
        if type(module) in targets and "forward" in module.__dict__:
            del module.forward
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """True if `enable(model)` is in effect."""
    targets = _targets()
    return any(type(m) in targets and "forward" in m.__dict__ for m in model.modules())
