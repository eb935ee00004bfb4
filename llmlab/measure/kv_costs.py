"""What a KV cache costs, measured with real caches: the memory each layout reserves for a mixed-length workload
(`measured_waste`, against the formula in `llmlab.cache.sizing.waste`) and the decode step's time as the context
grows (`decode_latency_vs_context`: each step reads the whole cache). Lab 03 plots both.
"""

from __future__ import annotations

import time

import torch

from llmlab.cache.kv_cache import KVCache
from llmlab.cache.paged_cache import PagedKVCache
from llmlab.cache.sizing import _check_lengths, allocated_bytes, bytes_per_token, cache_bytes
from llmlab.config import ModelConfig


def measured_waste(config: ModelConfig, lengths: list[int], max_seq_len: int, block_size: int = 16,
                   dtype: torch.dtype = torch.float32, device="cpu") -> dict:
    """Allocate both layouts for the workload and measure bytes: a `KVCache` of batch len(lengths) x max_seq_len,
    and a `PagedKVCache` whose block manager holds every sequence at its length (pool sized to exactly what the
    workload needs). Returns bytes reserved and used for both (bytes, from the tensors actually allocated)."""
    _check_lengths(lengths, max_seq_len, block_size)
    per_tok = bytes_per_token(config, dtype)
    used = sum(lengths) * per_tok
    contiguous = KVCache(config, len(lengths), max_seq_len, dtype, device)
    contiguous_bytes = allocated_bytes(contiguous)
    del contiguous
    nblocks = sum(-(-n // block_size) for n in lengths)
    paged = PagedKVCache(config, len(lengths), max_seq_len, dtype, device, block_size=block_size, num_blocks=nblocks)
    for i, n in enumerate(lengths):
        paged.blocks.allocate(i, n)
    paged_bytes = allocated_bytes(paged)
    assert paged.blocks.num_free == 0
    return {"sequences": len(lengths), "used_bytes": used, "bytes_per_token": per_tok,
            "contiguous_bytes": contiguous_bytes, "contiguous_waste": 1 - used / contiguous_bytes,
            "paged_bytes": paged_bytes, "paged_waste": 1 - used / paged_bytes, "block_size": block_size,
            "max_seq_len": max_seq_len}


@torch.inference_mode()
def decode_latency_vs_context(model, contexts: list[int], steps: int = 8, batch: int = 1) -> list[dict]:
    """Median decode-step time (ms) with `context` tokens already cached, for each context length.

    The cache is filled with random K/V (the values do not change the time), then `steps` single-token steps run
    at positions context, context+1, ...; the KV bytes read per step grow linearly with the context. The first
    context is run once untimed before the sweep: a process's first decode steps pay one-time costs (allocator,
    thread pools) that would make the shortest context look slowest.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: time at least one decode step per context (a whole number >= 1)")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    rows = []
    for ctx in list(contexts[:1]) + list(contexts):  # the first pass is the warm-up: dropped below
        cache = KVCache(model.config, batch, ctx + steps, dtype, device)
        for t in (*cache.k, *cache.v):
            t.normal_()
        cache.length = ctx
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        times = []
        for i in range(steps):
            pos = torch.tensor([ctx + i], device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model(token, pos, kv_cache=cache, last_only=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        rows.append({"context": ctx, "ms": times[len(times) // 2],
                     "kv_mb_read": cache_bytes(model.config, ctx, batch, dtype) / 1e6})
    return rows[1:]
