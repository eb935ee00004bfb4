"""labs/03_kv_cache.ipynb: every code cell is valid Python, each exercise holds its answer between solution markers
(the student copy in labs/student/ raises NotImplementedError instead) and is checked by a later cell, and the lab's
exercise checks accept the reference answers and reject wrong ones (the notebook itself runs under nbval:
`pytest --nbval-lax labs/03_kv_cache.ipynb`; tests/test_exercises.py runs each exercise cell against its check)."""

import ast
import json
from pathlib import Path

import pytest

from llmlab.solutions import lab03

NB = Path(__file__).resolve().parents[1] / "labs" / "03_kv_cache.ipynb"
STUDENT = NB.parent / "student" / NB.name
EXERCISES = ("kv_bytes_per_token", "slot", "paged_waste_tokens")


def code_cells(path: Path = NB) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_cells_parse():
    code = code_cells()
    assert len(code) >= 10
    for c in code:
        ast.parse(c)


@pytest.mark.parametrize("name", EXERCISES)
def test_exercise_cell_holds_its_answer_between_markers(name):
    """The lab's cell writes the answer out between solution markers (nothing imported from llmlab.solutions), the
    student copy's raises NotImplementedError in its place, and a later cell checks the function with lab03's
    check."""
    code = code_cells()
    i, cell = next((i, c) for i, c in enumerate(code) if c.lstrip().startswith(f"def {name}("))
    assert "# BEGIN SOLUTION" in cell and "# END SOLUTION" in cell
    assert "llmlab.solutions" not in cell
    assert any(f"check_{name}({name})" in c for c in code[i + 1:])
    student = code_cells(STUDENT)
    cell = next(c for c in student if c.lstrip().startswith(f"def {name}("))
    assert 'raise NotImplementedError("write your answer here")' in cell and "SOLUTION" not in cell


def test_reference_answers_pass_their_checks():
    lab03.check_kv_bytes_per_token(lab03.kv_bytes_per_token)
    lab03.check_slot(lab03.slot)
    lab03.check_paged_waste_tokens(lab03.paged_waste_tokens)


@pytest.mark.parametrize("check, wrong", [
    (lab03.check_kv_bytes_per_token, lambda c, b=2: None),
    (lab03.check_kv_bytes_per_token, lambda c, b=2: 2 * c.n_layers * c.n_heads * c.head_dim * b),  # query heads
    (lab03.check_kv_bytes_per_token, lambda c, b=2: c.n_layers * c.n_kv_heads * c.head_dim * b),  # K only
    (lab03.check_slot, lambda t, p, bs: None),
    (lab03.check_slot, lambda t, p, bs: (p // bs, p % bs)),  # the block index, not the block id
    (lab03.check_slot, lambda t, p, bs: (t[p // 16], p % 16)),  # a fixed block size
    (lab03.check_paged_waste_tokens, lambda lengths, bs: None),
    (lab03.check_paged_waste_tokens, lambda lengths, bs: sum(bs - n % bs for n in lengths)),  # full blocks waste bs
    (lab03.check_paged_waste_tokens, lambda lengths, bs: sum(n % bs for n in lengths)),  # the filled part
])
def test_checks_reject_wrong_answers(check, wrong):
    with pytest.raises(AssertionError):
        check(wrong)
