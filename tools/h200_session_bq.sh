#!/usr/bin/env bash
# Device call BQ (session 12, for issue 5's figures): TMA tensor-descriptor loads against the package's pointer
# loads, each in one process: decode attention's split kernel (tools/exp_attention_tma.py, same configs), then the
# M = 1 int4 GEMV's weight tiles (tools/exp_int4_tma.py, the harness of tools/int4_gemv_sweep.py).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step exp_attention_tma 300 python3 tools/exp_attention_tma.py "$OUT/r/exp_attention_tma.json"
step exp_int4_tma 200 python3 tools/exp_int4_tma.py "$OUT/r/exp_int4_tma.json"
finish
