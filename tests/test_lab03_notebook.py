"""labs/03_kv_cache.ipynb: every code cell is valid Python, the exercises come unsolved (the reference answer stands
in, imported from llmlab.solutions.lab03, as in labs 00, 02, 05 and 07), and the lab's exercise checks accept the
reference answers and reject wrong ones (the notebook itself runs under nbval:
`pytest --nbval-lax labs/03_kv_cache.ipynb`)."""

import ast
import json
from pathlib import Path

import pytest

from llmlab.solutions import lab03

NB = Path(__file__).resolve().parents[1] / "labs" / "03_kv_cache.ipynb"
EXERCISES = ("kv_bytes_per_token", "slot", "paged_waste_tokens")


def code_cells() -> list[str]:
    return ["".join(c["source"]) for c in json.loads(NB.read_text())["cells"] if c["cell_type"] == "code"]


def test_cells_parse():
    code = code_cells()
    assert len(code) >= 10
    for c in code:
        ast.parse(c)


@pytest.mark.parametrize("name", EXERCISES)
def test_exercise_cell_is_a_skeleton(name):
    """The student's cell holds no answer: its body imports the reference and hands over to it, and a later cell
    checks the student's function with lab03's check."""
    code = code_cells()
    i, cell = next((i, c) for i, c in enumerate(code) if c.lstrip().startswith(f"def {name}("))
    assert "YOUR ANSWER HERE" in cell
    assert f"from llmlab.solutions.lab03 import {name} as reference" in cell
    assert any(f"check_{name}({name})" in c for c in code[i + 1:])


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
