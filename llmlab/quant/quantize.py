"""Quantize a loaded model by swapping modules: every nn.Linear of the decoder layers becomes an `Int8Linear` or
`Int4Linear` (llmlab/quant/linear.py), in place; the model's code does not change (gpt-fast's approach,
https://github.com/pytorch-labs/gpt-fast).

    model = llmlab.load().model
    quantize_model(model, "int8")                 # q/k/v/o and gate/up/down of every layer
    quantize_model(model2, "int4", group_size=64) # int4, one scale per 64 inputs (a K it does not divide: padded)
    weight_bytes(model)                           # bytes the weights now occupy
    dequantize_model(model)                       # back to nn.Linear (with the rounded weights)

What is swapped: every nn.Linear inside the model except `lm_head` (unless include_lm_head=True). In a
`llmlab.model.Transformer` that is q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj of each layer. The
token embedding (an nn.Embedding) and the RMSNorm gains are never touched. With tied embeddings (lm_head.weight IS
embed_tokens.weight) quantizing lm_head gives it its own int8/int4 copy; the embedding keeps the original values.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn as nn

from llmlab.kernels.weight_quant import check_int4_range, check_weight

from .linear import Int4Linear, Int8Linear, QuantizedLinear

__all__ = ["SCHEMES", "GROUP_SIZES", "quantize_model", "dequantize_model", "is_quantized", "quantized_layers",
           "check_int4_group", "weight_bytes"]

SCHEMES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)  # the int4 group sizes this course uses (the kernels accept any multiple of 32)


def _check_model(op: str, model) -> None:
    if not isinstance(model, nn.Module):
        hint = " (an LLM: pass llm.model)" if isinstance(getattr(model, "model", None), nn.Module) else ""
        raise TypeError(f"{op}: expected a torch.nn.Module{hint}, got {type(model).__name__}")


def _targets(model: nn.Module, include_lm_head: bool) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(full name, parent, attribute, linear) of every nn.Linear to swap, in module order."""
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if type(child) is nn.Linear and (include_lm_head or name != "lm_head"):
                found.append((name, parent, attr, child))
    return found


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    """{name: module} of the model's quantized linear layers (empty when it is not quantized)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def is_quantized(model: nn.Module) -> bool:
    """True when any of the model's modules is an Int8Linear or Int4Linear."""
    _check_model("is_quantized", model)
    return bool(quantized_layers(model))


def check_int4_group(op: str, model: nn.Module, group_size, include_lm_head: bool = False) -> int:
    """Refuse an int4 group size that `quantize_model` cannot use on `model`, before any layer is swapped (so a
    refused call leaves the model as it was): it must be a positive int multiple of 32 (the kernels' smallest K
    tile), and no larger than the smallest input dimension K among the layers to quantize (a larger group would
    pad each row of such a layer to one group of mostly zeros, read as weights by every GEMV), so int4 needs every
    such K >= 32 (int8 takes any K). A layer whose K
    it does not divide is stored padded to the next multiple of it (`Int4Linear`, "Padding"). Returns it as a
    Python int (a NumPy integer is taken).

    Raises:
        TypeError: group_size is not an integer (bool and float included).
        ValueError: not a positive multiple of 32, or larger than a layer's K; a layer with K < 32 (int8 then);
            the message names group_size, the usual choices and those that need no padding for this model.
    """
    ks = sorted({lin.in_features for _, _, _, lin in _targets(model, include_lm_head)})
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"{op}: group_size must be an int, one of {GROUP_SIZES} (or another positive multiple of "
                        f"32); got {group_size!r}")
    group_size = int(group_size)
    if ks and ks[0] < 32:
        raise ValueError(f"{op}: int4 cannot quantize a layer whose input dimension K={ks[0]} is below 32, the "
                         f"smallest group the int4 kernels read (any group_size would be mostly zeros there); "
                         f"quantize this model to int8 instead (scheme='int8': one scale per row, any K)")
    fit = tuple(g for g in GROUP_SIZES if not ks or g <= ks[0])
    exact = [g for g in (*GROUP_SIZES, 256) if all(k % g == 0 for k in ks)]
    unpadded = (f"of those, {', '.join(map(str, exact))} divide every layer's K {ks} (no padding)" if exact else
                f"none of them divides every layer's K {ks}, so some layers are stored padded")
    if group_size <= 0 or group_size % 32:
        raise ValueError(f"{op}: group_size={group_size} is not a positive multiple of 32 (the int4 kernels' "
                         f"smallest K tile); use one of {fit} (128 is the usual choice; {unpadded})")
    if ks and group_size > ks[0]:
        raise ValueError(f"{op}: group_size={group_size} is larger than the input dimension K={ks[0]} of some of "
                         f"the layers to quantize: each of their rows would be stored as one group, "
                         f"{group_size - ks[0]} of its {group_size} columns zeros that every GEMV reads; use a "
                         f"group size of at most {ks[0]}, e.g. one of {fit}")
    return group_size


def check_not_swapped(op: str, model: nn.Module) -> None:
    """Raise ValueError when the Triton kernel modules are swapped in (they fuse the layers' float weights, which
    quantizing or rescaling would leave stale); the message says how to swap them out."""
    swapped = [n for n, m in model.named_modules() if type(m).__module__ == "llmlab.kernels.modules"]
    if swapped:
        raise ValueError(f"{op}: {swapped[0]} is a Triton-kernel module (the 'Triton kernels' switch), which fuses "
                         f"the layers' weights; call llmlab.kernels.modules.swap_out(model) first")


def check_weights(op: str, model: nn.Module, scheme: str, include_lm_head: bool = False) -> None:
    """Every weight `quantize_model` would quantize can be: finite, and for int4 within the kernels' scale range
    (`weight_quant.check_int4_range`). Run before any layer changes, so that a refusal leaves the model whole;
    ValueError naming `op` and the layer otherwise."""
    for name, _, _, linear in _targets(model, include_lm_head):
        check_weight(op, linear.weight, f"{name}.weight")
        if scheme == "int4":
            check_int4_range(op, linear.weight, f"{name}.weight")


def quantize_model(model: nn.Module, scheme: str = "int8", group_size: int = 128,
                   include_lm_head: bool = False) -> nn.Module:
    """Replace the model's linear layers by weight-only quantized ones, in place. Returns the model.

    Args:
        model: a `llmlab.model.Transformer` (or any nn.Module; its nn.Linear children are swapped). Its device
            and dtype are kept: the packed weights live where the weights were.
        scheme: "int8" (per output channel) or "int4" (group-wise, two per byte). Both symmetric.
        group_size: int4 only (ignored for int8): inputs per scale; 32, 64 or 128 (128 is the usual choice:
            smaller groups track the weights more closely and cost more scale bytes), or another positive multiple
            of 32. A layer whose input dimension K it does not divide (K = 704 at 128, the default model's
            down_proj) is stored padded with zero columns to Kp = `linear.padded_k(K, group_size)` (768): its
            output is that of the unpadded weight, its `padded_in_features` is Kp, and `weight_bytes` counts the
            padded bytes (llmlab/quant/linear.py, "Padding").
        include_lm_head: also quantize the output projection `lm_head` (off by default: it is the layer most
            sensitive to rounding, and with tied embeddings it shares its weight with the embedding).

    Raises:
        TypeError: model is not an nn.Module (an `LLM`: pass llm.model); group_size not an int.
        ValueError: an unknown scheme; a model already quantized (dequantize_model first, or load the float
            checkpoint); a model whose modules are swapped for the Triton kernels (llmlab.kernels.modules.swap_out
            first); an int4 group size that is not a positive multiple of 32 (the message names group_size, the
            usual choices and those that need no padding for this model); no linear layer to quantize; a weight
            with NaN or inf, or (int4) too large for the kernels' scales; all checked before any layer changes.
    """
    _check_model("quantize_model", model)
    if scheme not in SCHEMES:
        raise ValueError(f"quantize_model: unknown scheme {scheme!r}; use one of {SCHEMES}")
    if is_quantized(model):
        raise ValueError(f"quantize_model: the model is already quantized ({len(quantized_layers(model))} layers); "
                         f"quantizing twice would round the rounded weights again. Call "
                         f"llmlab.quant.dequantize_model(model) first (for an LLM: dequantize_model(llm.model); it "
                         f"keeps the rounding), or load the float checkpoint it came from")
    check_not_swapped("quantize_model", model)
    targets = _targets(model, include_lm_head)
    if not targets:
        raise ValueError("quantize_model: the model has no nn.Linear layer to quantize")
    if scheme == "int4":
        group_size = check_int4_group("quantize_model", model, group_size, include_lm_head)
    check_weights("quantize_model", model, scheme, include_lm_head)  # all of them before the first swap
    for name, parent, attr, linear in targets:
        if scheme == "int8":
            q = Int8Linear.from_linear(linear, name=name + ".weight")
        else:
            q = Int4Linear.from_linear(linear, group_size, name=name + ".weight")
        q.train(linear.training)
        setattr(parent, attr, q)
    return model


def dequantize_model(model: nn.Module, dtype: torch.dtype | str | None = None) -> nn.Module:
    """Undo `quantize_model`'s swap, in place: each quantized layer becomes an nn.Linear holding its DEQUANTIZED
    weight (the rounded values, not the original ones: quantization is lossy) in `dtype` (torch.float32 /
    bfloat16 / float16 or 'fp32' / 'bf16' / 'fp16'; default: the original layer's dtype). A quantized lm_head of a
    model with tied embeddings is re-tied to the embedding (which was never quantized, so that restores the
    original exactly). Returns the model; a model with no quantized layer is returned unchanged. ValueError for
    another dtype, before any layer changes."""
    _check_model("dequantize_model", model)
    if dtype is not None:
        from llmlab.engine import pick_dtype
        try:
            dtype = pick_dtype(dtype, torch.device("cpu"))
        except ValueError as e:
            raise ValueError(f"dequantize_model: dtype: {e}") from None
    tie = getattr(getattr(model, "config", None), "tie_embeddings", False)
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if not isinstance(child, QuantizedLinear):
                continue
            dt = dtype or child.orig_dtype
            lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            device=child.scales.device, dtype=dt)
            with torch.no_grad():
                if tie and not parent_name and attr == "lm_head" and hasattr(model, "embed_tokens"):
                    lin.weight = model.embed_tokens.weight
                else:
                    lin.weight.copy_(child.dequantize(dt))
                if child.bias is not None:
                    lin.bias.copy_(child.bias)
            lin.train(child.training)
            setattr(parent, attr, lin)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: the quantized layers' packed values + scales (`QuantizedLinear.
    weight_bytes`), plus every other parameter and float buffer (embedding, norms, biases, unquantized layers)
    at its own dtype; a tensor shared by two modules (tied embeddings) counts once. Non-weight buffers (RoPE
    tables: `inv_freq`, `cos`/`sin` caches) are not weights and are left out.

    This is what one decode step must read (the weights part of it), the numerator of MBU."""
    _check_model("weight_bytes", model)
    seen: set[int] = set()
    total = 0
    packed_ids = set()
    for m in quantized_layers(model).values():
        for t in m.packed_tensors():
            packed_ids.add(id(t))
            total += t.numel() * t.element_size()
    for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                       if n.endswith(".bias")]:
        if id(t) in packed_ids or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
