"""Generation with the system-overhead fixes: static KV cache, CUDA graphs, torch.compile, no host sync per token.

`llmlab.generate.generate` is the eager reference: every step launches each kernel from Python, reads a position
on the host (its `KVCache`), and copies the new token to the host (`token.tolist()`) — so the CPU waits for the
GPU to finish every token before it can launch the next one, and the GPU then waits for the CPU's launches.
`generate_fast` removes these costs one switch at a time and returns the same `Generation`:

* mode "static": the decode step on a static KV cache (`llmlab.cache.static_cache`), run eagerly — the baseline that
  the next modes speed up, and the path the CPU tests use;
* mode "graphs": that step replayed from CUDA graphs, one per batch-size bucket (`llmlab.runtime.cuda_graphs`);
* mode "compile": the step through `torch.compile` (on CUDA with mode="reduce-overhead", i.e. Inductor's own
  CUDA graphs); "compile+graphs": Inductor's fused kernels captured in this package's graphs;
* gpu_sampling=True: tokens are sampled on the GPU (`llmlab.sampling.sample`, which never reads the device),
  written to a device buffer, and copied to the host only every `eos_check_every` steps — and the host looks at
  them one step late: the copy is queued, then the NEXT step is queued, and only then does the host wait for the
  copy. Waiting right away would drain the GPU's queue at every read, and the GPU would sit idle while the host
  checks the tokens and launches the next step. Serving engines do the same with their whole CPU side: SGLang's
  zero-overhead scheduler (https://lmsys.org/blog/2024-12-04-sglang-v0-4/#zero-overhead-batch-scheduler),
  TensorRT-LLM's overlap scheduler (https://nvidia.github.io/TensorRT-LLM/latest/features/overlap-scheduler.html),
  vLLM's async output processing (https://github.com/vllm-project/vllm/pull/7049);
* prefill_graph=True (graph modes): the prompt is padded to a length bucket and its prefill replayed from a CUDA
  graph too (`GraphDecoder.prefill(..., bucketed=True)`): a short prompt's prefill is as launch-bound as a decode
  step, so without it the time to the first token is the eager launch time.

The EOS trade-off. The host learns that a sequence ended only when it reads the tokens. Reading every step costs
one synchronization per token: the CPU cannot queue step t+1 until step t is done, so the GPU idles while the CPU
launches. Reading every N steps, one step late, lets the CPU run up to N steps ahead and never lets the GPU's queue
run dry, at the price of up to N wasted steps after the last sequence ends (`Generation.extra["wasted_steps"]`;
their time is left out of `step_ms`). `on_token` callbacks are still made for every step, in order — in bursts of
N; a stop they ask for takes effect at the next read.

Step times come from CUDA events (`llmlab.measure.timing.StepTimer`), recorded between steps without synchronizing.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch

from llmlab.runtime.cuda_graphs import MODES, GraphDecoder, RunnerCache
from llmlab.generate import (Generation, check_flags, check_on_token, check_seed, make_generator, prepare_prompt,
                             to_device)
from llmlab.sampling import check_sampling_args, sample, warn_greedy_filters
from llmlab.measure.timing import StepTimer, sync


class _Collector:
    """Host-side bookkeeping, as in `generate`: append each row's tokens until its EOS, stop when every row has
    ended or on_token asks to. Fed blocks of steps read from the device buffer."""

    def __init__(self, batch: int, eos: set[int], on_token):
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.done = [False] * batch
        self.eos, self.on_token = eos, on_token
        self.steps = 0  # steps consumed (= kept)
        self.finish = "length"

    def feed(self, block: list[list[int]]) -> bool:
        """block[b][j]: row b's token at step self.steps + j. Returns True when generation should stop."""
        for j in range(len(block[0])):
            step, tokens = self.steps, [row[j] for row in block]
            self.steps += 1
            for b, t in enumerate(tokens):
                if not self.done[b]:
                    self.out[b].append(t)
                    self.done[b] = t in self.eos
            stop = self.on_token is not None and self.on_token(step, tokens)  # every step, the last one too
            if all(self.done):
                self.finish = "eos"
                return True
            if stop:
                self.finish = "stopped"
                return True
        return False


class _TokenReader:
    """Copies blocks of generated tokens from the device buffer `out` (N steps, B rows) to the host. Step-major: a
    block of steps is one contiguous run of memory.

    `request(a, b)` queues the copy of steps a..b-1; `take()` returns them as lists (block[row][j]), waiting for the
    copy if it is still running. late=True on a GPU: the copy goes into page-locked memory, non_blocking, with an
    event after it, so the host can queue more work before it waits — the caller takes the block one step later.
    (The block must be contiguous on both sides: a strided device-to-host copy goes through a pageable temporary,
    and a copy into pageable memory makes the host wait for the GPU's whole queue at `request`.)
    late=False: `take` reads at once (`.tolist()` waits for the GPU). On a CPU there is nothing to copy: `take`
    reads the buffer, whenever the caller takes it (late or not)."""

    def __init__(self, out: torch.Tensor, late: bool):
        self.out, self.late = out, late
        self.async_copy = late and out.is_cuda
        self._host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True) if self.async_copy else None
        self._block = None  # (start, stop, event or None) of the requested, not yet taken block
        self.reads = 0

    def pending(self) -> bool:
        return self._block is not None

    def request(self, start: int, stop: int) -> None:
        event = None
        if self.async_copy:
            self._host[start:stop].copy_(self.out[start:stop], non_blocking=True)  # contiguous rows: truly async
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.out.device))
        self._block = (start, stop, event)
        self.reads += 1

    def take(self) -> list[list[int]]:
        start, stop, event = self._block
        self._block = None
        if event is None:
            return self.out[start:stop].T.tolist()
        event.synchronize()  # only this copy: the step queued after it keeps the GPU busy meanwhile
        return self._host[start:stop].T.tolist()


@torch.no_grad()
def generate_fast(
    model,
    prompt_ids: torch.Tensor | list[int] | list[list[int]],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    on_token: Callable[[int, list[int]], bool | None] | None = None,
    *,
    mode: str = "graphs",
    gpu_sampling: bool = True,
    eos_check_every: int = 16,
    pin_memory: bool = False,
    prefill_graph: bool = False,
    max_batch: int | None = None,
    runner: GraphDecoder | None = None,
    runners: RunnerCache | None = None,
    kernels=None,
) -> Generation:
    """Generate like `llmlab.generate.generate` (same arguments, same `Generation`), through a static-cache runner.

    Args:
        model, prompt_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, on_token: as `generate`.
            Greedy and seeded sampled tokens equal `generate`'s (same logits up to rounding, same random draws).
        mode: "static" (eager), "graphs" (CUDA only), "compile", "compile+graphs" (CUDA only) — see the module doc.
        gpu_sampling: True: the host reads tokens only every `eos_check_every` steps (and at the end), each read
            waited for after the next step is queued. False: every step, at once, like `generate` (one
            synchronization per token).
        eos_check_every: steps between host reads with gpu_sampling (>= 1).
        pin_memory: copy the prompt through pinned memory, non_blocking (CUDA only; no effect on a CPU).
        prefill_graph: replay the prefill from a CUDA graph of its padded length bucket (modes "graphs" and
            "compile+graphs"; in mode "static" the same padded prefill runs eagerly, for tests).
        max_batch: build the runner for at least this many rows (its buckets), e.g. to capture once for a sweep.
        runner: decode on this `GraphDecoder` (its mode wins over `mode`, and it runs its own `kernels`).
        runners: take the runner from this `RunnerCache` (`RunnerCache.runner_for`: reused while it fits, built or
            grown when it does not), e.g. `LLM.runners`. Neither runner nor runners: a runner built for this call.
        kernels: the Triton kernels' decode step (`llmlab.kernels.KernelDecodeStep(model)`, `LLM.kernels`): the
            runner runs its forward and greedy pick instead of the model's (see `GraphDecoder`); None: the model's.

    Returns:
        A `Generation`; `extra` holds decode_mode, bucket, n_graphs, compile_mode, host_reads, wasted_steps,
        wasted_ms, prefill_length (the padded length of a bucketed prefill, else None), n_prefill_graphs (the
        runner's, so far). A call that builds a runner (the first one on a `runners` cache, one that needs a
        bigger runner, any call with neither runner nor runners) captures/compiles first, and the first call that
        meets a prefill bucket captures its graph first; that time is not in `step_ms`.

    Warns:
        UserWarning: as `generate` (top_k or top_p given at temperature 0, where they have no effect).

    Raises:
        ValueError: as `generate` (empty prompt, lengths beyond the context, ids outside the vocabulary, bad
            sampling settings, a seed out of range), an unknown mode, graphs on a CPU model, eos_check_every < 1,
            max_batch < 1, a runner too small, for another model or with other kernels, prefill_graph in mode
            "compile" (its runner captures nothing).
        TypeError: as `generate` (ids, max_new_tokens or seed of the wrong type, an on_token that is not
            callable), gpu_sampling / pin_memory / prefill_graph not a bool, eos_check_every not a whole number.
            All checked on the host before anything is launched.
    """
    check_sampling_args(temperature, top_k, top_p)
    check_flags(gpu_sampling=gpu_sampling, pin_memory=pin_memory, prefill_graph=prefill_graph)
    check_seed(seed)
    check_on_token(on_token)
    warn_greedy_filters(temperature, top_k, top_p)
    if runner is not None:
        mode = runner.mode
    if mode not in MODES:
        raise ValueError(f"unknown decode mode {mode!r}; use one of {', '.join(MODES)}")
    if prefill_graph and mode == "compile":
        raise ValueError("prefill_graph replays the prefill from this package's CUDA graphs, which mode 'compile' "
                         "does not capture (Inductor captures its own): use mode 'graphs' or 'compile+graphs'")
    if isinstance(eos_check_every, bool) or not isinstance(eos_check_every, numbers.Integral):
        raise TypeError(f"eos_check_every={eos_check_every!r}: give a whole number of steps (>= 1)")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, numbers.Integral)
                                  or max_batch < 1):
        raise ValueError(f"max_batch={max_batch!r}: give a whole number of rows >= 1, or None")
    if eos_check_every < 1:
        raise ValueError(f"eos_check_every={eos_check_every}: read the tokens at least every 1 step")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if "graphs" in mode and device.type != "cuda":
        raise ValueError(f"mode {mode!r} needs a model on a CUDA GPU (this one is on {device}); use 'static'")
    ids = prepare_prompt(model, prompt_ids, max_new_tokens)
    max_new_tokens = int(max_new_tokens)  # a numpy or other Integral count, checked above; the cache wants an int
    B, T = ids.shape
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    generator = make_generator(seed, device)

    if runner is None:
        runners = RunnerCache() if runners is None else runners
        runner = runners.runner_for(model, mode, B, T + max_new_tokens, max_batch, kernels)  # may capture/compile
    elif runner.model is not model:
        raise ValueError(f"the runner ({runner}) was built for another model; build one for this model "
                         f"(llmlab.runtime.cuda_graphs.GraphDecoder) or leave runner=None")
    elif kernels is not None and runner.kernels is not kernels:
        raise ValueError(f"the runner ({runner}) runs other kernels than kernels={kernels!r}: leave kernels out "
                         f"(the runner's own run) or build the runner with them")
    elif B > runner.max_batch or T + max_new_tokens > runner.max_seq_len:
        raise ValueError(f"the runner ({runner}) is too small: {B} rows (it has {runner.max_batch}) of "
                         f"{T} + {max_new_tokens} tokens (its cache holds {runner.max_seq_len}); build a larger "
                         f"one or leave runner=None")
    ids = to_device(ids, device, pin_memory)
    every = eos_check_every if gpu_sampling else 1
    out = torch.empty(max_new_tokens, B, dtype=torch.long, device=device)  # the tokens, on the device (step-major)
    collect = _Collector(B, eos, on_token)
    reader = _TokenReader(out, late=gpu_sampling)
    prefill_length = runner.prefill_length(B, T) if prefill_graph else None
    if prefill_graph:
        runner.capture_prefill(ids)  # now, untimed, as the decode graphs were

    sync(device)
    timer = StepTimer(device)
    timer.start()
    steps_run = 0
    for step in range(max_new_tokens):
        if step == 0:
            logits = runner.prefill(ids, bucketed=prefill_graph)  # (B, V)
            token = sample(logits, temperature, top_k, top_p, generator)  # (B,)
        else:
            logits, greedy = runner.step()  # (B, V), (B,): the step's outputs, valid until the next step
            token = greedy if temperature == 0 else sample(logits, temperature, top_k, top_p, generator)
        out[step].copy_(token)
        timer.mark()
        steps_run = step + 1
        if reader.pending() and collect.feed(reader.take()):  # the last read's tokens, now that this step is queued
            break
        if steps_run % every == 0 or steps_run == max_new_tokens:
            reader.request(collect.steps, steps_run)
            if not reader.late and collect.feed(reader.take()):  # read at once: the host waits for the GPU here
                break
        if steps_run < max_new_tokens:
            if step == 0:
                runner.start(token, T)  # the first generated token sits at position T
            else:
                runner.advance(token)
    else:
        if reader.pending():
            collect.feed(reader.take())

    step_ms = timer.step_ms()
    kept = collect.steps
    return Generation(
        token_ids=collect.out, prompt_len=T, step_ms=step_ms[:kept], finish_reason=collect.finish, use_cache=True,
        device=str(device), dtype=str(dtype).removeprefix("torch."),
        extra={"decode_mode": mode, "bucket": runner.bucket(B), "n_graphs": len(runner.graphs),
               "compile_mode": runner.compile_mode, "gpu_sampling": gpu_sampling, "eos_check_every": every,
               "host_reads": reader.reads, "wasted_steps": steps_run - kept, "wasted_ms": sum(step_ms[kept:]),
               "prefill_length": prefill_length, "n_prefill_graphs": len(runner.prefill_graphs)})


def decode_mode(cuda_graphs: bool, torch_compile: bool) -> str:
    """The generate_fast mode for a pair of switches: neither -> "static", graphs -> "graphs", compile ->
    "compile", both -> "compile+graphs"."""
    return {(False, False): "static", (True, False): "graphs", (False, True): "compile",
            (True, True): "compile+graphs"}[(bool(cuda_graphs), bool(torch_compile))]
