#!/usr/bin/env bash
# Device call CU (session 20): call CT found the 16-warp Gluon GEMV at K = 14336 at 11.1 us without its per-chunk
# cross-warp step (13.0 with it), and every in-kernel join of split rows slower than the package. Here: PF chunks of
# loads in flight instead of 1, so a warp's loads stay issued while the barrier waits for the slowest warp
# (tools/exp_int4_split.py, SWEEP=pf). Predicted at 4096 x 14336: PF = 2 or 3 between 11.1 and 12.5 us.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"
step pf 250 env SWEEP=pf python3 tools/exp_int4_split.py "$OUT/r/call-cu_int4_pf.json"
cp "$LOG" "$OUT/call-cu.log"
finish
