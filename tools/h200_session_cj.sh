#!/usr/bin/env bash
# Device call CJ (session 18): the package's input-stationary int4 GEMV after its tiles were laid out so that Triton 3.6
# keeps slot q of every row in one thread (no shared-memory move per chunk), over explicit configs, beside call CF's CUDA build and the autotuned
# K-walking GEMV (tools/exp_int4_xstat.py); the kernel micro-benchmark's weight-only matmul rows (the figure of
# record, int4_matmul switching to the K-walking GEMV above IS_MAX_K = 8192); the int4/int8 GPU tests.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"
step build 90 nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC \
  -o /tmp/libxstat.so tools/exp_int4_xstat.cu
step int4_is 300 python3 tools/exp_int4_xstat.py "$OUT/r/call-cj_int4_is.json" /tmp/libxstat.so
step kernel_bench 120 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
step gpu_tests 200 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 8 tests/test_kernels_dequant_matmul.py
cp "$LOG" "$OUT/call-cj.log"
finish
