#!/usr/bin/env bash
# Device call AE (session 6): the M = 1 int4/int8 GEMVs read each field as a subnormal fp32 (`_field`: one LOP3, no
# FADD per weight; offline count 4.2 -> 3.3-3.7 instructions per int4 weight). (1) GPU tests of the quantized
# matmuls in fp16/bf16; (2) every package config plus call AE's candidates at the four 8B shapes (CUDA-graph
# replay); (3) the matmul kernel benchmark, autotuned over the package's configs.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-330}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests_dequant 80 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py
step sweep 170 python3 tools/exp_quant_gemv.py "$OUT/r/sweep.json" int4,int8 ae
step kernel_bench 60 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
finish
