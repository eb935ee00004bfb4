#!/usr/bin/env bash
# Device call BK (session 11): where the package's M = 1 int4 GEMV stalls (Nsight Compute, --set full, stall
# reasons sampled per SASS instruction), one launch at 14336 x 4096 (`tools/ncu_int4_stalls.py`).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-240}
source "$(dirname "$0")/h200_lib.sh"

step ncu 180 ncu --clock-control none --profile-from-start off --set full --import-source yes \
  -o "$OUT/r/prof" python3 tools/ncu_int4_stalls.py
if [ -f "$OUT/r/prof.ncu-rep" ]; then
  ncu --import "$OUT/r/prof.ncu-rep" --page details > "$OUT/r/call-bk_ncu_details.txt" 2>&1
  ncu --import "$OUT/r/prof.ncu-rep" --page raw --csv 2>&1 | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin))
for name, unit, value in zip(rows[0], rows[1], rows[2]):
    if 'stall' in name or 'warps_active' in name or 'inst_executed' in name or 'issue_active' in name:
        print(name, unit, value)" > "$OUT/r/call-bk_ncu_stalls.txt"
  ncu --import "$OUT/r/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/r/call-bk_ncu_sass.csv" 2>&1
  rm -f "$OUT/r/prof.ncu-rep"
fi
finish
