#!/usr/bin/env bash
# Device call N (last of the session): the GPU tests calls K-M did not finish with the final code (PDL on), the
# kernel micro-benchmarks of the shipped fused and weight-only GEMVs (the word-based int4/int8 GEMVs of call L were
# reverted), and the long workload (8K context, batch 1: the fused one-token path, attention tuned on a full cache).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-440}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 190 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_model.py tests/test_cuda_graphs.py \
  tests/test_kernels_paged_attention.py tests/test_paged_kernel_cache.py tests/test_gpu.py tests/test_sampling.py \
  -k "not compile"
step kernel_bench 100 python3 -m llmlab.kernels.bench_kernels --ops gemv,matmul --out "$OUT/r"
step long_1b 140 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --peers --repeats 1 --time-budget 110
finish
