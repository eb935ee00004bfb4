"""The bench file: one JSON document per `llmlab bench` run (or kernel micro-benchmark), in `data/bench/`.

    {"format": "llmlab-bench", "version": 1, "device": str, "commit": str, "date": str, "versions": {...},
     "peaks": {"copy_GBps": x, "bf16_TFLOPs": x, "matmul_dtype": ..., ...}, "units": {...},
     "model": {...}, "workload": {...}, "notes": [str, ...], "skipped": [{"step", "reason"}, ...],
     "complete": bool,
     "results": [{"workload", "model", "step", "batch_size", "weights", "tokens_per_s", "ttft_ms", "tpot_ms_p50",
                  "tpot_ms_p90", "mbu", "mfu", "gpu_util", "sm_active", "peak_mem_GB", ...}, ...]}

Kernel micro-benchmarks (`llmlab.kernels.bench_kernels`) write the same shape (`result_row`, `bench_document`,
`save_bench`) with `workload` naming the op and a `bw_fraction` or `speedup_vs_bf16` column. `validate_bench`
checks a document; `list_bench` and `latest_ladder` find the files the labs replay.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from llmlab import REPO_ROOT
from llmlab.envinfo import git_commit, versions

FORMAT = "llmlab-bench"
VERSION = 1
DEFAULT_OUT = REPO_ROOT / "data" / "bench"

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
         "peak_mem_GB": "torch.cuda.max_memory_allocated during the timed runs, 1e9 bytes: the whole process's, so a "
                        "row that converts the weights (+int8, +int4, ...) counts the loaded model beside its copy; "
                        "weights_allocated_GB is the row's own weights",
         "warmup_s": "seconds of the untimed warm-up run (compilation, CUDA-graph capture included)"}


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
    """NaN and inf -> None, floats rounded to 6 decimals, tuples -> lists, through dicts and lists."""
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


def describe_doc(doc: dict) -> str:
    """One line naming a bench file: device, workload, model, date, commit."""
    wl = doc.get("workload", {})
    wl = wl.get("name", "?") if isinstance(wl, dict) else wl
    model = doc.get("model", {})
    model = model.get("id", "?") if isinstance(model, dict) else model
    return (f"{doc['device']} | workload {wl} | model {model} | {doc.get('date', '?')} | commit {doc['commit']}"
            + ("" if doc.get("complete", True) else " | INCOMPLETE run"))
