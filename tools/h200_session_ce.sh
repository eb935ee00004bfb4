#!/usr/bin/env bash
# Device call CE (session 16): as CD, plus a persistent grid, for the int4 GEMV in CUDA C++ on the package's layout (tools/exp_int4_cuda.cu), against
# cuBLAS bf16 and the Triton kernel, with a plain read of the same bytes.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"
step build 60 nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -shared -Xcompiler -fPIC \
  -o /tmp/libint4.so tools/exp_int4_cuda.cu
step int4_cuda 150 python3 tools/exp_int4_cuda.py "$OUT/r/call-ce_int4_cuda.json" /tmp/libint4.so
finish
