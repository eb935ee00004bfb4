#!/usr/bin/env bash
# Device call BD (session 10): the step-tuning GPU tests after BC's fix (a runner clamped to a short model
# context); decode attention at 8K under Nsight Compute (split kernel vs a plain read of the same bytes vs the
# merge); decode attention called three ways (plain / seq_lens / as the model's step calls it) and with 8-warp
# split configs, in the micro-benchmark's CUDA-graph chain.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 120 $PYTEST tests/test_step_tuning.py
step ncu 120 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis \
  -o "$OUT/r/prof" python3 tools/ncu_attention.py
[ -f "$OUT/r/prof.ncu-rep" ] && ncu --import "$OUT/r/prof.ncu-rep" --page details > "$OUT/r/ncu_attention.txt" 2>&1
rm -f "$OUT/r/prof.ncu-rep"
step attention_paths 130 python3 tools/exp_attention_paths.py "$OUT/r/attention_paths.json"
finish
