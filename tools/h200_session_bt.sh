#!/usr/bin/env bash
# Device call BT (session 13): the chat ladder with its peers on the shipped default model (pydoc-llama, 7.7M
# parameters), the current code: issue 4's "launch-bound model" figure (the graph-captured step >= 5x the eager
# step) was last measured on 2026-11-30 (9acabe5), before the Triton rungs, step tuning and prefill graphs.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"

step chat_ladder_default 380 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model default --steps all \
  --peers --repeats 2 --time-budget 340
finish
