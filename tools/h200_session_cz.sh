#!/usr/bin/env bash
# Device call CZ (session 21): session 21 changed no kernel but the package around it: presets are now built in
# their own dtype on the meta device (`llmlab.engine.random_model`, used by every GPU benchmark and test on a preset
# shape), weights are checked for NaN/inf at load, the profiler's step time comes from the step ranges. So: (1) the
# whole test suite on the GPU (OMP_NUM_THREADS=1, see h200_lib.sh); (2) the chat ladder with its peers on the
# Llama-3.2-1B shape, all rungs, on today's code (issue 4's figures, re-measured, not re-tuned).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"
step gpu_tests 200 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -n 14 --dist load tests/
step chat_1b 330 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 300
cp "$LOG" "$OUT/call-cz.log"
finish
