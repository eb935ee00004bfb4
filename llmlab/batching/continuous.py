"""`generate_continuous`: a list of prompts served by continuous batching, returned as one `Generation`.

What `LLM.generate(prompts, batching="continuous")` runs, and the `+continuous_batching` rung of the ladder: every
prompt is a request of a `llmlab.batching.engine.BatchEngine` (all arriving at once), the engine steps until all are
done, and the result has the shape `generate` gives, so the tour, the dashboard and the bench read it as they read
any other rung:

    token_ids   each request's tokens, in the order of the prompts
    step_ms     the engine's steps (step 0 ends with the first prefill chunks; later steps mix decode rows and
                prefill chunks, so a "step" is not one token of every row as in a static batch)
    extra       "requests": per request its TTFT, queueing delay, TPOT (ms) and preemptions; "engine": the
                engine's totals (`BatchEngine.summary`); "max_batch" and "num_blocks" as run

Greedy outputs equal each prompt's solo output (the engine's tests check it at fp32). With the Triton kernel modules
swapped into the model (`LLM.generate` with the Triton kernels switch), the decode rows run the paged-attention
kernel, from a CUDA graph per batch-size bucket on a GPU (`llmlab.batching.paged_graphs`); otherwise the engine runs
the model eagerly on the gathering view (`PagedBatchView`).
"""

from __future__ import annotations

import numbers
import time

import torch

from llmlab.batching.engine import BatchEngine, model_of
from llmlab.batching.scheduler import check_positive_int
from llmlab.batching.static import check_prompts
from llmlab.generate import Generation, check_seed

__all__ = ["generate_continuous"]


def generate_continuous(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0,
                        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                        eos_token_id=None, on_token=None, max_batch: int | None = None,
                        num_blocks: int | None = None, token_budget: int | None = None,
                        chunk: int | None = None, cuda_graphs: bool | None = None,
                        overlap: bool | None = None) -> Generation:
    """Serve `prompts` (a list of token-id lists, any lengths) by continuous batching; one `Generation`.

    Args:
        model: an `llmlab.LLM` or an `llmlab.model.Transformer`.
        prompts: B prompts of token ids (lists of ints; a single prompt as a list of ints is one request).
        max_new_tokens, temperature, top_k, top_p: as `LLM.generate`, the same for every request.
        seed: request i samples with seed + i, modulo 2**64 (a torch generator's range: a negative seed means
            what torch reads it as, 2**64 + seed); None: unseeded; greedy ignores it.
        eos_token_id: stop a request at this token (None: every request generates max_new_tokens).
        on_token: not supported (requests advance at different steps): must be None.
        max_batch: the most requests running at once (default: all of them, at most 64).
        num_blocks: the KV pool's blocks (default: room for max_batch requests of the longest prompt +
            max_new_tokens). A smaller pool makes the engine preempt and recompute.
        token_budget: the most tokens per step (default: max(256, max_batch) on a CPU; 4096 on a GPU, where a
            prefill pass costs little more per token than a decode step's weight reads).
        chunk: the most prompt tokens one request prefills per step (default 64 on a CPU, 512 on a GPU).
        cuda_graphs: as `BatchEngine` (with the Triton kernel modules swapped into `model`, the decode step is
            captured per batch-size bucket; None: on a CUDA device).
        overlap: as `BatchEngine`: launch each greedy decode step before reading the last one back (None: where
            the decode step is graph-captured). The tokens are the same either way.

    Raises:
        ValueError / TypeError: as `BatchEngine` and its `make_request` (each names the field), on_token given.
    """
    llm_or_model, model = model, model_of(model, "model")
    if on_token is not None:
        raise ValueError("on_token: continuous batching advances each request at its own step; stream tokens with "
                         "llmlab.batching.requests.Server instead, or leave on_token out")
    if isinstance(prompts, torch.Tensor):  # first: a tensor's truth value is ambiguous
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts: give at least one prompt")
    context = model.config.max_seq_len
    # ids, max_new_tokens and each prompt's length checked against the context before the pool is sized from them
    prompts = check_prompts(prompts, max_new_tokens, context, model.config.vocab_size, pad_id=0)
    longest = max(len(p) for p in prompts) + int(max_new_tokens)
    max_batch = min(len(prompts), 64) if max_batch is None else check_positive_int("max_batch", max_batch)
    block_size = 16
    need = -(-longest // block_size)  # the blocks of the longest request
    whole = isinstance(num_blocks, numbers.Integral) and not isinstance(num_blocks, bool)
    if whole and 1 <= num_blocks < need:
        raise ValueError(f"num_blocks={num_blocks}: {num_blocks} block(s) of {block_size} tokens cannot hold the "
                         f"longest request (prompt + max_new_tokens = {longest} tokens): give num_blocks >= {need}, "
                         f"or shorter prompts or fewer max_new_tokens")
    gpu = next(model.parameters()).device.type == "cuda"
    engine = BatchEngine(llm_or_model, num_blocks=num_blocks, block_size=block_size, max_batch=max_batch,
                         token_budget=max(4096 if gpu else 256, max_batch) if token_budget is None else token_budget,
                         chunk=(512 if gpu else 64) if chunk is None else chunk,
                         max_seq_len=min(max(longest, 2), context),
                         cuda_graphs=cuda_graphs, overlap=overlap)
    eos = eos_token_id is not None
    if eos:
        engine.eos_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    check_seed(seed)  # the seed given, before each request's seed + i wraps into the generator's range
    seqs = [engine.make_request(p, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=None if seed is None else (int(seed) + i) % 2**64, stop_at_eos=eos)
            for i, p in enumerate(prompts)]  # every request checked before any is queued
    start = time.perf_counter()
    for s in seqs:
        s.arrival_time = start
        engine.add(s)
    step_ms = []
    while engine.has_work():
        t = time.perf_counter()
        in_flight = engine.overlap is not None and engine.overlap.in_flight is not None
        result = engine.step()
        if result.error is not None:
            raise result.error
        if result.stats is None and not in_flight:  # nothing ran and nothing was read back: cannot happen while
            raise RuntimeError("continuous batching made no progress")  # requests wait (one fits the pool alone)
        step_ms.append((time.perf_counter() - t) * 1e3)  # a call that only read back an overlapped step counts too
    param = next(model.parameters())
    reasons = {s.finish_reason for s in seqs}
    requests = [{"ttft_ms": 1e3 * (s.first_token_time - s.arrival_time),
                 "queueing_ms": 1e3 * (s.admitted_time - s.arrival_time),
                 "tpot_ms": (1e3 * (s.finish_time - s.first_token_time) / (len(s.output) - 1)
                             if len(s.output) > 1 else None),
                 "preemptions": s.num_preemptions, "finish_reason": s.finish_reason} for s in seqs]
    return Generation(token_ids=[list(s.output) for s in seqs], prompt_len=max(len(p) for p in prompts),
                      step_ms=step_ms, finish_reason="eos" if reasons == {"eos"} else "length", use_cache=True,
                      device=str(param.device), dtype=str(param.dtype).removeprefix("torch."),
                      extra={"requests": requests, "engine": engine.summary(), "max_batch": max_batch,
                             "num_blocks": engine.pool.num_blocks})
