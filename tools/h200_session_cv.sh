#!/usr/bin/env bash
# Device call CV (session 20): decode attention's split kernel with 1- and 2-warp programs (the online softmax in
# one warp: no barrier per tile), every config in the op's chain beside the autotuned op. Predicted at 8K: a 1-warp
# config between 12 and 13.5 us if per-tile barriers cost what the GEMV's did (package 13.7-14.3 us).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"
step warps 260 python3 tools/exp_attention_warps.py "$OUT/r/call-cv_attention_warps.json"
cp "$LOG" "$OUT/call-cv.log"
finish
