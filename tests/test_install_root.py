"""Where llmlab finds the clone's data/ (the default model, bench files, traces) when it is installed elsewhere:
a non-editable `pip install .` puts the package in site-packages, away from data/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _root_seen(tmp_path: Path, cwd: Path, env_root: str | None = None) -> str:
    """REPO_ROOT as a copy of the package outside the clone computes it, started in `cwd`."""
    pkg = tmp_path / "site" / "llmlab"
    pkg.parent.mkdir(parents=True, exist_ok=True)
    if not pkg.exists():
        pkg.mkdir()
        (pkg / "__init__.py").write_text((ROOT / "llmlab" / "__init__.py").read_text())
    env = {"PYTHONPATH": str(pkg.parent), "PATH": "/usr/bin:/bin"}
    if env_root:
        env["LLMLAB_ROOT"] = env_root
    run = subprocess.run([sys.executable, "-c", "import llmlab; print(llmlab.REPO_ROOT)"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_an_installed_package_finds_the_clone_from_a_folder_inside_it(tmp_path):
    assert _root_seen(tmp_path, ROOT / "labs") == str(ROOT)
    assert _root_seen(tmp_path, ROOT) == str(ROOT)


def test_outside_the_clone_llmlab_root_names_it_and_without_it_data_is_missing(tmp_path):
    assert _root_seen(tmp_path, tmp_path, env_root=str(ROOT)) == str(ROOT)
    assert _root_seen(tmp_path, tmp_path) == str(tmp_path / "site")


def test_the_editable_package_uses_its_own_clone():
    import llmlab

    assert llmlab.REPO_ROOT == ROOT
