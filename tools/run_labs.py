"""Execute the lab notebooks with nbclient and keep the executed copies: labs/NN_*.ipynb -> OUT/gpu-outputs.tar.gz.

Each lab runs in a fresh python3 kernel (the interpreter running this script, so the kernel sees the same PYTHONPATH)
with labs/ as its working folder, as nbval runs them. Before the lab's own cells the copy gets ONE extra code cell,
tagged `llmlab-run-header`, whose output names the device (GPU name, memory, driver, torch and CUDA versions; on a
machine without CUDA "no CUDA GPU: cpu ..."), the UTC date and the commit ($LLMLAB_COMMIT). A lab stops at its first
cell that raises (recorded as failed, with the cell and the error) or when its time is up (timeout); the next lab
runs all the same. A lab is not started when fewer than --min-lab-s seconds of --deadline-s are left: it is listed
as not run, with the LABS=... line that runs the rest.

    python3 tools/run_labs.py --out /tmp/labs                     # every labs/NN_*.ipynb, in order
    python3 tools/run_labs.py --out /tmp/labs 00 04_quantization  # a subset (number, name or path); or LABS="00 04"
    python3 tools/run_labs.py --list                              # the labs it would run

It writes into --out: gpu-outputs.tar.gz (the executed notebooks as gpu-outputs/NN_*.ipynb, every lab that started,
rewritten after each lab, so a run that is killed keeps what it finished; past 16 MiB, the largest file that comes
back from the GPU machine, the labs that do not fit go on into gpu-outputs-2.tar.gz, ...) and labs.log (one line
per lab: status, seconds, size, and for a failure the cell and the error; then a summary). Each executed copy records
the run in its notebook metadata under "llmlab_run" (status, seconds, device, date, commit, error).
tools/unpack_gpu_outputs.py unpacks the archives into labs/gpu-outputs/ and refuses copies that did not run clean.

Needs nbformat, nbclient, jupyter_client and ipykernel (no Jupyter server, no installed kernelspec: a python3
kernelspec for this interpreter is written to a temporary JUPYTER_PATH). Exit status: 0 when every lab asked for ran
clean, 1 when one failed, timed out or was not run, 2 for bad arguments or a missing package.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
ARCHIVE = "gpu-outputs.tar.gz"
ARCHIVE_FOLDER = "gpu-outputs"  # the folder inside the archive, and under labs/ once unpacked
HEADER_TAG = "llmlab-run-header"
ARCHIVE_LIMIT = 16 * 2**20  # bytes: the largest file that comes back from the GPU machine
NEEDED = ("nbformat", "nbclient", "jupyter_client", "ipykernel", "plotly", "ipywidgets", "anywidget")

HEADER_SOURCE = '''\
# Where and when this copy of the lab ran: added by tools/run_labs.py, not part of the lab.
def _run_header():
    import datetime, os, platform, subprocess
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        n = torch.cuda.device_count()
        device = f"{n} x " if n > 1 else ""
        device += f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.split("\\n")[0].strip()
            device += f", driver {smi}" if smi else ""
        except (OSError, subprocess.SubprocessError):
            pass
        device += f" (torch {torch.__version__}, CUDA {torch.version.cuda})"
    else:
        device = f"no CUDA GPU: cpu ({platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__})"
    print("device:", device)
    print("date:  ", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))
    print("commit:", os.environ.get("LLMLAB_COMMIT", "-"))


_run_header()
del _run_header
'''

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class LabResult:
    """One lab's run: status is "ok", "failed" (a cell raised, or the kernel died) or "timeout"."""
    name: str
    status: str
    seconds: float
    error: str = ""  # "cell N (...): Name: message" for a failure, empty when ok
    device: str = ""
    date: str = ""
    nb: object = field(default=None, repr=False)  # the executed nbformat.NotebookNode


def all_labs() -> list[Path]:
    """Every labs/NN_*.ipynb, in order (labs/student/ and labs/gpu-outputs/ are not among them)."""
    return sorted(LABS.glob("[0-9][0-9]_*.ipynb"))


def resolve_labs(names: list[str]) -> list[Path]:
    """The labs named by `names` (a two-digit number "04", a file name with or without .ipynb, or a path), in the
    order given; every lab when `names` is empty. Raises ValueError naming the argument that matches no lab, or one
    that matches several."""
    labs = all_labs()
    if not names:
        return labs
    out = []
    for name in names:
        stem = Path(name).name.removesuffix(".ipynb")
        stem = stem.zfill(2) if stem.isdigit() else stem
        hits = [p for p in labs if p.stem == stem or (len(stem) == 2 and stem.isdigit() and p.name[:2] == stem)]
        if len(hits) != 1:
            choices = " ".join(p.stem[:2] for p in labs)
            raise ValueError(f"lab {name!r} matches {len(hits)} notebooks in labs/; name one of: {choices} "
                             "(a number, a file name or a path)")
        if hits[0] not in out:
            out.append(hits[0])
    return out


def header_cell():
    """The code cell put before a lab's own cells: its output names the device, the UTC date and the commit."""
    import nbformat

    cell = nbformat.v4.new_code_cell(HEADER_SOURCE)
    cell.metadata["tags"] = [HEADER_TAG]
    return cell


def _header_fields(cell) -> dict[str, str]:
    """{"device": ..., "date": ..., "commit": ...} read from the executed header cell's printed lines."""
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("device", "date", "commit"):
            found[key.strip()] = value.strip()
    return found


def _prepare_environment(tmp: Path) -> None:
    """Point Jupyter and IPython at folders under `tmp` (nothing read from or left in the user's home) and write
    a python3 kernelspec for this interpreter there, first on JUPYTER_PATH, so the kernel is this Python whatever
    kernelspecs the machine has. PYTHONPATH gets the repository root (the labs import llmlab from it)."""
    spec = tmp / "data" / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python", "metadata": {"debugger": False}}))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.update({
        "JUPYTER_PATH": os.pathsep.join([str(tmp / "data")] + [p for p in os.environ.get("JUPYTER_PATH", "").split(
            os.pathsep) if p]),
        "JUPYTER_DATA_DIR": str(tmp / "data"), "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "IPYTHONDIR": str(tmp / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in paths if p != str(ROOT)]),
    })


def run_lab(path: Path, limit_s: float, cell_timeout_s: float) -> LabResult:
    """Execute the lab at `path` (header cell first) in a fresh python3 kernel whose working folder is labs/.

    `limit_s` (seconds) bounds the whole lab: each cell gets the lab's time left, at most `cell_timeout_s`. The
    kernel is shut down afterwards in every case. Returns a LabResult whose `nb` is the executed copy with its
    "llmlab_run" metadata; never raises for an error inside the lab."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, header_cell())
    client = NotebookClient(nb, kernel_name="python3", timeout=int(max(1, min(limit_s, cell_timeout_s))),
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.monotonic()
    status, error, index = "ok", "", -1
    try:
        with client.setup_kernel():
            info = client.wait_for_reply(client.kc.kernel_info())
            if info and "language_info" in info["content"]:
                nb.metadata["language_info"] = info["content"]["language_info"]
            try:
                for index, cell in enumerate(nb.cells):
                    left = limit_s - (time.monotonic() - start)
                    if left < 1:
                        raise CellTimeoutError(f"the lab's {limit_s:.0f} s were up before cell {index}")
                    client.timeout = int(max(1, min(left, cell_timeout_s)))
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                client.set_widgets_metadata()
            except (CellTimeoutError, DeadKernelError):
                client.shutdown_kernel = "immediate"  # a busy or dead kernel cannot answer a polite shutdown
                raise
    except CellExecutionError as e:
        status, error = "failed", f"{e.ename}: {e.evalue}"
        lines = ANSI.sub("", e.traceback).splitlines()
        # nbclient's message quotes the cell's source between two lines of dashes: keep what follows, the traceback
        seps = [i for i, ln in enumerate(lines) if ln.strip() == "-" * 18]
        tail = [ln for ln in lines[seps[-1] + 1 if seps else 0:] if ln.strip()][-12:]
        error += "\n" + "\n".join("      " + ln for ln in tail)
    except CellTimeoutError as e:
        status, error = "timeout", f"time up after {limit_s:.0f} s ({str(e).splitlines()[0][:200]})"
    except DeadKernelError as e:
        status, error = "failed", f"the kernel died: {e}"
    except Exception as e:  # the kernel did not start, the client broke: this lab fails, the next one still runs
        status, error = "failed", f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if status != "ok" and index >= 0:
        source = "".join(nb.cells[index].source).strip().splitlines()
        first = source[0][:80] if source else ""
        where = "the header cell" if index == 0 else f"cell {index - 1} of labs/{path.name} (0-based)"
        error = f"{where}, starting {first!r}: {error}"
    found = _header_fields(nb.cells[0])
    nb.metadata["llmlab_run"] = {"status": status, "seconds": round(seconds, 1), "error": error.split("\n")[0],
                                 "device": found.get("device", ""), "date": found.get("date", ""),
                                 "commit": found.get("commit", os.environ.get("LLMLAB_COMMIT", "-")),
                                 "tool": "tools/run_labs.py"}
    return LabResult(path.name, status, seconds, error, found.get("device", ""), found.get("date", ""), nb)


def write_archive(out: Path, results: list[LabResult], limit: int = ARCHIVE_LIMIT) -> list[Path]:
    """Write the executed copies into out/ARCHIVE as ARCHIVE_FOLDER/NN_*.ipynb, each file atomically (a temporary
    file, then a rename). When they would not fit in `limit` bytes, the labs that do not fit go on, in order, into
    out/gpu-outputs-2.tar.gz, -3, ...: no archive is larger than `limit` unless one notebook alone is. Parts left
    from an earlier write that are no longer needed are removed. Returns the archives written."""
    import gzip

    import nbformat

    parts: list[list[tuple[str, bytes]]] = [[]]
    used = 0
    for r in results:
        data = nbformat.writes(r.nb).encode()
        packed = len(gzip.compress(data, compresslevel=6)) + 2048  # what it adds to the archive, tar header included
        if parts[-1] and used + packed > limit - 2**20:  # a MiB kept spare: the estimate is close, not exact
            parts.append([])
            used = 0
        parts[-1].append((r.name, data))
        used += packed
    written = []
    for k, files in enumerate(parts, 1):
        path = out / (ARCHIVE if k == 1 else ARCHIVE.replace(".tar.gz", f"-{k}.tar.gz"))
        tmp = path.with_name(path.name + ".part")
        with tarfile.open(tmp, "w:gz") as tar:
            for name, data in files:
                info = tarfile.TarInfo(f"{ARCHIVE_FOLDER}/{name}")
                info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
                tar.addfile(info, io.BytesIO(data))
        tmp.replace(path)
        written.append(path)
    for stale in out.glob(ARCHIVE.replace(".tar.gz", "-*.tar.gz")):
        if stale not in written:
            stale.unlink()
    return written


def _size_note(nb) -> str:
    """"N.N MiB" of the executed notebook, with the share of its saved widget state (each plotly FigureWidget
    saves plotly.js, ~5 MB, there)."""
    import nbformat

    total = len(nbformat.writes(nb).encode())
    widgets = len(json.dumps(nb.metadata.get("widgets", {})))
    note = f"{total / 2**20:.1f} MiB"
    return note + (f" ({widgets / 2**20:.1f} MiB widget state)" if widgets > 2**20 else "")


def _check_packages() -> str:
    """"name version, ..." of the packages the run needs; raises SystemExit(2) naming those that do not import."""
    from importlib import import_module

    found, missing = [], []
    for name in NEEDED:
        try:
            found.append(f"{name} {getattr(import_module(name), '__version__', '?')}")
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        raise SystemExit("run_labs.py: these packages do not import: " + ", ".join(missing) +
                         "; install them (on the GPU machine: carry their wheels, see tools/README.md)")
    return ", ".join(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Execute the labs with nbclient and archive the executed copies.")
    ap.add_argument("labs", nargs="*", help="labs to run: 00, 04_quantization or labs/04_quantization.ipynb "
                                            "(default: $LABS, else every labs/NN_*.ipynb)")
    ap.add_argument("--out", type=Path, help="folder for gpu-outputs.tar.gz and labs.log (created)")
    ap.add_argument("--lab-timeout-s", type=float, default=float(os.environ.get("LAB_TIMEOUT_S", 300)),
                    help="seconds one lab may take (default $LAB_TIMEOUT_S or 300)")
    ap.add_argument("--cell-timeout-s", type=float, default=600, help="seconds one cell may take (default 600)")
    ap.add_argument("--deadline-s", type=float, default=3600, help="seconds for the whole run (default 3600)")
    ap.add_argument("--min-lab-s", type=float, default=30,
                    help="do not start a lab with fewer seconds than this left of the deadline (default 30)")
    ap.add_argument("--list", action="store_true", help="print the labs that would run, and exit")
    args = ap.parse_args(argv)
    start = time.monotonic()
    try:
        labs = resolve_labs(args.labs or os.environ.get("LABS", "").replace(",", " ").split())
    except ValueError as e:
        ap.error(str(e))
    if args.list:
        print("\n".join(str(p.relative_to(ROOT)) for p in labs))
        return 0
    if args.out is None:
        ap.error("--out is required: the folder for gpu-outputs.tar.gz and labs.log")
    for name in ("lab_timeout_s", "cell_timeout_s", "deadline_s"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    args.out.mkdir(parents=True, exist_ok=True)
    versions = _check_packages()
    log_path = args.out / "labs.log"
    log = log_path.open("a")

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    say(f"# run_labs: {len(labs)} labs, {args.lab_timeout_s:.0f} s each at most, deadline {args.deadline_s:.0f} s; "
        f"python {sys.version.split()[0]}; {versions}; commit {os.environ.get('LLMLAB_COMMIT', '-')}")
    results: list[LabResult] = []
    not_run: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="llmlab-labs-") as tmp:
        _prepare_environment(Path(tmp))
        for i, path in enumerate(labs):
            left = args.deadline_s - (time.monotonic() - start)
            if left < args.min_lab_s:
                not_run = labs[i:]
                break
            say(f"### {path.name}: started at {time.monotonic() - start:.0f} s, limit "
                f"{min(args.lab_timeout_s, left):.0f} s")
            r = run_lab(path, min(args.lab_timeout_s, left), args.cell_timeout_s)
            results.append(r)
            say(f"{r.name:32s} {r.status.upper() if r.status != 'ok' else 'ok':8s} {r.seconds:7.1f} s  "
                f"{_size_note(r.nb)}" + (f"; device: {r.device}; date: {r.date}" if r.status == "ok" else
                                         f"\n    {r.error}"))
            archives = write_archive(args.out, results)
    ok = sum(r.status == "ok" for r in results)
    say(f"# summary: {ok} ok, {sum(r.status == 'failed' for r in results)} failed, "
        f"{sum(r.status == 'timeout' for r in results)} timed out, {len(not_run)} not run; "
        f"{time.monotonic() - start:.0f} s in all")
    if results:
        sizes = [p.stat().st_size for p in archives]
        say(f"# {len(results)} notebooks in " + ", ".join(f"{p.name} ({n / 2**20:.2f} MiB)" for p, n in
                                                           zip(archives, sizes))
            + (f"; one is OVER the {ARCHIVE_LIMIT // 2**20} MiB a file that comes back from the GPU machine may "
               "have: run that lab alone" if max(sizes) > ARCHIVE_LIMIT else ""))
    if not_run:
        say("# not run (the time was up): " + " ".join(p.name for p in not_run))
        say("# to run them: LABS=\"" + " ".join(p.name[:2] for p in not_run) + "\"")
    log.close()
    return 0 if ok == len(labs) else 1


if __name__ == "__main__":
    sys.exit(main())
