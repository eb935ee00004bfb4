#!/usr/bin/env bash
# Device call N (last of the session): the GPU tests with the final code (PDL on; the review fixes: positions
# outside the cache, RoPE angles reduced in fp64, far positions), and the kernel micro-benchmarks of the shipped
# fused and weight-only GEMVs (the word-based int4/int8 GEMVs that call L measured were reverted).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-440}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 300 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_rope_cache.py \
  tests/test_kernels_fused_gemv.py tests/test_kernels_model.py tests/test_cuda_graphs.py tests/test_sampling.py \
  tests/test_kernels_paged_attention.py tests/test_paged_kernel_cache.py tests/test_kernels_decode_attention.py \
  tests/test_gpu.py -k "not compile"
step kernel_bench 110 python3 -m llmlab.kernels.bench_kernels --ops gemv,matmul --out "$OUT/r"
finish
