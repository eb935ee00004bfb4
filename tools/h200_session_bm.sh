#!/usr/bin/env bash
# Device call BM (session 11): why "+paged_kv" decodes faster than "eager" in the chat ladder
# (`tools/exp_eager_paged.py`).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-240}
source "$(dirname "$0")/h200_lib.sh"

step eager_paged 200 python3 tools/exp_eager_paged.py
finish
