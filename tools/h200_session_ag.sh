#!/usr/bin/env bash
# Device call AG (session 6): why the tensor-core int4 GEMV is slower than the CUDA-core one (Nsight Compute: warp
# stalls, occupancy, memory), and which configs give the wrong rows seen in call AF's GPU test (N 48, K 192, G 64).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-200}
source "$(dirname "$0")/h200_lib.sh"

step ncu 150 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis \
  --section InstructionStats -o "$OUT/r/prof" python3 tools/ncu_int4_mma.py
[ -f "$OUT/r/prof.ncu-rep" ] && ncu --import "$OUT/r/prof.ncu-rep" --page details > "$OUT/r/prof.txt" 2>&1
rm -f "$OUT/r/prof.ncu-rep"
finish
