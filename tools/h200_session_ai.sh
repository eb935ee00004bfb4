#!/usr/bin/env bash
# Device call AI (session 6, after the autotuner fix 11481df: `tune_bench` keeps the GPU busy while the host queues
# a config's launches): GPU tests of the kernels touched this session, and call AI's GEMV candidates at the four 8B
# shapes (exp_quant_gemv.py "ai").
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-240}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 110 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_decode_attention.py tests/test_kernels_model.py \
  tests/test_kernels_dequant_matmul.py tests/test_kernels_int4_mma.py
step sweep 100 python3 tools/exp_quant_gemv.py "$OUT/r/sweep_ai.json" int4,int8 ai
finish
