"""`llmlab bench`: named workloads x a model x the optimization ladder, against peers and the roofline.

One run = one workload on one model, every ladder step that can run here (`llmlab.ladder`), Hugging Face
`generate` on the SAME weights (eager, and with its static cache, which transformers compiles on a GPU), and the
bandwidth ceiling. It prints a table and writes one JSON file per run into `data/bench/`:

    {"format": "llmlab-bench", "version": 1, "device": str, "commit": str, "date": str, "versions": {...},
     "peaks": {"copy_GBps": x, "bf16_TFLOPs": x, "matmul_dtype": ..., ...},
     "model": {...}, "workload": {...}, "notes": [str, ...], "skipped": [{"step", "reason"}, ...],
     "complete": bool,
     "results": [{"workload", "model", "step", "batch_size", "weights", "tokens_per_s", "ttft_ms", "tpot_ms_p50",
                  "tpot_ms_p90", "mbu", "mfu", "gpu_util", "sm_active", "peak_mem_GB", ...}, ...]}

Kernel micro-benchmarks write the same shape (`result_row`, `bench_document`, `save_bench`) with `workload`
naming the op and a `bw_fraction` or `speedup_vs_bf16` column. `validate_bench` checks a document.

Definitions (Databricks 2023, https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices;
see `llmlab.measure.roofline`): tokens/s = generated tokens / wall time of the whole workload (prefill included); TTFT = from
the start of the workload to a request's first token (a request that waits for an earlier group counts its wait); TPOT
= one decode step (all sequences of a batch advance by one token); MBU / MFU = the bytes / FLOPs a KV-cache decode
step must move / do (weights once per step + each sequence's KV cache) divided by the measured step time and the
measured peak (`llmlab.measure.peaks`). The same model bytes and FLOPs are used for every row, so a row that does more work
than needed (no KV cache recomputes the sequence) shows a lower MBU/MFU, as "model" utilisation should (PaLM, App. B,
https://arxiv.org/abs/2204.02311).

Workloads:

    chat    batch 1, a 128-token prompt, 256 new tokens
    batch   64 requests at once: 16 each of 64-, 128-, 256- and 512-token prompts, 128 new tokens each
    long    batch 1, an 8K context: an (8192 - 256)-token prompt, 256 new tokens

The llmlab engine cannot yet batch prompts of different lengths (no padding mask; continuous batching is lab 06),
so `batch` runs as 4 groups of 16 equal-length prompts, one group after the other; the JSON `notes` say so, and
Hugging Face runs the same 64 prompts as ONE left-padded batch with an attention mask (its normal way).

Prompts are random token ids (seeded), the same for every row. Greedy decoding; EOS is ignored, so every request
generates exactly its new tokens.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from llmlab import REPO_ROOT
from llmlab.measure import roofline
from llmlab.config import PRESETS
from llmlab.engine import LLM
from llmlab.envinfo import device_name, git_commit, versions
from llmlab.ladder import LadderStep, ResolvedStep, available_steps, weight_bytes_per_param, weights_label
from llmlab.switches import apply_switches, describe

FORMAT = "llmlab-bench"
VERSION = 1
DEFAULT_OUT = REPO_ROOT / "data" / "bench"
_AS_LOADED = LadderStep("as loaded", {})  # weights in the model's own dtype (peers and the roofline)
# Every row warms up on the whole workload before it is timed. The compiled and graph-captured rows need it
# (compilation and capture are sized by it; warmup_s reports its time), and so do the eager ones: the first time a
# decode step meets a new KV length it pays one-off costs (measured on the H200, call BM: the eager KV-cache decode's
# first 256-token run took 52 ms per step, the next ones 13 ms), which a short warm-up left in the timed runs of
# whichever row met those lengths first.

# the keys every result row has (null where not measured); kernel rows add bw_fraction or speedup_vs_bf16
ROW_KEYS = ("workload", "model", "step", "batch_size", "weights", "tokens_per_s", "ttft_ms", "tpot_ms_p50",
            "tpot_ms_p90", "mbu", "mfu", "gpu_util", "sm_active", "peak_mem_GB")
TOP_KEYS = ("device", "commit", "versions", "peaks", "results")
PEAK_KEYS = ("copy_GBps", "bf16_TFLOPs")
UNITS = {"tokens_per_s": "generated tokens per second, summed over the batch, prefill included",
         "ttft_ms": "ms, mean over requests, waiting for earlier groups included",
         "tpot_ms_p50": "ms per decode step (median)", "tpot_ms_p90": "ms per decode step (90th percentile)",
         "mbu": "fraction (0.25 = 25%) of peaks.copy_GBps", "mfu": "fraction of peaks.bf16_TFLOPs",
         "gpu_util": "fraction: NVML GPU-Util (time >= 1 kernel ran), mean over the timed runs",
         "sm_active": "fraction: NVML GPM SM activity, mean over the timed runs",
         "peak_mem_GB": "torch.cuda.max_memory_allocated during the timed runs, 1e9 bytes",
         "warmup_s": "seconds of the untimed warm-up run (compilation, CUDA-graph capture included)"}


# -- workloads ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A named set of requests: one prompt length per request, new tokens per request.

    quick_new_tokens replaces new_tokens under `--quick` (tests, CPU smoke runs); prompts keep their lengths.
    """

    name: str
    description: str
    prompt_lens: tuple[int, ...]
    new_tokens: int
    quick_new_tokens: int

    @property
    def n_requests(self) -> int:
        return len(self.prompt_lens)

    def context_needed(self, quick: bool = False) -> int:
        """Longest prompt + new tokens: the context length the model must have."""
        return max(self.prompt_lens) + (self.quick_new_tokens if quick else self.new_tokens)


WORKLOADS: dict[str, Workload] = {
    "chat": Workload("chat", "batch 1, 128-token prompt, 256 new tokens", (128,), 256, 16),
    "batch": Workload("batch", "64 requests at once: 16 each of 64-, 128-, 256- and 512-token prompts, "
                      "128 new tokens each", tuple(n for n in (64, 128, 256, 512) for _ in range(16)), 128, 8),
    "long": Workload("long", "batch 1, 8K context: 7936-token prompt, 256 new tokens", (8192 - 256,), 256, 16),
}


def get_workload(name: str) -> Workload:
    """Raises ValueError naming the known workloads."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def make_prompts(workload: Workload, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """One list of random token ids per request (seeded: every row and every peer gets the same prompts)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in workload.prompt_lens]


def group_by_length(prompts: list[list[int]]) -> list[list[int]]:
    """Indices of the requests grouped by prompt length (shortest first): the llmlab engine runs each group as one
    batch, since all prompts of one `generate` call must have the same length."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    return [groups[n] for n in sorted(groups)]


# -- models -------------------------------------------------------------------------------------------------------


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


def hf_peer_model(llm: LLM):
    """A transformers `AutoModelForCausalLM` that SHARES llmlab's weight tensors (no copy, same device and dtype).

    Built from `llm.config.to_hf_config()`, then `load_state_dict(..., assign=True)` with llmlab's parameters
    (names: 'model.' + llmlab's, lm_head tied where the config says so). Raises ImportError without transformers,
    RuntimeError if a weight would be left at its random initialisation.
    """
    import transformers

    hf_cfg = llm.config.to_hf_config()
    cfg = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    with torch.device(llm.device):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=llm.dtype, attn_implementation="sdpa")
    wanted = set(hf.state_dict())
    ours = {("model." + k if k != "lm_head.weight" else k): v for k, v in llm.model.state_dict().items()}
    state = {k: v for k, v in ours.items() if k in wanted}
    missing = wanted - set(state)
    if llm.config.tie_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise RuntimeError(f"transformers model has weights llmlab does not: {sorted(missing)[:5]}")
    hf.load_state_dict(state, strict=False, assign=True)
    if llm.config.tie_embeddings:
        hf.tie_weights()
        if hf.lm_head.weight.data_ptr() != llm.model.embed_tokens.weight.data_ptr():
            hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.to(llm.device)  # the parameters are llmlab's already; this moves any buffer built elsewhere (RoPE tables)
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None  # never stop early: every request generates all its tokens
    return hf.eval()


# -- one timed run ------------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One `generate` call of a run: its requests (indices), prompt lengths, step times and tokens."""

    requests: list[int]
    prompt_lens: list[int]
    step_ms: list[float]
    tokens: list[list[int]]


@dataclass
class Run:
    calls: list[Call] = field(default_factory=list)

    @property
    def total_ms(self) -> float:
        return sum(sum(c.step_ms) for c in self.calls)

    def tokens_by_request(self) -> dict[int, list[int]]:
        return {r: t for c in self.calls for r, t in zip(c.requests, c.tokens)}


class _StepClock:
    """Marks step boundaries from inside Hugging Face `generate` (a logits processor runs once per new token).

    CUDA events are recorded into the stream (no host synchronisation added); on a CPU the host clock is read.
    """

    def __init__(self, device: torch.device):
        from llmlab.measure.timing import StepTimer

        self.timer = StepTimer(device)

    def __call__(self, input_ids, scores):
        self.timer.mark()
        return scores


def run_llmlab(llm: LLM, kwargs: dict, prompts: list[list[int]], new_tokens: int) -> Run:
    """Run a workload on the llmlab engine: one `generate` call per group of equal-length prompts."""
    run = Run()
    for idx in group_by_length(prompts):
        g = llm.generate([prompts[i] for i in idx], max_new_tokens=new_tokens, stop_at_eos=False, **kwargs)
        run.calls.append(Call(idx, [len(prompts[i]) for i in idx], list(g.step_ms), g.token_ids))
    return run


def run_hf(hf, prompts: list[list[int]], new_tokens: int, static: bool, pad_id: int = 0) -> Run:
    """Run a workload with Hugging Face `generate`: all requests as ONE batch, left-padded with an attention mask.

    Greedy, exactly `new_tokens` new tokens (min_new_tokens = max_new_tokens). static=True adds
    `cache_implementation="static"` (transformers then compiles the forward pass on a GPU). Step times come from
    a logits processor that marks a CUDA event each time a token is chosen.
    """
    from transformers import LogitsProcessorList

    device = next(hf.parameters()).device
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    clock = _StepClock(device)
    extra = {"cache_implementation": "static"} if static else {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    clock.timer.start()
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, logits_processor=LogitsProcessorList([clock]), pad_token_id=pad_id,
                      **extra)
    step_ms = clock.timer.step_ms()
    tokens = out[:, T:].tolist()
    return Run([Call(list(range(len(prompts))), [len(p) for p in prompts], step_ms, tokens)])


# -- metrics of a run ---------------------------------------------------------------------------------------------


def decode_work(config, prompt_lens: list[int], n_steps: float, weight_bpp: float, kv_bytes: float,
                first_step: int = 1) -> tuple[float, float]:
    """(bytes, FLOPs) a KV-cache decode must move / do for decode steps first_step .. n_steps - 1 of a batch.

    Weights are read once per step for the whole batch; each sequence reads its own KV cache (prompt + tokens so
    far). With first_step=1 this is the decode after the prefill's first token (what TPOT times); first_step=0
    counts n_steps full steps (the roofline row).
    """
    steps = n_steps - first_step
    if steps <= 0:
        return 0.0, 0.0
    byts = steps * roofline.weight_bytes(config, weight_bpp)
    flops = 0.0
    for p in prompt_lens:
        ctx = p + (first_step + n_steps - 1) / 2  # mean cached tokens over the steps
        byts += steps * roofline.kv_cache_bytes(config, 1, ctx, kv_bytes)
        flops += steps * roofline.decode_step_flops(config, 1, ctx)
    return byts, flops


def run_metrics(run: Run, config, weight_bpp: float, kv_bytes: float, peak_bw: float | None,
                peak_tflops: float | None) -> dict:
    """tokens/s, TTFT, TPOT (mean, p50, p90), achieved GB/s, MBU and MFU of one run (see the module docstring)."""
    n_tokens = sum(len(t) for c in run.calls for t in c.tokens)
    total_s = run.total_ms / 1e3
    ttfts, waited = [], 0.0
    for c in run.calls:
        ttfts += [waited + c.step_ms[0]] * len(c.requests)
        waited += sum(c.step_ms)
    decode_ms = [ms for c in run.calls for ms in c.step_ms[1:]]
    byts = flops = 0.0
    for c in run.calls:
        b, f = decode_work(config, c.prompt_lens, len(c.step_ms), weight_bpp, kv_bytes)
        byts, flops = byts + b, flops + f
    decode_s = sum(decode_ms) / 1e3
    out = {"tokens_per_s": n_tokens / total_s if total_s > 0 else None,
           "ttft_ms": statistics.fmean(ttfts),
           "tpot_ms": statistics.fmean(decode_ms) if decode_ms else None,
           "tpot_ms_p50": roofline.percentile(decode_ms, 50) if decode_ms else None,
           "tpot_ms_p90": roofline.percentile(decode_ms, 90) if decode_ms else None,
           "achieved_GBps": byts / decode_s / 1e9 if decode_s > 0 else None,
           "mbu": None, "mfu": None}
    if decode_s > 0 and peak_bw:
        out["mbu"] = byts / decode_s / 1e9 / peak_bw
    if decode_s > 0 and peak_tflops:
        out["mfu"] = flops / decode_s / 1e12 / peak_tflops
    return out


def _median_metrics(per_run: list[dict]) -> dict:
    out = {}
    for k in per_run[0]:
        vals = [m[k] for m in per_run if m[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
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

    Returns (runs, {"gpu_util", "sm_active", "peak_mem_GB"}, warm-up seconds): gpu_util and sm_active are the
    means (as fractions) of the sampler's gpu_util_pct and sm_active_pct over the timed calls, None when not
    sampled or not reported. backend: a telemetry backend for the sampler (tests); default NVML.
    """
    t0 = time.perf_counter()
    fn()
    _sync(device)
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
        _sync(device)
        while (sampler is not None and time.perf_counter() - t_runs < min_sampled_s
               and len(runs) < MAX_SAMPLED_RUNS):
            runs.append(fn())
            _sync(device)
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


# -- the JSON document ---------------------------------------------------------------------------------------------


def result_row(**fields) -> dict:
    """A result row with every key of `ROW_KEYS` (None where not given), then the extra fields in order given."""
    row = {k: fields.pop(k, None) for k in ROW_KEYS}
    row.update(fields)
    return row


def peaks_dict(device: torch.device, cache_path=None) -> dict:
    """The measured peaks (`llmlab.measure.peaks.measure_peaks`, cached) in the bench file's shape (`peaks_record`).
    Raises ValueError for an unsupported device."""
    from llmlab.measure.peaks import measure_peaks

    return peaks_record(measure_peaks(device, cache_path=cache_path))


def peaks_record(p) -> dict:
    """A `llmlab.measure.peaks.Peaks` in the bench file's shape: copy_GBps, bf16_TFLOPs, matmul_dtype, the datasheet's,
    measured_at, cached (read from the cache file rather than measured for this run), how steady the measurement
    was (verdict "steady"/"noisy"/None, noise_reasons, copy_spread, matmul_spread, repeats, attempts, cpu_wait: see
    `Peaks`) and a note.

    On a CPU `bf16_TFLOPs` holds the fp32 matmul rate (`matmul_dtype` says which); `note` says so.
    """
    note = ("measured: copy_GBps = device-to-device copy (bytes read + written), bf16_TFLOPs = dense matmul in "
            f"{p.matmul_dtype}")
    if p.matmul_dtype != "bfloat16":
        note += f" (the key keeps its name for comparability; this device's rate is {p.matmul_dtype})"
    return {"copy_GBps": p.copy_bw_gb_s, "bf16_TFLOPs": p.matmul_tflops, "matmul_dtype": p.matmul_dtype,
            "datasheet_GBps": p.datasheet_bw_gb_s, "datasheet_TFLOPs": p.datasheet_tflops,
            "measured_at": p.measured_at, "cached": p.cached, "verdict": p.verdict,
            "noise_reasons": list(p.noise_reasons), "copy_spread": p.copy_spread, "matmul_spread": p.matmul_spread,
            "repeats": p.repeats, "attempts": p.attempts, "cpu_wait": p.cpu_wait, "note": note}


def peaks_line(p) -> str:
    """The "peaks:" line printed before a bench's rows: a `llmlab.measure.peaks.Peaks`'s figures, where they come from
    (`Peaks.source`) and how far to trust them (`Peaks.trust`), e.g. "peaks: copy 34 GB/s, matmul 0.20 TFLOP/s
    (float32), measured now, saved to <file>; spread 2% (copy), 1% (matmul) over 5 repeats: steady"."""
    line = (f"peaks: copy {p.copy_bw_gb_s:.0f} GB/s, matmul {p.matmul_tflops:.2f} TFLOP/s ({p.matmul_dtype}), "
            f"{p.source()}")
    if p.trust():
        line += f"; {p.trust()}"
    if p.cached:
        line += "; --refresh-peaks measures them again"
    return line


def bench_document(results: list[dict], *, device: str, peaks: dict, notes: list[str] | None = None,
                   **extra) -> dict:
    """A bench file's content: device, commit, date, versions, peaks, results, notes (+ `extra` keys).

    Kernel micro-benchmarks call this too, with rows from `result_row(workload="<op>", ...)`.
    """
    doc = {"format": FORMAT, "version": VERSION, "device": device, "commit": git_commit(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": versions(), "peaks": peaks,
           "units": UNITS}
    doc.update(extra)
    doc["notes"] = list(notes or [])
    doc["results"] = results
    return doc


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9.]+", "-", str(text).lower()).strip("-.") or "unknown"


def bench_filename(device: str, workload: str, model: str, when: float | None = None) -> str:
    """`<device-slug>_<workload>_<model-slug>_<UTC timestamp>.json`."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
    return f"{slug(device)}_{slug(workload)}_{slug(model)}_{stamp}.json"


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 6) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def save_bench(doc: dict, path: str | os.PathLike) -> Path:
    """Write `doc` to `path` atomically (NaN -> null, floats to 6 decimals). Validates first (`validate_bench`)."""
    doc = _clean(doc)
    validate_bench(doc)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".bench-", suffix=".json")
    os.chmod(tmp, 0o644)  # mkstemp makes it private; a results file is for everyone to read
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_bench(doc: dict) -> None:
    """Check a bench document's shape. Raises ValueError listing every problem found.

    Required: TOP_KEYS (device and commit strings, versions a dict, peaks with numeric copy_GBps and bf16_TFLOPs,
    results a list); every row has all ROW_KEYS; workload/model/step/weights are strings; the metric columns are
    numbers or null; batch_size an int or null; tokens_per_s a number unless the row is a kernel micro-benchmark
    (it has bw_fraction or speedup_vs_bf16); times, rates and memory not negative; format and version, where
    present (older files lack them), this module's.
    """
    problems = []
    if not isinstance(doc, dict):
        raise ValueError("a bench document is a JSON object")
    for k in TOP_KEYS:
        if k not in doc:
            problems.append(f"missing top-level key {k!r}")
    if "format" in doc and doc["format"] != FORMAT:  # files from before the field was written have none
        problems.append(f"format is {doc['format']!r}, not {FORMAT!r}: not an llmlab bench file")
    if "version" in doc and (isinstance(doc["version"], bool) or not isinstance(doc["version"], int)
                             or not 1 <= doc["version"] <= VERSION):
        problems.append(f"version {doc['version']!r}: this llmlab reads versions 1..{VERSION} (a newer file needs a "
                        f"newer llmlab)")
    for k in ("device", "commit"):
        if k in doc and not isinstance(doc[k], str):
            problems.append(f"{k} must be a string")
    if "versions" in doc and not isinstance(doc["versions"], dict):
        problems.append("versions must be an object")
    peaks = doc.get("peaks")
    if isinstance(peaks, dict):
        for k in PEAK_KEYS:
            if not _is_num(peaks.get(k)):
                problems.append(f"peaks.{k} must be a number")
    elif "peaks" in doc:
        problems.append("peaks must be an object")
    results = doc.get("results")
    if "results" in doc and not isinstance(results, list):
        problems.append("results must be a list")
        results = []
    for i, row in enumerate(results or []):
        if not isinstance(row, dict):
            problems.append(f"results[{i}] is not an object")
            continue
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            problems.append(f"results[{i}] misses {missing}")
        for k in ("workload", "model", "step", "weights"):
            if k in row and not isinstance(row[k], str):
                problems.append(f"results[{i}].{k} must be a string")
        if row.get("batch_size") is not None and not (isinstance(row["batch_size"], int)
                                                      and not isinstance(row["batch_size"], bool)):
            problems.append(f"results[{i}].batch_size must be an integer")
        for k in ROW_KEYS[5:]:
            if row.get(k) is not None and not _is_num(row[k]):
                problems.append(f"results[{i}].{k} must be a number or null, not {row[k]!r}")
        kernel = "bw_fraction" in row or "speedup_vs_bf16" in row
        if not kernel and not _is_num(row.get("tokens_per_s")):
            problems.append(f"results[{i}] ({row.get('step')}) has no tokens_per_s")
        for k in ("tokens_per_s", "ttft_ms", "tpot_ms_p50", "tpot_ms_p90", "peak_mem_GB"):
            if _is_num(row.get(k)) and row[k] < 0:
                problems.append(f"results[{i}].{k} is negative ({row[k]!r})")
    if problems:
        raise ValueError("invalid bench document: " + "; ".join(problems))


def load_bench(path: str | os.PathLike) -> dict:
    """Read and validate one bench file (ValueError if it is not one)."""
    with open(path) as f:
        doc = json.load(f)
    validate_bench(doc)
    doc["path"] = str(path)
    return doc


def list_bench(directory: str | os.PathLike | None = None, device_contains: str | None = None) -> list[dict]:
    """Every valid bench file in `directory` (default data/bench/), oldest first; invalid files are skipped.

    device_contains: keep only files whose device name contains it (case-insensitive), e.g. "H200".
    """
    folder = Path(directory) if directory is not None else DEFAULT_OUT
    docs = []
    for p in sorted(folder.glob("*.json")):
        try:
            doc = load_bench(p)
        except (OSError, ValueError):
            continue
        if device_contains and device_contains.lower() not in doc["device"].lower():
            continue
        docs.append(doc)
    return sorted(docs, key=lambda d: str(d.get("date") or ""))  # a file without a date sorts first


def latest_ladder(workload: str, model_id: str | None = None, directory: str | os.PathLike | None = None) -> dict | None:
    """The newest GPU bench file of `workload` (optionally of model `model_id`, e.g. "llama-3.2-1b") that climbed the
    ladder from its "eager" rung — not a run of a few rungs only. None if there is none."""
    runs = [d for d in list_bench(directory) if "cpu" not in d["device"].lower()
            and d.get("workload", {}).get("name") == workload
            and (model_id is None or d.get("model", {}).get("id") == model_id)
            and any(r["step"] == "eager" for r in d["results"])]
    return runs[-1] if runs else None


# -- the table ----------------------------------------------------------------------------------------------------


def _fmt(x, spec: str, pct: bool = False) -> str:
    if x is None:
        return "-"
    return format(100 * x, spec) + "%" if pct else format(x, spec)


def format_table(results: list[dict]) -> str:
    """Plain-text table of result rows (speed-up relative to the 'eager' row where there is one)."""
    base = next((r["tokens_per_s"] for r in results if r["step"] == "eager"), None)
    head = (f"{'step':<16}{'batch':>6}{'weights':>8}{'tokens/s':>11}{'vs eager':>9}{'TTFT ms':>10}{'TPOT p50':>10}"
            f"{'TPOT p90':>10}{'MBU':>8}{'MFU':>8}{'GPU-Util':>9}{'SM act.':>8}{'mem GB':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        tps = r.get("tokens_per_s")
        speed = f"{tps / base:.2f}x" if base and tps else "-"
        lines.append(f"{r['step']:<16}{_fmt(r['batch_size'], 'd'):>6}{r['weights'] or '-':>8}{_fmt(tps, '.1f'):>11}"
                     f"{speed:>9}{_fmt(r['ttft_ms'], '.2f'):>10}{_fmt(r['tpot_ms_p50'], '.3f'):>10}"
                     f"{_fmt(r['tpot_ms_p90'], '.3f'):>10}{_fmt(r['mbu'], '.1f', True):>8}"
                     f"{_fmt(r['mfu'], '.2f', True):>8}{_fmt(r['gpu_util'], '.0f', True):>9}"
                     f"{_fmt(r['sm_active'], '.0f', True):>8}{_fmt(r['peak_mem_GB'], '.2f'):>8}")
    return "\n".join(lines)


# -- a batch sweep ------------------------------------------------------------------------------------------------


def batch_sweep(llm: LLM, batch_sizes=(1, 2, 4, 8, 16, 32, 64), prompt_len: int = 32, new_tokens: int = 32,
                settings: dict | None = None, peaks: dict | None = None, repeats: int = 1) -> list[dict]:
    """Decode the same workload at growing batch sizes: where bandwidth-bound turns into compute-bound.

    Every batch size runs `batch` random prompts of `prompt_len` tokens for `new_tokens` tokens (a short untimed
    warm-up of 4 tokens, then the median of `repeats`). Returns one dict per batch size: batch, tpot_ms (mean decode
    step), tokens_per_s (decode: batch x 1000 / tpot_ms), intensity (FLOP/byte of a decode step,
    `llmlab.measure.roofline`), achieved_tflops, achieved_GBps, mbu, mfu (against `peaks`, default the measured ones:
    `peaks_dict`).
    Raises ValueError if prompt_len + new_tokens exceeds the context or new_tokens < 2.
    """
    if new_tokens < 2:
        raise ValueError("new_tokens must be >= 2: the decode steps come after the first token")
    settings = settings or {}
    peaks = peaks or peaks_dict(llm.device)
    run_llm, kwargs = apply_switches(llm, settings)
    cfg = llm.config
    wbpp = weight_bytes_per_param(_AS_LOADED, run_llm.dtype)
    kv = torch.empty((), dtype=run_llm.dtype).element_size()
    ctx = roofline.decode_mean_context_len(prompt_len, new_tokens)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batch_sizes:
        prompts = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=gen).tolist()
        run_llm.generate(prompts, max_new_tokens=min(4, new_tokens), stop_at_eos=False, **kwargs)  # first-call costs
        tpots = []
        for _ in range(repeats):
            g = run_llm.generate(prompts, max_new_tokens=new_tokens, stop_at_eos=False, **kwargs)
            tpots.append(statistics.fmean(g.step_ms[1:]))
        tpot = statistics.median(tpots)
        step_s = tpot / 1e3
        rows.append({
            "batch": b, "tpot_ms": tpot, "tokens_per_s": b * 1e3 / tpot,
            "intensity": roofline.arithmetic_intensity(cfg, b, ctx, wbpp, kv),
            "achieved_tflops": roofline.decode_step_flops(cfg, b, ctx) / step_s / 1e12,
            "achieved_GBps": roofline.decode_step_bytes(cfg, b, ctx, wbpp, kv) / step_s / 1e9,
            "mbu": roofline.mbu(step_s, cfg, b, ctx, peaks["copy_GBps"], wbpp, kv),
            "mfu": roofline.mfu(step_s, cfg, b, ctx, peaks["bf16_TFLOPs"]),
        })
    return rows


def describe_doc(doc: dict) -> str:
    """One line naming a bench file: device, workload, model, date, commit."""
    wl = doc.get("workload", {})
    wl = wl.get("name", "?") if isinstance(wl, dict) else wl
    model = doc.get("model", {})
    model = model.get("id", "?") if isinstance(model, dict) else model
    return (f"{doc['device']} | workload {wl} | model {model} | {doc.get('date', '?')} | commit {doc['commit']}"
            + ("" if doc.get("complete", True) else " | INCOMPLETE run"))


# -- one bench run ------------------------------------------------------------------------------------------------


class NothingToRun(ValueError):
    """None of the requested ladder steps can run here and no peer was asked for: a run would measure nothing."""


def plan_steps(llm: LLM, steps: list[str] | None, peers: bool
               ) -> tuple[list[ResolvedStep], list[tuple[LadderStep, str]]]:
    """`available_steps(llm, steps)`: (runnable rungs, [(skipped rung, reason)]), checked before anything is measured.

    Raises:
        ValueError: an unknown step name (the message lists the steps).
        NothingToRun: none of the steps can run here and `peers` is False; the message gives each step's reason,
            the steps that can run here, and the fix.
    """
    runnable, skipped = available_steps(llm, steps)
    if runnable or peers:
        return runnable, skipped
    here = [r.name for r in available_steps(llm)[0]]
    raise NothingToRun("none of the requested ladder steps can run here, so there is nothing to measure: "
                       + "; ".join(f"{s.name}: {why}" for s, why in skipped)
                       + f". Run them where they can (a CUDA GPU for the GPU-only steps), or choose steps that run "
                         f"here ({', '.join(here) or 'none'}; 'all' runs every one that can), or add the Hugging "
                         f"Face peers (--peers)")


def run_bench(workload: str = "chat", model: str = "default", steps: list[str] | None = None, peers: bool = True,
              out: str | os.PathLike | None = DEFAULT_OUT, quick: bool = False, repeats: int | None = None,
              device=None, dtype=None, time_budget_s: float | None = None, llm: LLM | None = None,
              peaks_cache=None, measured_peaks=None, print_fn=print) -> dict:
    """Benchmark one workload on one model: the ladder steps, the peers, the roofline. Returns the document.

    Args:
        workload: a key of WORKLOADS ('chat', 'batch', 'long').
        model: 'default', a preset name (random weights; bf16 on CUDA) or a model folder.
        steps: ladder step names (None / ['all']: every rung that can run here; the rest are listed in
            "skipped" with the reason).
        peers: also run Hugging Face generate, eager ('hf_eager') and static cache ('hf_static').
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
        ValueError: unknown workload, model or step; a workload longer than the model's context (the message
            gives both lengths).
        NothingToRun (a ValueError): none of the `steps` can run here and `peers` is False; nothing is written.
    """
    t_start = time.perf_counter()
    wl = get_workload(workload)
    if llm is None:
        llm, model_id, random_weights = load_bench_model(model, device=device, dtype=dtype)
    else:
        model_id, random_weights = (model if model != "default" else llm.name), llm.random_weights
    cfg, dev = llm.config, llm.device
    need = wl.context_needed(quick)
    if need > cfg.max_seq_len:
        raise ValueError(f"workload {workload!r} needs a context of {need} tokens but {model_id} has "
                         f"{cfg.max_seq_len}: it does not fit")
    runnable, skipped = plan_steps(llm, steps, peers)
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
        notes.append(f"llmlab rows: the engine cannot batch prompts of different lengths yet (no padding mask), so "
                     f"the {wl.n_requests} requests run as {len(groups)} batches of equal-length prompts ("
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
                                "dtype": str(llm.dtype).removeprefix("torch.")},
                         workload={"name": wl.name, "description": wl.description, "requests": wl.n_requests,
                                   "prompt_lens": sorted(set(wl.prompt_lens)), "new_tokens": new_tokens,
                                   "quick": quick},
                         skipped=[{"step": s.name, "reason": why} for s, why in skipped])
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
    print_fn(f"llmlab bench — {wl.name} ({wl.description}{quick_note}) on {model_id} "
             f"[{cfg.num_params() / 1e6:.1f}M params, {str(llm.dtype).removeprefix('torch.')}] | {dev_name}")
    print_fn(peaks_line(measured_peaks))
    for s, why in skipped:
        print_fn(f"  {s.name}: skipped — {why}")

    base_row = {"workload": wl.name, "model": model_id, "batch_size": wl.n_requests, "prompt_tokens":
                max(wl.prompt_lens) if len(set(wl.prompt_lens)) == 1 else None, "new_tokens": new_tokens}
    tokens_of: dict[str, dict] = {}  # step -> {request: tokens}, to compare every row's tokens with "eager"

    def add_row(step: str, label: str, weights: str, wbpp: float, runs: list[Run], hw: dict, warmup_s: float,
                **extra) -> None:
        m = _median_metrics([run_metrics(r, cfg, wbpp, kv_bytes, peaks["copy_GBps"], peaks["bf16_TFLOPs"])
                             for r in runs])
        tokens_of[step] = runs[0].tokens_by_request()
        doc["results"].append(result_row(**base_row, step=step, weights=weights, **m, **hw, label=label,
                                         warmup_s=warmup_s, repeats=len(runs), weight_bytes_per_param=wbpp,
                                         tokens_match_eager=None, **extra))
        save()
        print_fn(f"  {step}: {m['tokens_per_s']:.1f} tokens/s, TPOT p50 {_fmt(m['tpot_ms_p50'], '.3f')} ms, "
                 f"MBU {_fmt(m['mbu'], '.1f', True)} (warm-up {warmup_s:.1f} s)")

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
                tiles = run_llm.model.__dict__.get("_llmlab_step_tiles", {})
                report = run_llm.model.__dict__.get("_llmlab_step_tuning_report") or {}
                tuned = {"step_tiles": {role: str(c) for role, c in tiles.items()},
                         "step_tuning_s": report.get("seconds")}  # the tuning's own time (before warm-up)
            add_row(r.name, r.step.label, weights_label(r.step, run_llm.dtype),
                    weight_bytes_per_param(r.step, run_llm.dtype), runs, hw, warm, settings=r.settings,
                    setting_label=describe(r.settings), note=r.step.note, **tuned)
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
            for name in ("hf_eager", "hf_static"):
                doc["skipped"].append({"step": name, "reason": f"transformers model not built: "
                                                               f"{type(e).__name__}: {e}"})
        for name, static in (("hf_eager", False), ("hf_static", True)):
            if hf is None or over_budget(name):
                continue
            try:
                if static:
                    torch._dynamo.reset()  # a clean compile cache: the warm-up time is transformers' own
                runs, hw, warm = timed(lambda: run_hf(hf, prompts, new_tokens, static), dev, repeats, sample)
                how = ""
                if static:
                    how = ", cache_implementation='static'" + (" (compiled by transformers)" if dev.type == "cuda"
                                                               else " (not compiled on a CPU)")
                add_row(name, "HF generate" + (" (static cache)" if static else ""),
                        weights_label(_AS_LOADED, llm.dtype), weight_bytes_per_param(_AS_LOADED, llm.dtype), runs,
                        hw, warm, note=f"transformers {_tf_version()} generate, greedy, same weights{how}")
            except Exception as e:
                failed(name, e)
            finally:
                _free(dev)
        hf = None
        _free(dev)

    reference = tokens_of.get("eager")
    for row in doc["results"]:
        if reference is not None:
            row["tokens_match_eager"] = tokens_of[row["step"]] == reference

    # the bandwidth ceiling of this workload, as the llmlab engine runs it (groups one after another)
    wbpp = weight_bytes_per_param(_AS_LOADED, llm.dtype)
    ceil_s = flops_total = 0.0
    for idx in groups:
        b, f = decode_work(cfg, [len(prompts[i]) for i in idx], new_tokens, wbpp, kv_bytes, first_step=0)
        ceil_s += b / (peaks["copy_GBps"] * 1e9)
        flops_total += f
    step_ms = 1e3 * ceil_s / (new_tokens * len(groups))
    mfu_at_ceiling = flops_total / ceil_s / 1e12 / peaks["bf16_TFLOPs"]
    compute_s = flops_total / (peaks["bf16_TFLOPs"] * 1e12)
    doc["results"].append(result_row(
        **base_row, step="roofline", weights=weights_label(_AS_LOADED, llm.dtype),
        tokens_per_s=wl.n_requests * new_tokens / ceil_s, tpot_ms_p50=step_ms, tpot_ms_p90=step_ms, mbu=1.0,
        mfu=mfu_at_ceiling, label="bandwidth roofline", weight_bytes_per_param=wbpp,
        compute_ceiling_tokens_per_s=wl.n_requests * new_tokens / compute_s,
        note="decode only (prefill not counted): every step reads the weights once and each sequence's KV cache "
             "at the measured copy bandwidth"
             + ("; mfu > 1: the arithmetic, not the bandwidth, is the tighter limit here (see "
                "compute_ceiling_tokens_per_s)" if mfu_at_ceiling > 1 else "")))
    table_notes = [n for n in (mbu_above_roofline_note(doc["results"]), roofline_mfu_note(doc["results"])) if n]
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


def mbu_above_roofline_note(results: list[dict]) -> str | None:
    """A note for rows with MBU above 100% (None if there are none): bytes read faster than the measured copy
    bandwidth, which happens on a CPU when a small model's weights stay in the caches between decode steps."""
    above = [r["step"] for r in results if r["step"] != "roofline" and (r.get("mbu") or 0) > 1]
    if not above:
        return None
    return (f"MBU above 100% ({', '.join(above)}): the bytes were read faster than the measured copy bandwidth — "
            f"on a CPU a small model's weights stay in the caches between steps, so the DRAM roofline does not "
            f"bound it")


def roofline_mfu_note(results: list[dict]) -> str | None:
    """A note for a roofline row with MFU above 100% (None otherwise): the row is a bandwidth-only ceiling, and
    doing this workload's arithmetic at its speed would take more than the measured matmul rate, so the compute
    ceiling (`compute_ceiling_tokens_per_s`) is the tighter one."""
    row = next((r for r in results if r["step"] == "roofline"), None)
    if row is None or (row.get("mfu") or 0) <= 1:
        return None
    compute = row.get("compute_ceiling_tokens_per_s")
    return (f"MFU above 100% (roofline): the roofline row is a bandwidth-only ceiling (every decode step at the "
            f"measured copy bandwidth); doing this workload's arithmetic that fast would take {100 * row['mfu']:.0f}% "
            f"of the measured matmul rate, so here compute, not bandwidth, is the tighter limit"
            + (f": at most {compute:.1f} tokens/s (compute_ceiling_tokens_per_s)" if compute else ""))


def _tf_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return "?"

