#!/usr/bin/env bash
# Device call CO (session 19): which GPU tests never finish (call CN: decode attention, KV quantization, int4-mma
# and errors stopped at ~93% after 240 s with -n 14): the same run with every test's result named (-v); then the
# Gluon int4 GEMV after call CN (its two-chunk loop now skips the compute of a chunk past the end; the one-chunk
# loop with two barriers; a register cap; a "balanced" program count from the compiled kernel's occupancy).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"
( nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -o /tmp/libxstat.so \
    tools/exp_int4_xstat.cu > "$OUT/r/nvcc.log" 2>&1; echo "nvcc exit $?" >> "$OUT/r/nvcc.log" ) &
step gpu_tests 200 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -v -n 14 --dist load -o faulthandler_timeout=150 \
  tests/test_kernels_decode_attention.py tests/test_kv_quant.py tests/test_kernels_int4_mma.py tests/test_errors.py
python3 -m pytest -o addopts= -p no:cacheprovider --collect-only -q tests/test_kernels_decode_attention.py \
  tests/test_kv_quant.py tests/test_kernels_int4_mma.py tests/test_errors.py > "$OUT/r/collected.txt" 2>&1
wait
cat "$OUT/r/nvcc.log" | tee -a "$LOG"
step int4_gluon 330 python3 tools/exp_int4_gluon.py "$OUT/r/call-co_int4_gluon.json" /tmp/libxstat.so
cp "$LOG" "$OUT/call-co.log"
finish
