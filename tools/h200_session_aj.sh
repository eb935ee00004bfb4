#!/usr/bin/env bash
# Device call AJ (session 6, the last): with call AI's GEMV configs in the package (int4 split-K 8 one-warp programs,
# int8 4-8 rows x 512-wide K tiles) — the kernel benchmark over every op and the chat ladder with its peers.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"

step kernel_bench 130 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 150
step gpu_tests_attention 50 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -x tests/test_kernels_decode_attention.py
finish
