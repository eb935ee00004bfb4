#!/usr/bin/env bash
# Device call AA (session 5), the final one: (1) the kernel benchmark, all ops, autotuned; (2) the chat ladder with
# its peers (HF eager / static) in one run; (3) GPU tests with autotuning off (quantized and fused GEMVs, the model
# switch, the GPU end-to-end tests) and (4) the M = 1 GEMV tests WITH autotuning (every config the tuner may pick).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"

step kernel_bench 150 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step chat_1b 210 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 165
step gpu_tests 120 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py \
  tests/test_kernels_fused_gemv.py tests/test_kernels_model.py tests/test_gpu.py -k "not compile"
step gpu_tests_tuned 70 $PYTEST tests/test_kernels_dequant_matmul.py -k "matches_dequantized or over_output_sizes"
finish
