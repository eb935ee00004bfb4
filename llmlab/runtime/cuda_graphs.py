"""The decode step captured in CUDA graphs, one per batch-size bucket: the model runner of nano-vllm and gpt-fast.

An eager decode step launches a few hundred small kernels, each costing the CPU several microseconds (about 6 us
on an H200, `docs/results.md`; more with Python around it), while the GPU finishes many of them faster than that: at
batch 1 the GPU mostly waits for the CPU. A CUDA graph records the step's kernels once and replays them with one
launch (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs). The price is rigidity: a replay repeats the
same kernels on the same addresses with the same shapes. So

* inputs live in static buffers the step reads (`ids`, `pos`): a decode step copies the new token into `ids` and
  bumps `pos` before the replay; the outputs (logits, greedy tokens) are the tensors the captured step wrote,
  rewritten in place by each replay;
* the KV cache is static (`llmlab.cache.static_cache`): fixed shape, written at device-side positions, masked;
* one graph per batch size. The batch sizes are rounded up to buckets (1, 2, 4, ..., 64, then max_batch) and a batch
  replays the smallest bucket that fits; the rows beyond the batch ("padding") decode a dummy token at position 0
  in their own rows of the cache, so they cannot change the real rows (every op is row-wise);
* the prefill runs eagerly unless asked for (`prefill(..., bucketed=True)`, the "prefill_graphs" switch): its
  length varies with the prompt, so a captured prefill pads the prompt to a length bucket (16, 32, ..., 512
  tokens) and replays that bucket's graph, captured the first time a bucket is met. The pad tokens go FIRST but
  sit at positions after the prompt (T, T+1, ...): the causal mask hides them from every prompt token, the prompt's
  last token is the last input (its logits are the ones returned), and the slots they write are the ones the
  decode steps write next, before anything reads them. A long prompt stays eager: its prefill is compute-bound
  and its launches are hidden behind the work anyway.

`GraphDecoder(model, max_batch, max_seq_len)` with `cuda_graphs=False` runs exactly the same code without
capturing (the "eager static" path): that is how the CPU tests check everything but the capture itself.
`compile=True` runs the step through `torch.compile` — with its own CUDA graphs (mode "reduce-overhead") when
`cuda_graphs=False`, or as plain Inductor kernels captured by this runner's graphs when `cuda_graphs=True`.

What runs in a step is the model's own forward and `llmlab.sampling.argmax_rows`, or, given `kernels` (the Triton
kernels' decode step, `llmlab.kernels.KernelDecodeStep`), its forward and greedy pick.

`RunnerCache.runner_for(model, mode, batch, seq_len)` keeps one runner per mode (`LLM.runners` holds one cache per
LLM) and only rebuilds (recaptures) it when a request needs more rows or a longer cache than it has, or the model's
weights, its modules or the kernels' step changed.
"""

from __future__ import annotations

import math
import warnings

import torch

from llmlab.sampling import argmax_rows
from llmlab.cache.static_cache import StaticKVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Runner caches hold at least MIN_SEQ tokens (or the whole context if shorter), then multiples of SEQ_ROUND: a
# warm-up call and a slightly longer request reuse the captured graphs. Attention reads the whole cache every step,
# so it is not sized to a long model context (131072 tokens for Llama 3.2 would be 4 GB read per token).
MIN_SEQ, SEQ_ROUND = 1024, 512
# Prefill graphs: the padded prompt lengths captured, and the most rows x padded tokens one may hold (above either,
# the prefill runs eagerly: at ~500+ tokens a 1B model's prefill is compute-bound, the launches no longer matter).
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512)
PREFILL_MAX_TOKENS = 8192
# ... and the most rows x cache slots: a captured prefill keeps its peak memory for the runner's life, and the
# attention's keys and values, repeated for every query head over the whole static cache, are most of that peak
PREFILL_MAX_SLOTS = 65536
MODES = {"static": (False, False), "graphs": (True, False), "compile": (False, True), "compile+graphs": (True, True)}


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes to capture: the powers of two up to 64 below max_batch, then max_batch.
    64 -> (1, 2, 4, 8, 16, 32, 64); 200 -> (1, 2, 4, 8, 16, 32, 64, 200)

    Raises:
        ValueError: max_batch < 1.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: need at least 1 row")
    return tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)


def warm_up(run, times: int, device) -> None:
    """run() `times` times on a side stream of `device` before a CUDA-graph capture (lazy setup such as cuBLAS
    workspaces and Triton compiles must not happen during capture); the current stream waits for it, even if it
    raises."""
    stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    try:
        with torch.cuda.stream(side):
            for _ in range(times):
                run()
    finally:
        stream.wait_stream(side)


def decode_step(model, cache: StaticKVCache, input_ids: torch.Tensor, positions: torch.Tensor, kernels=None):
    """One decode step: input_ids (b, 1) int64 at positions (b,) int64 -> logits (b, V) in the model's dtype and
    the greedy tokens (b,) int64. Writes each row's K/V at its position. Nothing in it reads a value on the host,
    so it can be captured in a CUDA graph or compiled with fullgraph=True. kernels: None (the model's forward,
    `argmax_rows`) or the kernels' step, whose `forward` and `greedy` run instead (`GraphDecoder`'s `kernels`)."""
    forward = model if kernels is None else kernels.forward
    logits = forward(input_ids, positions[:, None], kv_cache=cache, last_only=True)[:, -1]  # (b, V)
    return logits, (argmax_rows if kernels is None else kernels.greedy)(logits)


def weights_fingerprint(model, kernels=None) -> tuple:
    """What a captured step depends on: (name, address, dtype, shape) of every parameter, the class of every module
    (`llmlab.kernels.swap_in` replaces some by kernel modules) and the kernels' step's own fingerprint (the kernel
    configs `llmlab.kernels.step_tuning` chose). It changes when weights are replaced or moved, modules are swapped or a
    config is chosen, any of which makes captured graphs (they hold the old addresses and the old kernels) stale."""
    params = tuple((n, p.data_ptr(), p.dtype, tuple(p.shape)) for n, p in model.named_parameters())
    modules = tuple((n, type(m).__qualname__) for n, m in model.named_modules())
    return params + modules + (("kernels", None if kernels is None else kernels.fingerprint()),)


def _raise_recompile_limit(limit: int = 64) -> None:
    """torch.compile keeps at most `recompile_limit` (default 8) compiled versions of one function and silently
    runs it eagerly after that. Every runner (model x bucket) is one version, so allow more."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)


class GraphDecoder:
    """Runs decode steps on static buffers, replaying one CUDA graph per batch-size bucket.

    Args:
        model: a `Transformer` (its device and dtype are used). The runner keeps a reference to it.
        max_batch: the most rows decoded together; buckets are `batch_buckets(max_batch)` unless given.
        max_seq_len: tokens per row in the static cache (prompt + new tokens must fit); default min(context, 1024).
        buckets: batch sizes to capture, ascending, the last one = max_batch.
        cuda_graphs: capture the buckets (default: on a CUDA device). False: run the same step eagerly.
        compile: run the step through torch.compile (see the module docstring for the modes).
        warmup_steps: eager runs of each bucket before capturing it (cuBLAS and the compiler set up there).
        kernels: the Triton kernels' decode step (`llmlab.kernels.KernelDecodeStep(model)`, `LLM.kernels`), or
            any object with the same `forward(input_ids, positions, kv_cache, last_only)`, `greedy(logits)` and
            `fingerprint()`: its forward runs the prefill and the step, its greedy picks the step's tokens, instead
            of the model's forward and `argmax_rows`. None: the model's own.

    Attributes: `graphs` {bucket: CUDAGraph} (empty without capture), `prefill_graphs` {(bucket, padded length):
    CUDAGraph} (captured on first use by `prefill(..., bucketed=True)`), `buckets`, `cache` (the StaticKVCache),
    static input buffers `ids` (max_batch, 1) and `pos` (max_batch,), the last step's outputs `logits` (B, V) and
    `tokens` (B,) (views of the bucket's output tensors, which its graph rewrites at each replay; None before the
    first step),
    `compile_mode` (None, "default" or "reduce-overhead"), `kernels`.

    Raises:
        ValueError: cuda_graphs=True on a model that is not on a CUDA device; bad sizes; max_seq_len beyond the
            model's context; kernels made for another model. MemoryError: (CUDA) the cache does not fit.
    """

    def __init__(self, model, max_batch: int = 1, max_seq_len: int | None = None, *, buckets=None,
                 cuda_graphs: bool | None = None, compile: bool = False, warmup_steps: int = 2, kernels=None):
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        if kernels is not None and getattr(kernels, "model", model) is not model:
            raise ValueError(f"the kernels' step {kernels!r} was made for another model")
        self.kernels = kernels
        self.forward = model if kernels is None else kernels.forward  # the prefill's forward (the decode step's too)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA GPU; this one is on {self.device}")
        config = model.config
        max_seq_len = min(config.max_seq_len, 1024) if max_seq_len is None else max_seq_len
        self.buckets = tuple(buckets) if buckets is not None else batch_buckets(max_batch)
        if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1 or self.buckets[-1] != max_batch:
            raise ValueError(f"buckets {self.buckets} must be ascending positive sizes ending at max_batch={max_batch}")
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.cache = StaticKVCache(config, max_batch, max_seq_len, self.dtype, self.device)  # checks the sizes

        dev = self.device
        self.ids = torch.zeros(max_batch, 1, dtype=torch.long, device=dev)  # static inputs
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=dev)
        # the step's outputs per bucket: (logits (b, V), greedy tokens (b,)). A captured graph writes the same
        # tensors at every replay, so a step returns views of them — no copy into separate output buffers (a
        # 128K-vocabulary logits row is 256 KB: one more kernel and its gap per step)
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.logits = self.tokens = None  # the last step's outputs (set by `step`)
        self._host_pos = [0] * max_batch  # the host's copy of `pos` (bookkeeping only: checked before launching)
        self._batch = 0  # rows in use since the last `start`

        self.compile_mode = None
        self._fn = decode_step
        if compile:
            _raise_recompile_limit()
            if dev.type == "cuda" and not cuda_graphs:
                self.compile_mode = "reduce-overhead"  # Inductor's own CUDA graphs ("CUDA graph trees")
                for t in self.cache.k + self.cache.v:  # the cache is written in place: tell the graphs it stays put
                    torch._dynamo.mark_static_address(t)
                self._fn = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
            else:
                self.compile_mode = "default"  # fused Triton (GPU) / C++ (CPU) kernels, no graphs of its own
                self._fn = torch.compile(decode_step, fullgraph=True, dynamic=False)

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # prefill graphs: their own memory pool (a prefill's activations are larger than a decode step's, and a
        # prefill's output must survive the decode graphs' replays until it is sampled), static inputs allocated
        # on first use
        self.prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._prefill_outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._prefill_pool = None
        self._prefill_ids = self._prefill_pos = None
        self._prefill_failed: set[tuple[int, int]] = set()  # buckets whose capture failed: they run eagerly
        self.warmup_steps = warmup_steps
        with torch.no_grad():
            if cuda_graphs:
                self.capture()
            elif compile:
                for b in self.buckets:  # compile (and, reduce-overhead, record) every bucket now, not mid-request
                    for _ in range(max(warmup_steps, 3)):
                        self._forward(b)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
        self.fingerprint = weights_fingerprint(model, kernels)

    @property
    def mode(self) -> str:
        """"static", "graphs", "compile" or "compile+graphs" (the names of `RunnerCache` / `generate_fast`)."""
        return {v: k for k, v in MODES.items()}[(bool(self.graphs), self.compile_mode is not None)]

    # -- the step ---------------------------------------------------------------------------------------------
    def _forward(self, b: int) -> None:
        """Run the step on rows 0..b-1 of the static buffers (eagerly, compiled, or while being captured)."""
        if self.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs were already copied out
        logits, tokens = self._fn(self.model, self.cache, self.ids[:b], self.pos[:b], self.kernels)
        if self.compile_mode == "reduce-overhead":  # Inductor's graphs reuse their output memory at the next
            logits, tokens = logits.clone(), tokens.clone()  # call (of any bucket): keep copies of our own
        self._outputs[b] = (logits, tokens)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first so the smaller ones reuse its memory pool (nano-vllm).

        Each bucket first runs `warmup_steps` times on a side stream, as the PyTorch docs ask: lazy setup (cuBLAS
        workspaces, compilation) must not happen during capture. The warm-up writes dummy K/V at position 0 of
        rows the next prefill overwrites or the mask hides.
        """
        pool = None
        for b in sorted(self.buckets, reverse=True):
            warm_up(lambda b=b: self._forward(b), self.warmup_steps, self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(b)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def bucket(self, batch: int) -> int:
        """The smallest bucket >= batch. Raises ValueError when batch > max_batch."""
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} exceeds this runner's max_batch {self.max_batch}")

    # -- a request --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, row: int = 0, bucketed: bool = False) -> torch.Tensor:
        """Run prompts (B, T) through the model, filling cache rows row..row+B-1 at positions 0..T-1.

        The rows are zeroed first: the mask adds -inf to the slots a query may not see, and -inf + NaN is NaN, so
        a NaN or inf left there by an earlier sequence would otherwise poison the new one.
        bucketed: pad the prompts to `prefill_length(B, T)` and replay that bucket's prefill graph, captured on
        first use (the module docstring says how the padding stays invisible); on a runner without graphs the same
        padded forward runs eagerly (what the CPU tests check). It runs the bucket's bucket(B) rows: rows
        B..bucket(B)-1 are zeroed and hold pad tokens after it (as a decode step writes its pad rows), so prefill
        such a row only after it, or prefill rows 0..B-1 unbucketed. Rows from `row` > 0, and prompts longer than
        the buckets, run eagerly and unpadded.
        Returns the last position's logits (B, V); a bucketed prefill's are a view that the next bucketed prefill
        rewrites. Rows of different prompt lengths: prefill them one call each.

        Raises:
            ValueError: rows beyond max_batch, T beyond max_seq_len.
        """
        B, T = input_ids.shape
        if row < 0 or row + B > self.max_batch:
            raise ValueError(f"rows {row}..{row + B - 1} are outside this runner's {self.max_batch} rows")
        if T > self.max_seq_len:
            raise ValueError(f"a {T}-token prompt does not fit this runner's {self.max_seq_len}-token cache")
        length = self.prefill_length(B, T) if bucketed and row == 0 else None
        if length is not None:
            return self._bucketed_prefill(input_ids, length)
        positions = torch.arange(T, device=self.device)
        return self.forward(input_ids, positions, kv_cache=self._cleared_rows(row, B), last_only=True)[:, -1]

    def _cleared_rows(self, row: int, n: int) -> StaticKVCache:
        """Cache rows row..row+n-1 (the whole cache, or a view of them), zeroed (see `prefill`)."""
        cache = self.cache if (row, n) == (0, self.max_batch) else self.cache.rows(row, row + n)
        for t in cache.k + cache.v:
            t.zero_()
        return cache

    def prefill_length(self, batch: int, length: int) -> int | None:
        """The padded prompt length a bucketed prefill of (batch, length) uses: the smallest of PREFILL_LENGTHS
        >= length that fits the cache, with bucket(batch) x it <= PREFILL_MAX_TOKENS; None: it runs eagerly (also
        when bucket(batch) x max_seq_len > PREFILL_MAX_SLOTS)."""
        rows = self.bucket(batch)
        if rows * self.max_seq_len > PREFILL_MAX_SLOTS:
            return None
        for n in PREFILL_LENGTHS:
            if n >= length:
                return n if n <= self.max_seq_len and rows * n <= PREFILL_MAX_TOKENS else None
        return None

    def capture_prefill(self, input_ids: torch.Tensor) -> None:
        """Capture the prefill graph a bucketed prefill of `input_ids` (B, T) will replay, if it is not captured
        (or failed) yet, e.g. before a timed run; the prefill it computes on the way is thrown away. Does nothing on
        a runner without graphs or for a prompt that prefills eagerly."""
        B, T = input_ids.shape
        length = self.prefill_length(B, T)
        key = (self.bucket(B), length)
        if length is not None and self.graphs and key not in self.prefill_graphs and key not in self._prefill_failed:
            self.prefill(input_ids, bucketed=True)

    def _bucketed_prefill(self, input_ids: torch.Tensor, length: int) -> torch.Tensor:
        B, T = input_ids.shape
        b = self.bucket(B)
        if self._prefill_ids is None:
            self._prefill_ids = torch.zeros(self.max_batch, PREFILL_LENGTHS[-1], dtype=torch.long, device=self.device)
            self._prefill_pos = torch.zeros(PREFILL_LENGTHS[-1], dtype=torch.long, device=self.device)
        ids = self._prefill_ids[:b, :length]
        pad = length - T
        ids[:B, pad:].copy_(input_ids)  # the prompt last ...
        ids[:B, :pad].zero_()  # ... after pad tokens (id 0)
        ids[B:].zero_()  # the bucket's pad rows
        # the pads at positions T..length-1 (after the prompt: the causal mask hides them), then the prompt at
        # 0..T-1: (T + i) mod length, made on the device (no host -> device copy)
        torch.remainder(torch.arange(T, T + length, device=self.device), length, out=self._prefill_pos[:length])
        key = (b, length)
        graph = self.prefill_graphs.get(key)
        if graph is None and self.graphs and key not in self._prefill_failed:  # a graph runner: capture it (once)
            graph = self._capture_prefill(b, length)
        if graph is not None:
            graph.replay()
        else:
            self._prefill_forward(b, length)
        return self._prefill_outputs[key][:B]

    def _prefill_forward(self, b: int, length: int) -> None:
        """The bucketed prefill of rows 0..b-1 from the static inputs (eagerly, or while being captured)."""
        logits = self.forward(self._prefill_ids[:b, :length], self._prefill_pos[:length],
                              kv_cache=self._cleared_rows(0, b), last_only=True)[:, -1]  # (b, V)
        self._prefill_outputs[(b, length)] = logits

    def _capture_prefill(self, b: int, length: int) -> torch.cuda.CUDAGraph | None:
        """Capture the bucketed prefill of (b rows, length tokens), as `capture` does a decode bucket: warm-up
        runs on a side stream first (they compute the very prefill asked for: the inputs are already in place).

        A capture that fails (out of memory, say: a captured prefill holds its memory for the runner's life) warns
        once, leaves the current stream as it was, and returns None: this bucket's prefill runs eagerly from then
        on. An error in the warm-up (the eager prefill itself) is raised."""
        stream = torch.cuda.current_stream(self.device)
        warm_up(lambda: self._prefill_forward(b, length), max(self.warmup_steps, 1), self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._prefill_pool):
                self._prefill_forward(b, length)
        except Exception as e:  # noqa: BLE001 — the eager prefill still works
            torch.cuda.set_stream(stream)  # a capture_end that raises leaves the capture stream current
            self._prefill_outputs.pop((b, length), None)
            self._prefill_failed.add((b, length))
            warnings.warn(f"the prefill graph of {b} rows x {length} tokens was not captured ({type(e).__name__}: "
                          f"{e}); this bucket's prefill runs eagerly", stacklevel=4)
            return None
        if self._prefill_pool is None:
            self._prefill_pool = graph.pool()
        self.prefill_graphs[(b, length)] = graph
        return graph

    @torch.no_grad()
    def start(self, tokens: torch.Tensor, positions: int | list[int]) -> None:
        """Set the first decode step's inputs: tokens (B,) on the device at host-known positions (an int for all
        rows, or one per row). The pad rows of B's bucket get token 0 at position 0.

        Raises:
            ValueError: B beyond max_batch, a position outside 0..max_seq_len-1, tokens not one dimension.
            TypeError: tokens not an integer tensor.
        """
        if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex() \
                or tokens.dtype == torch.bool:
            raise TypeError(f"start: tokens must be a (B,) integer tensor of token ids, got "
                            f"{tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        if tokens.dim() != 1:
            raise ValueError(f"start: tokens must be one id per row, shape (B,), got {tuple(tokens.shape)}")
        B = tokens.shape[0]
        b = self.bucket(B)
        host_pos = [positions] * B if isinstance(positions, int) else [int(p) for p in positions]
        if len(host_pos) != B:
            raise ValueError(f"{len(host_pos)} positions for {B} tokens")
        self._check_positions(host_pos)
        self.ids[:B, 0].copy_(tokens)
        self.ids[B:b].zero_()
        self.pos[:B].copy_(torch.tensor(host_pos, dtype=torch.long), non_blocking=True)
        self.pos[B:b].zero_()
        self._host_pos = host_pos + [0] * (self.max_batch - B)
        self._batch = B

    @torch.no_grad()
    def advance(self, tokens: torch.Tensor) -> None:
        """Feed the tokens (B,) just produced as the next step's inputs, one position further. Device-side only."""
        B = self._batch
        self.ids[:B, 0].copy_(tokens)
        self.pos[:B] += 1
        self._host_pos[:B] = [p + 1 for p in self._host_pos[:B]]

    @torch.no_grad()
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the current batch: replay its bucket's graph (or run it). Returns views of the step's
        outputs: logits (B, V) and greedy tokens (B,), valid until the next step of any bucket (the graphs share one
        memory pool). No host synchronization.

        Raises:
            ValueError: no batch was started, or a row's position reached max_seq_len (checked on the host before
                launching: on CUDA an out-of-range write would be a device-side error that poisons the process).
        """
        B = self._batch
        if B == 0:
            raise ValueError("call start(tokens, positions) before step()")
        self._check_positions(self._host_pos[:B])
        b = self.bucket(B)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()  # rewrites this bucket's output tensors in place
        else:
            self._forward(b)
        logits, tokens = self._outputs[b]
        self.logits, self.tokens = logits[:B], tokens[:B]
        return self.logits, self.tokens

    def _check_positions(self, host_pos: list[int]) -> None:
        if min(host_pos) < 0 or max(host_pos) >= self.max_seq_len:
            raise ValueError(f"position {max(host_pos)} is outside this runner's {self.max_seq_len}-token cache "
                             f"(positions 0..{self.max_seq_len - 1}); build a runner with a larger max_seq_len")

    def __repr__(self) -> str:
        return (f"GraphDecoder(max_batch={self.max_batch}, max_seq_len={self.max_seq_len}, buckets={self.buckets}, "
                f"graphs={len(self.graphs)}, prefill_graphs={len(self.prefill_graphs)}, "
                f"compile={self.compile_mode}, kernels={self.kernels!r}, device={self.device})")


class RunnerCache:
    """Decode runners kept between requests, one per mode: `runners["graphs"]` is the current graph runner.

    Owned by whoever keeps the model (`llmlab.engine.LLM.runners`; `generate_fast(..., runners=...)`). A copy
    (deepcopy, pickling) starts empty: graphs hold the old weights' addresses and cannot be copied."""

    def __init__(self):
        self._runners: dict[str, GraphDecoder] = {}

    def __getitem__(self, mode: str) -> GraphDecoder:
        return self._runners[mode]

    def __contains__(self, mode: str) -> bool:
        return mode in self._runners

    def __len__(self) -> int:
        return len(self._runners)

    def __deepcopy__(self, memo):
        return RunnerCache()

    def __reduce__(self):
        return (RunnerCache, ())

    def clear(self) -> None:
        """Drop every runner (and with it its cache and captured graphs)."""
        self._runners.clear()

    def runner_for(self, model, mode: str, batch: int, seq_len: int, max_batch: int | None = None,
                   kernels=None) -> GraphDecoder:
        """The runner for `mode` that fits `batch` rows of `seq_len` tokens of `model` with `kernels`, built if
        needed.

        A runner is reused while it has enough rows and cache length, runs the same model and kernels' step, and
        the weights, modules and tiles are the ones it captured (`weights_fingerprint`); otherwise it is dropped and a
        bigger one is built (and captured/compiled): rows rounded up to a power of two, lengths to MIN_SEQ or a
        multiple of SEQ_ROUND (capped at the model's context), never smaller than the old runner's.

        mode: "static" (eager on the static cache), "graphs", "compile", "compile+graphs". kernels: as
        `GraphDecoder`.

        Raises:
            ValueError: unknown mode, graphs on a CPU model, seq_len beyond the model's context.
        """
        if mode not in MODES:
            raise ValueError(f"unknown decode mode {mode!r}; use one of {', '.join(MODES)}")
        graphs, compiled = MODES[mode]
        context = model.config.max_seq_len
        if seq_len > context:
            raise ValueError(f"{seq_len} tokens exceed the model's context of {context} tokens")
        old = self._runners.get(mode)
        want_batch = max(batch, max_batch or 1)
        same = (old is not None and old.model is model and old.kernels is kernels
                and old.fingerprint == weights_fingerprint(model, kernels))
        if same and old.max_batch >= want_batch and old.max_seq_len >= seq_len:
            return old
        rows = 2 ** math.ceil(math.log2(want_batch))
        length = min(context, max(MIN_SEQ, SEQ_ROUND * math.ceil(seq_len / SEQ_ROUND)))
        if old is not None:
            if same:
                rows, length = max(rows, old.max_batch), max(length, old.max_seq_len)
            del self._runners[mode]
            del old  # free its cache and graph pools before allocating the new ones
        runner = GraphDecoder(model, max_batch=rows, max_seq_len=length, cuda_graphs=graphs, compile=compiled,
                              kernels=kernels)
        self._runners[mode] = runner
        return runner
