#!/usr/bin/env bash
# Device call AO (session 7, the last): the code of the previous session's end again (the experiments of calls
# AL-AN taken out), with its review commit's change to int4_mma_gemv (PTX picked by a constexpr expression) never
# run on a GPU before: GPU tests, the kernel benchmark over every op, the chat ladder with its peers.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-450}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 80 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_int4_mma.py tests/test_kernels_model.py
step kernel_bench 130 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 160
finish
