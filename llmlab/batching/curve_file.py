"""A throughput-latency curve on disk: the serving curve's JSON file, written and found again.

`llmlab.batching.trace_runner.throughput_latency_curve` makes the rows (one per arrival rate and server mode);
`save_curve` writes them with the device, date, commit and versions they were measured with, `load_curve` reads
one back and checks it, and `list_curves` / `latest_curve` find the recorded ones in data/bench/ (files named
`<device>_serving_<model>_<date>.json`, beside the bench files), which lab 06 replays on a machine without a GPU.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

from llmlab import REPO_ROOT
from llmlab.envinfo import device_name, git_commit, versions

__all__ = ["save_curve", "load_curve", "list_curves", "latest_curve", "CURVE_FORMAT", "CURVE_KEYS", "DEFAULT_DIR"]

CURVE_FORMAT = "llmlab-serving-curve"
DEFAULT_DIR = REPO_ROOT / "data" / "bench"  # where recorded curves are looked for (and written by trace_runner)
CURVE_KEYS = ("rate", "mode", "requests", "finished", "tokens", "wall_s", "tokens_per_s", "requests_per_s",
              "queueing_ms_p50", "queueing_ms_p90", "queueing_ms_p99", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
              "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99", "mean_batch")


def _clean(x):
    """JSON-safe: NaN -> None, inf -> "inf", tuples -> lists, floats to 6 decimals."""
    if isinstance(x, float):
        return "inf" if x == math.inf else round(x, 6) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def save_curve(rows: list[dict], path: str | os.PathLike, *, model: dict | str, settings: dict,
               device: str | None = None, extra: dict | None = None) -> Path:
    """Write a throughput-latency curve as JSON (atomically): format, version, device, date, commit, versions
    (`llmlab.envinfo`), model, settings (how the traces were served), rows, and any `extra` keys (e.g.
    "batch_sweep": `llmlab.measure.batch_sweep.batch_sweep`'s rows). A rate of math.inf is written as "inf".

    Args:
        rows: `trace_runner.throughput_latency_curve`'s dicts (each needs `CURVE_KEYS`). model: its name or a dict
            (id, params, dtype...). device: default the current device's name (`envinfo.device_name`).

    Raises:
        ValueError: no rows, or a row missing a key (named), before anything is written.
    """
    _check_rows(rows, "rows")
    doc = {"format": CURVE_FORMAT, "version": 1, "device": device or device_name(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
           "versions": versions(), "model": model if isinstance(model, dict) else {"id": str(model)},
           "settings": settings, **(extra or {}), "rows": rows}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".curve-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(_clean(doc), f, indent=1)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def _check_rows(rows, where: str) -> None:
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: a curve needs at least one row (throughput_latency_curve's output)")
    for i, row in enumerate(rows):
        missing = [k for k in CURVE_KEYS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{where}[{i}] misses {missing}: save rows made by trace_runner.throughput_latency_curve")


def load_curve(path: str | os.PathLike) -> dict:
    """Read a curve file written by `save_curve` (rates "inf" back to math.inf); adds "path".

    Raises:
        FileNotFoundError: no such file. ValueError: not a curve file (format), or rows missing keys.
    """
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("format") != CURVE_FORMAT:
        raise ValueError(f"{path}: not a serving-curve file (format {CURVE_FORMAT!r} expected)")
    for key in ("device", "versions", "commit", "model", "settings"):
        if key not in doc:
            raise ValueError(f"{path}: a serving-curve file needs {key!r}")
    _check_rows(doc.get("rows"), f"{path}: rows")
    for row in doc["rows"]:
        row["rate"] = math.inf if row["rate"] == "inf" else row["rate"]
    doc["path"] = str(path)
    return doc


def list_curves(directory: str | os.PathLike | None = None, device_contains: str | None = None) -> list[dict]:
    """Every readable curve file in `directory` (default `DEFAULT_DIR`, data/bench/), oldest first (by date); other
    JSON files (bench files) and broken ones are skipped. device_contains: keep only devices whose name contains it."""
    folder = Path(directory) if directory is not None else DEFAULT_DIR
    docs = []
    for p in sorted(folder.glob("*.json")):
        try:
            doc = load_curve(p)
        except (OSError, ValueError):
            continue
        if device_contains is None or device_contains.lower() in str(doc["device"]).lower():
            docs.append(doc)
    return sorted(docs, key=lambda d: str(d.get("date") or ""))


def latest_curve(directory: str | os.PathLike | None = None, prefer: str | None = "H200") -> dict | None:
    """The newest curve file recorded on a GPU: the newest from a device whose name contains `prefer` (the course's
    reference GPU), else the newest from any other GPU (None: the newest from any GPU). CPU curves never count;
    None when there is none."""
    docs = [d for d in list_curves(directory) if "cpu" not in str(d["device"]).lower()]
    preferred = [d for d in docs if prefer is not None and prefer.lower() in str(d["device"]).lower()]
    return (preferred or docs or [None])[-1]
