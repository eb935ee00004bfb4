#!/usr/bin/env bash
# Device call AP (session 7): the persistent M = 1 int4 GEMV experiment (tools/exp_int4_persistent.py) against the
# package kernel's best configs, at Llama-3.1-8B's four shapes.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-190}
source "$(dirname "$0")/h200_lib.sh"

step int4_persistent 180 python3 tools/exp_int4_persistent.py "$OUT/r/int4_persistent.json"
finish
