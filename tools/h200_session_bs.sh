#!/usr/bin/env bash
# Device call BS (session 13): the argmax capture test after its fix (an empty scratch table of its own), run after
# the files that met its key first in call BR; then the chat ladder with its peers again, to see whether call BP's
# slow static-cache rungs (+gpu_sampling, +pinned_memory: TPOT 21 ms against 11 ms in call BN) come back — call BR
# found the same code equal to ac9c12c's when run alone (tools/exp_static_regression.py).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-420}
source "$(dirname "$0")/h200_lib.sh"

step argmax_test 90 python3 -c "
import sys, pytest, torch
from llmlab.kernels.argmax import argmax
argmax(torch.randn(3, 5000, device='cuda'))  # meets the test's (3 rows, 8 slots) key first, as call BR's worker did
sys.exit(pytest.main(['-o', 'addopts=', '-p', 'no:cacheprovider', '-q', '-rs', 'tests/test_kernels_argmax.py']))"
step chat_ladder 300 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 280
finish
