#!/usr/bin/env bash
# Device call BE (session 10): after the review of step tuning (measure results checked, failed tiles kept apart,
# candidates checked, the switch's tiles keyed by dtype/device/shapes/PDL): the GPU tests of it, two full chat
# ladders with peers (is the +step_tuning figure of call BC reproducible?) and the long workload.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-580}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 100 $PYTEST tests/test_step_tuning.py
step gpu_tests_model 60 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_model.py tests/test_static_cache.py \
  -k "not compiled"
step chat_1b 210 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 190
step long_1b 60 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps +triton_kernels,+step_tuning --repeats 2
step chat_1b_again 140 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b \
  --steps +cuda_graphs,+triton_kernels,+step_tuning --peers --repeats 2 --time-budget 120
finish
