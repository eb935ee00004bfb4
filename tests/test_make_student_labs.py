"""tools/make_student_labs.py never overwrites a student's answers without --force: a copy whose exercise cells have
been written in is left as it is (exit 1, naming the notebook and the cells), the other copies are still written, and
a stale copy with its stubs untouched is rewritten. Every test works on copies under tmp_path, never on labs/."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "make_student_labs.py"
STUB = 'raise NotImplementedError("write your answer here")'

_spec = importlib.util.spec_from_file_location("make_student_labs", TOOL)
msl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(msl)


def _lab(path: Path, answer: str = "return 42", intro: str = "x = 1\n", ids: bool = True) -> Path:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": ["# A lab\n"]},
             {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": [intro]},
             {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
              "source": ["def f():\n", "    # BEGIN SOLUTION\n", f"    {answer}\n", "    # END SOLUTION\n"]}]
    if ids:
        for i, cell in enumerate(cells):
            cell["id"] = f"cell-{i}"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5 if ids else 4}))
    return path


def _write_answer(copy: Path, answer: str = "    return 41\n") -> str:
    """Replace the stub line of `copy` by `answer`, as a student does in Jupyter; the new text of the copy."""
    nb = json.loads(copy.read_text())
    cell = nb["cells"][2]
    cell["source"] = [answer if line.strip() == STUB else line for line in cell["source"]]
    text = json.dumps(nb, indent=1)
    copy.write_text(text)
    return text


def _code(copy: Path) -> str:
    return "".join("".join(c["source"]) for c in json.loads(copy.read_text())["cells"])


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=60)


def test_a_copy_with_a_written_answer_is_refused_and_left_as_it_is(tmp_path):
    lab, other, out = _lab(tmp_path / "00_a.ipynb"), _lab(tmp_path / "01_b.ipynb"), tmp_path / "student"
    assert _run(str(lab), str(other), "--out", str(out)).returncode == 0
    mine = _write_answer(out / "00_a.ipynb")
    _lab(lab, intro="x = 2\n")  # the maintainers edit both labs: both copies are stale
    _lab(other, intro="x = 2\n")
    done = _run(str(lab), str(other), "--out", str(out))
    assert done.returncode == 1
    assert (out / "00_a.ipynb").read_text() == mine  # the answer is still there
    assert "NOT overwritten" in done.stderr and str(out / "00_a.ipynb") in done.stderr
    assert "cell 2 (def f():)" in done.stderr and "--force" in done.stderr and "cp " in done.stderr
    assert "x = 2" in _code(out / "01_b.ipynb")  # the other copy is still written
    assert _run(str(lab), str(other), "--out", str(out), "--check").returncode == 1  # --check: stale, as before


def test_force_overwrites_a_copy_with_a_written_answer(tmp_path):
    lab, out = _lab(tmp_path / "00_a.ipynb"), tmp_path / "student"
    assert msl.main([str(lab), "--out", str(out)]) == 0
    _write_answer(out / "00_a.ipynb")
    _lab(lab, intro="x = 2\n")
    assert msl.main([str(lab), "--out", str(out), "--force"]) == 0
    code = _code(out / "00_a.ipynb")
    assert STUB in code and "return 41" not in code and "x = 2" in code
    assert msl.main([str(lab), "--out", str(out), "--check"]) == 0


def test_a_stale_copy_with_its_stubs_untouched_is_rewritten(tmp_path):
    lab, out = _lab(tmp_path / "00_a.ipynb"), tmp_path / "student"
    assert msl.main([str(lab), "--out", str(out)]) == 0
    _lab(lab, answer="return 43", intro="x = 2\n")
    assert msl.main([str(lab), "--out", str(out), "--check"]) == 1
    assert msl.main([str(lab), "--out", str(out)]) == 0
    assert msl.main([str(lab), "--out", str(out), "--check"]) == 0


def test_cells_are_matched_by_id_and_by_position_without_ids(tmp_path):
    out = tmp_path / "student"
    for ids in (True, False):
        lab = _lab(tmp_path / "00_a.ipynb", ids=ids)
        assert msl.main([str(lab), "--out", str(out), "--force"]) == 0
        mine = _write_answer(out / "00_a.ipynb")
        student = json.loads((out / "00_a.ipynb").read_text())
        fresh, _ = msl.student_notebook(json.loads(_lab(lab, intro="x = 2\n", ids=ids).read_text()))
        assert msl.written_cells(mine, fresh) == ["cell 2 (def f():)"]
        if ids:  # the cells moved: the id still finds the written one
            student["cells"].reverse()
            assert msl.written_cells(json.dumps(student), fresh) == ["cell 0 (def f():)"]
        assert msl.main([str(lab), "--out", str(out)]) == 1


def test_an_unreadable_copy_is_refused_without_force(tmp_path, capsys):
    lab, out = _lab(tmp_path / "00_a.ipynb"), tmp_path / "student"
    out.mkdir()
    (out / "00_a.ipynb").write_text("<<<<<<< HEAD\n{")
    assert msl.main([str(lab), "--out", str(out)]) == 1
    assert "not a readable notebook" in capsys.readouterr().err
    assert (out / "00_a.ipynb").read_text() == "<<<<<<< HEAD\n{"
    assert msl.main([str(lab), "--out", str(out), "--force"]) == 0


def test_help_names_force_and_the_folders():
    text = _run("--help").stdout
    assert "--force" in text and "--out" in text and "labs" in text


def test_an_answer_in_an_added_cell_or_an_exercise_cell_the_copy_lacks_is_kept(tmp_path):
    lab, out = _lab(tmp_path / "00_a.ipynb"), tmp_path / "student"
    assert msl.main([str(lab), "--out", str(out)]) == 0
    copy_path = out / "00_a.ipynb"
    nb = json.loads(copy_path.read_text())
    nb["cells"].insert(3, {"cell_type": "code", "id": "mine", "metadata": {}, "execution_count": None,
                           "outputs": [], "source": ["def f():\n", "    return 41\n"]})  # the stub cell untouched
    added = json.dumps(nb, indent=1)
    copy_path.write_text(added)
    _lab(lab, intro="x = 2\n")
    assert msl.main([str(lab), "--out", str(out)]) == 1 and copy_path.read_text() == added
    fresh, _ = msl.student_notebook(json.loads(lab.read_text()))
    assert msl.written_cells(added, fresh) == ["cell 3 (def f():), added"]
    nb["cells"].pop(3)
    nb["cells"][2]["id"] = "renamed"  # the exercise cell's id differs from the lab's: it cannot be matched
    assert msl.written_cells(json.dumps(nb), fresh)[0].endswith("not found by its id")
    nb["cells"][2]["source"] = []  # an EMPTY added code cell holds nothing; the unmatched exercise still counts
    assert len(msl.written_cells(json.dumps(nb), fresh)) == 1


@pytest.mark.parametrize("text", ["[]", "{}", '"hello"', '{"cells": 5}'])
def test_json_that_is_not_a_notebook_is_refused_without_force(tmp_path, text):
    lab, out = _lab(tmp_path / "00_a.ipynb"), tmp_path / "student"
    out.mkdir()
    (out / "00_a.ipynb").write_text(text)
    assert msl.main([str(lab), "--out", str(out)]) == 1 and (out / "00_a.ipynb").read_text() == text
