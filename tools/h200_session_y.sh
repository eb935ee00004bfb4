#!/usr/bin/env bash
# Device call Y (session 5): (1) the word-reading GEMVs with call W/X's winning configs (1-2 warps), autotuned, in
# the kernel benchmark (data/bench JSON) — GPU tests first, with autotuning; (2) the experimental packed-bf16x2 +
# tensor-core int4 GEMV (tools/exp_int4_tc.py) against cuBLAS and the package's GEMV.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests_dequant 150 $PYTEST tests/test_kernels_dequant_matmul.py
step kernel_bench 120 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
step int4_tc 200 python3 tools/exp_int4_tc.py "$OUT/r/int4_tc.json"
finish
