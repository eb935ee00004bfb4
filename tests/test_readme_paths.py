"""Every repository path that README.md names in backticks exists.

Full paths (`docs/results.md`, `data/bench/nvidia-h200_kv_cache.json`) must exist as written; the shorthand
`..._20261201T072740Z.json` (the same folder and prefix as a path named before it) must match the end of some file
under data/. A README that cites a benchmark file or a script nobody committed would send a student looking for
figures that are not there.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
NAMED = sorted(set(re.findall(r"`([^`\s]+)`", README)))
FULL = [p for p in NAMED if re.match(r"(data|docs|labs|tools|kernels|llmlab|tests)/", p)]
SHORT = [p for p in NAMED if p.startswith("..._")]
DATA_FILES = [str(p.relative_to(ROOT)) for p in (ROOT / "data").rglob("*") if p.is_file()]


def test_the_readme_names_paths():
    assert len(FULL) >= 10, FULL


@pytest.mark.parametrize("path", FULL)
def test_named_path_exists(path):
    assert (ROOT / path).exists(), f"README.md names {path}, which is not in the repository"


def test_shorthand_resolves_to_a_data_file():
    missing = [short for short in SHORT if not any(f.endswith(short.removeprefix("...")) for f in DATA_FILES)]
    assert not missing, f"README.md names {missing}: no file under data/ ends with those names"
