#!/usr/bin/env bash
# Device call BC (session 10): step tuning (kernels/step_tuning.py) — the batch-1 decode GEMVs' tiles chosen by
# timing the captured step (call BB: the down projection's isolated pick 850 us/step, another tile 821).
# GPU tests of the new code; a same-process A/B (autotuner's tiles vs step-tuned, alternating rounds, chat and
# long); the chat ladder with peers (the new +step_tuning rung on top); the long workload.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 150 $PYTEST tests/test_step_tuning.py
step ab_chat 100 python3 tools/ab_decode_step.py llama-3.2-1b "$OUT/r/ab_chat_step_tuning.json" base= \
  tuned=STEP_TUNING=1 --rounds 5
step ab_long 70 python3 tools/ab_decode_step.py llama-3.2-1b "$OUT/r/ab_long_step_tuning.json" base= \
  tuned=STEP_TUNING=1 --rounds 3 --prompt-len 7936
step chat_1b 230 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 200
step long_1b 60 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps +triton_kernels,+step_tuning --repeats 2
finish
