"""Overlapped decode steps: the host plans and launches step t+1 while the GPU still runs step t.

A synchronous engine step is: plan (host), launch (host), wait for the GPU, read the new tokens back, record them
(host). The GPU idles while the host plans and records, the host idles while the GPU runs; when a step's GPU time
is a millisecond or two, the host's share is a large part of the step. Reading step t's tokens AFTER launching
step t+1 hides it: step t+1's input tokens are step t's outputs, which never leave the device (the paged decode
step reads them from its `last` buffer, `PagedDecodeBatch.input_ids`), and the host only needs their values to
append them to the outputs, one step later. vLLM calls this async scheduling; SGLang, its overlap scheduler.

What the host does not know while a step runs is its tokens: each sequence of the launched step holds a
placeholder (`PENDING`) in its output until the step is read back (`resolve`). The scheduler plans the next step
as if every sequence advanced by one token, which is true except where a token turns out to be EOS: that
sequence then finishes one step late, its extra token is cut off, and the K/V written for it go back to the pool
with its blocks (the GPU runs steps in order, so no later step sees them). A sequence that reaches max_new_tokens
finishes when it is launched, as in the synchronous engine; its last token is reported when read back.

Only decode steps whose every row is greedy overlap: a prefill pass and a sampled row read their tokens on the
host (`BatchEngine` waits for the step in flight before it runs one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmlab.batching.scheduler import FINISHED, Scheduler, Sequence, StepPlan

PENDING = -1  # a token the GPU has made and the host has not read yet


@dataclass
class InFlight:
    """A decode step launched and not read back: rows [(sequence, index of its PENDING token)], the row of each
    sequence id (the next step's source rows), the pinned host tensor its tokens are copied into and the event
    that marks the copy done (None on a CPU), and the sequences it finished by length."""

    rows: list[tuple[Sequence, int]]
    row_of: dict
    host: torch.Tensor
    done: torch.cuda.Event | None
    finished: list[Sequence] = field(default_factory=list)


class OverlappedDecode:
    """Launch greedy decode steps without waiting for them, and read each one back after the next is launched.

    Args:
        decode_step: the engine's `PagedDecodeGraphs` (its `step(rows, sources)` returns device tensors).
        scheduler: the engine's `Scheduler`.
        max_rows: the most rows of a step.
    """

    def __init__(self, decode_step, scheduler: Scheduler, max_rows: int):
        self.decode_step, self.scheduler = decode_step, scheduler
        device = decode_step.batch.values.device
        pin = device.type == "cuda"
        # two host buffers: step t's tokens are read while step t+1's are copied into the other
        self._host = [torch.empty(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0
        self.in_flight: InFlight | None = None

    @staticmethod
    def can_run(plan: StepPlan) -> bool:
        """Whether the plan is a step this class runs: decode rows only, every one greedy."""
        return bool(plan.decode) and not plan.prefill and all(s.params.temperature == 0 for s in plan.decode)

    def launch(self, plan: StepPlan, block_table) -> list[Sequence]:
        """Launch the plan's decode step, record a PENDING token for each row (`Scheduler.finish_step`) and keep
        the step in flight. Returns the sequences it finished by length (reported once read back: `resolve`).

        The step before must have been launched here and not read back yet, or read back already: a row whose
        input token is PENDING takes it from the previous step's row on the device.

        block_table: seq_id -> its block table (a list of block ids).
        """
        prev = self.in_flight
        rows, sources = [], []
        for s in plan.decode:
            p = s.num_computed  # the row's input is token p: the last one it has
            token = s.prompt[p] if p < len(s.prompt) else s.output[p - len(s.prompt)]
            if token == PENDING:  # made by the step in flight, still on the device
                sources.append(prev.row_of[s.seq_id])
                token = 0
            else:
                sources.append(-1)
            rows.append((token, p, block_table(s.seq_id)))
        _, picked = self.decode_step.step(rows, sources)
        host, done = self._host[self._turn][:len(rows)], self._events[self._turn]
        self._turn ^= 1
        host.copy_(picked, non_blocking=done is not None)
        if done is not None:
            done.record()
        finished = self.scheduler.finish_step(plan, {s.seq_id: PENDING for s in plan.decode})
        self.in_flight = InFlight([(s, len(s.output) - 1) for s in plan.decode],
                                  {s.seq_id: i for i, s in enumerate(plan.decode)}, host, done, finished)
        return finished

    def resolve(self, flight: InFlight, later: InFlight | None, now: float) -> tuple[dict, list[Sequence]]:
        """Read a launched step back: write its tokens over the PENDING ones and finish the sequences that made
        EOS (cutting off a token of `later`, the step launched after it, if any). Returns ({seq_id: token}, the
        sequences finished: by EOS now, or by length at launch)."""
        if flight.done is not None:
            flight.done.synchronize()
        picked = flight.host.tolist()
        tokens, finished = {}, []
        for (seq, i), token in zip(flight.rows, picked):
            if i >= len(seq.output) or seq.output[i] != PENDING:
                continue  # cut off: an EOS before it was read back first
            seq.output[i] = token
            if seq.finish_reason in ("cancelled", "error"):
                continue  # it ended while this step ran: its last token is kept, not reported, its reason stays
            tokens[seq.seq_id] = token
            seq.last_token_time = now
            if token in seq.eos_ids:
                del seq.output[i + 1:]  # a PENDING token of the later step
                if seq.status != FINISHED:
                    self.scheduler.stop(seq.seq_id, "eos")  # frees its blocks
                seq.finish_reason, seq.finish_time = "eos", now
                finished.append(seq)
                if later is not None and seq in later.finished:
                    later.finished.remove(seq)  # it finished here, not at the later step's max_new_tokens
        for seq in flight.finished:
            if seq not in finished:
                seq.finish_time = now  # its last token is known now
                finished.append(seq)
        return tokens, finished
