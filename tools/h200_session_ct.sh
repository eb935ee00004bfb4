#!/usr/bin/env bash
# Device call CT (session 20): (1) the Gluon GEMV's GPU tests that session 19 wrote last and never ran on a GPU
# (strided x, sliced weights, scale layouts, K past MAX_K) and the int4/int8 tests beside them, at commit 0092baf's
# kernel code (per-shape launch cache, lazy import); (2) tools/exp_int4_split.py: rows split into P parts joined in
# the kernel (predicted at 4096 x 14336: JOIN = 0 near call CR's 10.3 us, JOIN = 1 / 2 between 10.6 and 11.5 us);
# (3) the GEMV rows of the kernel micro-benchmark.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-540}
source "$(dirname "$0")/h200_lib.sh"
step gpu_tests 120 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 8 --dist load tests/test_kernels_int4_gluon.py tests/test_kernels_dequant_matmul.py
step split 300 python3 tools/exp_int4_split.py "$OUT/r/call-ct_int4_split.json"
step gemv_bench 100 python3 -m llmlab.kernels.bench_kernels --ops gemv --out "$OUT/r"
cp "$LOG" "$OUT/call-ct.log"
finish
