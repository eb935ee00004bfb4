"""Weight-only quantization of a loaded model, end to end: quantized linear layers swapped into the model, and the
quality checks that say what the rounding cost.

    linear.py    Int8Linear (per output channel) and Int4Linear (group-wise, two per byte): nn.Modules holding the
                 packed weights and scales of llmlab.kernels.weight_quant's formats; Triton kernel on CUDA for
                 M <= 16 rows, dequantize + F.linear otherwise
    quantize.py  quantize_model / dequantize_model (module swap, in place), is_quantized, weight_bytes
    fused.py     the q/k/v (or gate/up) layers of a quantized model as ONE quantized layer, for the kernel modules
    quality.py   perplexity on held-out tokens; greedy_agreement between two models
    calibration.py  the default model's held-out text (heldout_text), cut into calibration windows
                 (calibration_ids) and the tokens after them (evaluation_ids)
    awq.py       activation-aware scaling (AWQ): awq_scales searches per-input-channel scales on calibration
                 activations, apply_awq folds them into the float weights, quantize_awq does both, then RTN
    serialize.py save_quantized / load_quantized: a quantized model as safetensors + quant_config.json

Importing this package does not import triton (the kernels are imported at their first use on a GPU).
"""

from .linear import Int4Linear, Int8Linear, QuantizedLinear
from .awq import apply_awq, awq_scales, quantize_awq
from .calibration import calibration_ids, evaluation_ids, heldout_text
from .quality import greedy_agreement, perplexity
from .serialize import load_quantized, save_quantized
from .quantize import (GROUP_SIZES, SCHEMES, dequantize_model, is_quantized, quantize_model, quantized_layers,
                       weight_bytes)

__all__ = ["Int8Linear", "Int4Linear", "QuantizedLinear", "quantize_model", "dequantize_model", "is_quantized",
           "quantized_layers", "weight_bytes", "perplexity", "greedy_agreement", "SCHEMES", "GROUP_SIZES",
           "awq_scales", "apply_awq", "quantize_awq", "heldout_text", "calibration_ids", "evaluation_ids",
           "save_quantized", "load_quantized"]
