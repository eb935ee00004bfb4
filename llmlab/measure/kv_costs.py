"""What a KV cache costs, measured with real caches: the memory each layout reserves for a mixed-length workload
(`measured_waste`, against the formula in `llmlab.cache.sizing.waste`) and the decode step's time as the context
grows (`decode_latency_vs_context`: each step reads the whole cache), and the TTFT of a conversation with and without
prefix reuse (`reuse_ttft`). Lab 03 plots them. The timings are repeated, and each claim drawn from them
(`context_trend`, `reuse_verdict`) is made only when the difference is larger than the spread of the repeats
(`llmlab.measure.timing.compare_ms`): on a busy machine the verdict says the result is too noisy to conclude instead.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from llmlab.cache.kv_cache import KVCache
from llmlab.cache.paged_cache import PagedKVCache
from llmlab.cache.prefix_reuse import compare_ttft
from llmlab.cache.sizing import _check_lengths, allocated_bytes, bytes_per_token, cache_bytes
from llmlab.config import ModelConfig
from llmlab.measure.timing import (MAX_SPREAD, TOO_NOISY, Comparison, compare_ms, machine_load_note,
                                   summarize_ms, sync)


def measured_waste(config: ModelConfig, lengths: list[int], max_seq_len: int, block_size: int = 16,
                   dtype: torch.dtype = torch.float32, device="cpu") -> dict:
    """Allocate both layouts for the workload and measure bytes: a `KVCache` of batch len(lengths) x max_seq_len,
    and a `PagedKVCache` whose block manager holds every sequence at its length (pool sized to exactly what the
    workload needs). Returns bytes reserved and used for both (bytes, from the tensors actually allocated)."""
    _check_lengths(lengths, max_seq_len, block_size)
    per_tok = bytes_per_token(config, dtype)
    used = sum(lengths) * per_tok
    contiguous = KVCache(config, len(lengths), max_seq_len, dtype, device)
    contiguous_bytes = allocated_bytes(contiguous)
    del contiguous
    nblocks = sum(-(-n // block_size) for n in lengths)
    paged = PagedKVCache(config, len(lengths), max_seq_len, dtype, device, block_size=block_size, num_blocks=nblocks)
    for i, n in enumerate(lengths):
        paged.blocks.allocate(i, n)
    paged_bytes = allocated_bytes(paged)
    assert paged.blocks.num_free == 0
    return {"sequences": len(lengths), "used_bytes": used, "bytes_per_token": per_tok,
            "contiguous_bytes": contiguous_bytes, "contiguous_waste": 1 - used / contiguous_bytes,
            "paged_bytes": paged_bytes, "paged_waste": 1 - used / paged_bytes, "block_size": block_size,
            "max_seq_len": max_seq_len}


@torch.inference_mode()
def decode_latency_vs_context(model, contexts: list[int], steps: int = 8, batch: int = 1,
                              max_spread: float = MAX_SPREAD,
                              clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Decode-step time (ms) with `context` tokens already cached, for each context length, with how far to trust it.

    One `KVCache` per context is filled with random K/V (the values do not change the time) and a single-token step
    at position `context` is timed `steps` times per context. The contexts take turns (round 1 times every context
    once, then round 2, ...), so a burst of load from another program slows all contexts alike instead of making
    one of them look slow; a first untimed round pays the one-time costs (allocator, thread pools) that would
    otherwise land on the first context. Each repeat rewrites the same position, so every repeat does the same work.

    Returns one row per context: context, ms (the median step), spread, verdict ("steady" or "too noisy to conclude:
    rerun", `llmlab.measure.timing.summarize_ms`), repeats (the `Repeats`), kv_mb_read (MB of K/V a step reads,
    growing linearly with the context). `context_trend(rows)` says whether the step time rises. clock: seconds
    (time.perf_counter; a test passes a fake one).

    Raises:
        ValueError: steps not a whole number >= 2 (the spread needs repeats), or an empty `contexts`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r}: time at least 2 decode steps per context (a whole number; 5 or more on "
                         f"a busy machine), so the spread of the repeats can be judged")
    contexts = list(contexts)
    if not contexts:
        raise ValueError("contexts is empty: give the numbers of cached tokens to time, e.g. [16, 256, 900]")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    caches = []
    for ctx in contexts:
        cache = KVCache(model.config, batch, ctx + 1, dtype, device)
        for t in (*cache.k, *cache.v):
            t.normal_()
        caches.append(cache)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times: list[list[float]] = [[] for _ in contexts]
    for round_ in range(steps + 1):  # round 0 is the warm-up: not kept
        for i, (ctx, cache) in enumerate(zip(contexts, caches)):
            cache.length = ctx  # the step below writes position ctx and attends to ctx + 1 tokens, every repeat
            pos = torch.tensor([ctx], device=device)
            sync(device)
            t0 = clock()
            model(token, pos, kv_cache=cache, last_only=True)
            sync(device)
            elapsed_ms = (clock() - t0) * 1e3
            if round_:
                times[i].append(elapsed_ms)
    rows = []
    for ctx, samples in zip(contexts, times):
        rep = summarize_ms(samples, max_spread)
        rows.append({"context": ctx, "ms": rep.median_ms, "spread": rep.spread, "verdict": rep.verdict,
                     "repeats": rep, "kv_mb_read": cache_bytes(model.config, ctx, batch, dtype) / 1e6})
    return rows


def context_trend(rows: list[dict]) -> Comparison:
    """Does the decode step time rise with the context? Judged on `decode_latency_vs_context`'s rows.

    verdict:
      * "rises": the longest context's step is slower than the shortest's beyond the noise (`compare_ms`: the
        middle halves of their repeats do not overlap), and no longer context is faster than the one before it
        beyond the noise;
      * TOO_NOISY: the curve zig-zags (a longer context clearly faster than the one before it: the load changed
        between them, not the work), or the shortest and longest overlap while some repeats are scattered;
      * "does not rise": steady repeats and no clear difference between the shortest and longest context (on a
        tiny model at short contexts the cache may be too small a part of the step to show).
    ratio: the longest context's median over the shortest's; why: the evidence.

    Raises:
        ValueError: fewer than 2 rows, or rows not in increasing context order.
    """
    if len(rows) < 2:
        raise ValueError(f"context_trend needs at least 2 contexts, got {len(rows)} row(s)")
    ctxs = [r["context"] for r in rows]
    if ctxs != sorted(set(ctxs)):
        raise ValueError(f"contexts {ctxs}: pass the rows in increasing context order, each context once")
    first, last = rows[0], rows[-1]
    drops = [(a, b) for a, b in zip(rows, rows[1:]) if compare_ms(b["repeats"], a["repeats"]).verdict == "faster"]
    if drops:
        where = ", ".join(f"{a['context']} -> {b['context']} ({a['ms']:.2f} -> {b['ms']:.2f} ms)" for a, b in drops)
        load = machine_load_note()
        return Comparison(last["ms"] / first["ms"], TOO_NOISY,
                          f"the step time fell where the context grew ({where}), beyond the repeats' spread: the "
                          f"machine's load changed between the contexts" + (f"; {load}" if load else ""))
    c = compare_ms(last["repeats"], first["repeats"], f"context {last['context']}", f"context {first['context']}")
    verdict = {"slower": "rises", TOO_NOISY: TOO_NOISY}.get(c.verdict, "does not rise")
    return Comparison(c.ratio, verdict, c.why)


def reuse_ttft(model, messages: list[list[int]], max_new_tokens: int = 4, rounds: int = 5, block_size: int = 16,
               max_spread: float = MAX_SPREAD) -> list[dict]:
    """TTFT of every turn of a conversation with and without prefix reuse, repeated, with how far to trust it.

    Runs `llmlab.cache.prefix_reuse.compare_ttft` (the three modes 'none', 'contiguous', 'paged', replies checked
    identical) once untimed as a warm-up and then `rounds` times with one repeat each, so the modes take turns and
    a burst of load slows all of them alike. Returns compare_ttft's rows, one per (turn, mode), with ttft_ms the
    median of the rounds (ms) and three more keys: spread, verdict and repeats (`summarize_ms`). `reuse_verdict`
    compares two modes.

    Raises:
        ValueError: rounds not a whole number >= 2; and as compare_ttft.
        AssertionError: a mode replied differently (compare_ttft's check).
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2:
        raise ValueError(f"rounds={rounds!r}: run the conversation at least 2 times (a whole number; 5 or more on a "
                         f"busy machine), so the spread of the repeats can be judged")
    compare_ttft(model, messages, max_new_tokens, repeats=1, block_size=block_size)  # warm-up
    runs = [compare_ttft(model, messages, max_new_tokens, repeats=1, block_size=block_size) for _ in range(rounds)]
    rows = []
    for i, row in enumerate(runs[0]):
        rep = summarize_ms([run[i]["ttft_ms"] for run in runs], max_spread)
        rows.append({**row, "ttft_ms": rep.median_ms, "spread": rep.spread, "verdict": rep.verdict, "repeats": rep})
    return rows


def reuse_verdict(rows: list[dict], turn: int | None = None, slow_mode: str = "none",
                  fast_mode: str = "contiguous") -> Comparison:
    """Is `fast_mode`'s TTFT at `turn` (default: the last) below `slow_mode`'s beyond the noise? `compare_ms` of the
    two modes' repeats in `reuse_ttft`'s rows: verdict "slower" means slow_mode is slower, i.e. reuse pays off.

    Raises:
        ValueError: no row for that turn and mode.
    """
    turn = max(r["turn"] for r in rows) if turn is None else turn
    found = {r["mode"]: r for r in rows if r["turn"] == turn}
    for mode in (slow_mode, fast_mode):
        if mode not in found:
            raise ValueError(f"no row for turn {turn}, mode {mode!r}: the rows hold turns "
                             f"{sorted({r['turn'] for r in rows})} and modes {sorted({r['mode'] for r in rows})}")
    return compare_ms(found[slow_mode]["repeats"], found[fast_mode]["repeats"], f"turn {turn} without reuse"
                      if slow_mode == "none" else f"turn {turn} {slow_mode}", f"turn {turn} {fast_mode}")
