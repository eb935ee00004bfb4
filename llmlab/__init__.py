"""llmlab: why LLM inference leaves a GPU mostly idle, measured on a decoder you can read.

    import llmlab
    llm = llmlab.load()                 # the small model shipped in data/models/, offline
    print(llm.generate("The list").text)
"""

from .config import PRESETS, ModelConfig
from .engine import LLM, load
from .generate import Generation
from .model import Transformer

__version__ = "0.1.0"
__all__ = ["LLM", "load", "ModelConfig", "PRESETS", "Transformer", "Generation", "__version__"]
