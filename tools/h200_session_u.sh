#!/usr/bin/env bash
# Device call U (session 4): the long (8K) workload again after taking the fused merge out of the tuned configs for
# calls with lengths (the static-cache decode): does the +triton_kernels rung return from 714 to ~759 tokens/s?
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-150}
source "$(dirname "$0")/h200_lib.sh"

step long_1b 140 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --repeats 1 --time-budget 110
finish
