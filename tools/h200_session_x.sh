#!/usr/bin/env bash
# Device call X (session 5): call W's word-reading GEMVs were fastest with 1-2 warps (int4 17.0 us, int8 17.9 us at
# 14336 x 4096); 4-warp tiles 2x slower. (1) sweep small-warp configs, x per field (X_DIRECT) vs one (J, 8) tile;
# (2) Nsight Compute on four raw launches (why 4 warps lose; how close the best are to the DRAM / issue limits).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step sweep 300 python3 tools/exp_quant_gemv.py "$OUT/r/sweep.json" int4,int8 x
step ncu 150 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis \
  -o "$OUT/r/prof" python3 tools/ncu_gemv.py
[ -f "$OUT/r/prof.ncu-rep" ] && ncu --import "$OUT/r/prof.ncu-rep" --page details > "$OUT/r/prof.txt" 2>&1
rm -f "$OUT/r/prof.ncu-rep"
finish
