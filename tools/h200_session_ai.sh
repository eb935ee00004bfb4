#!/usr/bin/env bash
# Device call AI (session 6, after the autotuner fix 11481df: `tune_bench` keeps the GPU busy while the host queues
# a config's launches): GPU tests of decode attention and the model with the Triton kernels, and the chat ladder
# with its peers at this commit (the kernel benchmark was run just before in the same warm session, see the log).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-330}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 90 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_decode_attention.py tests/test_kernels_model.py
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 150
finish
