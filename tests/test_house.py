"""The house rules a newcomer relies on, checked: no import cycles inside llmlab, no module that does several jobs
(a size cap), kernels swapped in as modules (no per-instance `forward` patching, no private state in a model's
`__dict__`), each folder's `__init__.py` naming its files, and no run logs in code or docs (GPU-run labels belong in
docs/results.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "llmlab"
MAX_LINES = 550  # "a few hundred lines at most": one idea per file
RUN_LABEL = re.compile(r"\b[Cc]alls? [A-Z]{1,2}\b|\b[Ss]ession ?\d+\b|\bcall-[a-z]{1,2}\b|h200_session_|exp_[a-z0-9_]+\.py")


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        name = ".".join(("llmlab",) + f.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
        out[name] = f
    return out


def _module_level_imports(name: str, f: Path, mods: dict[str, Path]) -> set[str]:
    deps = set()
    package = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.parse(f.read_text()).body:  # module level only: imports inside functions run late
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                deps.add(full if full in mods else base)
        elif isinstance(node, ast.Import):
            deps.update(alias.name for alias in node.names)
    return {d for d in deps if d in mods and d not in (name, "llmlab")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    mods = _modules()
    graph = {name: _module_level_imports(name, f, mods) for name, f in mods.items()}
    assert not _cycles(graph), f"import cycles inside llmlab: {_cycles(graph)}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_no_module_does_several_jobs():
    long = {str(f.relative_to(ROOT)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_every_folder_names_its_files():
    # the README's promise: "each folder's __init__.py lists its files" (solutions/ names lab00.py ... lab09.py)
    for init in PKG.glob("*/__init__.py"):
        listing = ast.get_docstring(ast.parse(init.read_text())) or ""
        unnamed = [f.name for f in init.parent.glob("*.py")
                   if f.name != "__init__.py" and f.name not in listing and not re.fullmatch(r"lab\d\d\.py", f.name)]
        assert not unnamed, f"{init.relative_to(ROOT)} does not name {unnamed} in its docstring"


def test_kernels_are_swapped_in_as_modules():
    offenders = [f"{f.relative_to(ROOT)}:{i}" for f in PKG.rglob("*.py")
                 for i, line in enumerate(f.read_text().splitlines(), 1)
                 if "MethodType" in line or re.search(r"['\".]_llmlab_", line)]
    assert not offenders, f"per-instance forward patching or private model state: {offenders}"


def test_no_run_logs_in_code_or_docs():
    files = [*PKG.rglob("*.py"), *(ROOT / "labs").glob("*.ipynb"), *(ROOT / "tools").iterdir(), ROOT / "README.md",
             *(ROOT / "tests").glob("*.py")]
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for f in files if f.is_file() and f.name != "test_house.py"
            for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if RUN_LABEL.search(line)]
    assert not hits, "GPU-run labels or work logs (they belong in docs/results.md):\n" + "\n".join(hits[:20])
