"""The paged KV cache: keys and values live in fixed-size blocks of one shared pool, found through block tables.

`KVCache` reserves max_seq_len slots per sequence up front; a request that stops early wastes the rest. Here each
layer has one pool of blocks, shape (num_blocks, Hkv, block_size, hd) for K and the same for V, and a sequence
takes blocks only as it grows (`llmlab.cache.block_manager.BlockManager` does the bookkeeping, in plain Python). Token p
of a sequence is at block `table[p // block_size]`, offset `p % block_size` (Kwon et al. 2023, PagedAttention,
https://arxiv.org/abs/2309.06180).

Three ways to attend over a paged cache, all here:

* `PagedKVCache.update` (used by `llmlab.model.Attention`): writes the new K/V into their blocks, then GATHERS the
  sequence's blocks into a contiguous (B, Hkv, S, hd) tensor and lets the model's ordinary SDPA attend. This is the
  reference path: it is exact, but the gather copies the whole cache every step — the cost a paged kernel avoids;
* `PagedKVCache.write` + `PagedKVCache.decode_attention` (a decode step under the Triton kernels switch,
  `llmlab.kernels.modules`): `write` stores the new K/V (the first half of `update`), then the Triton paged
  kernel (`llmlab.kernels.paged_decode_attention`) reads each row's K/V in place through its block table — no
  gathered copy. The block tables and lengths go to the device once per step, shared by all layers;
* `paged_attention` (PyTorch reference of the paged decode kernel): queries read K/V straight from the pool through
  the block table, one sequence at a time.

The interface is `KVCache`'s (`update(layer, positions, k, v)`, `nbytes`, `length`, `reset`), so `generate` runs on
it unchanged: `generate(model, ids, cache_factory=PagedKVCache)`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmlab.cache.block_manager import BlockManager
from llmlab.config import ModelConfig
from llmlab.cache.kv_cache import check_cache_args
from llmlab.cache.sizing import bytes_per_token, check_fits


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
        spare_blocks: blocks allocated beyond num_blocks that the block manager never hands out (ids num_blocks
            .. num_blocks + spare_blocks - 1, in `spare`): scratch slots, e.g. where the padding rows of a
            captured decode step write their K/V (`llmlab.batching.paged_graphs`).

    Raises:
        ValueError: sizes not positive, or max_seq_len beyond the model's context.
        MemoryError: the pools would not fit in the free memory (GPU or host); the message gives needed and
            available bytes and what to change. Nothing is allocated then.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype, device,
                 block_size: int = 16, num_blocks: int | None = None, spare_blocks: int = 0):
        check_cache_args(config, dtype, batch_size=batch_size, max_seq_len=max_seq_len, block_size=block_size,
                         **({} if num_blocks is None else {"num_blocks": num_blocks}))
        batch_size, max_seq_len, block_size = int(batch_size), int(max_seq_len), int(block_size)
        num_blocks = None if num_blocks is None else int(num_blocks)
        if num_blocks is None:
            num_blocks = batch_size * math.ceil(max_seq_len / block_size)
        if isinstance(spare_blocks, bool) or not isinstance(spare_blocks, int) or spare_blocks < 0:
            raise ValueError(f"spare_blocks={spare_blocks!r}: give a whole number >= 0")
        device = torch.device(device)
        shape = (num_blocks + spare_blocks, config.n_kv_heads, block_size, config.head_dim)
        elem = torch.empty((), dtype=dtype).element_size()
        self.nbytes = 2 * config.n_layers * torch.Size(shape).numel() * elem
        check_fits(self.nbytes, device, f"paged KV cache ({num_blocks} blocks of {block_size} tokens x "
                   f"{config.n_layers} layers)", "lower num_blocks (or block_size), or use a smaller dtype")
        self.config, self.batch_size, self.max_seq_len = config, batch_size, max_seq_len
        self.block_size, self.num_blocks = block_size, num_blocks
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.blocks = BlockManager(num_blocks, block_size)  # hands out ids 0..num_blocks-1 only
        self.spare = list(range(num_blocks, num_blocks + spare_blocks))
        self.length = 0
        self._slots, self._end = None, 0  # set by each layer-0 write: every layer's (block, offset) slots
        self._step_tensors = None  # (B, block tables, lengths) on the device: built once per forward pass

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def check_holds(self, batch: int, tokens: int) -> None:
        """ValueError unless the pool can hold a whole run of `batch` rows caching up to `tokens` positions each
        (`generate`: prompt + max_new_tokens - 1), checked before its prefill: one generate call cannot free or
        preempt a row to make room, as a serving engine does. The message names num_blocks and the count that
        fits."""
        need = batch * self.blocks.blocks_for(tokens)
        if need > self.num_blocks:
            raise ValueError(f"the paged KV cache's pool has num_blocks={self.num_blocks} blocks of {self.block_size} "
                             f"tokens, and this call needs {need}: {batch} row{'s' if batch != 1 else ''} x "
                             f"ceil({tokens} cached tokens (prompt + max_new_tokens - 1) / {self.block_size}); give "
                             f"num_blocks >= {need}, or fewer max_new_tokens")

    def _reserve(self, B: int, start: int, end: int) -> None:
        """Make every row 0..B-1 hold `end` tokens (allocating or appending blocks); copy-on-write copies done."""
        for b in range(B):  # `_check_room` has ruled out gaps, stale tokens and a pool too small
            if b not in self.blocks.tables:
                self.blocks.allocate(b, end)
                continue
            have = self.blocks.length(b)
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

    def step_tensors(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..B-1's block tables (B, max_blocks) int32 and token counts (B,) int32, on the pools' device.

        Built on the first call after a write of layer 0 (or a reset) and then reused by every layer of the
        forward pass: one small host-to-device copy per step, not one per layer.

        Raises:
            ValueError: a row 0..B-1 holds no tokens.
        """
        if self._step_tensors is None or self._step_tensors[0] != B:
            empty = [b for b in range(B) if b not in self.blocks.tables]
            if empty:
                raise ValueError(f"rows {empty} of the batch hold no tokens; write their K/V before attending")
            lengths = [self.blocks.length(b) for b in range(B)]
            lens = torch.tensor(lengths, dtype=torch.int32, device=self.k[0].device)
            self._step_tensors = (B, self.block_tables(B), lens)
        return self._step_tensors[1:]

    def slots(self, b: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of row b's positions start..end-1: two (T,) int64 tensors."""
        table = self.blocks.block_table(b)
        pos = range(start, end)
        blk = torch.tensor([table[p // self.block_size] for p in pos], device=self.k[0].device)
        off = torch.tensor([p % self.block_size for p in pos], device=self.k[0].device)
        return blk, off

    # -- the KVCache interface --------------------------------------------------------------------------------
    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, Hkv, T, hd), the pools' dtype, at `positions` (T,) (the same for every row) in rows 0..B-1.

        Layer 0 does the bookkeeping for the whole forward pass: it reserves the blocks (allocating, appending,
        copying a forked block before it is written) and drops the previous step's block tables.

        Raises:
            ValueError: a write that would leave a gap in a row (or start past 0 in a new row).
            OutOfBlocks (a MemoryError): the pool has no free block left.
        """
        self._check_write(layer, k, v)
        B, T = k.shape[0], k.shape[2]
        if layer == 0:  # the same positions for every layer: do the bookkeeping once per forward pass
            start = int(positions[0])
            end = start + T
            self._check_room(B, start, end)  # before anything is reserved: a refused write changes nothing
            self._reserve(B, start, end)
            self._slots = [self.slots(b, start, end) for b in range(B)]
            self._step_tensors = None  # the tables may have grown: rebuild them on first use
            self._end = end
        for b, (blk, off) in enumerate(self._slots):
            self.k[layer][blk, :, off] = k[b].transpose(0, 1)  # (T, Hkv, hd) into T (block, offset) slots
            self.v[layer][blk, :, off] = v[b].transpose(0, 1)
        if layer == len(self.k) - 1:
            self.length = self._end

    def _check_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ValueError / TypeError for a write that does not fit the pools — before any state changes."""
        n_layers = len(self.k)
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} is out of range: this cache has layers 0..{n_layers - 1}")
        _, Hkv, _, hd = self.k[0].shape
        if k.dim() != 4 or k.shape != v.shape or k.shape[1] != Hkv or k.shape[3] != hd or k.shape[2] == 0:
            raise ValueError(f"k and v must both be (B, {Hkv}, T, {hd}) with T >= 1, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if not 1 <= k.shape[0] <= self.batch_size:
            raise ValueError(f"{k.shape[0]} rows, but this cache was made for batch_size={self.batch_size}")
        if k.dtype != self.k[0].dtype or v.dtype != self.k[0].dtype:
            raise TypeError(f"k/v are {k.dtype}/{v.dtype} but the pools hold {self.k[0].dtype}: convert them first "
                            f"(or build the cache with dtype={k.dtype})")
        if layer != 0 and (getattr(self, "_slots", None) is None or len(self._slots) != k.shape[0]):
            raise ValueError(f"write layer 0 of this step first (it reserves the blocks for all layers); got layer "
                             f"{layer} with no matching layer-0 write since the last reset")

    def _check_room(self, B: int, start: int, end: int) -> None:
        """Before anything is reserved: ValueError if a row would get a gap (start past its tokens) or keep stale
        tokens (end before its last reserved token); OutOfBlocks unless the free list holds every new block the rows
        need to reach `end`."""
        from llmlab.cache.block_manager import OutOfBlocks

        for b in range(B):
            have = self.blocks.length(b) if b in self.blocks.tables else 0
            if start > have:
                raise ValueError(f"row {b} holds {have} tokens; a write at position {start} would leave a gap")
            if end < have:  # the kernel path attends to every stored token: tokens past `end` would be stale
                raise ValueError(f"row {b} holds {have} tokens; a write ending at position {end - 1} would leave "
                                 f"stale tokens after it: write up to the row's end (slots reserved ahead, as "
                                 f"prefix reuse does, are fine), or reset() the cache to start again")
        bs = self.block_size
        need = 0
        for b in range(B):
            if b not in self.blocks.tables:
                need += -(-end // bs)
            elif end > self.blocks.length(b):  # counts the copy of a forked, partly filled last block too
                need += max(0, self.blocks.append_cost(b, end - self.blocks.length(b)))
        if need > self.blocks.num_free:
            raise OutOfBlocks(need, self.blocks.num_free, bs, f"writing tokens {start}..{end - 1} of {B} rows")

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, Hkv, T, hd) at `positions` (T,) into the rows' blocks and return the gathered
        (B, Hkv, S, hd) K/V, S = positions[-1] + 1 (the reference path: a copy of the whole cache)."""
        self.write(layer, positions, k, v)
        tables, _ = self.step_tensors(k.shape[0])
        return gather(self.k[layer], tables, self._end), gather(self.v[layer], tables, self._end)

    def decode_attention(self, layer: int, q: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """One decode step's attention read in place from the block pool by the Triton paged kernel.

        Each row b attends over every token stored for it (its block manager length), its new token included:
        call `write` for this layer first. The block tables and lengths are shared by all layers (`step_tensors`).

        Args:
            layer: which layer's pools to read.
            q: (B, H, 1, hd) queries after RoPE, the pools' dtype (fp32/fp16/bf16 on a GPU; fp32/fp16 in Triton's
                CPU interpreter); H a multiple of Hkv.
            scale: default 1/sqrt(hd).

        Returns:
            (B, H, 1, hd) in q's dtype.

        Raises:
            ValueError: the kernel cannot run here (no triton; a CPU tensor without TRITON_INTERPRET=1; bf16 in the
                interpreter) — `update` + SDPA is the path that runs everywhere; q not (B, H, 1, hd), or shapes
                that do not match the pools; a row with no tokens.
            TypeError: q's dtype differs from the pools'.

        Source: Kwon et al. 2023, PagedAttention, https://arxiv.org/abs/2309.06180.
        """
        self._check_kernel_runs(layer, q)
        if q.dim() != 4 or q.shape[2] != 1:
            raise ValueError(f"decode_attention takes one new query per row, q of shape (B, H, 1, hd); "
                             f"got {tuple(q.shape)} (use update + SDPA for a prefill)")
        from llmlab.kernels.paged_decode_attention import paged_decode_attention  # imports triton: only when used

        tables, lens = self.step_tensors(q.shape[0])
        # the lengths come from the block manager, so they are in range: skip the kernel's host-side check (a sync)
        return paged_decode_attention(q, self.k[layer], self.v[layer], tables, lens, scale=scale, check_lens=False)

    def _check_kernel_runs(self, layer: int, q: torch.Tensor) -> None:
        """Raise ValueError, with the reason and the way out, if the Triton paged kernel cannot take q and the pools."""
        from llmlab.kernels import _util  # llmlab.kernels only where the kernel is used (it imports no triton)

        fix = "decode with PagedKVCache.update (gather + SDPA) instead"
        ok, why = _util.triton_status()
        if not ok:
            raise ValueError(f"PagedKVCache.decode_attention: the Triton paged kernel cannot run here: {why}; {fix}")
        try:
            _util.check_tensors("PagedKVCache.decode_attention", (torch.float32, torch.float16, torch.bfloat16),
                                q=q, k_pool=self.k[layer], v_pool=self.v[layer])
        except (TypeError, ValueError) as e:  # a CPU tensor without the interpreter, bf16 in the interpreter
            raise ValueError(f"{e}; or {fix}") from e

    def reset(self) -> None:
        """Free every row's blocks (the pool is full again)."""
        for seq in list(self.blocks.tables):
            self.blocks.free(seq)
        self.length = 0
        self._step_tensors = None
        self._slots, self._end = None, 0  # a layer > 0 write now needs a fresh layer-0 write first

    bytes_per_token = staticmethod(bytes_per_token)  # the same bytes per token as the contiguous cache

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
