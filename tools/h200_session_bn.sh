#!/usr/bin/env bash
# Device call BN (session 11): the chat ladder with peers after the bench's warm-up fix (every row warms up on the
# whole workload; call BM found the eager rows' first run at new KV lengths 4x slower than the next).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-420}
source "$(dirname "$0")/h200_lib.sh"

step chat_1b 380 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 330
finish
