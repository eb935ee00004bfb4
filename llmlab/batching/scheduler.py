"""Continuous (iteration-level) batching: which sequences run in the next forward step, decided anew every step.

Static batching runs a batch until its longest request ends; a finished row idles and a new request waits for the
whole batch. Iteration-level scheduling (Yu et al. 2022, Orca, https://www.usenix.org/conference/osdi22/presentation/yu)
re-plans after every step instead: a request joins the batch as soon as there is room and leaves it the step it
finishes. This module is that plan, in plain Python (no torch), so it can be tested alone:

* two queues: `waiting` (first come, first served) and `running` (in admission order);
* admission by free KV blocks: a waiting sequence is admitted when the paged cache's block pool
  (`llmlab.cache.block_manager.BlockManager`) can hold all the tokens it has to compute (vLLM's rule, Kwon et al.
  2023, PagedAttention, https://arxiv.org/abs/2309.06180), and fewer than `max_batch` sequences run;
* a token budget per step, filled decode-first: every running sequence in decode gets its one token, then prompts
  are prefilled in chunks of at most `chunk` tokens in the budget left, so a long prompt never stalls the decodes
  (Agrawal et al. 2024, Sarathi-Serve, https://arxiv.org/abs/2403.02310);
* preemption by recompute: when a decode needs a new block and the pool is empty, the most recently admitted
  sequence gives all its blocks back and returns to the front of the waiting queue, keeping the tokens it has
  generated; re-admitted, it prefills prompt + those tokens again and goes on where it was. (The other way, swap,
  copies the blocks to host memory and back.)
* an optional admission delay (`admit_delay`, vLLM's scheduler delay factor): while sequences decode, the waiting
  queue is admitted only once its oldest request has waited `admit_delay` times the last prefill step's time. A step
  with a prefill costs far more than a decode step (its pass is not graph-captured, and it cannot overlap), so
  requests that arrive one at a time are better prefilled together in one pass than each in its own step; the
  price is up to that wait in TTFT.

A `Sequence` is one request's state. `num_computed` counts its tokens whose K/V are in the cache: a sequence with
more than one token left to compute is in prefill (a prompt, or a prompt + output being recomputed); one with a
single token left (the token it sampled last) is in decode.

One step: `plan = scheduler.schedule()`, run the model on the plan, then `scheduler.finish_step(plan, tokens)` with
the token sampled for each sequence of `plan.sampled`. The oldest running sequence is never preempted for a younger
one, and every request fits the pool alone (the engine checks that), so every request finishes.
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from llmlab.cache.block_manager import BlockManager

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
FINISH_REASONS = ("eos", "length", "cancelled", "error")


@dataclass(eq=False)
class Sequence:
    """One request's state as the scheduler sees it.

    seq_id: any hashable id (the request id), unique among live sequences. prompt: token ids. max_new_tokens: the
    most tokens to generate (>= 1). eos_ids: tokens that end it ("eos"). params: the sampling parameters, carried
    for the engine and never read here; origin: who made it (`BatchEngine.make_request` marks its own), never read
    here either. Times are seconds of the scheduler's clock (None until they happen).
    """

    seq_id: Any
    prompt: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    params: Any = None
    origin: Any = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache (reset to 0 by a preemption)
    status: str = WAITING
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    error: BaseException | None = None  # what failed, for finish_reason "error"
    num_preemptions: int = 0
    arrival_time: float | None = None
    admitted_time: float | None = None  # the first admission (queueing delay = admitted - arrival)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt) + len(self.output)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def in_decode(self) -> bool:
        return self.status == RUNNING and self.remaining == 1


@dataclass
class StepPlan:
    """One step's work. decode: sequences that run one token each (the model's (B, 1) batch), oldest first.
    prefill: (sequence, start, n) chunks: tokens start..start+n-1 of the sequence. preempted: sequences sent back
    to the waiting queue while planning. sampled: the sequences whose next token this step produces (every decode,
    and a chunk that reaches the end of its sequence)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens the step runs through the model (what the token budget limits)."""
        return len(self.decode) + sum(n for _, _, n in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


def check_positive_int(name: str, value) -> int:
    """value as an int; TypeError for a value that is not a whole number, ValueError below 1 (naming `name`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r}: give a whole number >= 1")
    if value < 1:
        raise ValueError(f"{name}={value}: must be at least 1")
    return int(value)


def check_admit_delay(value) -> float:
    """value as a float; TypeError for a value that is not a number, ValueError for one that is not finite and >= 0
    (naming admit_delay)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"admit_delay={value!r}: give a number >= 0 (0: admit at once)")
    if not 0 <= value < float("inf"):
        raise ValueError(f"admit_delay={value!r}: give a finite number >= 0 (0: admit at once)")
    return float(value)


class Scheduler:
    """Waiting and running queues over a `BlockManager`; `schedule()` plans one step, `finish_step()` records it.

    Args:
        blocks: the paged cache's block manager (shared with the cache that stores the K/V); sequence ids are
            its sequence ids.
        max_batch: the most sequences running at once (decode rows + sequences in prefill).
        token_budget: the most tokens one step runs (decodes count 1 each, a prefill chunk its length).
        chunk: the most prompt tokens one sequence prefills in one step.
        clock: seconds, for the request times (default `time.perf_counter`).
        admit_delay: while sequences decode, admit waiting requests only once the oldest has waited this many
            times the last prefill step's time (>= 0; 0, the default: at the first step with room).

    Raises:
        TypeError / ValueError: a size that is not a whole number >= 1, an admit_delay that is not a number /
            not a finite number >= 0 (the message names it).

    Not thread-safe: one thread calls it (`llmlab.batching.requests.Server` hands it requests through a queue).
    """

    def __init__(self, blocks: BlockManager, max_batch: int = 16, token_budget: int = 256, chunk: int = 64,
                 clock: Callable[[], float] = time.perf_counter, admit_delay: float = 0.0):
        if not isinstance(blocks, BlockManager):
            raise TypeError(f"blocks={blocks!r}: give a llmlab.cache.block_manager.BlockManager")
        self.blocks = blocks
        self.max_batch = check_positive_int("max_batch", max_batch)
        self.token_budget = check_positive_int("token_budget", token_budget)
        self.chunk = check_positive_int("chunk", chunk)
        self.admit_delay = check_admit_delay(admit_delay)
        self.prefill_s = 0.0  # how long the last step with a prefill chunk took, from schedule() to finish_step()
        self._planned_at = 0.0
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.live: dict[Any, Sequence] = {}  # seq_id -> waiting or running sequence
        self.num_preemptions = 0
        self._plan: StepPlan | None = None  # the plan between schedule() and finish_step()

    # -- requests in and out ----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (at the back of the waiting queue). Sets its arrival time if it has none.

        Raises:
            ValueError: its id is already live, it has no prompt or max_new_tokens < 1, or it is not new (status
                not waiting, tokens already computed or generated).
        """
        if seq.seq_id in self.live:
            raise ValueError(f"seq_id={seq.seq_id!r} is already queued or running: give each request its own id")
        if not seq.prompt or seq.max_new_tokens < 1:
            raise ValueError(f"sequence {seq.seq_id!r}: needs a non-empty prompt and max_new_tokens >= 1")
        if seq.status != WAITING or seq.output or seq.num_computed:
            raise ValueError(f"sequence {seq.seq_id!r} is not new (status {seq.status!r}): add a fresh Sequence")
        if seq.arrival_time is None:
            seq.arrival_time = self.clock()
        self.waiting.append(seq)
        self.live[seq.seq_id] = seq

    def cancel(self, seq_id) -> Sequence:
        """Remove a waiting or running sequence, free its blocks, finish it as "cancelled" and return it.

        Raises:
            KeyError: no live sequence has this id (unknown, or already finished).
            RuntimeError: called between schedule() and finish_step().
        """
        return self.stop(seq_id, "cancelled")

    def stop(self, seq_id, reason: str) -> Sequence:
        """Finish a waiting or running sequence now with `reason` (one of FINISH_REASONS), freeing its blocks: a
        cancel, or an EOS the engine read after the step that made it (`BatchEngine(overlap=True)`).

        Raises:
            KeyError: no live sequence has this id. ValueError: an unknown reason.
            RuntimeError: called between schedule() and finish_step().
        """
        self._check_no_plan("stop")
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason={reason!r}: one of {FINISH_REASONS}")
        if seq_id not in self.live:
            raise KeyError(f"no waiting or running sequence has seq_id={seq_id!r} (unknown, or already finished)")
        seq = self.live[seq_id]
        if seq.status == WAITING:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    def has_work(self) -> bool:
        return bool(self.live)

    # -- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan the next step: decodes first (reserving a block where one is full, preempting the newest running
        sequences when the pool is empty), then prefill chunks of running sequences, then admissions from the
        waiting queue, all within the token budget. An empty plan means there is nothing to run.

        Raises:
            RuntimeError: the previous plan has not been finished (`finish_step` or `abort_step`).
        """
        self._check_no_plan("schedule")
        plan = StepPlan()
        budget = self.token_budget
        self._planned_at = now = self.clock()
        for seq in list(self.running):  # 1. decodes, oldest first
            if budget == 0:
                break
            if seq.status != RUNNING or not seq.in_decode:
                continue  # preempted by an older one in this loop, or still in prefill
            if self._reserve(seq, 1, plan):
                plan.decode.append(seq)
                budget -= 1
        for seq in self.running:  # 2. the next chunk of prompts being prefilled
            if budget == 0:
                break
            if seq.remaining > 1:
                n = min(seq.remaining, self.chunk, budget)
                plan.prefill.append((seq, seq.num_computed, n))
                budget -= n
        if plan.decode and self.waiting and now - self.waiting[0].arrival_time < self.admit_delay * self.prefill_s:
            budget = 0  # 3. admissions wait: more requests may arrive to share their prefill pass (`admit_delay`)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:  # 3. admissions, in order
            seq = self.waiting[0]
            if seq in plan.preempted or not self.blocks.can_allocate(seq.num_tokens):
                break  # first come, first served: no one overtakes the head of the queue
            self.waiting.popleft()
            self.blocks.allocate(seq.seq_id, seq.num_tokens)  # blocks for everything it has to compute
            seq.status = RUNNING
            if seq.admitted_time is None:
                seq.admitted_time = now
            self.running.append(seq)
            n = min(seq.remaining, self.chunk, budget)
            plan.prefill.append((seq, 0, n))
            budget -= n
        plan.sampled = plan.decode + [s for s, start, n in plan.prefill if start + n == s.num_tokens]
        self._plan = plan if plan else None
        return plan

    def finish_step(self, plan: StepPlan, tokens: dict) -> list[Sequence]:
        """Record a step that ran: every planned token is now in the cache, each sequence of `plan.sampled` gets
        its new token from `tokens` ({seq_id: token id}), and those that reach EOS or max_new_tokens finish, free
        their blocks and leave the running queue now. Returns the finished sequences.

        Raises:
            ValueError: `plan` is not the open plan, or `tokens` does not hold exactly the sampled sequences' ids
                (nothing is recorded then).
        """
        if plan is not self._plan and plan:
            raise ValueError("finish_step: this plan is not the one schedule() returned last (or it was finished)")
        expected = {s.seq_id for s in plan.sampled}
        if set(tokens) != expected:
            raise ValueError(f"finish_step: tokens must hold one token for each sampled sequence "
                             f"{sorted(expected, key=repr)}, got ids {sorted(tokens, key=repr)}")
        for seq in plan.decode:
            seq.num_computed += 1
        for seq, _, n in plan.prefill:
            seq.num_computed += n
        finished = []
        now = self.clock()
        if plan.prefill:
            self.prefill_s = now - self._planned_at
        for seq in plan.sampled:
            token = int(tokens[seq.seq_id])
            seq.output.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            reason = "eos" if token in seq.eos_ids else "length" if len(seq.output) >= seq.max_new_tokens else None
            if reason:
                self._finish(seq, reason, now)
                finished.append(seq)
        self._plan = None
        return finished

    def abort_step(self, plan: StepPlan, error: BaseException) -> list[Sequence]:
        """The step failed: finish every sequence of `plan` as "error" (freeing its blocks) and close the plan, so
        the other sequences go on. Returns them."""
        failed = list({id(s): s for s in plan.decode + [s for s, _, _ in plan.prefill]}.values())
        self._plan = None
        for seq in failed:
            seq.error = error
            self._finish(seq, "error")
        return failed

    def undo_step(self, plan: StepPlan) -> None:
        """Forget a plan that did not run (an interrupted step): its sequences keep their state and are planned
        again next step (blocks reserved for it stay reserved; preemptions made while planning stand)."""
        if plan is not self._plan and plan:
            raise ValueError("undo_step: this plan is not the one schedule() returned last (or it was finished)")
        self._plan = None

    # -- internals --------------------------------------------------------------------------------------------
    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Make room in seq's blocks for n more tokens, preempting the newest running sequences while the pool is
        short. False when seq itself had to be preempted."""
        need = seq.num_computed + n - self.blocks.length(seq.seq_id)
        if need <= 0:
            return True
        while not self.blocks.can_append(seq.seq_id, need):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.append(seq.seq_id, need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free all of seq's blocks; it waits at the front of the queue with its output."""
        self.blocks.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed = WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        if seq.status == RUNNING:
            self.blocks.free(seq.seq_id)
            self.running.remove(seq)
        seq.status, seq.finish_reason = FINISHED, reason
        seq.finish_time = self.clock() if now is None else now
        del self.live[seq.seq_id]

    def _check_no_plan(self, what: str) -> None:
        if self._plan is not None:
            raise RuntimeError(f"{what}: a step is planned and not finished; call finish_step or abort_step first")

    # -- occupancy ----------------------------------------------------------------------------------------------
    def occupancy(self) -> dict:
        """Counts now: running and waiting sequences, KV blocks used and free."""
        return {"running": len(self.running), "waiting": len(self.waiting), "blocks_used": self.blocks.num_used,
                "blocks_free": self.blocks.num_free}

    def check(self) -> None:
        """Assert the invariants (for tests): queues and `live` agree, every running sequence (and no other) holds
        blocks, enough for its computed tokens, and the block manager's own invariants hold."""
        self.blocks.check()
        running, waiting = {s.seq_id for s in self.running}, {s.seq_id for s in self.waiting}
        assert not running & waiting, "a sequence is both running and waiting"
        assert running | waiting == set(self.live), "live sequences differ from the queues"
        assert len(self.running) <= self.max_batch, "more running sequences than max_batch"
        assert set(self.blocks.tables) == running, "blocks held by sequences that are not running"
        for s in self.running:
            assert s.status == RUNNING and self.blocks.length(s.seq_id) >= s.num_computed
        for s in self.waiting:
            assert s.status == WAITING and s.num_computed == 0

