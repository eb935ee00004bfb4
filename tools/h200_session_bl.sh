#!/usr/bin/env bash
# Device call BL (session 11): the cost of the split-K fixup at the end of the int4 GEMV
# (`tools/exp_splitk_tail.py`: the package's ending, a release-only counter with the acquire in the last program
# alone, and no fixup at all as a lower bound), against the package kernel and cuBLAS bf16 at the 8B shapes.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-240}
source "$(dirname "$0")/h200_lib.sh"

step sweep 200 python3 tools/exp_splitk_tail.py "$OUT/r/call-bl_splitk_tail.json"
finish
