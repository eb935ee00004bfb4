"""labs/03_kv_cache.ipynb: every code cell is valid Python, each exercise holds its answer between solution markers
(the student copy in labs/student/ raises NotImplementedError instead) and is checked by a later cell, and the lab's
exercise checks accept the reference answers and reject wrong ones, and its timing claims are checked through verdicts
on repeated timings (the notebook itself runs under nbval: `pytest --nbval-lax labs/03_kv_cache.ipynb`;
tests/test_exercises.py runs each exercise cell against its check; tests/test_timing_spread.py tests the verdicts)."""

import ast
import json
import re
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


def test_timing_claims_go_through_verdicts():
    """"Step time rises with the context" and "reuse cuts the TTFT" are checked by `check_claim` on a verdict drawn
    from repeated timings (`context_trend`, `reuse_verdict`), which says "too noisy to conclude" on a busy machine,
    never by a bare comparison of two timings, which a busy machine can flip."""
    code = code_cells()
    sweep = next(c for c in code if "decode_latency_vs_context(" in c)
    assert "context_trend(" in sweep and "check_claim(" in sweep and "steps=" in sweep
    reuse = next(c for c in code if "reuse_ttft(" in c)
    assert "reuse_verdict(" in reuse and "check_claim(" in reuse and "rounds=" in reuse
    timed = re.compile(r"_ms\b|\bms\b|tokens_per_s|tpot|ttft")
    for c in code:
        for node in ast.walk(ast.parse(c)):
            if isinstance(node, ast.Assert):
                text = ast.unparse(node)
                assert not timed.search(ast.unparse(node.test)), f"a timing asserted without a verdict: {text}"
    assert timed.search(ast.unparse(ast.parse("assert last['none']['ttft_ms'] > last['contiguous']['ttft_ms']")))
