#!/usr/bin/env bash
# Device call AZ (session 9): the final code (one-launch argmax, graph outputs without copies, prefetch_kv on in the
# model's decode step): GPU tests of the model path, the chat ladder with peers and the long workload for the record.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 90 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_model.py tests/test_kernels_argmax.py \
  tests/test_cuda_graphs.py -k "not compiled"
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 160
step long_1b 40 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps +triton_kernels --repeats 2
step chat_rung 40 python3 -m llmlab.cli bench --out "$OUT/r/rung" --workload chat --model llama-3.2-1b \
  --steps +triton_kernels --repeats 3
finish
