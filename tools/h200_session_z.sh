#!/usr/bin/env bash
# Device call Z (session 5): the fused bf16 GEMV (the 1B model's Triton rung) tuned as the quantized GEMVs now are
# (`tune_bench`) and offered one-warp configs: (1) GPU tests of both GEMVs (autotuning off); (2) its configs at the
# 1B shapes; (3) the chat workload, CUDA-graph and Triton rungs (issue 4's MBU).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 90 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py tests/test_kernels_fused_gemv.py
step sweep_fused_gemv 150 python3 tools/exp_fused_gemv.py "$OUT/r/fused_gemv.json"
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --repeats 2 --time-budget 170
finish
