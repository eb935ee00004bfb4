#!/usr/bin/env bash
# Device call W (session 5): the M = 1 int4/int8 GEMVs rewritten to read 32-bit words and turn each 4- or 8-bit
# field into fp32 with one LOP3 + one FADD (`_code`); the offline SASS count (sm_90, Triton 3.9) went from 9.6 to
# 3.9-4.4 instructions per int4 weight. (1) their GPU tests in fp16/bf16; (2) every candidate config timed by
# CUDA-graph replay at the 8B shapes; (3) every decode-attention split config at 8K, split + merge.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests_dequant 120 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py
step sweep 400 python3 tools/exp_quant_gemv.py "$OUT/r/sweep.json" int4,int8,attention_sweep
finish
