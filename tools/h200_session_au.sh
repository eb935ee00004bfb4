#!/usr/bin/env bash
# Device call AU (session 8): the GPU tests of the landed code (the A/B switches of calls AQ-AT taken out):
# decode attention (trigger_next in the merge), paged attention, the fused GEMV (whole-row configs, the SwiGLU
# epilogue), the patched model.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 260 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_decode_attention.py \
  tests/test_kernels_paged_attention.py tests/test_kernels_model.py tests/test_kernels_fused_gemv.py
finish
