"""Make the student copies of the labs: labs/NN_*.ipynb -> labs/student/NN_*.ipynb, answers taken out.

A lab's code cells mark each reference answer with two comment lines:

    def quantize_int4_groupwise(w, group_size):
        # BEGIN SOLUTION
        ...the answer...
        # END SOLUTION

The student copy replaces every marked block, the two marker lines included, by one line at the indentation of its
`# BEGIN SOLUTION` line:

        raise NotImplementedError("write your answer here")

and clears every code cell's outputs and execution count. Markdown cells are copied as they are. Only labs with at
least one marker get a student copy (the others have no answer to take out).

    python3 tools/make_student_labs.py                 # every labs/NN_*.ipynb with markers -> labs/student/
    python3 tools/make_student_labs.py labs/04_quantization.ipynb
    python3 tools/make_student_labs.py --check         # exit 1 if a student copy is missing or out of date
    python3 tools/make_student_labs.py LAB... --out DIR  # other labs and folder (the tests use temporary ones)

This is a maintainers' step, run after editing a lab; students work in labs/student/, so a copy there may hold their
answers. A copy is rewritten only if it holds nothing a student may have written (`written_cells`): no exercise
cell (a stub in the new copy, matched by its cell id, or by position in a notebook without ids) without its stub
line, no exercise cell the copy lacks the id of, and no code cell with code whose id the lab does not have (a cell
the student added; a cell the maintainer removed from the lab looks the same). Such a copy is left as it is, with a
message naming it and those cells, and the tool exits 1 after writing the others; `--force` overwrites it anyway.
A copy whose stubs are untouched is rewritten as usual, and one that is not a readable notebook is refused the same
way (it may be a student's copy gone wrong). Work written above a stub line that is still there is not seen.

A marker out of balance (an END without a BEGIN, a BEGIN inside a block, a cell that ends inside a block) is an
error naming the notebook, the cell and the line; nothing is written then (exit 2). Standard library only.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
BEGIN = "# BEGIN SOLUTION"
END = "# END SOLUTION"
STUB = 'raise NotImplementedError("write your answer here")'


class MarkerError(ValueError):
    """Solution markers out of balance in a cell."""


def strip_solutions(source: str, where: str = "cell") -> tuple[str, int]:
    """(source with each marked block replaced by the stub line, number of blocks replaced).

    A marker is a line whose text, without its indentation and trailing spaces, is exactly BEGIN or END.
    Raises MarkerError (naming `where` and the 1-based line) for an END without a BEGIN, a BEGIN inside an open
    block, or a block still open at the end of the source."""
    out: list[str] = []
    open_at = None  # line number of the open block's BEGIN
    blocks = 0
    for i, line in enumerate(source.splitlines(keepends=True), 1):
        text = line.strip()
        if text == BEGIN:
            if open_at is not None:
                raise MarkerError(f"{where}, line {i}: {BEGIN!r} inside the block opened at line {open_at}; close it "
                                  f"with {END!r} first")
            open_at = i
            indent = line[:len(line) - len(line.lstrip())]
            out.append(indent + STUB + ("\n" if line.endswith("\n") else ""))
        elif text == END:
            if open_at is None:
                raise MarkerError(f"{where}, line {i}: {END!r} without a {BEGIN!r} before it")
            open_at = None
            blocks += 1
            if not line.endswith("\n") and out and out[-1].endswith("\n"):
                out[-1] = out[-1][:-1]  # the END line was the cell's last: the stub line ends the cell instead
        elif open_at is None:
            out.append(line)
    if open_at is not None:
        raise MarkerError(f"{where}, line {open_at}: {BEGIN!r} is never closed by {END!r}")
    return "".join(out), blocks


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def student_notebook(nb: dict, name: str = "notebook") -> tuple[dict, int]:
    """(a student copy of the notebook `nb` (a parsed .ipynb), number of answers taken out). `nb` is not changed.

    Code cells: markers replaced (`strip_solutions`), outputs and execution counts cleared. Raises MarkerError
    naming `name` and the cell (its index among all cells, from 0) for unbalanced markers."""
    out = copy.deepcopy(nb)
    total = 0
    for i, cell in enumerate(out.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        text, n = strip_solutions(_source(cell), f"{name}, cell {i}")
        total += n
        cell["source"] = text.splitlines(keepends=True)
        cell["outputs"] = []
        cell["execution_count"] = None
        cell.get("metadata", {}).pop("execution", None)
    return out, total


def dumps(nb: dict) -> str:
    """The notebook as Jupyter writes it: JSON, indent 1, keys sorted, non-ASCII kept, a final newline."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def default_labs() -> list[Path]:
    return sorted(LABS.glob("[0-9][0-9]_*.ipynb"))


def plan(paths: list[Path], out_dir: Path) -> list[tuple[Path, Path, str, int]]:
    """[(lab, student path, student text, answers taken out)] for every lab with markers. Reads and checks every
    lab before anything is written; raises MarkerError (unbalanced markers) or ValueError (not a notebook)."""
    jobs = []
    for p in paths:
        try:
            nb = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{p}: not a readable notebook ({e})") from e
        student, n = student_notebook(nb, p.name)
        if n:
            jobs.append((p, out_dir / p.name, dumps(student), n))
    return jobs


def _stubs(source: str) -> int:
    return sum(line.strip() == STUB for line in source.splitlines())


def _label(source: str) -> str:
    """A code cell's first `def`/`class` line (else its first line), shortened: how a student finds the cell."""
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    first = next((line for line in lines if line.startswith(("def ", "class "))), lines[0] if lines else "empty")
    return first if len(first) <= 60 else first[:57] + "..."


def written_cells(current: str, student: dict) -> list[str] | None:
    """What a student may have written in `current` (the text of a copy on disk) that `student` (the new copy)
    would lose: each as 'cell I (first line)', I its index in `current` from 0. It counts

    * an exercise cell (one holding the stub in the new copy) with fewer stub lines in `current`, matched by cell id,
      or by position where ids are missing; an exercise cell whose id `current` does not have counts as unknown;
    * a code cell of `current` with code in it and an id the new copy does not have (a cell the student added).

    None when `current` is not a readable notebook (a JSON object whose "cells" is a list)."""
    try:
        old = json.loads(current)
        old_cells = old["cells"]
        if not isinstance(old_cells, list):
            return None
        by_id = {c["id"]: i for i, c in enumerate(old_cells) if c.get("id")}
    except (ValueError, TypeError, AttributeError, KeyError):
        return None
    found = []
    new_cells = student.get("cells", [])
    for i, cell in enumerate(new_cells):
        stubs = _stubs(_source(cell)) if cell.get("cell_type") == "code" else 0
        if not stubs:
            continue
        if cell.get("id") and by_id:
            j = by_id.get(cell["id"])
            if j is None:
                found.append(f"the exercise cell {_label(_source(cell))!r}, not found by its id")
                continue
        else:
            j = i if i < len(old_cells) else None
        if j is not None and _stubs(_source(old_cells[j])) < stubs:
            found.append(f"cell {j} ({_label(_source(cell))})")
    new_ids = {c.get("id") for c in new_cells}
    found += [f"cell {j} ({_label(_source(c))}), added" for j, c in enumerate(old_cells)
              if c.get("cell_type") == "code" and c.get("id") and c["id"] not in new_ids and _source(c).strip()]
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write labs/student/ copies of the labs with the answers taken out "
                                             "(a maintainers' step: students work in the copies).")
    ap.add_argument("labs", nargs="*", type=Path, help="notebooks to convert (default: every labs/NN_*.ipynb)")
    ap.add_argument("--out", type=Path, default=LABS / "student", help="folder for the copies (default labs/student)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a copy is missing or stale")
    ap.add_argument("--force", action="store_true", help="overwrite copies even where exercise cells are written in "
                                                         "(the answers there are lost)")
    args = ap.parse_args(argv)
    try:
        jobs = plan(args.labs or default_labs(), args.out)
    except ValueError as e:
        print(f"make_student_labs: {e}", file=sys.stderr)
        return 2
    stale, refused = [], []
    for lab, dest, text, n in jobs:
        current = dest.read_text(encoding="utf-8") if dest.exists() else None
        if args.check:
            if current != text:
                stale.append(dest)
            continue
        if current is not None and current != text and not args.force:
            written = written_cells(current, json.loads(text))
            if written is None or written:
                refused.append(dest)
                why = "it may hold a student's work: " + ", ".join(written) if written else "not a readable notebook"
                keep = dest.with_name(f"{dest.stem}_mine{dest.suffix}")
                print(f"{dest}: NOT overwritten: {why}.\n  To keep that work, copy the notebook under another name "
                      f"first (cp {dest} {keep}); to discard it, rerun with --force.", file=sys.stderr)
                continue
        if current != text:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text, encoding="utf-8")
        print(f"{lab.name}: {n} answer(s) taken out -> {dest}")
    if not jobs:
        print("no lab has solution markers: nothing to write")
    if stale:
        print("out of date (run python3 tools/make_student_labs.py): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    if refused:
        print(f"{len(refused)} copy(ies) not overwritten, see above: " + ", ".join(map(str, refused)), file=sys.stderr)
        return 1
    if args.check and jobs:
        print(f"{len(jobs)} student copies are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
