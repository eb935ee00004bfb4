"""The continuous-batching decode step on a GPU: paged attention in place, replayed from one CUDA graph per bucket.

`llmlab.batching.paged_batch.PagedBatchView` is the exact reference: every layer gathers every row's K/V into a
contiguous copy and masks it, and the host launches each of the step's kernels anew. A decode step of a server
does neither (Kwon et al. 2023, PagedAttention, https://arxiv.org/abs/2309.06180; vLLM and SGLang capture their
decode step per batch size the same way):

* `PagedDecodeBatch` is the KV cache the model sees in a decode step of up to `max_rows` sequences, each one new
  token at its own position. It offers `write` (each row's new K/V into its slot of the pool) and
  `decode_attention` (the Triton paged kernel, `llmlab.kernels.paged_decode_attention`, reading each row's blocks
  in place through its block table) and no mask, so the Triton modules' attention takes its paged path
  (`llmlab.model.attention_path`). Its inputs live in static device buffers that `fill` rewrites before each step.
* `PagedDecodeGraphs` captures the step (embedding to greedy token) once per batch-size bucket (1, 2, 4, ...,
  max_batch) and replays the smallest bucket that holds the step's rows. The rows past the real ones are padding:
  they read one token and write their K/V into a spare block of the pool that no sequence owns
  (`PagedKVCache(spare_blocks=1)`), so they change nothing a real row sees.

The static shapes a graph needs: the bucket's rows, and a block table of fixed width (enough blocks for the
engine's longest request); a step copies only the columns its rows use (the kernel never reads past a row's
length). Without CUDA graphs (`cuda_graphs=False`; a CPU under `TRITON_INTERPRET=1` in the tests) the same step
runs eagerly on the same buffers, so the tests check the buffers and the padding on a CPU.
"""

from __future__ import annotations

from array import array

import torch

from llmlab.cache.paged_cache import PagedKVCache
from llmlab.runtime.cuda_graphs import batch_buckets, warm_up  # the same buckets and warm-up as the static runner


class PagedDecodeBatch:
    """The KV cache of one decode step over a shared block pool: row b is one sequence, one new token at its own
    position. Static buffers (device, allocated once): `values` (5, R) int64 holding each row's token, position, new
    slot (block, offset) and source row, with `positions` (R, 1), `block` and `offset` (R,) views of its rows;
    `last` (R,) int64, the greedy tokens of the step before; lengths (R,) int32 (tokens each row attends over, its
    new one included: positions + 1, computed on the device at the start of the step) and tables (R, width) int32;
    R = max_rows. `rows` is the number of rows the next forward pass uses (a bucket).

    A row's input token is its `token` value, or, where its source row s >= 0, `last[s]`: the token the step before
    picked in row s, still on the device. That lets the host launch a step before it has read the last one's tokens
    (`BatchEngine(overlap=True)`). The host stages each step's values in one of two pinned buffers (on a GPU), so the
    copies to the device run without waiting for the GPU.

    Args:
        pool: the `PagedKVCache` the sequences' K/V live in; it needs one spare block (`spare_blocks=1`) for the
            padding rows.
        max_rows: the most rows of a step (the largest bucket).
        width: block-table columns: blocks of the longest sequence served.

    Raises:
        ValueError: a pool without a spare block; sizes below 1.
    """

    def __init__(self, pool: PagedKVCache, max_rows: int, width: int):
        if not pool.spare:
            raise ValueError("the pool has no spare block for the padding rows: build it with "
                             "PagedKVCache(..., spare_blocks=1)")
        if max_rows < 1 or width < 1:
            raise ValueError(f"max_rows={max_rows} and width={width} must be at least 1")
        dev = pool.k[0].device
        self.pool, self.pad_block, self.width = pool, pool.spare[0], width
        self.values = torch.zeros(5, max_rows, dtype=torch.int64, device=dev)  # one copy per step fills all five
        self.values[2] = self.pad_block
        self.values[4] = -1
        self.positions = self.values[1].view(max_rows, 1)
        self.block, self.offset = self.values[2], self.values[3]
        self.last = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.lengths = torch.ones(max_rows, dtype=torch.int32, device=dev)
        self.tables = torch.full((max_rows, width), self.pad_block, dtype=torch.int32, device=dev)
        self.max_rows, self.rows = max_rows, max_rows
        # host staging: two pinned buffers on a GPU (values, then the tables' columns), each reused once the copies
        # out of it have run (its event)
        pin = dev.type == "cuda"
        self._staging = [(torch.empty(5 * max_rows, dtype=torch.int64, pin_memory=pin),
                          torch.empty(max_rows * width, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0

    def input_ids(self, b: int) -> torch.Tensor:
        """(b, 1) int64 input tokens of the first b rows: `token`, or `last[source]` where a row has a source row."""
        token, source = self.values[0, :b], self.values[4, :b]
        return torch.where(source >= 0, self.last[source.clamp(min=0)], token).view(b, 1)

    def fill(self, rows: list[tuple[int, int, list[int]]], bucket: int, sources: list[int] | None = None) -> None:
        """Load a step into the buffers: rows [(token, position, block table)], len(rows) <= bucket <= max_rows;
        sources: per row, the row of the step before whose greedy token is its input (-1: its `token`; default all
        -1).

        Rows len(rows)..bucket-1 become padding: token 0 at position 0, written to the spare block, attending
        over that one slot. Two host-to-device copies: the per-row values, and the tables' used columns (built as
        flat Python lists first: a tensor op per row would cost the host more than the step's GPU time).

        Raises:
            ValueError: more rows than the bucket, a bucket beyond max_rows, a table wider than `width`, a position
                outside its table, or sources of another length or outside 0..max_rows-1.
        """
        n = len(rows)
        if not 1 <= n <= bucket <= self.max_rows:
            raise ValueError(f"{n} rows in a bucket of {bucket} (at most {self.max_rows} rows)")
        bs = self.pool.block_size
        used = max(len(table) for _, _, table in rows)
        if used > self.width:
            raise ValueError(f"a block table of {used} blocks is wider than this step's {self.width} columns")
        if sources is None:
            sources = [-1] * n
        elif len(sources) != n or not all(-1 <= r < self.max_rows for r in sources):
            raise ValueError(f"sources: one per row, each -1 or a row below {self.max_rows}; got {sources}")
        pad, blank = bucket - n, [self.pad_block] * used
        tokens, positions, blocks, offsets, flat = [], [], [], [], []
        for b, (token, pos, table) in enumerate(rows):
            if not 0 <= pos < len(table) * bs:
                raise ValueError(f"row {b}: position {pos} is outside its {len(table)} blocks of {bs} tokens")
            tokens.append(token)
            positions.append(pos)
            blocks.append(table[pos // bs])
            offsets.append(pos % bs)
            flat += table
            flat += blank[len(table):]
        flat += blank * pad
        values = array("q", tokens + [0] * pad + positions + [0] * pad + blocks + [self.pad_block] * pad + offsets
                       + [0] * pad + sources + [-1] * pad)  # array -> tensor costs a third of torch.tensor(list)
        (buf, tbuf), done = self._staging[self._turn], self._copied[self._turn]
        if done is not None:
            done.synchronize()  # the copies out of this buffer two steps ago have run
        buf[:5 * bucket].copy_(torch.frombuffer(values, dtype=torch.int64))
        tbuf[:bucket * used].copy_(torch.frombuffer(array("i", flat), dtype=torch.int32))
        # same dtypes on both sides: a copy that also converts would go through pageable memory and wait for the GPU
        self.values[:, :bucket].copy_(buf[:5 * bucket].view(5, bucket), non_blocking=True)
        self.tables[:bucket, :used].copy_(tbuf[:bucket * used].view(bucket, used), non_blocking=True)
        if done is not None:
            done.record()
        self._turn ^= 1
        self.rows = bucket

    # -- what the model calls (`llmlab.kernels.modules.TritonAttention`, paged decode path) --------------------
    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each row's new K and V, (rows, Hkv, 1, hd), in its slot of layer `layer`'s pools."""
        b = self.rows
        self.pool.k[layer][self.block[:b], :, self.offset[:b]] = k[:, :, 0]
        self.pool.v[layer][self.block[:b], :, self.offset[:b]] = v[:, :, 0]

    def decode_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (rows, H, 1, hd) after RoPE -> (rows, H, 1, hd): each row attends over its `lengths` tokens, read in
        place from the pool through its block table. No host sync (the lengths are not checked on the host)."""
        from llmlab.kernels.paged_decode_attention import paged_decode_attention  # imports triton: when used

        b = self.rows
        return paged_decode_attention(q, self.pool.k[layer], self.pool.v[layer], self.tables[:b],
                                      self.lengths[:b], check_lens=False)


class PagedDecodeGraphs:
    """Decode steps of a continuous-batching engine: `PagedDecodeBatch` buffers and one CUDA graph per bucket.

    Args:
        model: a `llmlab.model.Transformer` with the Triton kernel modules swapped in
            (`llmlab.kernels.modules.swap_in`, the "Triton kernels" switch): their attention has the paged path.
        pool: the engine's `PagedKVCache`, with one spare block.
        max_batch: the most decode rows of a step.
        width: block-table columns (blocks of the longest request).
        cuda_graphs: capture the buckets (default: on a CUDA device); False runs the same step eagerly.
        warmup_steps: eager runs of each bucket before its capture (Triton compiles and cuBLAS sets up there).

    Raises:
        ValueError: a model without the kernel modules, cuda_graphs on a model that is not on a CUDA device.
    """

    def __init__(self, model, pool: PagedKVCache, max_batch: int, width: int, cuda_graphs: bool | None = None,
                 warmup_steps: int = 2):
        from llmlab.kernels.modules import is_swapped

        if not is_swapped(model):
            raise ValueError("the paged decode step runs the Triton kernel modules' paged attention: swap them in "
                             "first (the triton_kernels switch, or llmlab.kernels.modules.swap_in)")
        device = next(model.parameters()).device
        cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA GPU; this one is on {device}")
        self.model, self.buckets = model, batch_buckets(max_batch)
        self.batch = PagedDecodeBatch(pool, max_batch, width)
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits (b, V), tokens (b,))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if cuda_graphs:
            self._capture(warmup_steps)

    def _forward(self, b: int) -> None:
        """The step on the first b rows of the buffers (eagerly, or while being captured)."""
        self.batch.rows = b
        torch.add(self.batch.positions[:b, 0], 1, out=self.batch.lengths[:b])  # int64 -> the int32 lengths
        ids = self.batch.input_ids(b)  # (b, 1)
        logits = self.model(ids, self.batch.positions[:b], kv_cache=self.batch, last_only=True)
        logits = logits[:, -1]  # (b, V)
        tokens = logits.argmax(dim=-1)
        self.batch.last[:b].copy_(tokens)  # the next step's rows may read these (their source rows)
        self.outputs[b] = (logits, tokens)

    @torch.inference_mode()
    def _capture(self, warmup_steps: int) -> None:
        """One graph per bucket, largest first so the smaller ones reuse its memory pool. Each bucket runs
        `warmup_steps` times on a side stream before its capture (lazy setup must not happen while capturing); the
        buffers hold padding rows then, so the warm-up writes only the spare block."""
        dev = self.batch.values.device
        pool = None
        for b in sorted(self.buckets, reverse=True):
            self.batch.fill([(0, 0, [self.batch.pad_block])], b)
            warm_up(lambda b=b: self._forward(b), warmup_steps, dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(b)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize(dev)

    def bucket(self, n: int) -> int:
        """The smallest bucket >= n. Raises ValueError beyond the largest."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} decode rows exceed this step's max_batch of {self.buckets[-1]}")

    @torch.inference_mode()
    def step(self, rows: list[tuple[int, int, list[int]]], sources: list[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of rows [(token, position, block table)] (sources: as `PagedDecodeBatch.fill`): writes
        each row's K/V at its position and returns (logits (n, V), greedy tokens (n,)) on the device, views of the
        bucket's outputs (the next step rewrites them: read them first). Nothing waits for the GPU."""
        n = len(rows)
        b = self.bucket(n)
        self.batch.fill(rows, b, sources)
        if b in self.graphs:
            self.graphs[b].replay()
        else:
            self._forward(b)
        logits, tokens = self.outputs[b]
        return logits[:n], tokens[:n]
