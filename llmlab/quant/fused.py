"""Quantized linear layers that read one input, as ONE quantized layer: the q/k/v projections (or gate/up) of a
quantized model, for the Triton kernel modules (`llmlab.kernels.modules`), which run one GEMV where the model runs
three (or two).

The float version (`llmlab.kernels.modules.fuse`) concatenates the layers' weights; here the same is done to what
a quantized layer stores: the packed values and the scales are concatenated along the output dimension N (rows),
which keeps both formats intact, because each format's values and scales are laid out row by row (an int8 row has
one scale, an int4 row K / group_size scales). The layers must share the scheme, K and (int4) the group size.

As with the float weights, each layer's buffers become VIEWS of their rows of the fused tensors: no second copy,
and the layers keep working on their own (`quantize_model`'s layers, `dequantize_model`, `state_dict`). A buffer
replaced or moved afterwards makes `fuse_quantized` build the fused layer anew.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from .linear import QuantizedLinear

__all__ = ["FusedQuantized", "fuse_quantized", "all_quantized"]


class FusedQuantized(NamedTuple):
    """One quantized layer standing for several: `layer` (of their class, N = the sum of theirs), each layer's
    number of rows, and the addresses of the layers' buffers when they were fused (to see when to rebuild)."""

    addresses: tuple
    layer: QuantizedLinear
    sizes: tuple


def all_quantized(linears) -> bool:
    """True when every layer is a `QuantizedLinear` (False for plain nn.Linear layers)."""
    return all(isinstance(lin, QuantizedLinear) for lin in linears)


def _buffers(lin: QuantizedLinear) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what a layer stores per output row: its packed tensors and its bias."""
    return [(name, t) for name, t in lin.named_buffers(recurse=False) if t is not None]


def _check_same_format(linears) -> None:
    first = linears[0]
    for lin in linears[1:]:
        if type(lin) is not type(first):
            raise ValueError(f"fuse_quantized: cannot fuse a {type(first).__name__} with a {type(lin).__name__}: "
                             f"quantize every layer with the same scheme")
        if lin.in_features != first.in_features or getattr(lin, "group_size", None) != getattr(first, "group_size",
                                                                                             None):
            raise ValueError(f"fuse_quantized: the layers differ in K ({first.in_features} vs {lin.in_features}) or "
                             f"group size ({getattr(first, 'group_size', None)} vs {getattr(lin, 'group_size', None)})"
                             f"; they must read the same input in the same format")
        if [n for n, _ in _buffers(lin)] != [n for n, _ in _buffers(first)]:
            raise ValueError("fuse_quantized: the layers store different tensors (one has a bias, another not?)")


def fuse_quantized(linears, fused: FusedQuantized | None = None) -> FusedQuantized:
    """`fused` while the layers' buffers still live in it, else the layers fused anew.

    Args:
        linears: Int8Linear or Int4Linear layers of one scheme reading the same input (same K, same group size).
        fused: what an earlier call returned, or None.

    Returns:
        A `FusedQuantized` whose `layer(x)` equals the concatenation of each layer's output along the last
        dimension.

    Raises:
        ValueError: layers of different classes, K, group size or buffers.
    """
    linears = tuple(linears)
    addresses = tuple(t.data_ptr() for lin in linears for _, t in _buffers(lin))
    if fused is not None and fused.addresses == addresses:
        return fused
    _check_same_format(linears)
    layer = copy.copy(linears[0])  # the attributes (K, group size, dtype, use_kernel) of the first layer
    layer._buffers = dict(layer._buffers)  # its own buffer dict: the first layer's must not change
    layer._parameters, layer._modules = dict(layer._parameters), dict(layer._modules)
    with torch.no_grad():
        for name, _ in _buffers(linears[0]):
            whole = torch.cat([lin._buffers[name] for lin in linears])  # rows of every layer, in order
            layer._buffers[name] = whole
            start = 0
            for lin in linears:  # each layer's buffer becomes a view of its rows of the fused one
                rows = lin.out_features
                lin._buffers[name] = whole[start:start + rows]
                start += rows
    layer.out_features = sum(lin.out_features for lin in linears)
    addresses = tuple(t.data_ptr() for lin in linears for _, t in _buffers(lin))
    return FusedQuantized(addresses, layer, tuple(lin.out_features for lin in linears))
