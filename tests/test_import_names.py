"""The repository root exposes no module that shadows an installed package.

Python puts the current directory (`python -c`, `python -m pytest`, a notebook kernel started there) or pytest's
rootdir on `sys.path` ahead of site-packages, so a top-level folder of this repository whose name is also an installed
package's module is imported in its place. transformers imports Hugging Face's `kernels` package whenever one is
installed; a top-level `kernels/` folder here broke every transformers model load. The Triton kernels therefore live
in `llmlab/kernels/`.
"""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_FIND_SPEC = (
    "import importlib.util, json, sys\n"
    "out = {}\n"
    "for name in sys.argv[1:]:\n"
    "    spec = importlib.util.find_spec(name)\n"
    "    out[name] = None if spec is None else (spec.origin or list(spec.submodule_search_locations or []))\n"
    "print(json.dumps(out))\n"
)


def _importable_names_at_root():
    """Names `import NAME` would find in the repository root: folders and .py files with identifier names."""
    names = []
    for entry in ROOT.iterdir():
        stem = entry.name[:-3] if entry.name.endswith(".py") and entry.is_file() else entry.name
        if entry.is_dir() and entry.name.startswith("."):
            continue
        if stem.isidentifier() and (entry.is_dir() or entry.name.endswith(".py")):
            names.append(stem)
    return sorted(names)


def _resolve_from(cwd, names):
    """Where each name resolves in a fresh `python -c` started in `cwd` (which puts cwd first on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", _FIND_SPEC, *names], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _inside_repo(found):
    """The paths of `found` that are this repository's own files (a virtual environment inside the clone is not)."""
    paths = found if isinstance(found, list) else [found]
    env = Path(sys.prefix).resolve()
    return [p for p in paths if p and Path(p).resolve().is_relative_to(ROOT) and not Path(p).resolve().is_relative_to(env)]


def test_no_top_level_kernels_module_from_the_repository_root():
    # From the root (python -c / python -m pytest / jupyter lab started there) and from labs/ (a notebook kernel).
    for cwd in (ROOT, ROOT / "labs"):
        found = _resolve_from(cwd, ["kernels"])["kernels"]
        assert not _inside_repo(found), (
            f"`import kernels` started in {cwd} resolves to this repository ({found}): it shadows Hugging Face's "
            "`kernels` package that transformers imports; keep the Triton kernels in llmlab/kernels/")


def test_no_top_level_kernels_module_under_pytest():
    # pytest (rootdir conftest.py, prepend import mode) puts the root on sys.path of this very process.
    spec = importlib.util.find_spec("kernels")
    found = None if spec is None else (spec.origin or list(spec.submodule_search_locations or []))
    assert not _inside_repo(found), f"`import kernels` inside pytest resolves to this repository: {found}"


def test_no_root_name_shadows_an_installed_distribution():
    installed = importlib.metadata.packages_distributions()   # top-level module -> distributions that install it
    clashes = {name: installed[name] for name in _importable_names_at_root()
               if name in installed and name != "llmlab"}
    assert not clashes, (f"top-level names in the repository shadow installed packages: {clashes}; rename them or "
                         "move them under llmlab/")


def test_the_check_sees_a_shadowing_folder(tmp_path):
    # The resolver above must be able to fail: a folder named like a module, in the start directory, wins.
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "__init__.py").write_text("")
    found = _resolve_from(tmp_path, ["csv"])["csv"]
    assert Path(found).resolve() == (tmp_path / "csv" / "__init__.py").resolve()


@pytest.mark.slow
def test_transformers_loads_a_llama_with_the_root_on_the_path():
    code = ("import torch\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
            "                  num_attention_heads=4, num_key_value_heads=2)\n"
            "m = LlamaForCausalLM(cfg)\n"
            "print(m(torch.tensor([[1, 2, 3]])).logits.shape)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "torch.Size([1, 3, 64])" in res.stdout


def test_python_started_inside_the_package_folder_gets_a_clear_error_for_kernels():
    """Started in llmlab/, `import kernels` (which transformers does) would find llmlab/kernels: it says why."""
    run = subprocess.run([sys.executable, "-c", "import kernels"], cwd=ROOT / "llmlab", capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0
    assert "started inside the llmlab/ folder" in run.stderr, run.stderr[-2000:]
