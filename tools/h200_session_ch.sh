#!/usr/bin/env bash
# Device call CH (session 17): as CG after the x prologue became one (Q, 32) load; the package's input-stationary int4 GEMV (kernels/dequant_matmul.py,
# `_int4_gemv_is_kernel`, now int4_matmul's M = 1 path) over explicit configs beside call CF's CUDA build
# (tools/exp_int4_xstat.py); the kernel micro-benchmark's weight-only matmul rows (the figure of record); the GPU
# tests of the files this session touched (autotuning off, as the suite runs).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"
step build 90 nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC \
  -o /tmp/libxstat.so tools/exp_int4_xstat.cu
step int4_is 200 python3 tools/exp_int4_xstat.py "$OUT/r/call-ch_int4_is.json" /tmp/libxstat.so
step kernel_bench 120 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
step gpu_tests 200 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 8 --dist loadfile tests/test_kernels_dequant_matmul.py \
  tests/test_kernels_decode_attention.py tests/test_kernels_model.py \
  tests/test_kv_quant.py
finish
