#!/usr/bin/env bash
# Device call CW (session 20): the Gluon int4 GEMV with its cross-warp step once per D turns, the per-warp partials
# kept in a global scratch (tools/exp_int4_split.py, SWEEP=batch). Call CT's 16-warp kernel without the step took
# 11.1 us at 4096 x 14336 (package 13.0). Predicted: D >= 4 between 11.1 and 11.6 us there; at K = 4096 (4-warp
# programs) within 3% of the package.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"
step batch 250 env SWEEP=batch python3 tools/exp_int4_split.py "$OUT/r/call-cw_int4_batch.json"
cp "$LOG" "$OUT/call-cw.log"
finish
