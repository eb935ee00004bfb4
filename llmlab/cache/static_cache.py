"""The static KV cache: the same buffers as `KVCache`, used so that one decode step has one shape forever.

A CUDA graph replays fixed kernels on fixed addresses with fixed shapes; nothing in it may depend on a number the
host has to read. `KVCache` breaks both rules: it slices `[:, :, :end]` (a shape that grows every step) and reads
the write position on the host (`int(positions[0])`, a GPU->CPU synchronization). The static cache keeps the same
(max_batch, Hkv, max_seq_len, hd) buffers and changes three things, as gpt-fast and the Hugging Face `StaticCache`
do:

* writes go to per-row positions given as a DEVICE tensor (a `scatter_`, so rows may be at different lengths and
  the host never reads a position);
* attention always reads the whole buffer (S = max_seq_len), so the step's shapes never change;
* a mask, built on the device from the positions, hides the slots a query may not see (not yet written, left
  over from an earlier sequence, or in the future).

The price: every decode step reads all max_seq_len slots, written or not. That is why the caller sizes the cache
to the request (rounded up) rather than to the model's whole context.

Slot s of a row holds that row's token at position s, so "may see" is simply `s <= position` (and, with a sliding
window, `s > position - window`).
"""

from __future__ import annotations

import copy

import torch

from llmlab.config import ModelConfig
from llmlab.cache.kv_cache import KVCache


class StaticKVCache(KVCache):
    """Per-layer (max_batch, n_kv_heads, max_seq_len, head_dim) buffers written at device-side positions.

    Args and errors as `KVCache` (ValueError for a length beyond the model's context, MemoryError on CUDA when the
    buffers would not fit). A forward pass may use fewer rows than max_batch: rows 0..B-1 are used.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype, device):
        super().__init__(config, batch_size, max_seq_len, dtype, device)
        self.slots = torch.arange(max_seq_len, device=device)  # (S,) slot index == absolute position
        self._lengths_for = None  # (positions, its version, batch, lengths): `decode_lengths`' last answer

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, Hkv, T, hd) at `positions` and return the whole buffers of rows 0..B-1.

        positions: (T,) int64 (the same for every row, e.g. a prefill 0..T-1) or (B, T) (one per row), on the
        cache's device. Returns k_all, v_all: (B, Hkv, max_seq_len, hd). Positions must be < max_seq_len: the
        caller checks lengths on the host before launching (out of range would be a device-side error on CUDA).
        """
        B, Hkv, T, hd = k.shape
        pos = positions.expand(B, T) if positions.dim() == 1 else positions  # (B, T)
        index = pos[:, None, :, None].expand(B, Hkv, T, hd)  # (B, Hkv, T, hd): the slot of every element
        k_all, v_all = self.k[layer][:B], self.v[layer][:B]  # views: the writes land in the buffers
        k_all.scatter_(2, index, k)
        v_all.scatter_(2, index, v)
        return k_all, v_all

    def visible(self, positions: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
        """True where a query at `positions` may attend to a slot: (T,) -> (1, 1, T, S); (B, T) -> (B, 1, T, S)."""
        pos = positions if positions.dim() == 2 else positions[None]  # (B or 1, T)
        q = pos[:, None, :, None]  # (B, 1, T, 1)
        mask = self.slots <= q  # (B, 1, T, S): causal; also hides slots not written yet
        if sliding_window is not None:
            mask = mask & (self.slots > q - sliding_window)
        return mask

    def attention_mask(self, positions: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
        """`visible` as an additive mask for SDPA, in the cache's dtype: 0 where visible, -inf elsewhere.

        Built once per forward pass (the model passes it to every layer); a boolean mask would be converted to
        this by SDPA again in every layer — two more small kernels per layer in the step.
        """
        visible = self.visible(positions, sliding_window)
        zero = torch.zeros((), dtype=self.k[0].dtype, device=visible.device)
        return zero.masked_fill(~visible, float("-inf"))  # (B or 1, 1, T, S)

    def decode_lengths(self, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """(batch,) int64: how many slots each row's newest token attends to (its position + 1), for the decode
        kernels that read only the filled slots (`llmlab.kernels.modules.TritonAttention`). positions as in
        `update` (the last one of a row counts).

        Computed once per forward pass — every layer gets the same `positions` tensor — and remembered here until
        that tensor changes (a loop that adds 1 to it in place bumps its version).

        Raises ValueError (before anything is written) for a position outside the slots, as `update`'s indexing
        refuses it; the check reads the positions on the host, so it is skipped while a CUDA graph is captured
        (the graph runner checks its positions on the host before each replay).
        """
        held = self._lengths_for
        if held is not None and held[0] is positions and held[1] == positions._version and held[2] == batch:
            return held[3]
        pos = row_positions(positions, batch)
        S = self.k[0].shape[2]
        if not (pos.is_cuda and torch.cuda.is_current_stream_capturing()):
            lo, hi = int(pos.min()), int(pos.max())
            if lo < 0 or hi >= S:
                raise ValueError(f"position {hi if hi >= S else lo} is outside the static KV cache's {S} slots "
                                 f"(0..{S - 1}): build the cache with a larger max_seq_len, or start a new sequence")
        lengths = pos + 1
        self._lengths_for = (positions, positions._version, batch, lengths)
        return lengths

    def rows(self, start: int, stop: int) -> "StaticKVCache":
        """A cache over rows start..stop-1 that shares these buffers (e.g. to prefill one row of a batch)."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows {start}..{stop - 1} are outside the cache's {self.batch_size} rows")
        view = copy.copy(self)
        view.k = [t[start:stop] for t in self.k]
        view.v = [t[start:stop] for t in self.v]
        view.batch_size = stop - start
        return view

    def reset(self) -> None:
        """Nothing to do: the mask hides whatever an earlier sequence left in the buffers."""


def row_positions(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """(batch,) the position of each row's last new token: positions is (B, T) (one per row) or (T,) (shared)."""
    return positions[:, -1] if positions.dim() == 2 else positions[-1:].expand(batch)
