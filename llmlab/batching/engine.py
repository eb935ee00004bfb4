"""The continuous-batching step loop: the scheduler's plan run on the model over a paged KV cache.

`BatchEngine.step()` is one iteration of an Orca / vLLM-style server (Yu et al. 2022, Orca,
https://www.usenix.org/conference/osdi22/presentation/yu; Kwon et al. 2023, PagedAttention,
https://arxiv.org/abs/2309.06180):

1. the scheduler (`llmlab.batching.scheduler`) plans the step: which sequences decode one token, which prompt
   chunks are prefilled, who is preempted to make room, who is admitted;
2. one forward pass runs every decode row together, a (B, 1) batch, each row at its own position; each prefill
   chunk runs as its own (1, n) forward pass. All of them read and write one shared block pool through a
   `llmlab.batching.paged_batch.PagedBatchView`, so `llmlab.model.Transformer` runs unchanged;
3. each sequence that reached its next token samples it with its own settings (greedy rows together; a sampled
   row with its own seeded generator, so its tokens do not depend on what else is in the batch);
4. sequences that hit EOS or max_new_tokens finish, give their blocks back and leave the batch this very step.

Chunks run as separate forward passes to keep each pass simple; a GPU server packs decode rows and chunks into
one pass of all their tokens (a "varlen" batch) so that the weights are read once per step.

The model runs eagerly (`Transformer.forward`; an `LLM`'s Triton kernels switch is not used here). The engine is
single-threaded; `llmlab.batching.requests.Server` adds submission from other threads, streaming and a
background loop.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass

import torch

from llmlab.batching.paged_batch import PagedBatchView
from llmlab.batching.scheduler import Scheduler, Sequence, StepPlan, check_positive_int
from llmlab.cache.paged_cache import PagedKVCache
from llmlab.generate import check_flags, check_seed, make_generator, prepare_prompt
from llmlab.sampling import argmax_rows, check_sampling_args, sample, warn_greedy_filters

HISTORY = 10_000  # steps whose `StepStats` the engine keeps (the oldest are dropped)


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
    """tokens: {seq_id: new token} of this step; finished: sequences that finished in it (an "error" finish
    included); stats: None when there was nothing to run; error: what made the step fail (its sequences are
    finished with reason "error"; the others go on)."""

    tokens: dict
    finished: list[Sequence]
    stats: StepStats | None = None
    error: BaseException | None = None


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

    Raises:
        TypeError / ValueError: a size that is not a whole number >= 1, max_seq_len beyond the model's context,
            or a pool too small for one request of max_seq_len tokens — each message names the argument.
        MemoryError: the pool would not fit in the free memory (`PagedKVCache`).
    """

    def __init__(self, llm_or_model, num_blocks: int | None = None, block_size: int = 16, max_batch: int = 16,
                 token_budget: int = 256, chunk: int = 64, max_seq_len: int | None = None,
                 clock=time.perf_counter):
        model = getattr(llm_or_model, "model", llm_or_model)
        if not hasattr(model, "config") or not callable(model):
            raise TypeError(f"llm_or_model={llm_or_model!r}: give an llmlab.LLM or an llmlab.model.Transformer")
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
        self.pool = PagedKVCache(config, max_batch, max_seq_len, self.dtype, self.device, block_size=block_size,
                                 num_blocks=num_blocks)
        self.scheduler = Scheduler(self.pool.blocks, max_batch=max_batch, token_budget=token_budget, chunk=chunk,
                                   clock=clock)
        eos = config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.history: deque[StepStats] = deque(maxlen=HISTORY)
        self.counters = dict(steps=0, decode_tokens=0, prefill_tokens=0, sampled=0, preemptions=0, finished=0,
                             errors=0)
        self._ids = itertools.count()

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
                        params)

    def add_request(self, prompt_ids, max_new_tokens: int = 64, **settings) -> Sequence:
        """`make_request` and queue it. Returns the queued `Sequence` (its `seq_id` names it)."""
        seq = self.make_request(prompt_ids, max_new_tokens, **settings)
        self.scheduler.add(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a sequence made by `make_request`."""
        self.scheduler.add(seq)

    def cancel(self, seq_id) -> Sequence:
        """Cancel a waiting or running request: it finishes as "cancelled" and its blocks are freed.

        Raises:
            ValueError: no waiting or running request has this id (unknown, or already finished).
        """
        try:
            return self.scheduler.cancel(seq_id)
        except KeyError:
            raise ValueError(f"seq_id={seq_id!r}: no waiting or running request has this id (unknown, or already "
                             f"finished)") from None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

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
        if not plan and not plan.preempted:
            return StepResult({}, [])
        try:
            tokens = self._run(plan) if plan else {}
        except Exception as e:  # noqa: BLE001 - any failure: fail this step's requests, keep serving
            finished = self.scheduler.abort_step(plan, e)
            self.counters["errors"] += 1
            return StepResult({}, finished, self._record(plan, finished, 0, t0), e)
        except BaseException:  # an interrupt (Ctrl-C in a notebook): forget the step, it runs again next time
            self.scheduler.undo_step(plan)
            raise
        finished = self.scheduler.finish_step(plan, tokens)
        return StepResult(tokens, finished, self._record(plan, finished, len(tokens), t0))

    def run_until_done(self) -> list[Sequence]:
        """Step until no request is waiting or running; returns the sequences in the order they finished."""
        done = []
        while self.has_work():
            done += self.step().finished
        return done

    @torch.inference_mode()
    def _run(self, plan: StepPlan) -> dict:
        """The forward passes of a plan, then the sampling: {seq_id: token} for `plan.sampled`."""
        logits = {}  # seq_id -> (V,) logits of its last token
        if plan.decode:  # every decode row in one (B, 1) forward pass, each at its own position
            seqs = plan.decode
            view = PagedBatchView(self.pool, [s.seq_id for s in seqs], [s.num_computed for s in seqs], 1)
            ids = torch.tensor([[token_at(s, s.num_computed)] for s in seqs], device=self.device)  # (B, 1)
            out = self.model(ids, view.positions, kv_cache=view, last_only=True)[:, -1]  # (B, V)
            logits.update((s.seq_id, out[i]) for i, s in enumerate(seqs))
        for seq, start, n in plan.prefill:  # each chunk its own (1, n) forward pass
            view = PagedBatchView(self.pool, [seq.seq_id], [start], n)
            ids = torch.tensor([[token_at(seq, p) for p in range(start, start + n)]], device=self.device)  # (1, n)
            out = self.model(ids, view.positions, kv_cache=view, last_only=True)[:, -1]  # (1, V)
            if start + n == seq.num_tokens:
                logits[seq.seq_id] = out[0]
        return self._sample(plan.sampled, logits)

    def _sample(self, seqs: list[Sequence], logits: dict) -> dict:
        """{seq_id: token}: greedy rows in one argmax, each sampled row with its own settings and generator."""
        tokens = {}
        greedy = [s for s in seqs if s.params.temperature == 0]
        if greedy:
            picked = argmax_rows(torch.stack([logits[s.seq_id] for s in greedy])).tolist()  # (G,) -> host
            tokens.update((s.seq_id, t) for s, t in zip(greedy, picked))
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


def token_at(seq: Sequence, p: int) -> int:
    """Token p of the sequence (prompt, then output)."""
    n = len(seq.prompt)
    return seq.prompt[p] if p < n else seq.output[p - n]
