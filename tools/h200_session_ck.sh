#!/usr/bin/env bash
# Device call CK (session 18): int4_matmul's M = 1 path as it lands — the input-stationary GEMV at one fixed config
# (R = 8 rows per chunk, 2 persistent programs per SM; the K-walking GEMV above K = 8192) — timed again over the
# explicit sweep of call CJ (is the fixed config's place in it stable?), beside the CUDA build; the full kernel
# micro-benchmark (the file of record for issue 5's figures); the GPU tests of the kernels and of the model paths
# that use them (autotuning off, as the suite runs).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"
step build 90 nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC \
  -o /tmp/libxstat.so tools/exp_int4_xstat.cu
step int4_is 150 python3 tools/exp_int4_xstat.py "$OUT/r/call-ck_int4_is.json" /tmp/libxstat.so
step kernel_bench 150 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step gpu_tests 220 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 8 --dist loadfile tests/test_kernels_dequant_matmul.py \
  tests/test_kernels_decode_attention.py tests/test_kernels_model.py tests/test_kv_quant.py
cp "$LOG" "$OUT/call-ck.log"
finish
