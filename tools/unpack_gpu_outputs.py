"""Unpack the executed labs that tools/run_labs.py archived (gpu-outputs.tar.gz, and gpu-outputs-2.tar.gz ... when
one file would have been over 16 MiB) into labs/gpu-outputs/NN_*.ipynb.

A notebook is written only when it ran clean: its "llmlab_run" metadata says status "ok", no cell holds an error
output, its first cell is the run header (tag `llmlab-run-header`) naming the device, and labs/ has a lab of the
same name. A copy run on a machine without CUDA (the header says "no CUDA GPU") is refused too, unless --allow-cpu.
Refused notebooks are listed with the reason (for errors: the cell and the error) and not written; the others are.

    python3 tools/unpack_gpu_outputs.py /path/to/gpu-outputs*.tar.gz           # -> labs/gpu-outputs/
    python3 tools/unpack_gpu_outputs.py gpu-outputs.tar.gz --dry-run           # check only, write nothing
    python3 tools/unpack_gpu_outputs.py gpu-outputs.tar.gz --dest /tmp/x --allow-cpu
    python3 tools/unpack_gpu_outputs.py gpu-outputs.tar.gz --drop-widget-state   # ~5 MB less per live figure

Each file is written whole (a temporary file, then a rename) with the bytes the archive holds. --drop-widget-state
removes the notebook metadata "widgets" instead (each plotly FigureWidget keeps a copy of plotly.js there, ~5 MB,
which lets JupyterLab draw the live figures as they ended; without it their outputs show the figure's text form) and
writes the notebook as nbformat does (indent 1, sorted keys). Exit status: 0 when
every notebook in the archives was taken, 1 when one was refused, 2 for an archive that cannot be read or two
copies of one lab. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
DEST = LABS / "gpu-outputs"
HEADER_TAG = "llmlab-run-header"  # the tag tools/run_labs.py gives the cell it adds
NAME = re.compile(r"^[0-9][0-9]_[A-Za-z0-9_-]+\.ipynb$")


def problems(name: str, data: bytes, allow_cpu: bool = False) -> list[str]:
    """Why the executed notebook `name` (its file bytes `data`) may not go into labs/gpu-outputs/; [] when it may.

    Checks, in order: a lab of that name exists in labs/, the bytes are a version-4 notebook, its "llmlab_run"
    metadata says "ok", the first cell is the run header with a "device:" line (not "no CUDA GPU" unless
    `allow_cpu`), and no cell has an error output (each one listed with its 0-based cell number in the lab)."""
    if not NAME.match(name) or not (LABS / name).is_file():
        return [f"labs/ has no lab named {name}"]
    try:
        nb = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"not a notebook (JSON: {e})"]
    if not isinstance(nb, dict) or nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
        return ["not a version-4 notebook"]
    found = []
    run = nb.get("metadata", {}).get("llmlab_run", {})
    if run.get("status") != "ok":
        found.append(f"the run's status is {run.get('status', 'missing')!r}: {run.get('error', '')}".rstrip(": "))
    cells = nb["cells"]
    header = cells[0] if cells else {}
    text = "".join("".join(o.get("text", "")) for o in header.get("outputs", []) if o.get("output_type") == "stream")
    device = next((ln.partition(":")[2].strip() for ln in text.splitlines() if ln.startswith("device:")), None)
    if HEADER_TAG not in header.get("metadata", {}).get("tags", []) or device is None:
        found.append("the first cell is not tools/run_labs.py's header naming the device")
    elif device.startswith("no CUDA GPU") and not allow_cpu:
        found.append(f"it ran without a GPU ({device}); --allow-cpu keeps such copies")
    for i, cell in enumerate(cells):
        for out in cell.get("outputs", []) or []:
            if out.get("output_type") == "error":
                where = "the header cell" if i == 0 else f"cell {i - 1}"
                found.append(f"{where} has an error output: {out.get('ename', '?')}: {out.get('evalue', '')}"[:300])
    return found


def drop_widget_state(data: bytes) -> bytes:
    """The notebook `data` without its saved widget state (metadata "widgets"), in nbformat's JSON layout."""
    nb = json.loads(data)
    nb.get("metadata", {}).pop("widgets", None)
    return (json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def read_archive(path: Path) -> dict[str, bytes]:
    """{file name: bytes} of the notebooks in the archive at `path` (members gpu-outputs/NN_*.ipynb, or NN_*.ipynb
    at its top). Other members are skipped; one whose path leaves its folder ('..', absolute) is refused.
    Raises ValueError naming `path` for a file that is not a readable tar archive, or one with two copies of a
    name."""
    try:
        tar = tarfile.open(path, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise ValueError(f"{path}: not a readable tar archive ({e}); pass the gpu-outputs.tar.gz that "
                         "tools/run_labs.py wrote") from e
    found: dict[str, bytes] = {}
    with tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if not m.isfile() or Path(m.name).is_absolute() or ".." in parts or not m.name.endswith(".ipynb"):
                continue
            if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gpu-outputs"):
                continue
            if parts[-1] in found:
                raise ValueError(f"{path}: holds {parts[-1]} twice; unpack one run's archive at a time")
            found[parts[-1]] = tar.extractfile(m).read()
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Unpack run_labs.py's gpu-outputs.tar.gz into labs/gpu-outputs/, "
                                             "refusing notebooks that did not run clean.")
    ap.add_argument("archives", type=Path, nargs="+",
                    help="the gpu-outputs.tar.gz (and gpu-outputs-2.tar.gz ...) that tools/run_labs.py wrote")
    ap.add_argument("--dest", type=Path, default=DEST, help="folder to write into (default labs/gpu-outputs)")
    ap.add_argument("--allow-cpu", action="store_true", help="keep copies that ran without a CUDA GPU")
    ap.add_argument("--dry-run", action="store_true", help="check and report, write nothing")
    ap.add_argument("--drop-widget-state", action="store_true",
                    help="leave out the saved widget state (plotly.js for each live figure, ~5 MB each)")
    args = ap.parse_args(argv)
    if args.dest.resolve() == LABS.resolve():
        ap.error("--dest is labs/ itself, where the labs without outputs live; use labs/gpu-outputs (the default)")
    for archive in args.archives:
        if not archive.is_file():
            ap.error(f"archive {archive} does not exist; pass the gpu-outputs.tar.gz that run_labs.py wrote")
    notebooks: dict[str, bytes] = {}
    try:
        for archive in args.archives:
            found = read_archive(archive)
            twice = sorted(set(found) & set(notebooks))
            if twice:
                raise ValueError(f"{archive}: {', '.join(twice)} also in an archive named before it; unpack one "
                                 "run's archives at a time")
            notebooks.update(found)
    except ValueError as e:
        print(f"unpack_gpu_outputs.py: {e}", file=sys.stderr)
        return 2
    if not notebooks:
        print(f"unpack_gpu_outputs.py: {' '.join(map(str, args.archives))} hold no NN_*.ipynb notebook",
              file=sys.stderr)
        return 2
    taken, refused = [], {}
    for name, data in sorted(notebooks.items()):
        why = problems(name, data, args.allow_cpu)
        if why:
            refused[name] = why
            continue
        taken.append(name)
        if not args.dry_run:
            args.dest.mkdir(parents=True, exist_ok=True)
            tmp = args.dest / (name + ".part")
            tmp.write_bytes(drop_widget_state(data) if args.drop_widget_state else data)
            tmp.replace(args.dest / name)
    verb = "would write" if args.dry_run else "wrote"
    print(f"{verb} {len(taken)} notebooks into {args.dest}: {' '.join(taken) or '-'}")
    for name, why in refused.items():
        print(f"REFUSED {name}:\n" + "\n".join(f"  - {w}" for w in why))
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
