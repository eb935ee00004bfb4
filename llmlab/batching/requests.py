"""The request API of continuous batching: submit, stream, cancel, metrics, and a background loop.

    server = Server(llmlab.load(), max_batch=16)        # a BatchEngine inside (llmlab.batching.engine)
    server.start()                                      # the engine loop, in a background thread
    h = server.submit("The list", max_new_tokens=32)    # returns at once: a RequestHandle
    for token in h.stream(): ...                        # tokens as they come
    print(h.result().text, h.metrics.ttft_ms)           # queueing delay, TTFT, TPOT, tokens
    server.stop()                                       # the loop ends; requests still in flight are cancelled

Without `start()` the same calls work in one thread: `run_until_done()`, `h.stream()` and `h.result()` run engine
steps themselves (scripts, tests).

Threads. `submit` and `cancel` check their arguments in the caller's thread, then only append to an inbox (a deque
under a lock); the thread that runs a step takes the whole inbox at the start of it, in order. So the engine is only
ever touched by one thread at a time (a step lock), a request is added exactly once, a cancel never races a step,
and every handle is finished exactly once: with "eos", "length", "cancelled" or "error".

Metrics follow the serving benchmarks' definitions (vLLM's `benchmark_serving`): queueing delay = admitted -
arrival, TTFT = first token - arrival, TPOT = (last token - first token) / (tokens - 1).
"""

from __future__ import annotations

import atexit
import math
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from llmlab.batching.engine import BatchEngine
from llmlab.batching.scheduler import Sequence

OPEN, RUNNING, STOPPED = "open", "running", "stopped"
POLL_S = 0.05  # how often a waiting thread looks again whether the background loop is still there
_RUNNING: "weakref.WeakSet[Server]" = weakref.WeakSet()  # servers whose background loop runs


@atexit.register
def _stop_running_servers() -> None:
    """At interpreter exit, stop the servers a script left running (`Server.stop`). Their loop is a daemon
    thread: killed at exit in the middle of a step inside torch, it aborts the process ("terminate called without
    an active exception") and hides the script's own traceback."""
    for server in list(_RUNNING):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - exiting anyway: a failed stop must not stop the others
            pass


def _ms(start: float | None, end: float | None, per: int = 1) -> float:
    return (end - start) * 1e3 / per if start is not None and end is not None and per > 0 else math.nan


@dataclass(frozen=True)
class RequestMetrics:
    """One request's times (seconds of `time.perf_counter`; None until they happen) and counts.

    queueing_delay_ms: arrival -> first admission; ttft_ms: arrival -> first token; tpot_ms: mean time between
    later tokens (NaN for fewer than two); latency_ms: arrival -> finish. NaN where a time is missing."""

    arrival: float | None
    admitted: float | None
    first_token: float | None
    last_token: float | None
    finish: float | None
    tokens: int
    preemptions: int

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        return cls(seq.arrival_time, seq.admitted_time, seq.first_token_time, seq.last_token_time, seq.finish_time,
                   len(seq.output), seq.num_preemptions)

    @property
    def queueing_delay_ms(self) -> float:
        return _ms(self.arrival, self.admitted)

    @property
    def ttft_ms(self) -> float:
        return _ms(self.arrival, self.first_token)

    @property
    def tpot_ms(self) -> float:
        return _ms(self.first_token, self.last_token, self.tokens - 1)

    @property
    def latency_ms(self) -> float:
        return _ms(self.arrival, self.finish)


@dataclass(frozen=True)
class Completion:
    """A finished request: its prompt and new token ids (EOS included if produced), the text of the new tokens
    (EOS left out; None without a tokenizer), why it ended and its metrics."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: RequestMetrics


class RequestHandle:
    """What `Server.submit` returns: follow one request (`stream`, `result`, `metrics`) or `cancel` it."""

    def __init__(self, server: "Server", seq: Sequence):
        self.request_id = seq.seq_id
        self._server, self._seq = server, seq  # seq.output holds the tokens (appended by the engine's thread)
        self._cond = threading.Condition()
        self._done = False
        self.finish_count = 0  # times the request was finished: 1 once done (checked by the tests)

    # -- called by the thread that runs the engine --------------------------------------------------------------
    def _notify(self) -> None:
        """New tokens are in seq.output: wake the streams."""
        with self._cond:
            self._cond.notify_all()

    def _finish(self) -> None:
        with self._cond:
            self.finish_count += 1
            self._done = True
            self._cond.notify_all()

    # -- the user's side ---------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done

    @property
    def finish_reason(self) -> str | None:
        """None while in flight, then "eos", "length", "cancelled" or "error"."""
        return self._seq.finish_reason if self._done else None

    @property
    def tokens(self) -> list[int]:
        """The tokens generated so far (a copy)."""
        return list(self._seq.output)

    @property
    def metrics(self) -> RequestMetrics:
        """The request's metrics now (times not reached yet are None)."""
        return RequestMetrics.of(self._seq)

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """Yield the request's token ids as they are produced, from the first; ends when the request finishes.

        With the background loop running, waits for the tokens (at most `timeout` seconds in all, then
        TimeoutError); without it, runs engine steps in this thread. Each stream of a handle sees every token."""
        i = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if i < len(self._seq.output):
                    token, drive = self._seq.output[i], False
                elif self._done:
                    return
                elif self._server._state == OPEN:  # no background loop: run the engine here
                    drive = True
                else:  # the loop runs (or stop() is cancelling what is left): wait for it
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {self.request_id}: not finished within {timeout} s")
                    self._cond.wait(POLL_S if left is None else min(left, POLL_S))
                    continue
            if drive:
                self._server._drive(self)
                continue
            i += 1
            yield token

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the request to finish (running steps in this thread when no background loop runs) and return
        its `Completion`.

        Raises:
            TimeoutError: not finished within `timeout` seconds (background loop only).
            RuntimeError: the request failed (finish_reason "error"); the cause is attached.
        """
        for _ in self.stream(timeout):
            pass
        seq = self._seq
        if seq.finish_reason == "error":
            raise RuntimeError(f"request {self.request_id} failed in the engine: {seq.error!r}") from seq.error
        return Completion(self.request_id, list(seq.prompt), self.tokens, self._server._text(self.tokens),
                          seq.finish_reason, self.metrics)

    def cancel(self) -> None:
        """`Server.cancel` of this request."""
        self._server.cancel(self.request_id)

    def __repr__(self) -> str:
        state = self.finish_reason or "in flight"
        return f"RequestHandle(request_id={self.request_id}, {len(self._seq.output)} tokens, {state})"


class Server:
    """Continuous batching behind a request API (module docstring).

    Args:
        llm_or_engine: an `llmlab.LLM` (text prompts need its tokenizer), a `Transformer`, or a `BatchEngine`.
        **engine_args: `BatchEngine`'s (num_blocks, block_size, max_batch, token_budget, chunk, max_seq_len,
            cuda_graphs, overlap, admit_delay, prefill_graphs) when the engine is built here.

    Raises:
        TypeError: engine_args given with a ready BatchEngine. And what `BatchEngine` raises.

    Attributes: engine (the `BatchEngine`), errors (exceptions of failed steps; their requests finished "error").
    """

    def __init__(self, llm_or_engine, **engine_args):
        if isinstance(llm_or_engine, BatchEngine):
            if engine_args:
                raise TypeError(f"engine arguments {sorted(engine_args)} given with a ready BatchEngine: set them "
                                f"when building the engine, or pass the LLM instead")
            self.engine = llm_or_engine
        else:
            self.engine = BatchEngine(llm_or_engine, **engine_args)
        if self.engine.overlap is not None:
            raise ValueError("the engine overlaps its steps (overlap=True): its outputs hold a placeholder until a "
                             "step is read back, which a stream must not see; give overlap=False for a Server")
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()  # guards the state, the inbox and the request tables
        self._step_lock = threading.Lock()  # one engine step at a time, whichever thread runs it
        self._idle = threading.Condition(self._lock)  # notified whenever a request finishes
        self._inbox: deque[tuple[str, object]] = deque()  # ("add", Sequence) / ("cancel", request id), in order
        self._live: dict[int, RequestHandle] = {}  # submitted, not finished
        self._finished: dict[int, str] = {}  # request id -> finish reason
        self._state = OPEN
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._work = threading.Event()  # set by submit / cancel: wakes an idle loop

    # -- requests ----------------------------------------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, stop_at_eos: bool = True) -> RequestHandle:
        """Queue one request and return its handle at once.

        prompt: text (with an LLM that has a tokenizer) or token ids (a list of ints, a 1-D integer tensor).
        max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos: as `LLM.generate`.

        Raises (in this thread, before anything is queued; the requests already in flight are unharmed):
            ValueError: the argument at fault named — an empty prompt, text without a tokenizer, a prompt longer
                than the context or than the engine's max_seq_len with max_new_tokens, max_new_tokens < 1, sampling
                settings out of range, a seed out of range. TypeError: an argument of the wrong type.
            RuntimeError: the server is stopped (`start()` opens it again).
        """
        self._check_open()
        ids = self._encode(prompt)
        seq = self.engine.make_request(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                       seed=seed, stop_at_eos=stop_at_eos)
        seq.arrival_time = self.engine.scheduler.clock()
        with self._lock:
            self._check_open()
            handle = RequestHandle(self, seq)
            self._live[seq.seq_id] = handle
            self._inbox.append(("add", seq))
        self._work.set()
        return handle

    def cancel(self, request_id: int) -> None:
        """Cancel a request in flight: it finishes as "cancelled" at the start of the next step, its stream ends and
        its KV blocks are freed. (A request that finishes on its own before that step keeps its own finish.)

        Raises:
            ValueError: request_id unknown, or that request already finished (the message gives its reason).
        """
        with self._lock:
            if request_id in self._finished:
                raise ValueError(f"request_id={request_id}: that request already finished "
                                 f"({self._finished[request_id]!r}); there is nothing to cancel")
            if isinstance(request_id, bool) or request_id not in self._live:
                raise ValueError(f"request_id={request_id!r}: no request with this id was submitted to this server")
            self._inbox.append(("cancel", request_id))
        self._work.set()

    @property
    def pending(self) -> int:
        """Requests submitted and not finished yet."""
        with self._lock:
            return len(self._live)

    # -- running the engine --------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Take the inbox, then run one engine step and hand its tokens and finishes to the handles. Returns False
        when there was nothing to run. Thread-safe (one step at a time)."""
        with self._step_lock:
            self._take_inbox()
            if not self.engine.has_work():
                return False
            result = self.engine.step()
            with self._lock:
                handles = [self._live[seq_id] for seq_id in result.tokens]
            for handle in handles:
                handle._notify()
            for seq in result.finished:
                self._deliver(seq)
            if result.error is not None:
                self.errors.append(result.error)
            return True

    def run_until_done(self, timeout: float | None = None) -> None:
        """Return once every submitted request has finished: with the background loop running, wait for it (at most
        `timeout` seconds, then TimeoutError); otherwise run the steps in this thread."""
        if self.is_running:
            with self._idle:
                if not self._idle.wait_for(lambda: not self._live, timeout):
                    raise TimeoutError(f"{len(self._live)} requests still in flight after {timeout} s")
            return
        while self.step():
            pass

    @property
    def is_running(self) -> bool:
        """Whether the background loop runs."""
        return self._state == RUNNING

    def start(self) -> "Server":
        """Run the engine loop in a background (daemon) thread; reopens a stopped server. No-op when running. A
        server still running when the interpreter exits is stopped first (its requests cancelled)."""
        with self._lock:
            if self._state == RUNNING:
                return self
            self._state = RUNNING
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="llmlab-batching-loop", daemon=True)
            self._thread.start()
            _RUNNING.add(self)
        return self

    def stop(self) -> None:
        """Stop the background loop (after its current step) and cancel every request still in flight, so no
        handle waits forever. Later submits raise RuntimeError until `start()`."""
        with self._lock:
            if self._state == STOPPED:
                return
            self._state = STOPPED
            thread, self._thread = self._thread, None
            _RUNNING.discard(self)
        if thread is threading.current_thread():
            raise RuntimeError("stop() was called from the engine loop itself; call it from another thread")
        if thread is not None:
            self._stop.set()
            self._work.set()
            thread.join()
        with self._step_lock:
            self._take_inbox()
            for seq_id in list(self.engine.scheduler.live):
                self._deliver(self.engine.cancel(seq_id))

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict:
        """The engine's totals (`BatchEngine.summary`) plus requests in flight and finished."""
        with self._lock:
            return {**self.engine.summary(), "in_flight": len(self._live), "requests_finished": len(self._finished)}

    # -- internals -------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._work.clear()  # before looking at the inbox: a submit after this wakes the wait below
            try:
                busy = self.step()
            except Exception as e:  # noqa: BLE001 - a failure outside the model step: keep the loop alive
                self.errors.append(e)
                busy = False
            if not busy:
                self._work.wait(POLL_S)

    def _drive(self, handle: RequestHandle) -> None:
        """Run one step for a handle waiting without a background loop."""
        if not self.step() and not handle.done and self._state == OPEN:
            raise RuntimeError(f"request {handle.request_id} is not finished but there is nothing to run")

    def _take_inbox(self) -> None:
        """Apply the queued submits and cancels, in order (under the step lock)."""
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "add":
                self.engine.add(item)
            elif item in self.engine.scheduler.live:  # a cancel of a request that has not finished meanwhile
                self._deliver(self.engine.cancel(item))

    def _deliver(self, seq: Sequence) -> None:
        with self._lock:
            handle = self._live.pop(seq.seq_id)
            self._finished[seq.seq_id] = seq.finish_reason
            handle._finish()
            self._idle.notify_all()

    def _check_open(self) -> None:
        if self._state == STOPPED:
            raise RuntimeError("submit: the server is stopped; call server.start() to serve again")

    def _encode(self, prompt):
        """Text -> token ids with the LLM's tokenizer; ids pass through (the engine checks them)."""
        if not isinstance(prompt, str):
            return prompt
        llm = self.engine.llm
        if llm is None or getattr(llm, "tokenizer", None) is None:
            raise ValueError("prompt: text was given but this model has no tokenizer; pass token ids (a list of ints)")
        if not prompt.strip():
            raise ValueError(f"prompt={prompt!r} is empty or only whitespace: give some text to continue")
        return llm.encode(prompt)

    def _text(self, tokens: list[int]) -> str | None:
        llm = self.engine.llm
        if llm is None or getattr(llm, "tokenizer", None) is None:
            return None
        return llm.decode([t for t in tokens if t not in self.engine.eos_ids])

