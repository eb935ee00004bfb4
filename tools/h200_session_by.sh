#!/usr/bin/env bash
# Device call BY (session 15): the `batch` workload (64 requests of mixed lengths) climbing the whole ladder from
# eager, then its peers (HF eager and static cache). Lab 02 replays the newest batch ladder; the committed ones
# (2026-11-30) predate the whole-workload warm-up, step tuning and the prefill graphs. The time budget stops new
# ladder rows early enough for the two peers to run (torch.compile's warm-up alone took 114 s in call BW).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"
LADDER="eager,+gpu_sampling,+pinned_memory,+cuda_graphs,+torch_compile,+triton_kernels,+step_tuning,+prefill_graphs"
step batch_1b 520 python3 -m llmlab.cli bench --out "$OUT/r" --workload batch --model llama-3.2-1b --steps "$LADDER" \
  --peers --repeats 1 --time-budget 380
finish
