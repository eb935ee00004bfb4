#!/usr/bin/env bash
# Device call BQ (session 12, for issue 5's attention figure): the split kernel reading K/V through TMA tensor
# descriptors against the package's pointer loads, same configs, one process (tools/exp_attention_tma.py).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"

step exp_attention_tma 380 python3 tools/exp_attention_tma.py "$OUT/r/exp_attention_tma.json"
finish
