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
REPO_ROOT = Path(__file__).resolve().parent.parent  # the clone: data/models, data/bench, data/traces live here

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
