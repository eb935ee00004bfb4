"""What a model's weights weigh: the bytes one decode step reads (computed from the tensors' shapes and dtypes), and
the bytes they occupy in memory (measured: the storages really allocated). The bench records both per rung, so a
quantized rung's memory saving and its MBU stand on the bytes it really moves.

    step_weight_bytes(model)       every weight a decode step reads: packed values + scales of quantized layers
                                   (`llmlab.quant`), the float layers, norms and lm_head; an untied input embedding
                                   only contributes one row per token, so its table is left out (the convention of
                                   `llmlab.measure.roofline.weight_params_read`)
    allocated_weight_bytes(model)  bytes of the distinct storages behind the model's parameters and weight buffers
                                   (tied or fused views counted once; RoPE tables left out)
"""

from __future__ import annotations

import torch

from llmlab.quant import quantized_layers, weight_bytes

__all__ = ["step_weight_bytes", "allocated_weight_bytes"]

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
