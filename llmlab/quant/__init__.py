"""Weight-only quantization of a loaded model, end to end: quantized linear layers swapped into the model, and the
quality checks that say what the rounding cost.

    linear.py    Int8Linear (per output channel) and Int4Linear (group-wise, two per byte): nn.Modules holding the
                 packed weights and scales of llmlab.kernels.weight_quant's formats; Triton kernel on CUDA for
                 M <= 16 rows, dequantize + F.linear otherwise
    quantize.py  quantize_model / dequantize_model (module swap, in place), is_quantized, weight_bytes
    quality.py   perplexity on held-out tokens; greedy_agreement between two models

Importing this package does not import triton (the kernels are imported at their first use on a GPU).
"""

from .linear import Int4Linear, Int8Linear, QuantizedLinear
from .quality import greedy_agreement, perplexity
from .quantize import (GROUP_SIZES, SCHEMES, dequantize_model, is_quantized, quantize_model, quantized_layers,
                       weight_bytes)

__all__ = ["Int8Linear", "Int4Linear", "QuantizedLinear", "quantize_model", "dequantize_model", "is_quantized",
           "quantized_layers", "weight_bytes", "perplexity", "greedy_agreement", "SCHEMES", "GROUP_SIZES"]
