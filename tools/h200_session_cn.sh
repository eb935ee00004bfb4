#!/usr/bin/env bash
# Device call CN (session 19): the GPU tests that calls CK and CM never saw finish (decode attention, KV
# quantization, int4-mma, errors; distributed per test, not per file: one file's 108 tests had run on one worker),
# then the int4 GEMV written in Gluon (`tools/exp_int4_gluon.py`: the chunk's row sums by an in-warp transpose and
# one barrier) timed beside int4_matmul as shipped (its weight loads now 16 bytes wide), the package's Triton
# input-stationary kernel at a few configs and the CUDA build.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"
( nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -o /tmp/libxstat.so \
    tools/exp_int4_xstat.cu > "$OUT/r/nvcc.log" 2>&1; echo "nvcc exit $?" >> "$OUT/r/nvcc.log" ) &
step gpu_tests 240 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 14 --dist load tests/test_kernels_decode_attention.py \
  tests/test_kv_quant.py tests/test_kernels_int4_mma.py tests/test_errors.py
wait
cat "$OUT/r/nvcc.log" | tee -a "$LOG"
step int4_gluon 300 python3 tools/exp_int4_gluon.py "$OUT/r/call-cn_int4_gluon.json" /tmp/libxstat.so
cp "$LOG" "$OUT/call-cn.log"
finish
