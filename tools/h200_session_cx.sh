#!/usr/bin/env bash
# Device call CX (session 20): call CW's batched cross-warp step through a GLOBAL scratch was slower (its flush reads
# the partials back from L2, one round trip per turn in series: the loads cannot pass the stores of y). The same
# batching through SHARED memory (tools/exp_int4_split.py, SWEEP=sbatch); its per-turn barrier is the one the
# in-warp transpose already has. Predicted at 4096 x 14336: D = 4-8 between 11.1 (CT's bound) and 11.8 us.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"
step sbatch 250 env SWEEP=sbatch python3 tools/exp_int4_split.py "$OUT/r/call-cx_int4_sbatch.json"
cp "$LOG" "$OUT/call-cx.log"
finish
