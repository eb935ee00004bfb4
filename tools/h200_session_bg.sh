#!/usr/bin/env bash
# Device call BG (session 10): the step-tuning GPU tests after BF's two test fixes, and one more full chat ladder
# with peers at the final code (is BF's 75.6% reproducible?).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-420}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 90 $PYTEST tests/test_step_tuning.py
step chat_1b 230 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 200
finish
