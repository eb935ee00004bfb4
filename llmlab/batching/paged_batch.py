"""One forward step's KV cache over a shared block pool: any sequences, each at its own positions.

Continuous batching runs, in one forward pass, sequences that joined at different times: row b of the batch is
whichever sequence the scheduler picked, at its own length. `llmlab.cache.paged_cache.PagedKVCache` ties row b to
sequence id b and gives every row the same positions; this view lifts both limits. It is built for one forward
pass from (sequence ids, first position of each row, T new tokens per row) and offers the two methods
`llmlab.model.Transformer` looks for on a cache, so the model runs it unchanged:

* `update(layer, positions, k, v)`: writes each row's new K/V into its blocks (token p of a sequence lives in block
  `table[p // block_size]` at offset `p % block_size`) and returns every row's K/V GATHERED into a contiguous
  (B, Hkv, S, hd) copy, S = the longest row's length; shorter rows are padded with whatever block 0 holds;
* `attention_mask(positions, sliding_window)`: the additive (B, 1, T, S) mask that hides, per row, the padding and
  the future (slot s is visible to a query at position p when s <= p, and s > p - window with a sliding window).

The pools are a `PagedKVCache`'s (per layer (num_blocks, Hkv, block_size, hd) for K and for V) and the block tables
are its `BlockManager`'s, which the scheduler (`llmlab.batching.scheduler`) fills: the view only reads them.

This is the reference path, plain PyTorch and exact: the gather copies every row's whole cache in every layer of
every step. On a GPU two things replace it. The decode rows' attention becomes the Triton paged kernel
(`llmlab.kernels.paged_decode_attention.paged_decode_attention(q, k_pool, v_pool, block_tables, lengths)`), which
reads each row's blocks in place through the (B, width) tables this view already builds — a view for the decode rows
would offer `write` + `decode_attention` as `PagedKVCache` does, with no mask. And the decode step is captured as a
CUDA graph per batch-size bucket (pad B up to 1, 2, 4, 8, ... and the tables to a fixed width, refill the same device
tensors before each replay, as `llmlab.runtime.cuda_graphs` does for a static cache), since the host otherwise
launches every kernel of every step anew.

Source: Kwon et al. 2023, PagedAttention, https://arxiv.org/abs/2309.06180.
"""

from __future__ import annotations

import numbers

import torch

from llmlab.cache.paged_cache import PagedKVCache, gather


class PagedBatchView:
    """The KV cache of one forward pass: row b is sequence `seq_ids[b]`, its counts[b] new tokens at positions
    starts[b] .. starts[b] + counts[b] - 1, LEFT-padded to T tokens.

    Left padding lets chunks of different lengths share one pass (one read of the weights) and keeps every row's
    last real token at index T - 1, where `last_only` logits are taken. A padding token (token 0 of the caller's
    choosing) sits at its row's first new position, so RoPE and the mask stay in range, and its K/V go to the pool's
    spare block (`PagedKVCache(spare_blocks=1)`), a slot no block table lists: no real query ever sees it, and the
    padding queries' outputs are thrown away.

    Args:
        pool: the `PagedKVCache` whose pools hold the K/V and whose `blocks` (a `BlockManager`) hold the tables.
        seq_ids: one sequence id per row (B >= 1), each with blocks reserved up to its new tokens.
        starts: each row's first new position (its tokens before it are already in the cache).
        T: tokens per row of the pass (1 for a decode batch; the longest chunk for prefill).
        counts: new tokens per row, each 1..T (default: T for every row, no padding).

    Attributes (built once, shared by every layer): positions (B, T) int64 on the pools' device, to pass to the
    model; block_tables (B, width) int64; length S = max(starts[b] + counts[b]); padding = B * T - sum(counts).

    Raises:
        ValueError: no rows, T < 1, starts / counts and seq_ids of different lengths, a count outside 1..T, a
            negative start, a row whose blocks do not reach its last new token (reserve them first:
            `BlockManager.allocate` / `append`), or padding in a pool without a spare block.
        TypeError: T, a start or a count that is not a whole number. KeyError: a sequence id without blocks.
    """

    def __init__(self, pool: PagedKVCache, seq_ids: list, starts: list[int], T: int, counts: list[int] | None = None):
        B = len(seq_ids)
        counts = [T] * B if counts is None else list(counts)
        if B == 0 or T < 1 or len(starts) != B or len(counts) != B:
            raise ValueError(f"a view needs B >= 1 rows, T >= 1 tokens per row and one start and count per row; "
                             f"got {B} seq_ids, T={T}, {len(starts)} starts, {len(counts)} counts")
        if any(not 1 <= n <= T for n in counts):
            raise ValueError(f"counts={counts}: each row's new tokens must be between 1 and T={T}")
        blocks, bs = pool.blocks, pool.block_size
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in [T, *starts, *counts]):
            raise TypeError(f"T={T!r}, starts={starts} and counts={counts} must be whole numbers")
        for sid, start, n in zip(seq_ids, starts, counts):
            if start < 0:
                raise ValueError(f"sequence {sid!r}: start={start}; a row's first new position must be >= 0")
            if blocks.length(sid) < start + n:
                raise ValueError(f"sequence {sid!r}: tokens {start}..{start + n - 1} are not all within its "
                                 f"{blocks.length(sid)} reserved token slots; reserve blocks before the forward pass")
        self.padding = B * T - sum(counts)
        if self.padding and not pool.spare:
            raise ValueError("rows of different lengths need a spare block for their padding: build the pool with "
                             "PagedKVCache(..., spare_blocks=1)")
        self.pool = pool
        self.length = max(s + n for s, n in zip(starts, counts))  # S: the longest row, cached tokens + new ones
        width = -(-self.length // bs)  # blocks per row of the tables
        tables, blk, off, pos = [], [], [], []
        for sid, start, n in zip(seq_ids, starts, counts):
            table = blocks.block_table(sid)[:width]
            tables.append(table + [0] * (width - len(table)))  # padding: slots past the row's length, masked
            blk += [pool.spare[0] if pool.spare else 0] * (T - n)  # left padding: the spare block, offset 0
            off += [0] * (T - n)
            pos += [start] * (T - n)
            for p in range(start, start + n):
                blk.append(table[p // bs])
                off.append(p % bs)
                pos.append(p)
        device = pool.k[0].device
        self.positions = torch.tensor(pos, dtype=torch.int64, device=device).view(B, T)  # (B, T)
        self.block_tables = torch.tensor(tables, dtype=torch.int64, device=device)  # (B, width)
        self._blk = torch.tensor(blk, dtype=torch.int64, device=device)  # (B*T,) block of each new token
        self._off = torch.tensor(off, dtype=torch.int64, device=device)  # (B*T,) offset in its block
        self.B, self.T = B, T

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, Hkv, T, hd), the pools' dtype, into the rows' blocks; return the gathered K, V
        (B, Hkv, S, hd) of every row (slots past a row's length hold padding: `attention_mask` hides them).

        positions: the view's own `positions` (B, T) (the slots were computed from them when the view was built).

        Raises:
            ValueError: positions or k/v not shaped for this view's (B, T).
        """
        if tuple(positions.shape) != (self.B, self.T) or k.shape[0] != self.B or k.shape[2] != self.T:
            raise ValueError(f"this view is for B={self.B} rows of T={self.T} tokens; got positions "
                             f"{tuple(positions.shape)} and k {tuple(k.shape)}: build a view per forward pass")
        B, Hkv, T, hd = k.shape
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]  # (num_blocks, Hkv, bs, hd)
        k_pool[self._blk, :, self._off] = k.permute(0, 2, 1, 3).reshape(B * T, Hkv, hd)  # one slot per new token
        v_pool[self._blk, :, self._off] = v.permute(0, 2, 1, 3).reshape(B * T, Hkv, hd)
        return gather(k_pool, self.block_tables, self.length), gather(v_pool, self.block_tables, self.length)

    def attention_mask(self, positions: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
        """(B, 1, T, S) additive mask in the pools' dtype: 0 where slot s is visible to the query at
        positions[b, t] (s <= position, and s > position - sliding_window with a window), -inf elsewhere.

        Built once per forward pass (the model passes it to every layer). Every query sees at least its own slot,
        so no row of the softmax is all -inf.
        """
        slots = torch.arange(self.length, device=positions.device)  # (S,) slot s holds position s
        q = positions[:, None, :, None]  # (B, 1, T, 1)
        visible = slots <= q  # (B, 1, T, S)
        if sliding_window is not None:
            visible = visible & (slots > q - sliding_window)
        zero = torch.zeros((), dtype=self.pool.k[0].dtype, device=positions.device)
        return zero.masked_fill(~visible, float("-inf"))
