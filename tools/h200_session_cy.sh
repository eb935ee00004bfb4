#!/usr/bin/env bash
# Device call CY (session 20): Nsight Compute (full set: stall reasons per instruction) on the Gluon int4 GEMV at
# 4096 x 14336, its variant without the cross-warp step, and the same bytes as 16384 x 3584 (tools/ncu_int4_gluon.py).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"
step ncu 200 ncu --clock-control none --profile-from-start off --set full --import-source no \
  -o "$OUT/r/prof" python3 tools/ncu_int4_gluon.py
if [ -f "$OUT/r/prof.ncu-rep" ]; then
  ncu --import "$OUT/r/prof.ncu-rep" --page details > "$OUT/r/call-cy_ncu_int4_gluon.txt" 2>&1
  ncu --import "$OUT/r/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/r/call-cy_ncu_sass.csv" 2>&1
  rm -f "$OUT/r/prof.ncu-rep"
fi
cp "$LOG" "$OUT/call-cy.log"
finish
