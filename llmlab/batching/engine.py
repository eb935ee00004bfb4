"""The continuous-batching step loop: the scheduler's plan run on the model over a paged KV cache.

`BatchEngine.step()` is one iteration of an Orca / vLLM-style server (Yu et al. 2022, Orca,
https://www.usenix.org/conference/osdi22/presentation/yu; Kwon et al. 2023, PagedAttention,
https://arxiv.org/abs/2309.06180):

1. the scheduler (`llmlab.batching.scheduler`) plans the step: which sequences decode one token, which prompt
   chunks are prefilled, who is preempted to make room, who is admitted;
2. one forward pass runs every decode row together, a (B, 1) batch, each row at its own position; the prefill
   chunks run in as few passes as `pack_chunks` allows: chunks of near-equal length share one (k, T) pass, each
   row left-padded to the longest. All of them read and write one shared block pool through a
   `llmlab.batching.paged_batch.PagedBatchView`, so `llmlab.model.Transformer` runs unchanged;
3. each sequence that reached its next token samples it with its own settings (greedy rows together; a sampled
   row with its own seeded generator, so its tokens do not depend on what else is in the batch);
4. sequences that hit EOS or max_new_tokens finish, give their blocks back and leave the batch this very step.

Padding buys fewer passes with wasted compute; a server that packs decode rows and chunks of any lengths into one
pass of all their tokens (a "varlen" batch, with attention kernels that take each row's length) wastes none.

With the Triton kernel modules swapped in (`llmlab.kernels.modules.swap_in`, an `LLM` with the "Triton kernels"
switch on), the decode rows run `llmlab.batching.paged_graphs.PagedDecodeGraphs` instead: the paged-attention
kernel reads each row's K/V in place, and on a GPU the step is replayed from a CUDA graph captured per batch-size
bucket. Without them the model runs eagerly on the gathering view, the exact reference the tests compare with.
With `prefill_graphs=True` the prefill chunks run as fixed-shape passes (`llmlab.batching.prefill_graphs`),
captured per (rows, tokens) bucket on a GPU, instead of `pack_chunks` passes of any shape.
The engine is single-threaded; `llmlab.batching.requests.Server` adds submission from other threads, streaming and
a background loop.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from llmlab.batching.overlap import OverlappedDecode
from llmlab.batching.paged_batch import PagedBatchView
from llmlab.batching.paged_graphs import PagedDecodeGraphs
from llmlab.batching.prefill_graphs import PagedPrefillGraphs
from llmlab.batching.scheduler import Scheduler, Sequence, StepPlan, check_admit_delay, check_positive_int
from llmlab.cache.paged_cache import PagedKVCache
from llmlab.generate import check_flags, check_seed, make_generator, prepare_prompt
from llmlab.sampling import argmax_rows, check_sampling_args, sample, warn_greedy_filters

HISTORY = 10_000  # steps whose `StepStats` the engine keeps (the oldest are dropped)
PACK_SLACK = 0.25  # padding allowed in a packed prefill pass, as a share of its real tokens (`pack_chunks`)


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens (`llmlab.sampling.sample`): temperature 0 is greedy. generator: seeded from
    the request's seed (None: unseeded, torch's global generator)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class StepStats:
    """What one step ran: counts of sequences and tokens, the pool's occupancy after it, its time in ms."""

    step: int
    decode_rows: int  # sequences that decoded one token (the (B, 1) batch)
    prefill_chunks: int
    prefill_tokens: int
    tokens: int  # decode_rows + prefill_tokens: what the token budget limits
    budget_used: float  # tokens / token_budget
    sampled: int  # new tokens produced
    preempted: int
    finished: int
    running: int  # after the step
    waiting: int
    blocks_used: int
    blocks_free: int
    ms: float


@dataclass
class StepResult:
    """tokens: {seq_id: new token} of this step, when it ran synchronously; read_back: {seq_id: token} of an earlier,
    overlapped step read back in this call (`BatchEngine(overlap=True)`; a sequence can have one of each);
    finished: sequences whose last token is known now (an "error" finish included); stats: None when nothing was
    planned; error: what made the step fail (its sequences are finished with reason "error"; the others go on)."""

    tokens: dict
    finished: list[Sequence]
    stats: StepStats | None = None
    error: BaseException | None = None
    read_back: dict = field(default_factory=dict)


def model_of(llm_or_model, name: str = "llm_or_model") -> torch.nn.Module:
    """The Transformer of an `llmlab.LLM`, or the Transformer given; TypeError naming `name` for anything else."""
    model = getattr(llm_or_model, "model", llm_or_model)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"{name}={llm_or_model!r}: give an llmlab.LLM or an llmlab.model.Transformer")
    return model


class BatchEngine:
    """Continuous batching of many requests on one model over a paged KV cache of `num_blocks` blocks.

    Args:
        llm_or_model: an `llmlab.LLM` (its model is used) or a `llmlab.model.Transformer`.
        num_blocks: blocks in the KV pool (the KV budget); default: room for max_batch requests of max_seq_len.
        block_size: tokens per block.
        max_batch: the most requests running at once.
        token_budget: the most tokens one step runs (decode rows + prefill chunk tokens).
        chunk: the most prompt tokens one request prefills per step (chunked prefill).
        max_seq_len: the longest request served (prompt + max_new_tokens); default: the model's context. The pool
            must hold one such request: then any request can finish, if need be alone.
        clock: seconds, for the request times (default `time.perf_counter`).
        cuda_graphs: with the Triton kernel modules swapped into the model, capture the decode step per
            batch-size bucket (default: on a CUDA device). True without the kernel modules is an error; without
            them the decode step runs eagerly on the gathering view whatever this says (None, False).
        overlap: launch each greedy decode step before reading the last one's tokens back
            (`llmlab.batching.overlap`): the host's planning hides behind the GPU's work. Tokens then reach
            `StepResult.read_back` and each sequence's output one step after they were made, and a sequence that makes
            EOS finishes one step late (its extra token is cut off). False (the default): every step waits for its
            tokens. None: on where the decode step is graph-captured. True needs the paged decode step.
        admit_delay: `Scheduler`'s: while sequences decode, admit waiting requests only once the oldest has waited
            this many times the last prefill step's time, so that they share one prefill pass (0: at once).
        prefill_graphs: run the prefill chunks of two or more tokens as fixed-shape passes
            (`llmlab.batching.prefill_graphs`): on a CUDA device each (rows, tokens) bucket is captured as a CUDA
            graph when the engine is built (unless cuda_graphs=False), elsewhere the same passes run eagerly. False
            (the default): `pack_chunks` passes of any shape, run eagerly.

    Raises:
        TypeError / ValueError: a size that is not a whole number >= 1, max_seq_len beyond the model's context,
            a pool too small for one request of max_seq_len tokens, a bad admit_delay — each message names the
            argument.
        MemoryError: the pool would not fit in the free memory (`PagedKVCache`).
    """

    def __init__(self, llm_or_model, num_blocks: int | None = None, block_size: int = 16, max_batch: int = 16,
                 token_budget: int = 256, chunk: int = 64, max_seq_len: int | None = None,
                 clock=time.perf_counter, cuda_graphs: bool | None = None, overlap: bool | None = False,
                 admit_delay: float = 0.0, prefill_graphs: bool = False):
        model = model_of(llm_or_model)
        self.llm = llm_or_model if model is not llm_or_model else None
        self.model, config = model, model.config
        context = config.max_seq_len
        max_seq_len = context if max_seq_len is None else check_positive_int("max_seq_len", max_seq_len)
        if not 2 <= max_seq_len <= context:
            raise ValueError(f"max_seq_len={max_seq_len}: must be between 2 (one prompt token + one new token) and "
                             f"the model's context of {context} tokens")
        block_size = check_positive_int("block_size", block_size)
        for name, value in (("max_batch", max_batch), ("token_budget", token_budget), ("chunk", chunk)):
            check_positive_int(name, value)
        check_admit_delay(admit_delay)  # every argument checked before the pool is allocated
        if not isinstance(prefill_graphs, bool):
            raise TypeError(f"prefill_graphs={prefill_graphs!r}: give True or False")
        if num_blocks is None:
            num_blocks = max_batch * -(-max_seq_len // block_size)
        num_blocks = check_positive_int("num_blocks", num_blocks)
        if num_blocks * block_size < max_seq_len:
            raise ValueError(f"num_blocks={num_blocks} x block_size={block_size} = {num_blocks * block_size} token "
                             f"slots cannot hold even one request of max_seq_len={max_seq_len} tokens: give "
                             f"num_blocks >= {-(-max_seq_len // block_size)}, or a smaller max_seq_len")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_seq_len = max_seq_len
        why_not = paged_step_reason(model, cuda_graphs)
        self.pool = PagedKVCache(config, max_batch, max_seq_len, self.dtype, self.device, block_size=block_size,
                                 num_blocks=num_blocks, spare_blocks=1)  # the padding's slot
        # the decode step: the paged kernel (graph-captured on a GPU) where the kernel modules are in, else None
        self.decode_step = None if why_not else PagedDecodeGraphs(
            model, self.pool, max_batch, -(-max_seq_len // block_size),
            cuda_graphs=self.device.type == "cuda" if cuda_graphs is None else cuda_graphs)
        # the prefill buckets: the largest chunk the scheduler can plan sets the largest; cuda_graphs=False: eager
        self.prefill = None if not prefill_graphs else PagedPrefillGraphs(
            model, self.pool, min(chunk, token_budget, max_seq_len), token_budget, max_batch,
            -(-max_seq_len // block_size), cuda_graphs=False if cuda_graphs is False else None)
        self.scheduler = Scheduler(self.pool.blocks, max_batch=max_batch, token_budget=token_budget, chunk=chunk,
                                   clock=clock, admit_delay=admit_delay)
        if overlap is None:
            overlap = self.decode_step is not None and bool(self.decode_step.graphs)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap={overlap!r}: give True, False or None")
        if overlap and self.decode_step is None:
            raise ValueError(f"overlap=True: overlapped steps run the paged decode step, and this engine cannot: "
                             f"{why_not}; or leave overlap out")
        self.overlap = OverlappedDecode(self.decode_step, self.scheduler, max_batch) if overlap else None
        self._unreported: tuple[dict, list] = ({}, [])  # read back while a step was interrupted: the next result
        eos = config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.history: deque[StepStats] = deque(maxlen=HISTORY)
        self.counters = dict(steps=0, decode_tokens=0, prefill_tokens=0, sampled=0, preemptions=0, finished=0,
                             errors=0)
        self._ids = itertools.count()
        self._origin = object()  # marks the requests this engine made (`add` takes only those)

    # -- requests ---------------------------------------------------------------------------------------------
    def make_request(self, prompt_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                     top_p: float | None = None, seed: int | None = None, stop_at_eos: bool = True) -> Sequence:
        """A checked, not yet queued `Sequence` for one request (its id fresh from the engine's counter); touches
        no engine state, so any thread may call it.

        prompt_ids: token ids (a list of ints or a 1-D integer tensor). The other arguments as `LLM.generate`.

        Warns: UserWarning for top_k / top_p at temperature 0 (`llmlab.sampling.warn_greedy_filters`).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt that is not one sequence,
                max_new_tokens < 1, prompt + max_new_tokens beyond max_seq_len, sampling settings out of range, a
                seed out of range. TypeError: ids or settings of the wrong type. Each message names the argument.
        """
        check_sampling_args(temperature, top_k, top_p)
        check_seed(seed)
        check_flags(stop_at_eos=stop_at_eos)
        warn_greedy_filters(temperature, top_k, top_p)  # top_k / top_p at temperature 0 change nothing: say so
        ids = prepare_prompt(self.model, prompt_ids, max_new_tokens)  # types, vocabulary, the model's context
        if ids.shape[0] != 1:
            raise ValueError(f"prompt: {ids.shape[0]} sequences given; submit one prompt per request")
        prompt = ids[0].tolist()
        if len(prompt) + max_new_tokens > self.max_seq_len:
            room = self.max_seq_len - len(prompt)
            fix = f"lower max_new_tokens to at most {room}" if room >= 1 else "shorten the prompt"
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds this "
                             f"engine's max_seq_len={self.max_seq_len} (the KV pool holds {self.pool.num_blocks} "
                             f"blocks of {self.pool.block_size}); {fix}")
        params = SamplingParams(float(temperature), None if top_k is None else int(top_k), top_p, seed,
                                make_generator(seed, self.device))
        return Sequence(next(self._ids), prompt, int(max_new_tokens), self.eos_ids if stop_at_eos else frozenset(),
                        params, origin=self._origin)

    def add_request(self, prompt_ids, max_new_tokens: int = 64, **settings) -> Sequence:
        """`make_request` and queue it. Returns the queued `Sequence` (its `seq_id` names it)."""
        seq = self.make_request(prompt_ids, max_new_tokens, **settings)
        self.scheduler.add(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a sequence made by this engine's `make_request`.

        Raises:
            TypeError: not a Sequence (token ids go to `add_request`). ValueError: a Sequence another engine made
                (its id comes from that engine's counter and may clash with this one's), or one not new.
        """
        if not isinstance(seq, Sequence):
            raise TypeError(f"add takes a Sequence from this engine's make_request, got {type(seq).__name__}; "
                            f"queue token ids with add_request(prompt_ids, max_new_tokens)")
        if seq.origin is not self._origin:
            raise ValueError(f"sequence {seq.seq_id!r} was not made by this engine's make_request (another engine's "
                             f"ids may clash with this one's); make it here: engine.make_request(seq.prompt, "
                             f"seq.max_new_tokens, ...)")
        self.scheduler.add(seq)

    def cancel(self, seq_id) -> Sequence:
        """Cancel a waiting or running request: it finishes as "cancelled" and its blocks are freed.

        Raises:
            ValueError: no waiting or running request has this id (unknown, or already finished).
        """
        if seq_id in self.scheduler.live:  # its step in flight is read back first: no placeholder is left in it
            self._keep_unreported(*self._read_back(None))
        try:
            return self.scheduler.cancel(seq_id)
        except KeyError:
            raise ValueError(f"seq_id={seq_id!r}: no waiting or running request has this id (unknown, or already "
                             f"finished)") from None

    def has_work(self) -> bool:
        """Whether a request waits or runs, or a launched step has not been read back or reported (`overlap`)."""
        return (self.scheduler.has_work() or (self.overlap is not None and self.overlap.in_flight is not None)
                or any(self._unreported))

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Plan and run one step (module docstring). A failure inside the model or the sampler finishes that
        step's sequences with reason "error" and frees their blocks; the engine goes on serving the others. An
        interrupt (KeyboardInterrupt) is raised after the step is undone: the next step runs it again.

        Returns:
            A `StepResult`: the new tokens, the sequences finished, the step's `StepStats` (also appended to
            `history`), and the error if the step failed.
        """
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        ov = self.overlap
        read, finished = self._unreported  # what earlier steps read back and did not report yet (overlap)
        self._unreported = ({}, [])
        if ov is not None and ov.in_flight is not None and not ov.can_run(plan):
            self.scheduler.undo_step(plan)  # the plan needs tokens on the host: read the step in flight first
            more, done = self._read_back(None)
            read, finished = {**read, **more}, finished + done
            plan = self.scheduler.schedule()
        if not plan and not plan.preempted:
            return StepResult({}, finished, read_back=read)
        if ov is not None and ov.can_run(plan):
            return self._overlapped(plan, t0, read, finished)
        try:
            new = self._run(plan) if plan else {}
        except Exception as e:  # noqa: BLE001 - any failure: fail this step's requests, keep serving
            failed = self.scheduler.abort_step(plan, e)
            self.counters["errors"] += 1
            return StepResult({}, finished + failed, self._record(plan, failed, 0, t0), e, read)
        except BaseException:  # an interrupt (Ctrl-C in a notebook): forget the step, it runs again next time
            self.scheduler.undo_step(plan)
            self._keep_unreported(read, finished)
            raise
        done = self.scheduler.finish_step(plan, new)
        return StepResult(new, finished + done, self._record(plan, done, len(new), t0), read_back=read)

    def _overlapped(self, plan: StepPlan, t0: float, read: dict, finished: list) -> StepResult:
        """Launch a greedy decode plan without waiting for it, then read back the step launched before it. read,
        finished: what this call read back before (reported with it)."""
        ov = self.overlap
        before = ov.in_flight
        try:
            with torch.inference_mode():
                ov.launch(plan, self.pool.blocks.block_table)
        except BaseException as e:
            # the step before is read back first: its rows' tokens were to come from this step's device buffers
            ov.in_flight = before
            if isinstance(e, Exception):  # any failure: fail this plan's requests, keep serving
                failed = self.scheduler.abort_step(plan, e)
                more, done = self._read_back(None)
                self.counters["errors"] += 1
                return StepResult({}, finished + done + failed, self._record(plan, failed, 0, t0), e,
                                  {**read, **more})
            self.scheduler.undo_step(plan)  # an interrupt: the plan runs again next time
            more, done = self._read_back(None)
            self._keep_unreported({**read, **more}, finished + done)
            raise
        ov.in_flight, launched = before, ov.in_flight
        more, done = self._read_back(launched)
        ov.in_flight = launched
        return StepResult({}, finished + done, self._record(plan, [], 0, t0), read_back={**read, **more})

    def _keep_unreported(self, read: dict, finished: list) -> None:
        """Tokens and finished sequences read back outside a step's result: the next step reports them."""
        r, f = self._unreported
        self._unreported = ({**r, **read}, f + [s for s in finished if s not in f])

    def _read_back(self, later) -> tuple[dict, list[Sequence]]:
        """Read back the overlapped step in flight, if any (`OverlappedDecode.resolve`; `later`: the step launched
        after it) and count its tokens and finished sequences. Leaves no step in flight."""
        ov = self.overlap
        if ov is None or ov.in_flight is None:
            return {}, []
        tokens, finished = ov.resolve(ov.in_flight, later, self.scheduler.clock())
        ov.in_flight = None
        self.counters["sampled"] += len(tokens)
        self.counters["finished"] += len(finished)
        return tokens, finished

    def run_until_done(self) -> list[Sequence]:
        """Step until no request is waiting or running; returns the sequences in the order they finished."""
        done = []
        while self.has_work():
            done += self.step().finished
        return done

    @torch.inference_mode()
    def _run(self, plan: StepPlan) -> dict:
        """The forward passes of a plan, then the sampling: {seq_id: token} for `plan.sampled`."""
        logits, greedy = {}, {}  # seq_id -> (V,) logits of its last token; seq_id -> its greedy token (an int)
        # (sequence, first new position, new tokens): decode rows are one-token chunks at their next position
        chunks = [(s, s.num_computed, 1) for s in plan.decode] + list(plan.prefill)
        if self.decode_step is not None:  # every one-token chunk through the paged decode step
            ones = [c for c in chunks if c[2] == 1]
            chunks = [c for c in chunks if c[2] > 1]
            if ones:
                out, picked = self.decode_step.step([(token_at(s, p), p, self.pool.blocks.block_table(s.seq_id))
                                                     for s, p, _ in ones])  # (B, V), (B,)
                picked = picked.tolist()  # (B,) -> host: the step's one sync
                for i, (s, p, _) in enumerate(ones):
                    if p + 1 == s.num_tokens:
                        logits[s.seq_id], greedy[s.seq_id] = out[i], picked[i]
        if self.prefill is not None:  # fixed-shape passes, replayed from CUDA graphs on a GPU; one-token chunks
            fixed = [c for c in chunks if c[2] > 1]  # (decode rows without the paged step) run in one (k, 1) pass
            chunks = [c for c in chunks if c[2] == 1]
            for idx, B, T in self.prefill.plan([n for _, _, n in fixed]):
                group = [fixed[i] for i in idx]
                out = self.prefill.run([([token_at(s, q) for q in range(p, p + n)], p,
                                         self.pool.blocks.block_table(s.seq_id)) for s, p, n in group], B, T)
                for i, (s, p, n) in enumerate(group):
                    if p + n == s.num_tokens:
                        logits[s.seq_id] = out[i]
        for group in pack_chunks(chunks):  # chunks of near-equal length run as one left-padded (k, T) pass
            T = group[0][2]
            view = PagedBatchView(self.pool, [s.seq_id for s, _, _ in group], [p for _, p, _ in group], T,
                                  [n for _, _, n in group])
            ids = torch.tensor([[0] * (T - n) + [token_at(s, q) for q in range(p, p + n)] for s, p, n in group],
                               device=self.device)  # (k, T)
            out = self.model(ids, view.positions, kv_cache=view, last_only=True)[:, -1]  # (k, V)
            for i, (s, p, n) in enumerate(group):
                if p + n == s.num_tokens:
                    logits[s.seq_id] = out[i]
        return self._sample(plan.sampled, logits, greedy)

    def _sample(self, seqs: list[Sequence], logits: dict, greedy_tokens: dict | None = None) -> dict:
        """{seq_id: token}: greedy rows in one argmax (or the decode step's own argmax, `greedy_tokens` {seq_id:
        int}), each sampled row with its own settings and generator."""
        tokens, greedy_tokens = {}, greedy_tokens or {}
        greedy = [s for s in seqs if s.params.temperature == 0]
        if greedy:
            need = [s for s in greedy if s.seq_id not in greedy_tokens]
            if need:  # one argmax over every row the decode step did not pick, one copy to the host
                picked = argmax_rows(torch.stack([logits[s.seq_id] for s in need])).tolist()
                greedy_tokens = {**greedy_tokens, **{s.seq_id: t for s, t in zip(need, picked)}}
            tokens.update((s.seq_id, greedy_tokens[s.seq_id]) for s in greedy)
        for s in seqs:
            p = s.params
            if p.temperature != 0:
                tokens[s.seq_id] = int(sample(logits[s.seq_id][None], p.temperature, p.top_k, p.top_p, p.generator))
        return tokens

    def _record(self, plan: StepPlan, finished: list[Sequence], sampled: int, t0: float) -> StepStats:
        """Count the step (counters, history) and return its stats."""
        occ = self.scheduler.occupancy()
        prefill_tokens = sum(n for _, _, n in plan.prefill)
        stats = StepStats(step=self.counters["steps"], decode_rows=len(plan.decode),
                          prefill_chunks=len(plan.prefill), prefill_tokens=prefill_tokens, tokens=plan.num_tokens,
                          budget_used=plan.num_tokens / self.scheduler.token_budget, sampled=sampled,
                          preempted=len(plan.preempted), finished=len(finished), running=occ["running"],
                          waiting=occ["waiting"], blocks_used=occ["blocks_used"], blocks_free=occ["blocks_free"],
                          ms=(time.perf_counter() - t0) * 1e3)
        c = self.counters
        c["steps"] += 1
        c["decode_tokens"] += len(plan.decode)
        c["prefill_tokens"] += prefill_tokens
        c["sampled"] += sampled
        c["preemptions"] += len(plan.preempted)
        c["finished"] += len(finished)
        self.history.append(stats)
        return stats

    def summary(self) -> dict:
        """Totals over the steps run so far: the counters, mean decode rows per step and mean share of the token
        budget used (over the steps kept in `history`), and the KV pool's size in MB."""
        steps = list(self.history)
        mean = (lambda xs: sum(xs) / len(xs)) if steps else (lambda xs: math.nan)
        return {**self.counters, "mean_decode_rows": mean([s.decode_rows for s in steps]),
                "mean_budget_used": mean([s.budget_used for s in steps]), "kv_pool_mb": self.pool.nbytes / 1e6}


def paged_step_reason(model, cuda_graphs: bool | None) -> str:
    """'' if the engine's decode rows can run the paged decode step (`PagedDecodeGraphs`) on `model`, else why not.

    Raises:
        ValueError: cuda_graphs=True where the step cannot be captured (the message says why and what to do).
    """
    from llmlab.kernels.modules import is_swapped  # no triton imported: the modules load kernels on first use

    device = next(model.parameters()).device
    why = ""
    if cuda_graphs and device.type != "cuda":  # first: on a CPU no other fix helps
        why = f"the model is on {device}, and CUDA graphs need a CUDA GPU (load the model with device='cuda')"
    elif not is_swapped(model):
        why = "the model runs the PyTorch modules (turn the triton_kernels switch on for the paged kernel)"
    elif model.config.sliding_window is not None:
        why = "a sliding window: the paged kernel attends over every cached token"
    if why and cuda_graphs:
        raise ValueError(f"cuda_graphs=True: the continuous-batching decode step cannot be captured: {why}; "
                         f"or leave cuda_graphs out")
    return why


def pack_chunks(chunks: list, slack: float = PACK_SLACK) -> list[list]:
    """Chunks [(sequence, start, n)] grouped into forward passes, longest first: a chunk joins the current pass
    while the pass's padding (each row left-padded to its longest chunk) stays within `slack` of its real tokens.

    One pass per group reads the weights once and launches each kernel once; padding costs compute. With chunk
    lengths spread over 64..512 tokens, a slack of 1/4 packs a step's prefill chunks into a few passes instead of
    one pass per distinct length. Each group's first chunk is its longest (its n is the pass's T).

    Raises:
        ValueError: a chunk that is not (sequence, start, n) with n a whole number >= 1, or a slack that is not a
            finite number >= 0.
    """
    if not (isinstance(slack, (int, float)) and math.isfinite(slack) and slack >= 0):
        raise ValueError(f"slack={slack!r}: give the padding allowed as a share of the real tokens, a number >= 0")
    for c in chunks:
        if not (isinstance(c, tuple) and len(c) == 3 and isinstance(c[2], int) and c[2] >= 1):
            raise ValueError(f"chunk {c!r}: give (sequence, start, n) with n >= 1 tokens")
    groups: list[list] = []
    total = 0  # real tokens of the current group
    for c in sorted(chunks, key=lambda c: -c[2]):
        if groups and (len(groups[-1]) + 1) * groups[-1][0][2] <= (1 + slack) * (total + c[2]):
            groups[-1].append(c)
            total += c[2]
        else:
            groups.append([c])
            total = c[2]
    return groups


def token_at(seq: Sequence, p: int) -> int:
    """Token p of the sequence (prompt, then output)."""
    n = len(seq.prompt)
    return seq.prompt[p] if p < n else seq.output[p - n]
