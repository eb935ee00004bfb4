"""llmlab: why LLM inference leaves a GPU mostly idle, measured on a decoder you can read.

    import llmlab
    llm = llmlab.load()                 # the small model shipped in data/models/, offline
    print(llm.generate("The list").text)

The top-level names are imported on first use (PEP 562), so that `import llmlab.cli` (and `llmlab --help`) does not
import torch.
"""

import importlib
import importlib.util
from pathlib import Path

__version__ = "0.1.0"


def _find_root() -> Path:
    """The clone whose data/ (models, bench files, traces) the course reads: $LLMLAB_ROOT if set; else the folder
    above this package when it holds data/models (an editable install, or running from the clone); else the nearest
    folder at or above the working directory that holds data/models (a non-editable `pip install .` used from inside
    the clone, e.g. Jupyter started in labs/); else the folder above the package (data/ is then missing, and loading
    the default model says so)."""
    import os

    if os.environ.get("LLMLAB_ROOT"):
        return Path(os.environ["LLMLAB_ROOT"]).expanduser().resolve()
    beside = Path(__file__).resolve().parent.parent
    if (beside / "data" / "models").is_dir():
        return beside
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / "data" / "models").is_dir() and (folder / "llmlab").is_dir():
            return folder
    return beside


REPO_ROOT = _find_root()  # the clone: data/models, data/bench, data/traces live here

_LAZY = {  # name -> the submodule that defines it
    "LLM": "engine",
    "load": "engine",
    "ModelConfig": "config",
    "PRESETS": "config",
    "Transformer": "model",
    "Generation": "generate",
}

__all__ = ["LLM", "load", "ModelConfig", "PRESETS", "Transformer", "Generation", "__version__"]


def __getattr__(name: str):
    """The names of `_LAZY`, and submodules (`llmlab.engine` after a bare `import llmlab`), imported on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later look-ups skip __getattr__
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
