#!/usr/bin/env bash
# Device call CQ (session 19): the Gluon GEMV's tests after the fp32 bound became relative to max |y| (call CP: three
# fp32 cases at K = 4096-14336 off by 1.1-1.5e-4 absolute, <= 4e-7 of max |y|), with the dequant tests; then the
# one-chunk-loop Gluon GEMV around the shipped configs (`SWEEP=cq tools/exp_int4_gluon.py`), for the shapes still
# short of 3x in call CP: 4096 x 14336 (2.47x) and 4096 x 4096 (2.86x).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-420}
source "$(dirname "$0")/h200_lib.sh"
( nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -o /tmp/libxstat.so \
    tools/exp_int4_xstat.cu > "$OUT/r/nvcc.log" 2>&1; echo "nvcc exit $?" >> "$OUT/r/nvcc.log" ) &
step gpu_tests 120 env OMP_NUM_THREADS=1 LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 14 --dist load \
  tests/test_kernels_int4_gluon.py tests/test_kernels_dequant_matmul.py
wait
step int4_gluon 280 env SWEEP=cq python3 tools/exp_int4_gluon.py "$OUT/r/call-cq_int4_gluon.json" /tmp/libxstat.so
cp "$LOG" "$OUT/call-cq.log"
finish
