#!/usr/bin/env bash
# Device call BF (session 10): step tuning also chooses decode attention's split config (role "attention@<slots>",
# for static caches of the timed runner's size) and times the step at 256 cached tokens. GPU tests; a same-process
# A/B (autotuner's picks vs step-tuned); the full chat ladder with peers; the long workload.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 100 $PYTEST tests/test_step_tuning.py
step ab_chat 100 python3 tools/ab_decode_step.py llama-3.2-1b "$OUT/r/ab_chat_step_tuning.json" base= \
  tuned=STEP_TUNING=1 --rounds 5
step chat_1b 220 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 200
step long_1b 60 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps +triton_kernels,+step_tuning --repeats 2
finish
