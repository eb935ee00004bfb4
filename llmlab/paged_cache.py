"""The paged KV cache: keys and values live in fixed-size blocks of one shared pool, found through block tables.

`KVCache` reserves max_seq_len slots per sequence up front; a request that stops early wastes the rest. Here each
layer has one pool of blocks, shape (num_blocks, Hkv, block_size, hd) for K and the same for V, and a sequence
takes blocks only as it grows (`llmlab.block_manager.BlockManager` does the bookkeeping, in plain Python). Token p
of a sequence is at block `table[p // block_size]`, offset `p % block_size` (Kwon et al. 2023, PagedAttention,
https://arxiv.org/abs/2309.06180).

Two ways to attend over a paged cache, both here:

* `PagedKVCache.update` (used by `llmlab.model.Attention`): writes the new K/V into their blocks, then GATHERS the
  sequence's blocks into a contiguous (B, Hkv, S, hd) tensor and lets the model's ordinary SDPA attend. This is the
  reference path: it is exact, but the gather copies the whole cache every step — the cost a paged kernel avoids;
* `paged_attention` (PyTorch reference of the paged decode kernel): queries read K/V straight from the pool through
  the block table, one sequence at a time; a Triton paged-attention kernel (kernels/) does the same on the GPU
  without materializing the gathered copy.

The interface is `KVCache`'s (`update(layer, positions, k, v)`, `nbytes`, `length`, `reset`), so `generate` runs on
it unchanged: `generate(model, ids, cache_factory=PagedKVCache)`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .block_manager import BlockManager
from .config import ModelConfig
from .kv_memory import check_fits


class PagedKVCache:
    """Per-layer block pools (num_blocks, n_kv_heads, block_size, head_dim) for K and V, plus a `BlockManager`.

    Args:
        config: the model's shape.
        batch_size: rows of the batch; row b is sequence id b of the block manager.
        max_seq_len: the longest sequence expected (only used to size the pool when num_blocks is None, and checked
            against the model's context).
        dtype, device: of the pools.
        block_size: tokens per block (16 as in vLLM).
        num_blocks: blocks in the pool; default: enough for batch_size x max_seq_len (no saving by itself — a
            server sizes the pool to the free memory and lets many sequences share it).

    Raises:
        ValueError: sizes not positive, or max_seq_len beyond the model's context.
        MemoryError: the pools would not fit in the free memory (GPU or host); the message gives needed and
            available bytes and what to change. Nothing is allocated then.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype, device,
                 block_size: int = 16, num_blocks: int | None = None):
        if batch_size <= 0 or max_seq_len <= 0 or block_size <= 0:
            raise ValueError(f"batch_size={batch_size}, max_seq_len={max_seq_len}, block_size={block_size} "
                             f"must be positive")
        if max_seq_len > config.max_seq_len:
            raise ValueError(f"a KV cache of {max_seq_len} tokens exceeds the model's context length "
                             f"{config.max_seq_len}; generate fewer tokens or use a shorter prompt")
        if num_blocks is None:
            num_blocks = batch_size * math.ceil(max_seq_len / block_size)
        device = torch.device(device)
        shape = (num_blocks, config.n_kv_heads, block_size, config.head_dim)
        elem = torch.empty((), dtype=dtype).element_size()
        self.nbytes = 2 * config.n_layers * torch.Size(shape).numel() * elem
        check_fits(self.nbytes, device, f"paged KV cache ({num_blocks} blocks of {block_size} tokens x "
                   f"{config.n_layers} layers)", "lower num_blocks (or block_size), or use a smaller dtype")
        self.config, self.batch_size, self.max_seq_len = config, batch_size, max_seq_len
        self.block_size, self.num_blocks = block_size, num_blocks
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.blocks = BlockManager(num_blocks, block_size)
        self.length = 0

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _reserve(self, B: int, start: int, end: int) -> None:
        """Make every row 0..B-1 hold `end` tokens (allocating or appending blocks); copy-on-write copies done."""
        for b in range(B):
            if b not in self.blocks.tables:
                if start != 0:
                    raise ValueError(f"row {b} has no cached tokens but the write starts at position {start}")
                self.blocks.allocate(b, end)
                continue
            have = self.blocks.length(b)
            if start > have:
                raise ValueError(f"row {b} holds {have} tokens; a write at position {start} would leave a gap")
            if end > have:
                for src, dst in self.blocks.append(b, end - have):
                    self.copy_block(src, dst)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write after a fork)."""
        for pool in (*self.k, *self.v):
            pool[dst].copy_(pool[src])

    def block_tables(self, B: int, device=None) -> torch.Tensor:
        """(B, max_blocks) int32 block tables, padded with 0 (padding is never read: see context_lens)."""
        tables = [self.blocks.block_table(b) for b in range(B)]
        width = max(len(t) for t in tables)
        rows = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32, device=device or self.k[0].device)

    def slots(self, b: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of row b's positions start..end-1: two (T,) int64 tensors."""
        table = self.blocks.block_table(b)
        pos = range(start, end)
        blk = torch.tensor([table[p // self.block_size] for p in pos], device=self.k[0].device)
        off = torch.tensor([p % self.block_size for p in pos], device=self.k[0].device)
        return blk, off

    # -- the KVCache interface --------------------------------------------------------------------------------
    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, Hkv, T, hd) at `positions` (T,) into the rows' blocks and return the gathered
        (B, Hkv, S, hd) K/V, S = positions[-1] + 1 (the reference path: a copy of the whole cache)."""
        B, T = k.shape[0], k.shape[2]
        if layer == 0:  # the same positions for every layer: do the bookkeeping once per forward pass
            start = int(positions[0])
            end = start + T
            self._reserve(B, start, end)
            self._slots = [self.slots(b, start, end) for b in range(B)]
            self._tables = self.block_tables(B)
            self._end = end
        for b, (blk, off) in enumerate(self._slots):
            self.k[layer][blk, :, off] = k[b].transpose(0, 1)  # (T, Hkv, hd) into T (block, offset) slots
            self.v[layer][blk, :, off] = v[b].transpose(0, 1)
        if layer == len(self.k) - 1:
            self.length = self._end
        return gather(self.k[layer], self._tables, self._end), gather(self.v[layer], self._tables, self._end)

    def reset(self) -> None:
        """Free every row's blocks (the pool is full again)."""
        for seq in list(self.blocks.tables):
            self.blocks.free(seq)
        self.length = 0

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layers * config.n_kv_heads * config.head_dim * elem

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks in use (the pool's allocated-to-sequences part)."""
        return self.nbytes * self.blocks.num_used // self.num_blocks


def gather(pool: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous K (or V) of every row: pool (N, Hkv, bs, hd), block_tables (B, nb) -> (B, Hkv, length, hd).

    Reads nb x bs >= length slots per row and copies them (the reference path; a paged kernel reads in place).
    """
    N, Hkv, bs, hd = pool.shape
    B, nb = block_tables.shape
    blocks = pool[block_tables.long()]  # (B, nb, Hkv, bs, hd)
    return blocks.permute(0, 2, 1, 3, 4).reshape(B, Hkv, nb * bs, hd)[:, :, :length]


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor | list[int], scale: float | None = None) -> torch.Tensor:
    """Decode attention read through block tables: the PyTorch reference of a paged-attention kernel.

    Args:
        q: (B, H, hd) one new query per sequence (its K/V already written to the pool).
        k_pool, v_pool: (num_blocks, Hkv, block_size, hd); H % Hkv == 0 (GQA: query head h reads KV head h // rep).
        block_tables: (B, max_blocks) int; row b's token p is at block_tables[b, p // bs], offset p % bs.
        context_lens: (B,) tokens of each sequence (rows may differ; padding entries of a table are never read).
        scale: default 1/sqrt(hd).

    Returns:
        (B, H, hd) in q's dtype; softmax in fp32. Bytes moved per row: 2 x ceil(len/bs) x bs x Hkv x hd x elem.
    """
    B, H, hd = q.shape
    _, Hkv, bs, _ = k_pool.shape
    rep = H // Hkv
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    lens = [int(x) for x in context_lens]
    out = torch.empty_like(q)
    for b in range(B):
        n = lens[b]
        nb = -(-n // bs)
        blocks = block_tables[b, :nb].long()
        k = k_pool[blocks].permute(1, 0, 2, 3).reshape(Hkv, nb * bs, hd)[:, :n]  # (Hkv, n, hd)
        v = v_pool[blocks].permute(1, 0, 2, 3).reshape(Hkv, nb * bs, hd)[:, :n]
        qb = q[b].view(Hkv, rep, hd).float()  # (Hkv, rep, hd): the query heads that share each KV head
        scores = qb @ k.float().transpose(1, 2) * scale  # (Hkv, rep, n)
        out[b] = (F.softmax(scores, dim=-1) @ v.float()).reshape(H, hd).to(q.dtype)
    return out
