#!/usr/bin/env bash
# Device call BU (session 13): call BT's default-model ladder read GPU-Util 0% for its fastest rungs (runs of ~25 ms,
# far shorter than NVML's averaging window). bench.timed now repeats a sampled row until its timed runs have taken
# 1 s: the quick GPU bench test, then the default-model ladder again.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"

step quick_gpu_test 80 $PYTEST "tests/test_bench.py::test_gpu_chat_quick_fills_the_gpu_columns"
step chat_ladder_default 220 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model default --steps all \
  --peers --repeats 2 --time-budget 200
finish
