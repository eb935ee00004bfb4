"""The training corpus of the shipped model: documentation that every CPython installation carries.

Two sources, both read from the *running* interpreter, so the corpus needs no download and is byte-identical for
the same Python version (and an unpatched standard library):

1. `pydoc_data.topics.topics` — the language-reference topics that `help("assert")` prints (a dict of
   topic name -> plain text rendered from the Python docs by Sphinx). One document per topic: `topic:assert`.
2. Docstrings of the standard library's `.py` files under `sysconfig.get_paths()["stdlib"]`, read by *parsing* the
   source with `ast` — never by importing it (importing `antigravity` opens a web browser, `this` prints a poem,
   and many modules have platform-dependent import-time behaviour). One document per module: `module:json.decoder`.
   Each docstring is prefixed by a header line that names it the way the Python docs do:

       module json.decoder
       Implementation of JSONDecoder

       class json.decoder.JSONDecoder(object)
       Simple JSON <https://json.org> decoder
       ...

       def json.decoder.JSONDecoder.decode(s, _w=WHITESPACE.match)
       Return the Python representation of ``s`` ...

   so the model learns that `def ` / `class ` is followed by a signature and Python-doc-like prose. Methods drop
   their `self`/`cls` argument (as the docs do); functions nested inside functions are skipped (private helpers);
   definitions inside module- or class-level `if`/`try` blocks are kept.

What is skipped, and why:

* directories `site-packages`, `dist-packages` (third-party code, differs between installations), `test`, `tests`,
  `idle_test` (the test suites: test-case docstrings are not documentation, and `lib2to3/tests/data` holds Python 2
  files on purpose), `__pycache__`, and any directory whose name has a `-` or starts with `.` (`lib-dynload`,
  `config-3.12-x86_64-linux-gnu`: build artefacts, not modules);
* `pydoc_data/` (source 1 already covers it) and `_sysconfigdata_*.py` (generated per build: machine-dependent);
* files that fail to parse (counted in `CorpusStats.skipped_files`) and modules with no docstring at all.

Documents are sorted by name (topics first, then modules in dotted-name order). The held-out split is by document:
a document is held out when the first 8 bytes of sha256(name), read as an integer, mod 10_000 fall below
`val_fraction * 10_000` — so held-out documents are whole topics/modules, and the split does not move when other
documents are added or removed.
"""

from __future__ import annotations

import ast
import hashlib
import os
import platform
import sys
import sysconfig
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

EOT = "<|endoftext|>"  # document separator; the tokenizer's only special token (also BOS and EOS)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
VAL_FRACTION = 0.03


@dataclass(frozen=True)
class Document:
    name: str  # "topic:assert" or "module:json.decoder": the unit of the held-out split
    text: str


@dataclass
class CorpusStats:
    python_version: str  # e.g. "3.12.3"
    python_implementation: str
    stdlib_dir: str
    n_documents: int
    n_topics: int
    n_modules: int
    n_docstrings: int  # docstrings (module + class + function) taken from the standard library
    skipped_files: list[str] = field(default_factory=list)  # .py files that failed to parse
    chars: int = 0  # characters of all documents (train + val), separators not counted
    sha256: str = ""  # of EOT.join(all document texts), UTF-8: the corpus fingerprint
    val_fraction: float = VAL_FRACTION
    n_train_documents: int = 0
    n_val_documents: int = 0
    train_chars: int = 0
    val_chars: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


# -- source 1: pydoc topics ---------------------------------------------------------------------------------
def topic_documents() -> list[Document]:
    """One document per `pydoc_data.topics.topics` entry (the text `help("topic")` shows), sorted by topic."""
    from pydoc_data.topics import topics  # a data module (one dict literal): importing it has no side effects

    return [Document(f"topic:{k}", topics[k].strip("\n")) for k in sorted(topics) if topics[k].strip()]


# -- source 2: standard-library docstrings via ast ----------------------------------------------------------
def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> str:
    """`(a, b=1, *args, **kw) -> int` from the function's ast; drops self/cls of methods (not of staticmethods)."""
    args = node.args
    decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
    if is_method and "staticmethod" not in decorators:
        args = ast.arguments(**{f: getattr(args, f) for f in args._fields})
        if args.posonlyargs:
            args.posonlyargs = args.posonlyargs[1:]
        elif args.args:
            args.args = args.args[1:]
    text = f"({ast.unparse(args)})"
    if node.returns is not None:
        text += f" -> {ast.unparse(node.returns)}"
    return text


class _DocstringCollector(ast.NodeVisitor):
    """Collects (header, docstring) pairs in source order; descends into classes, not into function bodies."""

    def __init__(self, module: str):
        self.scope = [module]
        self.in_class = [False]
        self.entries: list[tuple[str, str]] = []

    def _add(self, header: str, node: ast.AST) -> None:
        doc = ast.get_docstring(node, clean=True)  # inspect.cleandoc: strips the common indentation
        if doc and doc.strip():
            self.entries.append((header, doc.strip("\n")))

    def visit_Module(self, node: ast.Module) -> None:
        self._add(f"module {self.scope[0]}", node)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        qual = ".".join(self.scope + [node.name])
        self._add(f"class {qual}" + (f"({', '.join(bases)})" if bases else ""), node)
        self.scope.append(node.name)
        self.in_class.append(True)
        self.generic_visit(node)
        self.scope.pop()
        self.in_class.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        kw = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        qual = ".".join(self.scope + [node.name])
        self._add(f"{kw} {qual}{_signature(node, self.in_class[-1])}", node)  # no descent: nested = private

    visit_AsyncFunctionDef = visit_FunctionDef


def stdlib_files(stdlib: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """(dotted module name, path) of every standard-library .py file kept by the rules above, sorted by name."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and "-" not in d and not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        for fname in sorted(filenames):
            if not fname.endswith(".py") or fname.startswith("_sysconfigdata"):
                continue
            parts = list(rel.parts) + ([] if fname == "__init__.py" else [fname[:-3]])
            if parts:
                found.append((".".join(parts), Path(dirpath) / fname))
    return sorted(found)


def module_document(module: str, path: Path) -> tuple[Document | None, int]:
    """The module's docstrings as one document (None if it has none), and how many docstrings it has.

    Raises:
        SyntaxError, ValueError, UnicodeDecodeError: the file does not parse (the caller skips it).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes in old files: irrelevant here
        tree = ast.parse(path.read_bytes(), filename=str(path))  # bytes: honours a `# coding:` cookie
    collector = _DocstringCollector(module)
    collector.visit(tree)
    if not collector.entries:
        return None, 0
    text = "\n\n".join(f"{header}\n{doc}" for header, doc in collector.entries)
    return Document(f"module:{module}", text), len(collector.entries)


# -- the corpus ---------------------------------------------------------------------------------------------
def is_val(name: str, val_fraction: float = VAL_FRACTION) -> bool:
    """Deterministic held-out membership of a document, from sha256 of its name (whole topics/modules)."""
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return h % 10_000 < round(val_fraction * 10_000)


def corpus_sha256(docs: list[Document]) -> str:
    """sha256 hex digest of EOT.join(texts) in UTF-8: equal digests mean byte-identical corpora."""
    h = hashlib.sha256()
    for i, d in enumerate(docs):
        h.update(((EOT if i else "") + d.text).encode("utf-8"))
    return h.hexdigest()


def build_corpus(
    val_fraction: float = VAL_FRACTION,
    max_modules: int | None = None,
    max_topics: int | None = None,
    stdlib: str | os.PathLike | None = None,
) -> tuple[list[Document], list[Document], CorpusStats]:
    """Build the corpus from the running interpreter and split it into train and held-out documents.

    Args:
        val_fraction: share of documents (by name hash, see `is_val`) held out; ~3% by default.
        max_modules, max_topics: keep only the first N of each source (sorted order) — for the smoke test.
        stdlib: the standard library folder; default `sysconfig.get_paths()["stdlib"]` of this interpreter.

    Returns:
        (train documents, held-out documents, stats); both lists sorted by name.

    Raises:
        RuntimeError: a document contains the separator text `<|endoftext|>` (it would be read as a special token).
    """
    topics = topic_documents()[:max_topics]
    modules, n_docstrings, skipped = [], 0, []
    files = stdlib_files(stdlib)
    for module, path in files:
        if max_modules is not None and len(modules) >= max_modules:
            break
        try:
            doc, n = module_document(module, path)
        except (SyntaxError, ValueError, UnicodeDecodeError):
            skipped.append(module)
            continue
        if doc is not None:
            modules.append(doc)
            n_docstrings += n
    docs = topics + modules  # each part is sorted; "topic:" documents first, then "module:"
    bad = [d.name for d in docs if EOT in d.text]
    if bad:
        raise RuntimeError(f"documents {bad} contain the separator {EOT!r}; the corpus rules need a fix")
    train = [d for d in docs if not is_val(d.name, val_fraction)]
    val = [d for d in docs if is_val(d.name, val_fraction)]
    stats = CorpusStats(
        python_version=platform.python_version(),
        python_implementation=sys.implementation.name,
        stdlib_dir=str(stdlib or sysconfig.get_paths()["stdlib"]),
        n_documents=len(docs),
        n_topics=len(topics),
        n_modules=len(modules),
        n_docstrings=n_docstrings,
        skipped_files=skipped,
        chars=sum(len(d.text) for d in docs),
        sha256=corpus_sha256(docs),
        val_fraction=val_fraction,
        n_train_documents=len(train),
        n_val_documents=len(val),
        train_chars=sum(len(d.text) for d in train),
        val_chars=sum(len(d.text) for d in val),
    )
    return train, val, stats


if __name__ == "__main__":
    import json
    import time

    t0 = time.perf_counter()
    train, val, stats = build_corpus()
    print(json.dumps(stats.to_dict(), indent=2))
    print(f"built in {time.perf_counter() - t0:.2f} s; held out: {', '.join(d.name for d in val)}")
