"""Triton kernels for CUDA GPUs, one op per file, each beside its PyTorch reference.

Import it as `import llmlab.kernels` or `from llmlab import kernels`. It lives inside the package, not in a
top-level folder, because a top-level module named `kernels` would shadow Hugging Face's `kernels` package, which
transformers imports (tests/test_import_names.py checks that the repository exposes no such module).

    rmsnorm.py                 RMSNorm, optionally fused with the residual add
    swiglu.py                  silu(gate) * up
    rope.py                    rotary embedding applied to q and k in place (Hugging Face rotate-half pairing)
    rope_cache.py              one decode step's RoPE and static-KV-cache write, fused into one launch
    decode_attention.py        GQA decode attention over a contiguous KV cache, flash-decoding (split + LSE merge)
    split_attention.py         flash-decoding's first step: one program's attention over a slice of the keys
    rope_attention.py          the decode step's RoPE, K/V write and attention in the attention's own launch
    paged_decode_attention.py  the same over a paged KV cache, through block tables
    attention_splits.py        how decode attention splits the sequence: the split configs, which are worth timing
    lse_merge.py               the merge of the splits' partial outputs by their log-sum-exp (a kernel, or in-kernel)
    weight_quant.py            weight-only int8 (per channel) and int4 (group-wise, 2 per byte) formats, references
    int8_matmul.py             int8 weight-only matmul, M = 1..16 (a CUDA-core GEMV at M = 1)
    int8_gemv.py               int8's input-stationary GEMV at M = 1 (x in registers; step tuning may pick it)
    int4_matmul.py             int4 weight-only matmul, M = 1..16: which kernel runs; the tensor-core tile for M > 1
    dequantize.py              int8 / int4 weights to bf16 in one pass: a quantized layer's prefill, before its GEMM
    int4_gemv.py               int4_matmul's M = 1 GEMVs in Triton (input-stationary; K-walking with split-K)
    int4_gemv_gluon.py         int4_matmul's M = 1 path on CUDA GPUs, in Gluon (Triton's explicit-layout dialect)
    int8_gemv_gluon.py         int8_gemv.py's GEMV in Gluon, with int4_gemv_gluon.py's hand-laid row sums
    input_stationary.py        what the two Triton input-stationary GEMVs share: x once with its prologue, the store
    packed_fields.py           Triton helpers: packed int4/int8 fields read as fp32 without a conversion instruction
    quant_tiles.py             the tiles the int8/int4 kernels are autotuned over
    split_k.py                 split-K for a GEMV, finished in the same launch (the M = 1 GEMVs)
    split_k_gluon.py           the same fixup for the Gluon GEMV, one atomic round trip a program
    int4_mma_gemv.py           (experimental, slower) int4 GEMV on the tensor cores, weights in mma fragment order
    fused_gemv.py              batch-1 bf16 GEMVs with the layer's small ops (RMSNorm, SwiGLU, residual) fused in
    fused_quant_gemv.py        the same for int8 / int4 weights (the quantized GEMVs with prologue and epilogue)
    argmax.py                  the greedy token over a 100K+ vocabulary in one launch
    modules.py                 the "Triton kernels" switch: kernel modules swapped into a Transformer (swap_in)
    decode_step.py             KernelDecodeStep: residual adds folded across layers, the fused batch-1 step, argmax
    step_tuning.py             the "step tuning" switch: choose the batch-1 GEMVs' tiles by timing the whole step
    bench_kernels.py           micro-benchmarks -> an llmlab bench file (python -m llmlab.kernels.bench_kernels)
    lab07_solutions.py         reference answers and checks for labs/07_triton_kernels.ipynb
    _util.py                   what the kernels share: input checks, PDL, the autotuner's configs and timing

    from llmlab.kernels import KernelDecodeStep, swap_in, swap_out
    swap_in(model)                          # RMSNorm, MLP, Attention -> their kernel modules (same parameters)
    step = KernelDecodeStep(model)          # the model-level pieces, for the decode runner (`kernels=step`)
    swap_out(model)                         # the PyTorch modules again

Importing this package imports no triton; the op modules do. Without a GPU, set TRITON_INTERPRET=1 before
importing triton to run the kernels (slowly; fp32, and fp16 where numpy has it) in Triton's CPU interpreter.
"""

if __name__ != "llmlab.kernels":  # imported as a top-level `kernels`: Python was started inside llmlab/
    raise ImportError("llmlab/kernels was imported as the top-level module 'kernels' because Python was started "
                      "inside the llmlab/ folder, where it would shadow Hugging Face's `kernels` package that "
                      "transformers imports. Start Python (or Jupyter) from the repository root or any folder "
                      "outside llmlab/.")

_LAZY = {"swap_in": "modules", "swap_out": "modules", "is_swapped": "modules", "KernelDecodeStep": "decode_step"}


def __getattr__(name: str):
    # `from llmlab.kernels import swap_in` imports modules.py on first use (it imports torch and llmlab.model)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
