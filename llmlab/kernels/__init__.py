"""Triton kernels for CUDA GPUs, one op per file, each beside its PyTorch reference.

Import it as `import llmlab.kernels` or `from llmlab import kernels`. It lives inside the package, not in a
top-level folder, because a top-level module named `kernels` would shadow Hugging Face's `kernels` package, which
transformers imports (tests/test_import_names.py checks that the repository exposes no such module).

    rmsnorm.py                 RMSNorm, optionally fused with the residual add
    swiglu.py                  silu(gate) * up
    rope.py                    rotary embedding applied to q and k in place (Hugging Face rotate-half pairing)
    rope_cache.py              one decode step's RoPE and static-KV-cache write, fused into one launch
    decode_attention.py        GQA decode attention over a contiguous KV cache, flash-decoding (split + LSE merge)
    paged_decode_attention.py  the same over a paged KV cache, through block tables
    dequant_matmul.py          weight-only int8 (per channel) and int4 (group-wise, 2 per byte) matmul, M = 1..16
    int4_gemv_gluon.py         int4_matmul's M = 1 path on CUDA GPUs, in Gluon (Triton's explicit-layout dialect)
    int4_mma_gemv.py           (experimental, slower) int4 GEMV on the tensor cores, weights in mma fragment order
    fused_gemv.py              batch-1 bf16 GEMVs with the layer's small ops (RMSNorm, SwiGLU, residual) fused in
    argmax.py                  the greedy token over a 100K+ vocabulary in one launch
    patch_model.py             the "Triton kernels" switch: route a Transformer's ops through the kernels
    step_tuning.py             the "step tuning" switch: choose the batch-1 GEMVs' tiles by timing the whole step
    bench_kernels.py           micro-benchmarks -> an llmlab bench file (python -m llmlab.kernels.bench_kernels)
    lab07_solutions.py         reference answers and checks for labs/07_triton_kernels.ipynb

Importing this package imports no triton; the op modules do. Without a GPU, set TRITON_INTERPRET=1 before
importing triton to run the kernels (slowly; fp32, and fp16 where numpy has it) in Triton's CPU interpreter.
"""
