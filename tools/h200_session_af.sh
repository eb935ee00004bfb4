#!/usr/bin/env bash
# Device call AF (session 6): the tensor-core int4 GEMV (weights repacked into the mma fragment order, inline PTX
# mma.m16n8k16; offline 2.5 instructions per weight against 3.3-3.7 for the CUDA-core GEMV). (1) its GPU tests and
# the quantized-matmul tests (fp16/bf16); (2) its configs vs cuBLAS bf16 and the CUDA-core GEMV at the 8B shapes.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 90 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_int4_mma.py tests/test_kernels_dequant_matmul.py
step mma_sweep 150 python3 tools/exp_int4_mma.py "$OUT/r/int4_mma.json"
finish
