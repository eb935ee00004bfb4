#!/usr/bin/env bash
# Device call BH (session 11): the chunk-order int4 GEMV (`tools/exp_int4_xlayout.py`: x loaded in the weight tile's
# own layout, no shared-memory conversion in the K loop) swept against the package's GEMV and cuBLAS bf16 at the
# 8B shapes; Nsight Compute on two of its configs next to the package's.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-540}
source "$(dirname "$0")/h200_lib.sh"

step sweep 330 python3 tools/exp_int4_xlayout.py "$OUT/r/call-bh_int4_xlayout.json"
step ncu 150 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats \
  -o "$OUT/r/prof" python3 tools/ncu_int4_xlayout.py
[ -f "$OUT/r/prof.ncu-rep" ] && ncu --import "$OUT/r/prof.ncu-rep" --page details > "$OUT/r/call-bh_ncu.txt" 2>&1
rm -f "$OUT/r/prof.ncu-rep"
finish
