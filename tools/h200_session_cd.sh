#!/usr/bin/env bash
# Device call CD (session 16): an int4 GEMV in CUDA C++ on the package's layout (tools/exp_int4_cuda.cu), against
# cuBLAS bf16 and the Triton kernel: is issue 5's >= 3x reachable outside Triton? And why the Triton decode
# attention took 14.3 us at 8K in call CB and 18.0 in CC: the autotuner's choice in three fresh processes.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"
step build 60 nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -shared -Xcompiler -fPIC \
  -o /tmp/libint4.so tools/exp_int4_cuda.cu
step int4_cuda 150 python3 tools/exp_int4_cuda.py "$OUT/r/call-cd_int4_cuda.json" /tmp/libint4.so
for i in 1 2 3; do step attention_autotune_$i 60 python3 tools/exp_attention_autotune_spread.py; done
finish
