#!/usr/bin/env bash
# Device call AC (session 5): (1) GPU tests of the quantized matmuls, incl. the new word-reading int4 tile kernel
# (M = 2..16) in fp16/bf16; (2) the matmul kernel benchmark (M = 1, 4, 16; autotuned); (3) int8 at the q/k/v shape
# 6144 x 4096 over the package's own configs (call AA: 1.63x bf16, short of 1.7x — a slow config or a mis-pick?).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-290}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests_dequant 80 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py
step kernel_bench 80 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
step sweep_int8 100 python3 tools/exp_quant_gemv.py "$OUT/r/sweep_int8.json" int8 pkg
finish
