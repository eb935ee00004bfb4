#!/usr/bin/env bash
# Device call BI (session 11): the package's int4 GEMV with x's per-field lift and word sums done in x's own layout,
# before the conversion into the weight tile's (`tools/exp_int4_xlift.py`), swept over the package's configs
# against the package kernel and cuBLAS bf16 at the 8B shapes.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300}
source "$(dirname "$0")/h200_lib.sh"

step sweep 240 python3 tools/exp_int4_xlift.py "$OUT/r/call-bi_int4_xlift.json"
finish
