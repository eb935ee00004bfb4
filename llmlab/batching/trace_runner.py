"""Serving an arrival trace in real time, three ways: one request at a time, static batches, continuous batching.

A trace (`llmlab.batching.workload.make_trace`) says when each request arrives and how long its prompt and answer
are. `serve_trace` plays it against the wall clock: a request is handed to the server only once the clock has
passed its arrival time, and the server works as its mode says:

    "one_at_a_time"  first come, first served, one request after another (batch 1): no batching at all;
    "static"         request-level batching: a batcher collects requests until `max_batch` are queued or the
                     oldest has waited `static_wait_s`, then runs them as ONE left-padded batch to the end
                     (`llmlab.batching.static.generate_static`). Requests that arrive meanwhile wait for the whole
                     batch, however short they are (head-of-line blocking), and a batch returns its answers when
                     its longest row is done (the short rows' finish is the batch's end);
    "continuous"     iteration-level batching (`llmlab.batching.engine.BatchEngine` on a paged KV pool): the
                     server loop takes the requests that have arrived before every step, so a request joins at the
                     next step and leaves the step it is done (Yu et al. 2022, Orca,
                     https://www.usenix.org/conference/osdi22/presentation/yu).

All three run the model as it is given (eagerly with the PyTorch modules; the continuous engine runs its paged
decode step where the Triton kernel modules are swapped in), greedy, on the same requests. Every
request produces exactly its trace's `max_new_tokens` (EOS ignored, as serving benchmarks do with vLLM's
`--ignore-eos`), so every mode does the same useful work. The times of each request (arrival, admission, first
token, finish; seconds from the start of the run) feed `llmlab.measure.serving.summarize`.

`throughput_latency_curve` repeats this at rising arrival rates: throughput follows the offered rate until the
server saturates, then stalls while queueing, and TTFT with it, grows without bound. `save_curve` / `load_curve`
(`llmlab.batching.curve_file`) keep a curve with the device, versions and commit; `latest_curve` finds the newest
recorded one in data/bench/.
On a GPU: `python -m llmlab.batching.trace_runner --preset llama-3.2-1b` records a curve and a batch sweep.
"""

from __future__ import annotations

import argparse
import math
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from llmlab.batching import curve_file
from llmlab.batching.curve_file import CURVE_FORMAT, CURVE_KEYS, latest_curve, list_curves, load_curve, save_curve
from llmlab.batching.engine import BatchEngine, model_of
from llmlab.batching.scheduler import check_admit_delay, check_positive_int
from llmlab.batching.static import PaddingStats, generate_static
from llmlab.batching.workload import TraceRequest, make_trace, trace_prompts
from llmlab.envinfo import device_name
from llmlab.measure.serving import RequestTimes, curve_point, summarize
from llmlab.runtime.cuda_graphs import RunnerCache

__all__ = ["MODES", "TraceRun", "serve_trace", "curve_row", "throughput_latency_curve", "save_curve", "load_curve",
           "list_curves", "latest_curve", "CURVE_FORMAT", "CURVE_KEYS", "GPU_ENGINE_ARGS"]

MODES = ("continuous", "static", "one_at_a_time")
# the continuous engine on a GPU: whole chat prompts (chunks of up to 512 tokens, 4096 tokens a step) in one pass
# rather than BatchEngine's CPU-sized defaults (64-token chunks, 256 tokens a step), which spread a prompt over
# several passes; and its prefill passes at fixed shapes replayed from CUDA graphs (prefill_graphs). An eager pass
# is paced by the host launching its kernels, whatever its length: at 128 requests/s on Llama-3.2-1B's shape the
# eager passes took about half of the wall time (docs/results.md)
GPU_ENGINE_ARGS = {"token_budget": 4096, "chunk": 512, "prefill_graphs": True}


@dataclass
class TraceRun:
    """One trace served in one mode.

    requests: each request's `RequestTimes` in trace order (seconds from the start of the run; tokens = its new
        tokens). outputs: each request's new token ids, in trace order. wall_s: first arrival to last finish (s).
    occupancy: (t_s, used_blocks, total_blocks) of the KV pool after every step (continuous mode; empty otherwise).
    batches: static modes, one dict per batch: start_s, end_s, ids (trace indices), padding (`PaddingStats` with
        each row's own new tokens); continuous mode, one dict per step: t_s, ms, rows (sequences that ran in the
        step), running and waiting (after it), decode_rows, prefill_tokens.
    summary: `summarize`'s metrics + mode, max_batch, mean_batch (requests per static batch, or sequences per
        continuous step), useful_share (static modes: useful token slots / slots computed, from `PaddingStats`;
        None in continuous mode, which computes no pads).
    engine_summary: continuous mode, `BatchEngine.summary()` at the end (preemptions, prefill tokens, ...).
    """

    mode: str
    requests: list[RequestTimes]
    outputs: list[list[int]]
    wall_s: float
    occupancy: list[tuple[float, int, int]] = field(default_factory=list)
    batches: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    engine_summary: dict | None = None


# -- checks ----------------------------------------------------------------------------------------------------------


def _check_trace(trace, prompts, context: int) -> None:
    if not isinstance(trace, (list, tuple)) or not trace:
        raise ValueError("trace is empty: give at least one workload.TraceRequest (workload.make_trace)")
    if not all(isinstance(r, TraceRequest) for r in trace):
        raise TypeError("trace must hold workload.TraceRequest items (workload.make_trace makes them)")
    if not isinstance(prompts, (list, tuple)) or len(prompts) != len(trace):
        n = len(prompts) if isinstance(prompts, (list, tuple)) else type(prompts).__name__
        raise ValueError(f"prompts: {n} given for {len(trace)} requests; give one list of token ids per request "
                         f"(workload.trace_prompts(trace, vocab_size))")
    for i, (r, p) in enumerate(zip(trace, prompts)):
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
        if not (r.arrival_s >= 0 and math.isfinite(r.arrival_s)):
            raise ValueError(f"trace[{i}].arrival_s={r.arrival_s!r}: arrivals are finite seconds >= 0")
        if r.max_new_tokens < 1:
            raise ValueError(f"trace[{i}].max_new_tokens={r.max_new_tokens}: each request needs >= 1 new token")
        if len(p) + r.max_new_tokens > context:
            raise ValueError(f"request {i}: prompt ({len(p)} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds "
                             f"the model's context of {context} tokens; make the trace with max_context={context}")


# -- the three servers -------------------------------------------------------------------------------------------------


def serve_trace(llm, trace: list[TraceRequest], prompts: list[list[int]], mode: str = "continuous",
                max_batch: int = 16, static_wait_s: float = 0.05, pad_id: int = 0,
                clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                on_step: Callable[[float, int, int], None] | None = None, static_mode: str = "static",
                **engine_args) -> TraceRun:
    """Serve `trace` in real time in one `mode` (module docstring) and return every request's times and tokens.

    Args:
        llm: an `llmlab.LLM` or a `llmlab.model.Transformer` (eager, greedy; its device and dtype are used).
        trace: the requests (arrival_s: seconds from the start; prompt and output lengths); prompts[i] the token
            ids of trace[i] (`workload.trace_prompts`).
        mode: "continuous", "static" or "one_at_a_time".
        max_batch: the most requests in one forward batch (static) or running at once (continuous).
        static_wait_s: how long the static batcher holds its oldest request waiting for more (s, >= 0).
        pad_id: the pad token of static batches.
        clock, sleep: the wall clock (s) and how to wait (tests may pass their own).
        on_step: continuous mode: on_step(t_s, used_blocks, total_blocks) after every step (e.g. a live plot).
        static_mode: the decode runner of the static and one-at-a-time modes (`generate_static`'s mode: "static"
            eager, "graphs" CUDA graphs on an `LLM`'s runners, with its Triton kernels where switched on).
        **engine_args: `BatchEngine`'s num_blocks, block_size, token_budget, chunk, max_seq_len, overlap,
            admit_delay, prefill_graphs (continuous only; max_seq_len defaults to the trace's longest request, so
            the default pool holds max_batch of them; overlap defaults to None: on where the decode step is
            graph-captured).

    Returns:
        A `TraceRun`.

    Raises:
        ValueError: an unknown mode, an empty trace, prompts that do not match it, a request beyond the context,
            static_wait_s < 0; each message names the argument. TypeError: engine_args in a static mode, or
            arguments of the wrong type. RuntimeError: a continuous step failed (its error attached).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    model = model_of(llm, "llm")
    max_batch = check_positive_int("max_batch", max_batch)
    if isinstance(static_wait_s, bool) or not isinstance(static_wait_s, numbers.Real) or not static_wait_s >= 0:
        raise ValueError(f"static_wait_s={static_wait_s!r}: give the batcher's wait in seconds (>= 0)")
    _check_trace(trace, prompts, model.config.max_seq_len)
    if mode != "continuous" and engine_args:
        raise TypeError(f"engine arguments {sorted(engine_args)} only apply to mode='continuous'")
    if mode == "continuous":
        run = _serve_continuous(llm, trace, prompts, max_batch, clock, sleep, on_step, engine_args)
    else:
        batch, wait = (1, 0.0) if mode == "one_at_a_time" else (max_batch, float(static_wait_s))
        run = _serve_static(llm, trace, prompts, batch, wait, int(pad_id), clock, sleep, static_mode)
        run.mode = mode
    run.summary = {**summarize(run.requests, run.wall_s), "mode": mode, "max_batch": max_batch,
                   "mean_batch": _mean_batch(run), "useful_share": _useful_share(run)}
    return run


def _order(trace) -> list[int]:
    return sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, i))


def _wall_s(requests: list[RequestTimes]) -> float:
    end = max(r.finished_s for r in requests)
    return max(end - min(r.arrival_s for r in requests), 1e-9)


def _serve_static(llm, trace, prompts, max_batch, wait_s, pad_id, clock, sleep, mode="static") -> TraceRun:
    """The static batcher: FIFO queue; a batch goes when max_batch are queued or the oldest waited wait_s, or when
    the next request would make the batch's longest prompt + longest answer exceed the model's context."""
    model = model_of(llm, "llm")
    context = model.config.max_seq_len
    runners = None
    if mode != "static":
        # one runner cache for the trace (the LLM's own), its runner built at the largest batch this trace can form
        # before the clock starts: a runner outgrown mid-trace would be rebuilt and captured again on the clock
        # (`RunnerCache.runner_for`), as the continuous engine's graphs are captured before its clock starts
        runners = RunnerCache() if llm is model else llm.runners
        longest = min(context, max(len(p) for p in prompts) + max(r.max_new_tokens for r in trace))
        runners.runner_for(model, mode, min(max_batch, len(trace)), longest,
                           kernels=None if llm is model else llm.kernels)
    order = _order(trace)
    times: list[RequestTimes | None] = [None] * len(trace)
    outputs: list[list[int] | None] = [None] * len(trace)
    batches = []
    queue: deque[int] = deque()
    nxt = 0
    t0 = clock()
    while nxt < len(order) or queue:
        now = clock() - t0
        while nxt < len(order) and trace[order[nxt]].arrival_s <= now:
            queue.append(order[nxt])
            nxt += 1
        if not queue:
            sleep(max(0.0, trace[order[nxt]].arrival_s - now))
            continue
        deadline = trace[queue[0]].arrival_s + wait_s
        if len(queue) < max_batch and now < deadline:  # not full, and the oldest may wait longer
            wake = deadline if nxt == len(order) else min(deadline, trace[order[nxt]].arrival_s)
            sleep(max(0.0, wake - now))
            continue
        ids = [queue.popleft()]
        while queue and len(ids) < max_batch and _fits(ids + [queue[0]], trace, prompts, context):
            ids.append(queue.popleft())
        start = clock() - t0
        first: list[float] = []

        def on_token(step, _tokens, first=first):
            if step == 0:
                first.append(clock() - t0)

        g = generate_static(llm, [list(prompts[i]) for i in ids], max(trace[i].max_new_tokens for i in ids),
                            on_token=on_token, pad_id=pad_id, mode=mode, runners=runners)
        end = clock() - t0
        news = []
        for row, i in enumerate(ids):
            outputs[i] = g.token_ids[row][:trace[i].max_new_tokens]
            news.append(len(outputs[i]))
            times[i] = RequestTimes(trace[i].arrival_s, start, first[0], end, len(outputs[i]))
        padding = PaddingStats(tuple(len(prompts[i]) for i in ids), tuple(news), tuple(g.step_ms))
        batches.append({"start_s": start, "end_s": end, "ids": ids, "padding": padding})
    return TraceRun("static", times, outputs, _wall_s(times), batches=batches)


def _fits(ids: list[int], trace, prompts, context: int) -> bool:
    """Whether one padded batch of these requests fits the context: its longest prompt + its longest answer (every
    row is padded to the one and decodes for the other)."""
    return max(len(prompts[i]) for i in ids) + max(trace[i].max_new_tokens for i in ids) <= context


def _serve_continuous(llm, trace, prompts, max_batch, clock, sleep, on_step, engine_args) -> TraceRun:
    """The continuous server loop: take the arrived requests, run one engine step, repeat."""
    longest = max(len(p) + r.max_new_tokens for p, r in zip(prompts, trace))
    engine_args = {"max_seq_len": max(2, longest), "overlap": None, **engine_args}  # overlap where graph-captured
    engine = BatchEngine(llm, max_batch=max_batch, clock=clock, **engine_args)
    seqs = [engine.make_request(list(p), r.max_new_tokens, stop_at_eos=False) for p, r in zip(prompts, trace)]
    total = engine.pool.num_blocks
    order = _order(trace)
    occupancy, steps = [], []
    nxt = 0
    t0 = clock()
    while nxt < len(order) or engine.has_work():
        now = clock() - t0
        while nxt < len(order) and trace[order[nxt]].arrival_s <= now:
            i = order[nxt]
            seqs[i].arrival_time = t0 + trace[i].arrival_s  # when it arrived, not when the loop noticed it
            engine.add(seqs[i])
            nxt += 1
        if not engine.has_work():
            sleep(max(0.0, trace[order[nxt]].arrival_s - now))
            continue
        result = engine.step()
        if result.error is not None:
            raise RuntimeError(f"a continuous-batching step failed: {result.error!r}") from result.error
        s = result.stats
        if s is not None:
            t = clock() - t0
            occupancy.append((t, s.blocks_used, total))
            steps.append({"t_s": t, "ms": s.ms, "rows": s.decode_rows + s.prefill_chunks, "running": s.running,
                          "waiting": s.waiting, "decode_rows": s.decode_rows, "prefill_tokens": s.prefill_tokens})
            if on_step is not None:
                on_step(t, s.blocks_used, total)

    def rel(x):
        return None if x is None else x - t0

    times = [RequestTimes(trace[i].arrival_s, rel(s.admitted_time), rel(s.first_token_time), rel(s.finish_time),
                          len(s.output)) for i, s in enumerate(seqs)]
    return TraceRun("continuous", times, [list(s.output) for s in seqs], _wall_s(times), occupancy, steps,
                    engine_summary=engine.summary())


def _mean_batch(run: TraceRun) -> float:
    sizes = [b["rows"] if run.mode == "continuous" else len(b["ids"]) for b in run.batches]
    return sum(sizes) / len(sizes) if sizes else math.nan


def _useful_share(run: TraceRun) -> float | None:
    if run.mode == "continuous":
        return None
    pads = [b["padding"] for b in run.batches]
    useful = sum(p.prompt_useful + p.decode_useful for p in pads)
    return useful / sum(p.prompt_slots + p.decode_slots for p in pads)


# -- the throughput-latency curve ------------------------------------------------------------------------------------


def curve_row(rate: float, run: TraceRun) -> dict:
    """One point of the curve from a served trace: `serving.curve_point(rate, ...)` + mode, mean_batch, max_batch
    and n (requests). `throughput_latency_curve` makes its rows with it; a run served by hand at a rate joins a
    curve the same way."""
    return {**curve_point(rate, run.requests, run.wall_s), "mode": run.mode, "mean_batch": run.summary["mean_batch"],
            "max_batch": run.summary["max_batch"], "n": len(run.requests)}


def throughput_latency_curve(llm, rates, n: int = 24, seed: int = 0, modes=("continuous", "static"),
                             mix: dict | None = None, max_context: int | None = None, max_batch: int = 16,
                             static_wait_s: float = 0.05, log: Callable[[str], None] | None = None,
                             runs: dict | None = None, static_mode: str = "static", **engine_args) -> list[dict]:
    """Serve the same kind of trace at each arrival rate in each mode: one curve point per (rate, mode).

    Args:
        llm: as `serve_trace`. rates: arrival rates (requests/s; math.inf: all at once), each > 0.
        n, seed, mix, max_context: the trace (`workload.make_trace`; the same seed keeps the lengths and prompts
            at every rate, only the arrival times change); max_context defaults to the model's context.
        modes: which of `MODES` to serve each trace in. max_batch, static_wait_s, static_mode, **engine_args:
            `serve_trace`'s.
        log: called with one line per point (e.g. print). runs: a dict that, if given, receives every `TraceRun`
            under (rate, mode).

    Returns:
        One dict per rate and mode (rates in the order given): `serving.curve_point`'s fields (rate, tokens/s,
        requests/s, queueing / TTFT / TPOT at p50 / p90 / p99 in ms, ...) + mode, mean_batch, max_batch, n.

    Raises:
        ValueError: no rates, a rate not > 0, an unknown mode, and what `serve_trace` raises.
    """
    rates = list(rates)
    if not rates or any(not (isinstance(r, numbers.Real) and r > 0) for r in rates):
        raise ValueError(f"rates={rates!r}: give one or more arrival rates > 0 (requests/s; math.inf: all at once)")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes={modes!r}: choose from {', '.join(MODES)}")
    config = model_of(llm, "llm").config
    rows = []
    for rate in rates:
        trace = make_trace(n, rate, mix=mix, seed=seed, max_context=max_context or config.max_seq_len)
        prompts = trace_prompts(trace, config.vocab_size, seed=seed)
        for mode in modes:
            extra = engine_args if mode == "continuous" else {}
            run = serve_trace(llm, trace, prompts, mode, max_batch=max_batch, static_wait_s=static_wait_s,
                              static_mode=static_mode, **extra)
            if runs is not None:
                runs[(rate, mode)] = run
            row = curve_row(rate, run)
            rows.append(row)
            if log is not None:
                log(f"rate {rate:>6.3g}/s {mode:<14} {row['tokens_per_s']:8.1f} tokens/s  TTFT p50 "
                    f"{row['ttft_ms_p50']:8.0f} ms  p90 {row['ttft_ms_p90']:8.0f} ms  mean batch "
                    f"{row['mean_batch']:5.1f}  ({row['wall_s']:.1f} s)")
    return rows


# -- recording on a GPU ------------------------------------------------------------------------------------------------


def _numbers(ap: argparse.ArgumentParser, flag: str, text: str, kind) -> list:
    """'4,16,64' -> [4.0, 16.0, 64.0] (kind float) or whole numbers (kind int), each > 0; an argparse error naming
    the flag and the bad item otherwise."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            value = kind(item)
        except ValueError:
            value = None
        if value is None or not value > 0 or value == float("inf"):
            ap.error(f"{flag} {text!r}: {item!r} is not a {'whole ' if kind is int else ''}number > 0; give them "
                     f"comma-separated, e.g. {flag} 4,16")
        out.append(value)
    return out


def main(argv: list[str] | None = None) -> int:
    """Record a batch sweep and a throughput-latency curve on this machine's GPU into data/bench/."""
    from llmlab.cli import _positive_int
    from llmlab.config import ModelConfig
    from llmlab.engine import LLM
    from llmlab.measure.batch_sweep import batch_sweep
    from llmlab.measure.bench_file import bench_filename

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--preset", default="llama-3.2-1b", help="a preset shape with random weights (default %(default)s)")
    ap.add_argument("--rates", default="2,4,8,16,32,64", help="arrival rates, requests/s (default %(default)s)")
    ap.add_argument("-n", type=_positive_int, default=128, help="requests per trace (default %(default)s)")
    ap.add_argument("--max-context", type=_positive_int, default=1024, help="longest request (default %(default)s)")
    ap.add_argument("--max-batch", type=_positive_int, default=32, help="default %(default)s")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256",
                    help="batch sweep sizes (default %(default)s; '': no sweep)")
    ap.add_argument("--modes", default="continuous,static", help="servers to run at each rate (default %(default)s)")
    ap.add_argument("--admit-delay", type=float, default=0.0,
                    help="the continuous server's admission delay, as a multiple of the last prefill step's time "
                         "(BatchEngine's admit_delay; default %(default)s: admit at once)")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="the continuous server's prefill passes at fixed shapes, replayed from CUDA graphs "
                         "(BatchEngine's prefill_graphs; default: on; --no-prefill-graphs: eager passes of any "
                         "shape)")
    ap.add_argument("--out", type=Path, default=curve_file.DEFAULT_DIR)
    args = ap.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes!r}: choose one or more of {', '.join(MODES)}, comma-separated")
    try:
        check_admit_delay(args.admit_delay)
    except (TypeError, ValueError) as e:
        ap.error(f"--{e}")
    # every flag checked here, before the minutes of work a bad one would otherwise end
    rates, batches = _numbers(ap, "--rates", args.rates, float), _numbers(ap, "--batches", args.batches, int)
    if not rates:
        ap.error("--rates: give at least one arrival rate, e.g. --rates 4,16")
    try:
        ModelConfig.from_preset(args.preset)
    except (TypeError, ValueError) as e:
        ap.error(f"--preset: {e}")
    if not torch.cuda.is_available():
        ap.error("this records a GPU curve: no CUDA device here")
    from llmlab.switches import apply_switches

    llm = LLM.from_preset(args.preset, device="cuda", dtype="bf16")
    fast = {"cuda_graphs": True, "triton_kernels": True}
    # the sweep on the fast path too: an eager step is paced by the host at any batch size and shows no roofline
    sweep = batch_sweep(llm, batches, prompt_len=128, new_tokens=64, settings=fast) if batches else []
    # both servers on the fast path: static batches on CUDA graphs + the Triton kernels, the continuous engine's
    # decode rows on its graph-captured paged step and its prefill passes replayed from graphs too (GPU_ENGINE_ARGS)
    llm, _ = apply_switches(llm, fast)
    engine = {**GPU_ENGINE_ARGS, "admit_delay": args.admit_delay, "prefill_graphs": args.prefill_graphs}
    settings = {"n": args.n, "max_context": args.max_context, "max_batch": args.max_batch, "static_wait_s": 0.05,
                "mix": {"chat": 1.0}, "seed": 0, "dtype": "bf16",
                "runtime": "CUDA graphs + Triton kernels (static: graphs per batch size; continuous: paged step)",
                **engine, "batch_sweep_runtime": "CUDA graphs + Triton kernels"}
    rows = throughput_latency_curve(llm, rates, n=args.n, max_context=args.max_context, max_batch=args.max_batch,
                                    modes=modes, log=print, static_mode="graphs", **engine)
    device = device_name(llm.device)
    path = save_curve(rows, args.out / bench_filename(device, "serving", args.preset), model={"id": args.preset},
                      settings=settings, device=device, extra={"batch_sweep": sweep})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
