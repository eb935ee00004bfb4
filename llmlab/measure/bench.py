"""`llmlab bench`: named workloads x a model x the optimization ladder, against peers and the roofline.

One run = one workload (`llmlab.measure.workloads`) on one model, every ladder step that can run here
(`llmlab.ladder`), Hugging Face `generate` on the SAME weights (`llmlab.measure.peers`: eager, and with its static
cache, which transformers compiles on a GPU), and the bandwidth ceiling. Each row is timed by `timed` (one untimed
warm-up run of the whole workload, then the timed runs, with the NVML sampler on a GPU) and summarised by
`llmlab.measure.bench_metrics` (tokens/s, TTFT, TPOT, MBU, MFU: the definitions are there). It prints a table
(`llmlab.measure.bench_table`) and writes one JSON file per run into `data/bench/` (`llmlab.measure.bench_file`:
the format, and reading the files back).

The ladder's rungs without the batching switch run the `batch` workload as 4 groups of 16 equal-length prompts,
one group after the other (the JSON `notes` say so); `+static_batching` runs the 64 prompts as ONE left-padded batch
(`llmlab.batching.static`), as Hugging Face does, and `+continuous_batching` serves them by continuous batching
(`llmlab.batching.engine`), where each request's TTFT is its own and a step mixes decode rows and prefill chunks;
`+one_at_a_time`, the baseline without batching, serves each request alone, one after the other. The roofline
row bounds every schedule: all the requests decoded in one batch, each step reading the weights once.

Prompts are random token ids (seeded), the same for every row. Greedy decoding; EOS is ignored, so every request
generates exactly its new tokens.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from llmlab.config import PRESETS
from llmlab.engine import LLM
from llmlab.envinfo import device_name
from llmlab.kernels import step_tuning
from llmlab.ladder import LadderStep, ResolvedStep, available_steps, get_step, weight_bytes_per_param
from llmlab.measure import roofline
from llmlab.measure.bench_file import DEFAULT_OUT, bench_document, bench_filename, peaks_record, result_row, save_bench
from llmlab.measure.bench_metrics import AS_LOADED, Call, Run, decode_work, median_metrics, run_metrics
from llmlab.measure.bench_table import (converted_weights_mem_note, format_table, mbu_above_roofline_note, peaks_line,
                                       roofline_mfu_note, row_line)
from llmlab.measure.model_bytes import (allocated_weight_bytes, bytes_per_param_read, describe_weights, loaded_weights,
                                       step_weight_bytes)
from llmlab.measure.peers import (TORCHAO_PEERS, close_hf_continuous, hf_peer_model, peers_that_run, run_hf,
                                  run_hf_continuous, select_peers, torchao_peer_model, torchao_version,
                                  transformers_version, why_not_run)
from llmlab.measure.timing import sync
from llmlab.measure.workloads import get_workload, group_by_length, make_prompts
from llmlab.quant import is_quantized
from llmlab.switches import apply_switches, describe

# Other modules' names that callers outside llmlab.measure still reach through this module: `llmlab bench`
# (llmlab/cli.py) imports WORKLOADS; the README names llmlab.measure.bench.validate_bench, list_bench, latest_ladder.
from llmlab.measure.bench_file import latest_ladder, list_bench, validate_bench  # noqa: F401
from llmlab.measure.workloads import WORKLOADS  # noqa: F401


def load_bench_model(model: str = "default", device=None, dtype=None) -> tuple[LLM, str, bool]:
    """(llm, model id for the JSON, random_weights) for 'default', a preset name (random weights) or a folder.

    Raises:
        ValueError: a name that is neither 'default', a preset, nor an existing folder (the message lists presets).
    """
    if model in PRESETS:
        llm = LLM.from_preset(model, device=device, dtype=dtype)
        return llm, model, True
    if model == "default" or Path(model).expanduser().is_dir():
        llm = LLM.load(model, device=device, dtype=dtype)
        return llm, llm.name, False
    raise ValueError(f"unknown model {model!r}: give 'default', a preset ({', '.join(sorted(PRESETS))}) or a "
                     f"model folder")


def run_llmlab(llm: LLM, kwargs: dict, prompts: list[list[int]], new_tokens: int) -> Run:
    """Run a workload on the llmlab engine: one `generate` call per group of equal-length prompts, or, with the
    batching switch (`kwargs["batching"]`: "static", "continuous" or "one_at_a_time"), one call for every request."""
    run = Run()
    groups = [list(range(len(prompts)))] if kwargs.get("batching") else group_by_length(prompts)
    if kwargs.get("batching") == "one_at_a_time":  # one call per request, so each call's work is batch 1
        groups, kwargs = [[i] for i in range(len(prompts))], {k: v for k, v in kwargs.items() if k != "batching"}
    for idx in groups:
        g = llm.generate([prompts[i] for i in idx], max_new_tokens=new_tokens, stop_at_eos=False, **kwargs)
        requests = g.extra.get("requests")  # continuous batching / one at a time: each request's own TTFT
        ttft = [r["ttft_ms"] for r in requests] if requests else None
        run.calls.append(Call(idx, [len(prompts[i]) for i in idx], list(g.step_ms), g.token_ids, ttft))
    return run


def _weight_bpp(step: LadderStep, llm: LLM, cfg) -> float:
    """Bytes per weight a row's decode step reads, for its MBU: a quantized model's from its tensors (packed values
    + scales + the float layers it keeps, e.g. lm_head: `bytes_per_param_read`), whether the rung quantized it or
    it was loaded quantized, else the rung's weight format."""
    if is_quantized(llm.model):
        return bytes_per_param_read(llm.model, cfg, llm.dtype)
    return weight_bytes_per_param(step, llm.dtype)


def _weights(step: LadderStep, llm: LLM) -> str:
    """A row's `weights` field: the rung's own format ("int8", "int4"), else the weights as loaded: a quantized
    folder's scheme, or the float dtype (`loaded_weights`)."""
    return step.weights or loaded_weights(llm.model, llm.dtype)


def _weight_sizes(llm: LLM) -> dict:
    """The row's weights in GB: read per decode step (computed from the tensors) and allocated (measured)."""
    return {"weights_read_GB": step_weight_bytes(llm.model) / 1e9,
            "weights_allocated_GB": allocated_weight_bytes(llm.model) / 1e9}


def _free(device: torch.device) -> None:
    """Drop what a row left behind (its converted model, compiled graphs) before the next row is timed."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# NVML's GPU-Util is the share of a past window (1/6 s to 1 s, depending on the GPU) in which a kernel ran, and the
# GPM metrics average between two readings: a recording much shorter than that reads mostly the idle time around it
# (the default model's fastest rungs, ~25 ms a run, read 0% GPU-Util). So sampled rows run until it has watched this
# long — at most MAX_SAMPLED_RUNS runs.
MIN_SAMPLED_S = 1.0
MAX_SAMPLED_RUNS = 100


def timed(fn: Callable[[], Run], device: torch.device, repeats: int, sample: bool, backend=None,
          interval_s: float = 0.1, min_sampled_s: float = MIN_SAMPLED_S) -> tuple[list[Run], dict, float]:
    """One untimed warm-up call of `fn` (the whole workload), then `repeats` timed calls of `fn` with the NVML
    sampler running (when `sample`); while sampling, more timed calls until the timed calls have taken
    `min_sampled_s` seconds in all (or MAX_SAMPLED_RUNS calls), so the sampler's window is full of them.

    The warm-up covers the whole workload: the compiled and graph-captured rows are sized by it (warmup_s reports
    its time), and the eager ones pay one-off costs the first time a decode step meets a new KV length (on the H200
    the eager KV-cache decode's first 256-token run took 52 ms per step, the next ones 13 ms), which a shorter
    warm-up would leave in the timed runs of whichever row met those lengths first.

    Returns (runs, {"gpu_util", "sm_active", "peak_mem_GB"}, warm-up seconds): gpu_util and sm_active are the
    means (as fractions) of the sampler's gpu_util_pct and sm_active_pct over the timed calls, None when not
    sampled or not reported. backend: a telemetry backend for the sampler (tests); default NVML.
    """
    t0 = time.perf_counter()
    fn()
    sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sampler = None
    if sample:
        from llmlab.telemetry.nvml_sampler import Sampler

        try:
            sampler = Sampler(device_index=device.index or 0, interval_s=interval_s, backend=backend,
                              raise_on_error=False).start()
        except Exception:  # NVML present but not usable: the columns stay null
            sampler = None
    try:
        t_runs = time.perf_counter()
        runs = [fn() for _ in range(repeats)]
        sync(device)
        while (sampler is not None and time.perf_counter() - t_runs < min_sampled_s
               and len(runs) < MAX_SAMPLED_RUNS):
            runs.append(fn())
            sync(device)
    finally:
        if sampler is not None:  # a run shorter than one interval still gets one reading
            sampler.stop(raise_error=False, final_reading=True)
    hw = {"gpu_util": None, "sm_active": None, "peak_mem_GB": None}
    if device.type == "cuda":
        hw["peak_mem_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    if sampler is not None:
        cols = sampler.columns()
        for key, series in (("gpu_util", "gpu_util_pct"), ("sm_active", "sm_active_pct")):
            vals = [v for v in cols.get(series, []) if v is not None and math.isfinite(v)]
            hw[key] = statistics.fmean(vals) / 100 if vals else None
    return runs, hw, warmup_s


class NothingToRun(ValueError):
    """None of the requested ladder steps can run here and no peer was asked for: a run would measure nothing."""


def plan_steps(llm: LLM, steps: list[str] | None, peers, n_requests=(1,)
               ) -> tuple[list[ResolvedStep], list[tuple[LadderStep, str]]]:
    """`available_steps(llm, steps)`: (runnable rungs, [(skipped rung, reason)]), checked before anything is measured.
    peers: as `run_bench`; n_requests: the requests of each workload to run (which peer rows apply depends on it).

    Raises:
        ValueError: an unknown step or peer name (the message lists them).
        NothingToRun: none of the steps can run here and no peer row applies (`peers_that_run`); the message gives
            each step's reason, the steps that can run here, and the fix.
    """
    runnable, skipped = available_steps(llm, steps)
    wanted, weights = select_peers(peers), {r.step.weights for r in runnable}
    if runnable or any(peers_that_run(wanted, n, weights) for n in n_requests):
        return runnable, skipped
    here = [r.name for r in available_steps(llm)[0]]
    raise NothingToRun("none of the requested ladder steps can run here, so there is nothing to measure: "
                       + "; ".join(f"{s.name}: {why}" for s, why in skipped)
                       + f". Run them where they can (a CUDA GPU for the GPU-only steps), or choose steps that run "
                         f"here ({', '.join(here) or 'none'}; 'all' runs every one that can), or add the Hugging "
                         f"Face peers (--peers)")


def run_bench(workload: str = "chat", model: str = "default", steps: list[str] | None = None, peers=True,
              out: str | os.PathLike | None = DEFAULT_OUT, quick: bool = False, repeats: int | None = None,
              device=None, dtype=None, time_budget_s: float | None = None, llm: LLM | None = None,
              peaks_cache=None, measured_peaks=None, print_fn=print) -> dict:
    """Benchmark one workload on one model: the ladder steps, the peers, the roofline. Returns the document.

    Args:
        workload: a key of WORKLOADS ('chat', 'batch', 'long').
        model: 'default', a preset name (random weights; bf16 on CUDA) or a model folder.
        steps: ladder step names (None / ['all']: every rung that can run here; the rest are listed in
            "skipped" with the reason).
        peers: also run the peer rows: Hugging Face generate, eager ('hf_eager') and static cache ('hf_static'),
            its continuous batching ('hf_continuous', workloads of several requests) and torchao's weight-only
            layers ('torchao_int8' / 'torchao_int4', beside the quantized rungs). True or "all": every one that
            applies; False: none; a comma-separated string or a list: those (`llmlab.measure.peers.select_peers`).
        out: folder for the JSON file (None: write nothing). The file is rewritten after every row, so an
            interrupted run keeps what it measured ("complete": false).
        quick: `Workload.quick_new_tokens` new tokens and (unless `repeats` is given) 1 timed repeat.
        repeats: timed runs per row after one warm-up run; the median is reported (default 3, quick 1).
        time_budget_s: rows that would start after this many seconds (counted from this call's start: a model
            load and the peaks' measurement count) are skipped (reason recorded); the first row always runs.
        llm: an already loaded LLM to use instead of loading `model`; `model` is then only its id in the file
            ('default' -> the LLM's name).
        peaks_cache: the measured peaks' cache file (default `llmlab.measure.peaks.default_cache_path()`).
        measured_peaks: a `llmlab.measure.peaks.Peaks` to use instead of reading or measuring them (e.g.
            `measure_peaks(device, refresh=True)`: measured again, the cache rewritten); `peaks_cache` is then unused.
            The printed "peaks:" line (`peaks_line`) says where they come from and how steady they were.

    Raises:
        ValueError: unknown workload, model, step or peer; a workload longer than the model's context (the message
            gives both lengths).
        NothingToRun (a ValueError): none of the `steps` can run here and `peers` is False; nothing is written.
    """
    t_start = time.perf_counter()
    wl = get_workload(workload)
    wanted = select_peers(peers)  # None: every peer that applies
    if llm is None:
        llm, model_id, random_weights = load_bench_model(model, device=device, dtype=dtype)
    else:
        model_id, random_weights = (model if model != "default" else llm.name), llm.random_weights
    cfg, dev = llm.config, llm.device
    need = wl.context_needed(quick)
    if need > cfg.max_seq_len:
        raise ValueError(f"workload {workload!r} needs a context of {need} tokens but {model_id} has "
                         f"{cfg.max_seq_len}: it does not fit")
    runnable, skipped = plan_steps(llm, steps, peers, [wl.n_requests])
    peer_rows = peers_that_run(wanted, wl.n_requests, {r.step.weights for r in runnable})
    peers = bool(peer_rows)
    new_tokens = wl.quick_new_tokens if quick else wl.new_tokens
    repeats = repeats or (1 if quick else 3)
    prompts = make_prompts(wl, cfg.vocab_size)
    if measured_peaks is None:
        from llmlab.measure.peaks import measure_peaks

        measured_peaks = measure_peaks(dev, cache_path=peaks_cache)
    peaks = peaks_record(measured_peaks)
    kv_bytes = torch.empty((), dtype=llm.dtype).element_size()
    dev_name = device_name(dev)
    sample = False
    if dev.type == "cuda":
        from llmlab.telemetry.nvml_sampler import nvml_available

        sample, why_not = nvml_available()
    groups = group_by_length(prompts)
    notes = [f"{wl.name}: {wl.description}" + (f" (--quick: {new_tokens} new tokens)" if quick else ""),
             (f"median of {repeats} timed run(s)" if not sample else
              f"median of a row's timed runs (its `repeats`): {repeats}, or more until they have taken "
              f"{MIN_SAMPLED_S:g} s, since NVML's GPU-Util averages over a window of up to ~1 s")
             + " after one untimed warm-up run of the whole workload (warmup_s: its time, compilation and CUDA-graph "
               "capture included)",
             "greedy decoding; EOS ignored: every request generates exactly its new tokens",
             "prompts: random token ids (seed 0), the same for every row",
             "mbu/mfu count the bytes/FLOPs of a KV-cache decode step (weights once + each sequence's KV cache) "
             "over the decode steps only (TPOT), against the measured peaks"]
    if measured_peaks.verdict == "noisy":
        why = "; ".join(measured_peaks.noise_reasons)
        notes.append(f"the peaks were measured while the machine looked busy ({why}): they may read low, and "
                     f"mbu/mfu high")
    if len(groups) > 1:
        notes.append(f"llmlab rows without the batching switch run the {wl.n_requests} requests as {len(groups)} "
                     f"batches of equal-length prompts ("
                     + ", ".join(f"{len(g)} x {len(prompts[g[0]])} tokens" for g in groups)
                     + ") one after another; TTFT includes the wait for earlier batches; batch_size is the "
                       "number of requests")
        if peers:
            notes.append(f"hf rows: all {wl.n_requests} requests as ONE batch, left-padded to "
                         f"{max(wl.prompt_lens)} tokens with an attention mask")
    if dev.type == "cuda" and not sample:
        notes.append(f"gpu_util/sm_active are null: {why_not}")
    elif dev.type != "cuda":
        notes.append("gpu_util/sm_active/peak_mem_GB are null: not a GPU run")
    if dev.type != "cuda" and peers:
        notes.append("hf_static on a CPU: transformers compiles the static-cache forward only on GPUs (cuda, xpu, "
                     "...), so this row is the static cache without compilation")
    if random_weights:
        notes.append(f"{model_id}: random weights (a preset shape); the text is noise, the timing is real")

    doc = bench_document([], device=dev_name, peaks=peaks, notes=notes, complete=False,
                         model={"id": model_id, "name": llm.name, "random_weights": random_weights,
                                "params": cfg.num_params(), "params_read_per_token": roofline.weight_params_read(cfg),
                                "layers": cfg.n_layers, "dim": cfg.dim, "heads": cfg.n_heads,
                                "kv_heads": cfg.n_kv_heads, "vocab": cfg.vocab_size, "context": cfg.max_seq_len,
                                "dtype": str(llm.dtype).removeprefix("torch."),
                                "weights": describe_weights(llm.model, llm.dtype)},
                         workload={"name": wl.name, "description": wl.description, "requests": wl.n_requests,
                                   "prompt_lens": sorted(set(wl.prompt_lens)), "new_tokens": new_tokens,
                                   "quick": quick},
                         skipped=[{"step": s.name, "reason": why} for s, why in skipped]
                         + [{"step": n, "reason": why_not_run(n, wl.n_requests)}
                            for n in sorted(wanted or ()) if n not in peer_rows])
    path = Path(out) / bench_filename(dev_name, wl.name, model_id) if out is not None else None

    def save():
        if path is not None:
            save_bench(doc, path)

    def over_budget(name: str) -> bool:
        if not doc["results"]:  # the first row always runs, however long it and the setup before it take
            return False
        if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
            doc["skipped"].append({"step": name, "reason": f"time budget of {time_budget_s:.0f} s used up"})
            print_fn(f"  {name}: skipped, time budget used up")
            return True
        return False

    quick_note = f"; --quick: {new_tokens} new tokens" if quick else ""
    loaded = (f", {describe_weights(llm.model, llm.dtype)} weights" if is_quantized(llm.model) else "")
    print_fn(f"llmlab bench — {wl.name} ({wl.description}{quick_note}) on {model_id} "
             f"[{cfg.num_params() / 1e6:.1f}M params, {str(llm.dtype).removeprefix('torch.')}{loaded}] | {dev_name}")
    print_fn(peaks_line(measured_peaks))
    for s, why in skipped:
        print_fn(f"  {s.name}: skipped — {why}")

    base_row = {"workload": wl.name, "model": model_id, "batch_size": wl.n_requests, "prompt_tokens":
                max(wl.prompt_lens) if len(set(wl.prompt_lens)) == 1 else None, "new_tokens": new_tokens}
    tokens_of: dict[str, dict] = {}  # step -> {request: tokens}, to compare every row's tokens with "eager"

    def add_row(step: str, label: str, weights: str, wbpp: float, runs: list[Run], hw: dict, warmup_s: float,
                **extra) -> None:
        m = median_metrics([run_metrics(r, cfg, wbpp, kv_bytes, peaks["copy_GBps"], peaks["bf16_TFLOPs"])
                             for r in runs])
        tokens_of[step] = runs[0].tokens_by_request()
        doc["results"].append(result_row(**base_row, step=step, weights=weights, **m, **hw, label=label,
                                         warmup_s=warmup_s, repeats=len(runs), weight_bytes_per_param=wbpp,
                                         tokens_match_eager=None, **extra))
        save()
        print_fn(row_line(step, m, warmup_s))

    def failed(name: str, e: Exception) -> None:
        doc["skipped"].append({"step": name, "reason": f"failed: {type(e).__name__}: {e}"})
        print_fn(f"  {name}: FAILED — {type(e).__name__}: {e}")

    for r in runnable:
        if over_budget(r.name):
            continue
        run_llm = kwargs = None
        try:
            run_llm, kwargs = apply_switches(llm, r.settings)
            runs, hw, warm = timed(lambda: run_llmlab(run_llm, kwargs, prompts, new_tokens), dev, repeats, sample)
            tuned = {}
            if r.settings.get("step_tuning"):  # the tiles step tuning chose ({} = the autotuner's picks kept)
                tiles = step_tuning.chosen_tiles(run_llm)
                report = step_tuning.tuning_report(run_llm) or {}
                tuned = {"step_tiles": {role: str(c) for role, c in tiles.items()},
                         "step_tuning_s": report.get("seconds")}  # the tuning's own time (before warm-up)
            add_row(r.name, r.step.label, _weights(r.step, run_llm),
                    _weight_bpp(r.step, run_llm, cfg), runs, hw, warm, settings=r.settings,
                    setting_label=describe(r.settings), note=r.step.note, **_weight_sizes(run_llm), **tuned)
        except Exception as e:  # one broken rung must not lose the others
            failed(r.name, e)
        finally:
            run_llm = kwargs = None
            _free(dev)

    if peers:
        hf = None
        try:
            hf = hf_peer_model(llm)
        except Exception as e:
            for name in peer_rows:
                doc["skipped"].append({"step": name, "reason": f"transformers model not built: "
                                                               f"{type(e).__name__}: {e}"})
        for name in peer_rows:
            if hf is None or over_budget(name):
                continue
            static = name == "hf_static"
            try:
                if static:
                    torch._dynamo.reset()  # a clean compile cache: the warm-up time is transformers' own
                if name in TORCHAO_PEERS:
                    if TORCHAO_PEERS[name] == "int4" and (dev.type != "cuda" or llm.dtype != torch.bfloat16):
                        doc["skipped"].append({"step": name, "reason": "torchao's int4 weight-only layout runs "
                                               "bf16 weights on a CUDA GPU; this run is "
                                               f"{str(llm.dtype).removeprefix('torch.')} on {dev.type}"})
                        continue
                    try:
                        quantized, how = torchao_peer_model(hf, TORCHAO_PEERS[name])
                    except ImportError as e:
                        doc["skipped"].append({"step": name, "reason": f"torchao is not installed ({e})"})
                        continue
                    torch._dynamo.reset()
                    runs, hw, warm = timed(lambda: run_hf(quantized, prompts, new_tokens, True), dev, repeats,
                                           sample)
                    w = TORCHAO_PEERS[name]
                    add_row(name, f"torchao {w} (HF static cache)", w, weight_bytes_per_param(get_step("+" + w),
                                                                                            llm.dtype), runs, hw,
                            warm, note=f"torchao {torchao_version()} {how} on the decoder layers (lm_head "
                                       f"{str(llm.dtype).removeprefix('torch.')}), transformers "
                                       f"{transformers_version()} generate with its static cache, greedy")
                    quantized = None
                    continue
                if name == "hf_continuous":
                    runs, hw, warm = timed(lambda: run_hf_continuous(hf, prompts, new_tokens), dev, repeats, sample)
                    add_row(name, "HF continuous batching", _weights(AS_LOADED, llm),
                            _weight_bpp(AS_LOADED, llm, cfg), runs, hw, warm,
                            note=f"transformers {transformers_version()} generate_batch (its continuous batching), "
                                 f"greedy, same weights; one timed call, no per-token times")
                    continue
                runs, hw, warm = timed(lambda: run_hf(hf, prompts, new_tokens, static), dev, repeats, sample)
                how = ""
                if static:
                    how = ", cache_implementation='static'" + (" (compiled by transformers)" if dev.type == "cuda"
                                                               else " (not compiled on a CPU)")
                add_row(name, "HF generate" + (" (static cache)" if static else ""),
                        _weights(AS_LOADED, llm), _weight_bpp(AS_LOADED, llm, cfg), runs, hw, warm,
                        note=f"transformers {transformers_version()} generate, greedy, same weights{how}")
            except Exception as e:
                failed(name, e)
            finally:
                if name == "hf_continuous":
                    close_hf_continuous(hf)
                _free(dev)
        hf = None
        _free(dev)

    reference = tokens_of.get("eager")
    for row in doc["results"]:
        if reference is not None:
            row["tokens_match_eager"] = tokens_of[row["step"]] == reference

    # the bandwidth ceiling of this workload under any schedule: every request decoded in ONE batch, so each step
    # reads the weights once for all of them (the fewest bytes; a schedule of several batches, as the rungs without
    # the batching switch run, reads them once per batch), with the weights as loaded: a quantized folder's packed
    # values + scales, not its float dtype
    wbpp = _weight_bpp(AS_LOADED, llm, cfg)
    b, flops_total = decode_work(cfg, [len(p) for p in prompts], new_tokens, wbpp, kv_bytes, first_step=0)
    ceil_s = b / (peaks["copy_GBps"] * 1e9)
    step_ms = 1e3 * ceil_s / new_tokens
    mfu_at_ceiling = flops_total / ceil_s / 1e12 / peaks["bf16_TFLOPs"]
    compute_s = flops_total / (peaks["bf16_TFLOPs"] * 1e12)
    doc["results"].append(result_row(
        **base_row, step="roofline", weights=_weights(AS_LOADED, llm),
        tokens_per_s=wl.n_requests * new_tokens / ceil_s, tpot_ms_p50=step_ms, tpot_ms_p90=step_ms, mbu=1.0,
        mfu=mfu_at_ceiling, label="bandwidth roofline", weight_bytes_per_param=wbpp,
        weights_read_GB=wbpp * roofline.weight_params_read(cfg) / 1e9,
        compute_ceiling_tokens_per_s=wl.n_requests * new_tokens / compute_s,
        note="decode only (prefill not counted): all requests in one batch, every step reading the weights once "
             "and each sequence's KV cache at the measured copy bandwidth; it bounds tokens/s, not TPOT (a step of "
             "fewer sequences reads less KV cache and can be shorter)"
             + ("; mfu > 1: the arithmetic, not the bandwidth, is the tighter limit here (see "
                "compute_ceiling_tokens_per_s)" if mfu_at_ceiling > 1 else "")))
    one_run = (f"one timed run a row ({new_tokens} new tokens): rows differ by chance as much as by their change, "
               f"tens of percent on a busy CPU; compare rows of a run with --repeats 3 or more (the median)"
               if repeats == 1 else None)
    table_notes = [n for n in (mbu_above_roofline_note(doc["results"]), roofline_mfu_note(doc["results"]),
                               converted_weights_mem_note(doc["results"], _weights(AS_LOADED, llm)), one_run) if n]
    doc["notes"] += table_notes
    doc["complete"] = True
    doc["elapsed_s"] = time.perf_counter() - t_start
    save()
    print_fn("")
    print_fn(format_table(doc["results"]))
    for note in table_notes:
        print_fn(note)
    printed = {s.name for s, _ in skipped}  # the ladder's skips were listed before the first row
    for s in doc["skipped"]:
        if s["step"] not in printed:
            print_fn(f"skipped {s['step']}: {s['reason']}")
    if path is not None:
        print_fn(f"\nwrote {path}")
        doc["path"] = str(path)
    return doc
