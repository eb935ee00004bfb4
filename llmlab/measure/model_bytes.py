"""What a model's weights weigh: the bytes one decode step reads (computed from the tensors' shapes and dtypes), and
the bytes they occupy in memory (measured: the storages really allocated). The bench records both per rung, so a
quantized rung's memory saving and its MBU stand on the bytes it really moves.

    step_weight_bytes(model)       every weight a decode step reads: packed values + scales of quantized layers
                                   (`llmlab.quant`), the float layers, norms and lm_head; an untied input embedding
                                   only contributes one row per token, so its table is left out (the convention of
                                   `llmlab.measure.roofline.weight_params_read`)
    allocated_weight_bytes(model)  bytes of the distinct storages behind the model's parameters and weight buffers
                                   (tied or fused views counted once; RoPE tables left out)
    loaded_weights(model, dtype)   the `weights` field of a bench row for the model as loaded: "int8" / "int4" for
                                   quantized layers (as the +int8 / +int4 rungs label theirs), else "fp32", "bf16", ...
    describe_weights(model, dtype) the same with the group size and lm_head, e.g. "int4 g128 + lm_head"
    bytes_per_param_read(model, config, dtype)  bytes per weight one decode step reads, for MBU and the roofline
"""

from __future__ import annotations

import torch

from llmlab.ladder import weight_bytes_per_param, weights_label
from llmlab.measure.bench_metrics import AS_LOADED
from llmlab.measure.roofline import weight_params_read
from llmlab.quant import quantized_layers, weight_bytes

__all__ = ["step_weight_bytes", "allocated_weight_bytes", "loaded_weights", "describe_weights", "bytes_per_param_read"]

_NOT_WEIGHTS = ("inv_freq", "cos_cached", "sin_cached", "cos", "sin")  # RoPE tables: buffers, not weights


def _embedding(model: torch.nn.Module) -> torch.nn.Embedding | None:
    emb = getattr(model, "embed_tokens", None)
    return emb if isinstance(emb, torch.nn.Embedding) else None


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads (int). See the module docstring. Raises TypeError for
    anything but an nn.Module."""
    total = weight_bytes(model)  # every weight once, quantized layers as stored
    emb = _embedding(model)
    if emb is None:
        return total
    head = getattr(model, "lm_head", None)
    read_by_head = (isinstance(head, torch.nn.Linear) and type(head) is torch.nn.Linear
                    and head.weight.data_ptr() == emb.weight.data_ptr())
    if not read_by_head:  # untied (or a quantized copy in lm_head): the table itself is read one row at a time
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def allocated_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters and weight buffers (int): what the weights
    occupy in memory, measured from the allocations rather than computed from the shapes. Views of one storage
    (tied embeddings, the kernel modules' fused q/k/v) count once, with the whole storage."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"allocated_weight_bytes: expected an nn.Module, got {type(model).__name__}")
    tensors = [p for p in model.parameters()]
    tensors += [b for name, b in model.named_buffers() if b is not None and name.rsplit(".", 1)[-1] not in _NOT_WEIGHTS]
    for layer in quantized_layers(model).values():
        tensors += layer.packed_tensors()
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _check_module(op: str, model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: expected an nn.Module (an LLM's .model), got {type(model).__name__}")


def loaded_weights(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """The weight format of `model` as it is loaded, the `weights` field of a bench row (str).

    A model with quantized layers (`llmlab.quant.Int8Linear` / `Int4Linear`, e.g. a folder written by
    `llmlab.quant.serialize.save_quantized`) gives their scheme, "int8" or "int4" (several schemes joined by "+",
    e.g. "int4+int8"), the label the +int8 / +int4 rungs give their rows; any other model gives the float format
    of `dtype` ("fp32", "bf16", "fp16": `llmlab.ladder.weights_label`). The group size is in `describe_weights`.

    Raises:
        TypeError: `model` is not an nn.Module.
    """
    _check_module("loaded_weights", model)
    schemes = sorted({layer.scheme for layer in quantized_layers(model).values()})
    return "+".join(schemes) if schemes else weights_label(AS_LOADED, dtype)


def describe_weights(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """`loaded_weights` with what tells two quantized models of one scheme apart (str): the int4 group size(s)
    and whether lm_head is quantized too, e.g. "int8", "int4 g128", "int4 g64 + lm_head"; a float model's is its
    dtype's label ("fp32", "bf16").

    Raises:
        TypeError: `model` is not an nn.Module.
    """
    _check_module("describe_weights", model)
    layers = quantized_layers(model)
    if not layers:
        return loaded_weights(model, dtype)  # a float model: its dtype's label
    parts = []
    for scheme in sorted({layer.scheme for layer in layers.values()}):
        groups = sorted({g for layer in layers.values() if layer.scheme == scheme
                         and (g := getattr(layer, "group_size", None)) is not None})
        parts.append(scheme + (" " + "/".join(f"g{g}" for g in groups) if groups else ""))
    head = any(name == "lm_head" or name.endswith(".lm_head") for name in layers)
    return "+".join(parts) + (" + lm_head" if head else "")


def bytes_per_param_read(model: torch.nn.Module, config, dtype: torch.dtype) -> float:
    """Bytes per weight one batch-1 decode step of `model` as loaded reads (float), the weight term of MBU and of
    the bandwidth roofline (`llmlab.measure.roofline`, whose weight bytes are
    `weight_params_read(config)` x this).

    A quantized model's comes from its tensors: `step_weight_bytes(model)` (packed values + scales + the float
    layers it keeps, such as a tied embedding read as lm_head) / `weight_params_read(config)`: int4 layers at group
    size 128 weigh 0.5 + 4/128 bytes per weight, the float layers their dtype's size, and this is the mean over
    both; a float model's is its dtype's size (`llmlab.ladder.WEIGHT_BYTES`: 4 for fp32, 2 for bf16).

    Raises:
        TypeError: `model` is not an nn.Module.
        ValueError: a dtype with no entry in `llmlab.ladder.WEIGHT_BYTES`.
    """
    _check_module("bytes_per_param_read", model)
    if quantized_layers(model):
        return step_weight_bytes(model) / weight_params_read(config)
    return weight_bytes_per_param(AS_LOADED, dtype)
