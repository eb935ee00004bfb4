#!/usr/bin/env bash
# Device call CS (session 19): the code as it lands — the Gluon int4 GEMV at one wave of programs — in the full
# kernel micro-benchmark (the file of record for issue 5's figures), then the GPU tests of the kernels and of the
# model paths that use them — the whole suite, now that the runs finish (OMP_NUM_THREADS=1, see h200_lib.sh).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"
step kernel_bench 200 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step gpu_tests 190 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 14 --dist load tests/
cp "$LOG" "$OUT/call-cs.log"
finish
