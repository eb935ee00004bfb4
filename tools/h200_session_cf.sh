#!/usr/bin/env bash
# Device call CF (session 17): the "x-stationary" int4 GEMV (tools/exp_int4_xstat.{cu,py}: a program spans whole rows,
# x stays in registers, rows stream past), in CUDA C++ and in Triton, against cuBLAS bf16 and the package's kernel.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"
step build 90 nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -shared -Xcompiler -fPIC \
  -o /tmp/libxstat.so tools/exp_int4_xstat.cu
step int4_xstat 300 python3 tools/exp_int4_xstat.py "$OUT/r/call-cf_int4_xstat.json" /tmp/libxstat.so
finish
