#!/usr/bin/env bash
# Device call AH (session 6, the last): at the final kernel code — GPU tests (the subnormal-field GEMVs, the
# tensor-core int4 GEMV with its default config fixed, the model with the Triton kernels), the kernel benchmark over
# every op (autotuned, with call AE's two added GEMV configs), the chat ladder with its peers, and the M = 1 GEMV
# tests once more with autotuning on.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 110 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_int4_mma.py tests/test_kernels_dequant_matmul.py \
  tests/test_kernels_model.py tests/test_gpu.py -k "not compile"
step kernel_bench 140 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 160
step gpu_tests_tuned 70 $PYTEST tests/test_kernels_dequant_matmul.py -k "matches_dequantized or over_output_sizes"
finish
