"""Prefill passes of a continuous-batching engine at fixed shapes, replayed from CUDA graphs.

The engine's prefill chunks (`llmlab.batching.engine.pack_chunks`) run as left-padded (k, T) passes through a
`PagedBatchView`. Eagerly, such a pass costs the host a launch per kernel whatever its length, so on a GPU a pass of
a few hundred tokens can take the host longer than the GPU, and a server under steady arrivals runs one in most of
its steps. This module gives each pass a fixed shape so that it can be captured once and replayed:

* each chunk goes to the smallest bucket of T tokens that holds it (powers of two from 16 up to the engine's chunk),
  and a bucket's chunks run in passes of B rows (powers of two, `batch_buckets`), at most `token_budget` tokens a
  pass; padding rows and padding tokens write their K/V to the pool's spare block, and their outputs are dropped;
* every row's block table is padded to the width of the longest request (with the row's own first block, which
  holds finite values: a masked slot still enters the attention as 0 x value), so each layer gathers a fixed
  S = width x block_size slots and the mask (built from the positions, inside the graph) hides what a row may not
  see.

`PagedPrefillBatch` holds the inputs (token ids, positions, the slot of each new token, the block tables) in
buffers that every bucket's graph reads; `fill` copies a pass into them before a replay. Without CUDA graphs (on a
CPU, or cuda_graphs=False) the same fixed-shape passes run eagerly: the tests compare them with the variable-shape
reference. The price of the fixed shapes is compute on padding (each row under 2x its tokens, each pass under 2x its
rows, and attention over the full width): the trade a graph makes, cheap where the host, not the GPU, paces a pass.

Source: vLLM captures its steps per token-count bucket in the same spirit (CUDA graphs, https://docs.vllm.ai);
the padding rules here are this course's own.
"""

from __future__ import annotations

import torch

from llmlab.batching.paged_batch import PagedBatchView
from llmlab.cache.paged_cache import PagedKVCache
from llmlab.runtime.cuda_graphs import batch_buckets, warm_up

MIN_T = 16  # the shortest token bucket: shorter chunks pad to it


def token_buckets(chunk: int) -> tuple[int, ...]:
    """Tokens per row of the prefill buckets: powers of two from MIN_T below `chunk`, then `chunk`.
    512 -> (16, 32, 64, 128, 256, 512); 100 -> (16, 32, 64, 100); 8 -> (8,)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: need at least 1 token")
    out, t = [], MIN_T
    while t < chunk:
        out.append(t)
        t *= 2
    return (*out, chunk)


class PagedPrefillBatch(PagedBatchView):
    """A `PagedBatchView` whose tensors live in fixed buffers: one pass of up to max_rows rows and max_tokens tokens.

    `use(B, T)` points the view at the first B x T entries (the shape a bucket's graph was captured with); `fill`
    loads a pass into them. `update` and `attention_mask` are `PagedBatchView`'s, over length S = width x
    block_size.

    Args:
        pool: the engine's `PagedKVCache`, with a spare block (the padding tokens' slot).
        max_rows, max_tokens: the most rows, and rows x tokens, of a bucket.
        width: block-table columns (blocks of the longest request).
    """

    def __init__(self, pool: PagedKVCache, max_rows: int, max_tokens: int, width: int):  # noqa: D107 (no super)
        if not pool.spare:
            raise ValueError("fixed-shape prefill pads with a spare block: build the pool with "
                             "PagedKVCache(..., spare_blocks=1)")
        dev = pool.k[0].device
        self.pool, self.pad_block, self.width = pool, pool.spare[0], width
        self.length = width * pool.block_size
        # token ids, positions, block and offset of each new token: one buffer, one host-to-device copy a pass
        self._inputs = torch.zeros(4, max_tokens, dtype=torch.int64, device=dev)
        self._inputs[2] = self.pad_block
        self._tables_buf = torch.full((max_rows, width), self.pad_block, dtype=torch.int64, device=dev)
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.padding = 0
        self.use(1, 1)

    def use(self, B: int, T: int) -> None:
        """Shape the view as B rows of T tokens (views of the buffers' first entries)."""
        if not (1 <= B <= self.max_rows and 1 <= T and B * T <= self.max_tokens):
            raise ValueError(f"a pass of {B} x {T} tokens does not fit the buffers' {self.max_rows} rows and "
                             f"{self.max_tokens} tokens")
        n = B * T
        self.B, self.T = B, T
        self.input_ids = self._inputs[0, :n].view(B, T)
        self.positions = self._inputs[1, :n].view(B, T)
        self._blk, self._off = self._inputs[2, :n], self._inputs[3, :n]
        self.block_tables = self._tables_buf[:B]

    def fill(self, rows: list[tuple[list[int], int, list[int]]], B: int, T: int) -> None:
        """Load a pass: rows [(new token ids, first new position, block table)], each row's tokens left-padded to T;
        rows len(rows)..B-1 are all padding (token 0 at position 0, in the spare block).

        Raises:
            ValueError: more rows than B, a row longer than T or empty, a table wider than the buffers, a new token
                outside its row's table.
        """
        if not 1 <= len(rows) <= B:
            raise ValueError(f"{len(rows)} rows in a bucket of {B}")
        bs, pad = self.pool.block_size, self.pad_block
        ids, pos, blk, off, tables = [], [], [], [], []
        for tokens, start, table in rows:
            n = len(tokens)
            if not 1 <= n <= T:
                raise ValueError(f"a row of {n} new tokens in a bucket of {T} tokens per row")
            if len(table) > self.width or (start + n - 1) // bs >= len(table):
                raise ValueError(f"a block table of {len(table)} blocks (buffers: {self.width}) for tokens "
                                 f"{start}..{start + n - 1} of {bs} per block")
            ids += [0] * (T - n) + list(tokens)
            pos += [start] * (T - n) + list(range(start, start + n))
            blk += [pad] * (T - n) + [table[p // bs] for p in range(start, start + n)]
            off += [0] * (T - n) + [p % bs for p in range(start, start + n)]
            tables += table + [table[0]] * (self.width - len(table))  # masked slots of a block with finite values
        empty = B - len(rows)
        ids += [0] * (empty * T)
        pos += [0] * (empty * T)
        blk += [pad] * (empty * T)
        off += [0] * (empty * T)
        tables += [pad] * (empty * self.width)
        self.use(B, T)
        self._inputs[:, :B * T].copy_(torch.tensor(ids + pos + blk + off, dtype=torch.int64).view(4, B * T))
        self._tables_buf[:B].copy_(torch.tensor(tables, dtype=torch.int64).view(B, self.width))


class PagedPrefillGraphs:
    """Prefill passes of an engine at bucketed shapes, each bucket captured as a CUDA graph (or run eagerly).

    Args:
        model: a `llmlab.model.Transformer` (PyTorch or Triton kernel modules).
        pool: the engine's `PagedKVCache`, with one spare block.
        chunk: the most tokens a row prefills in one pass: the engine's chunk, capped at its token budget and
            max_seq_len (the largest chunk its scheduler can plan).
        token_budget: the most tokens of one step: no bucket holds more rows x tokens than this (at least 1 row).
        max_rows: the most rows of a pass (the engine's max_batch).
        width: block-table columns (blocks of the longest request).
        cuda_graphs: capture the buckets (default: on a CUDA device); False runs the same passes eagerly.
        warmup_steps: eager runs of each bucket before its capture.

    Raises:
        ValueError: cuda_graphs on a model that is not on a CUDA device.
    """

    def __init__(self, model, pool: PagedKVCache, chunk: int, token_budget: int, max_rows: int, width: int,
                 cuda_graphs: bool | None = None, warmup_steps: int = 2):
        device = next(model.parameters()).device
        cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA GPU; this one is on {device}")
        self.model = model
        self.buckets = {T: batch_buckets(max(1, min(max_rows, token_budget // T))) for T in token_buckets(chunk)}
        self.batch = PagedPrefillBatch(pool, max(rows[-1] for rows in self.buckets.values()),
                                       max(rows[-1] * T for T, rows in self.buckets.items()), width)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # (B, T) -> last-token logits (B, V)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if cuda_graphs:
            self._capture(warmup_steps)

    def _forward(self, B: int, T: int) -> None:
        self.batch.use(B, T)
        logits = self.model(self.batch.input_ids, self.batch.positions, kv_cache=self.batch, last_only=True)
        self.outputs[(B, T)] = logits[:, -1]  # (B, V)

    @torch.inference_mode()
    def _capture(self, warmup_steps: int) -> None:
        """One graph per (B, T) bucket, the most tokens first so the others reuse its memory pool; the buffers hold
        padding then, so the warm-up and the capture write only the spare block."""
        dev = self.batch.positions.device
        pool = None
        shapes = sorted(((B, T) for T, rows in self.buckets.items() for B in rows), key=lambda s: -s[0] * s[1])
        for B, T in shapes:
            self.batch.fill([([0], 0, [self.batch.pad_block])], B, T)
            warm_up(lambda B=B, T=T: self._forward(B, T), warmup_steps, dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(B, T)
            pool = graph.pool() if pool is None else pool
            self.graphs[(B, T)] = graph
        torch.cuda.synchronize(dev)

    def plan(self, lengths: list[int]) -> list[tuple[list[int], int, int]]:
        """Chunk lengths (new tokens per row) -> passes [(indices into lengths, B, T)]: each chunk goes to the
        smallest token bucket T that holds it (so a row is padded to less than twice its length, or to MIN_T), and
        each bucket's chunks are cut into passes of at most its largest row bucket, padded up to a row bucket B.

        Raises:
            ValueError: a length outside 1..the largest token bucket (the engine's chunk).
        """
        by_T: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            T = next((t for t in self.buckets if t >= n), None)
            if T is None or n < 1:
                raise ValueError(f"a chunk of {n} tokens: prefill buckets hold 1..{max(self.buckets)} tokens a row")
            by_T.setdefault(T, []).append(i)
        out = []
        for T in sorted(by_T, reverse=True):
            idx, most = by_T[T], self.buckets[T][-1]
            for k in range(0, len(idx), most):
                part = idx[k:k + most]
                out.append((part, next(b for b in self.buckets[T] if b >= len(part)), T))
        return out

    @torch.inference_mode()
    def run(self, rows: list, B: int, T: int) -> torch.Tensor:
        """One pass of `plan`: rows [(new token ids, first position, block table)] in a (B, T) bucket. Writes each
        row's K/V into its blocks and returns the rows' last-token logits (len(rows), V), a copy (the bucket's own
        output is rewritten by its next pass, maybe later in the same step)."""
        self.batch.fill(rows, B, T)
        if (B, T) in self.graphs:
            self.graphs[(B, T)].replay()
        else:
            self._forward(B, T)
        return self.outputs[(B, T)][:len(rows)].clone()
