"""labs/03_kv_cache.ipynb: every code cell is valid Python, and the lab's exercise checks accept the reference
answers (the notebook itself runs under nbval: `pytest --nbval-lax labs/03_kv_cache.ipynb`)."""

import ast
import json
from pathlib import Path

from llmlab.solutions import lab03

NB = Path(__file__).resolve().parents[1] / "labs" / "03_kv_cache.ipynb"


def test_cells_parse():
    cells = json.loads(NB.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert len(code) >= 10
    for c in code:
        ast.parse("".join(c["source"]))


def test_reference_answers_pass_their_checks():
    lab03.check_kv_bytes_per_token(lab03.kv_bytes_per_token)
    lab03.check_slot(lab03.slot)
    lab03.check_paged_waste_tokens(lab03.paged_waste_tokens)
