"""The contiguous KV cache: keep every past token's keys and values so a decode step computes only the new one.

Without a cache, generating token t re-runs the whole prefix through every layer: O(t) work per token, O(n^2)
in total. With it, a decode step projects only the new token and reads the stored K/V of the others. The price is
memory: 2 (K and V) x layers x KV heads x head_dim x bytes per element, per token per sequence
(`KVCache.bytes_per_token`). GQA shrinks it by n_heads / n_kv_heads.

This is the simplest layout — one (max_batch, Hkv, max_seq_len, hd) buffer per layer, allocated up front — the
layout gpt-fast uses and the one a paged cache improves on (Kwon et al. 2023, https://arxiv.org/abs/2309.06180).
"""

from __future__ import annotations

import numbers

import torch

from llmlab.config import ModelConfig
from llmlab.cache.sizing import bytes_per_token, check_fits


def check_cache_args(config: ModelConfig, dtype, **counts) -> None:
    """The checks every KV cache layout makes before allocating: each count (batch_size, max_seq_len, block_size,
    ...) a whole number >= 1, max_seq_len within the model's context, dtype a floating torch.dtype.

    Raises:
        TypeError: a count that is not an int, or a dtype that is not a floating torch.dtype (the message names
            torch.bfloat16 / torch.float16 / torch.float32).
        ValueError: a count below 1, or max_seq_len beyond config.max_seq_len.
    """
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy integers are whole numbers
            raise TypeError(f"{name}={value!r} ({type(value).__name__}): give a whole number, e.g. {name}=1")
    bad = [f"{name}={value}" for name, value in counts.items() if value <= 0]
    if bad:
        raise ValueError(f"{', '.join(bad)}: must be positive")
    if counts.get("max_seq_len", 0) > config.max_seq_len:
        raise ValueError(f"a KV cache of {counts['max_seq_len']} tokens exceeds the model's context length "
                         f"{config.max_seq_len}; generate fewer tokens or use a shorter prompt")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r}: give a floating torch.dtype for the cache, e.g. torch.bfloat16, "
                        f"torch.float16 or torch.float32 (normally the model's)")


class KVCache:
    """Per-layer key/value buffers of shape (batch, n_kv_heads, max_seq_len, head_dim).

    Args:
        config: the model's shape (layers, KV heads, head_dim).
        batch_size: sequences decoded together.
        max_seq_len: the longest sequence (prompt + generated) the cache can hold; at most config.max_seq_len.
        dtype, device: of the buffers (normally the model's).

    Raises:
        ValueError: max_seq_len beyond the model's context length, or a count not positive.
        TypeError: a count that is not an int, a dtype that is not a floating torch.dtype (`check_cache_args`).
        MemoryError: the buffers would not fit in the free memory (GPU memory on CUDA, MemAvailable on a CPU);
            the message gives needed and available bytes. Nothing is allocated in that case.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype, device):
        check_cache_args(config, dtype, batch_size=batch_size, max_seq_len=max_seq_len)
        batch_size, max_seq_len = int(batch_size), int(max_seq_len)  # a numpy count as a plain int from here on
        device = torch.device(device)
        shape = (batch_size, config.n_kv_heads, max_seq_len, config.head_dim)
        per_layer = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.nbytes = per_layer * config.n_layers
        check_fits(self.nbytes, device, f"KV cache ({config.n_layers} layers x batch {batch_size} x {max_seq_len} "
                   f"tokens)", "lower the batch size or max_seq_len (in generate: fewer prompts, a shorter prompt or "
                   "a smaller max_new_tokens; the cache holds prompt + new tokens), or use a smaller dtype")
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.length = 0  # tokens written so far (host-side bookkeeping)

    # 2 x layers x KV heads x head_dim x bytes per element: the cache cost of one token of one sequence
    bytes_per_token = staticmethod(bytes_per_token)

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write the new tokens' K/V at `positions` and return all cached K/V up to the last written position.

        positions: (T,) int64, contiguous and increasing, starting at or before `length` (a rewrite of earlier
        positions truncates the cache there); k, v: (B, Hkv, T, hd).
        Returns k_all, v_all: (B, Hkv, S, hd) views with S = positions[-1] + 1.

        Raises:
            ValueError: a write past max_seq_len, or one starting after `length` (a gap of unwritten slots).
        """
        B, T = k.shape[0], k.shape[2]
        if layer == 0:  # every layer writes the same positions: read them from the tensor once per forward pass
            start = int(positions[0])
            if start > self.length:  # the slots in between were never written: attention would read zeros
                raise ValueError(f"the KV cache holds {self.length} tokens; a write at position {start} would leave a "
                                 f"gap: write at position {self.length} (the next one) or earlier")
            if start + T > self.max_seq_len:
                raise ValueError(
                    f"the KV cache holds {self.max_seq_len} tokens but position {start + T - 1} was written; "
                    f"allocate a larger cache"
                )
            self._span = (start, start + T)
        start, end = self._span
        self.k[layer][:B, :, start:end] = k
        self.v[layer][:B, :, start:end] = v
        if layer == len(self.k) - 1:
            self.length = end
        return self.k[layer][:B, :, :end], self.v[layer][:B, :, :end]

    def reset(self) -> None:
        """Forget all cached tokens (the buffers are kept and overwritten by the next sequence)."""
        self.length = 0
