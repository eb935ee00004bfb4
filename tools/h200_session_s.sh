#!/usr/bin/env bash
# Device call S (session 4): the M = 1 GEMVs tuned by `_tune_bench` (launches after a 256 MB read, not Triton's
# 256 MB write) — the weight-only matmul benchmark again, and the dequant tests.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-200}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 60 $PYTEST tests/test_kernels_dequant_matmul.py
step kernel_bench 90 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
finish
