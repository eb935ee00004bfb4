#!/usr/bin/env bash
# Device call AK (session 6): after the new user's review — the M = 1 GEMVs' scales applied so that neither a tiny
# part * scale (int4) nor scale * 2^64 (int8) leaves fp32's range; the GPU tests of the quantized matmuls (fp16/bf16)
# and the matmul benchmark once more at this code.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-150}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 70 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py tests/test_kernels_int4_mma.py
step kernel_bench 70 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
finish
