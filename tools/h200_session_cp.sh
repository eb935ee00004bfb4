#!/usr/bin/env bash
# Device call CP (session 19): int4_matmul's M = 1 path as it lands — the Gluon GEMV (kernels/int4_gemv_gluon.py:
# one chunk per loop turn, R = 8 up to K = 4096 and R = 4 above, a balanced count of persistent programs) — in the
# full kernel micro-benchmark (the file of record for issue 5's figures), then the GPU tests of the kernels and of
# the model paths that use them. OMP_NUM_THREADS=1: calls CK-CO ran 14 pytest workers of 16 CPU threads each on 16
# cores, and a CPU-side test (int8 KV cache on the default model) took minutes there.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"
step kernel_bench 210 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step gpu_tests 330 env OMP_NUM_THREADS=1 LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 14 --dist load \
  tests/test_kernels_int4_gluon.py tests/test_kernels_dequant_matmul.py tests/test_kernels_decode_attention.py \
  tests/test_kv_quant.py tests/test_kernels_int4_mma.py tests/test_errors.py tests/test_kernels_model.py \
  tests/test_ladder.py
cp "$LOG" "$OUT/call-cp.log"
finish
