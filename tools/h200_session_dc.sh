#!/usr/bin/env bash
# Device call DC (session 21): the GPU tests of the kernels and the model paths after the student review's argument
# checks in the kernel wrappers (rope_'s overlap check, eps checks in rmsnorm / fused_gemv, which the Triton rung
# calls every layer, paged attention's new checks), 14 xdist workers, autotuning off.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-170}
source "$(dirname "$0")/h200_lib.sh"
step kernel_tests 150 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 14 --dist load tests/test_kernels_elementwise.py \
  tests/test_kernels_paged_attention.py tests/test_kernels_dequant_matmul.py tests/test_kernels_fused_gemv.py \
  tests/test_kernels_model.py tests/test_gpu.py tests/test_kernels_int4_gluon.py tests/test_generate.py
cp "$LOG" "$OUT/call-dc.log"
finish
