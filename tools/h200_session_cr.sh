#!/usr/bin/env bash
# Device call CR (session 19): the Gluon GEMV with one wave of programs (calls CO and CQ: the best count, or within
# 2%, at every shape; the "balanced" count lost 7% at 4096 x 4096) in the matmul part of the kernel
# micro-benchmark; its tests; and whether rows of 14336 would run faster split (the same bytes as (8192, 7168) and
# (16384, 3584) GEMVs: smaller programs, more of them per SM) before writing the join of the parts.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"
step kernel_bench 90 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
step gpu_tests 60 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 14 --dist load tests/test_kernels_int4_gluon.py
step int4_split 120 env SWEEP=cr python3 tools/exp_int4_gluon.py "$OUT/r/call-cr_int4_gluon.json"
cp "$LOG" "$OUT/call-cr.log"
finish
