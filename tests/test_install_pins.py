"""The install a student runs is the one CI tests: constraints.txt pins every dependency, and the README, .ci/run
and Binder's environment.yml all read it, with the same torch release.

A course that installs whatever is newest the day a student arrives breaks when an upstream release does (transformers
5.25 began importing a module named `kernels`); pinning the tested set keeps a fresh install today and in six months
the same. `.ci/newest` tries the newest releases separately and only reports.
"""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+!\-]+)", line)
        assert m, f"constraints.txt: {line!r} is not an exact pin NAME==VERSION"
        assert _norm(m[1]) not in pins, f"constraints.txt pins {m[1]} twice"
        pins[_norm(m[1])] = m[2]
    return pins


def _requirement_names(reqs):
    return {_norm(re.match(r"[A-Za-z0-9_.\-]+", r)[0]) for r in reqs}


def test_constraints_pin_every_dependency_exactly():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _requirement_names(project["dependencies"]) | _requirement_names(project["optional-dependencies"]["test"])
    pins = _pins()
    missing = sorted(wanted - set(pins))
    assert not missing, f"constraints.txt does not pin {missing}: a fresh install would take whatever is newest"
    assert "llmlab" not in pins, "constraints.txt must not pin llmlab itself (it is installed from the clone)"
    assert "+" not in pins["torch"], "pin torch without a local build tag, so both the CPU and the CUDA build match"


def _readme_install_block():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Install"):readme.index("## Quick start")]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]


def test_readme_install_uses_the_constraints_and_their_torch():
    block = _readme_install_block()
    torch_pin = _pins()["torch"]
    torch_lines = [l for l in block.splitlines() if l.startswith("pip install torch")]
    assert torch_lines and all(f"torch=={torch_pin}" in l for l in torch_lines), (torch_lines, torch_pin)
    assert 'pip install -c constraints.txt -e ".[test]"' in block


def test_ci_runs_the_readme_install():
    ci = (ROOT / ".ci" / "run").read_text()
    block = _readme_install_block()
    llmlab_line = next(l for l in block.splitlines() if "-e " in l)
    assert llmlab_line in ci, f".ci/run does not run the README's install line {llmlab_line!r}"
    gpu_torch = [l.split("#")[0].strip() for l in block.splitlines()
                 if l.startswith("pip install torch") and "--index-url" not in l]
    assert gpu_torch and gpu_torch[0] in ci, f".ci/run does not install torch as the README says: {gpu_torch}"


def test_binder_environment_reads_the_same_pins():
    env = (ROOT / "environment.yml").read_text()
    pip_lines = [l.strip()[2:].strip() for l in env.splitlines() if l.strip().startswith("- ")]
    assert "-c constraints.txt" in pip_lines, "environment.yml's pip section must read constraints.txt"
    assert f"torch=={_pins()['torch']}" in pip_lines
    assert any(l.startswith("-e .") for l in pip_lines), "environment.yml must install llmlab itself (-e .)"
