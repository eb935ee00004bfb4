#!/usr/bin/env bash
# Device call AT (session 8, the last): two more overlap experiments A/B'd on the chat Triton rung, two rounds each
# (runs of one call differ by ~2-3%): the large GEMVs load TWO tiles before gdc_wait (LLMLAB_EXP_PRE2=1), and a short
# static cache (<= 2048 slots) attends with the split kernel's own merge or one split, no merge kernel
# (LLMLAB_EXP_FUSED_LENS=2048). A variant is kept only if it beats the base by > 1.5% in BOTH rounds
# (tools/pick_variant.py); the chat ladder with its peers then runs with the kept variant (or the base).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 75 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_fused_gemv.py -k \
  "whole_row or swiglu_epilogue or split_k or matches_the_unfused or kernels_model" tests/test_kernels_model.py
for round in 1 2; do
  for v in base:0:0 pre2:1:0 fusedlens:0:2048; do
    IFS=: read -r name pre fl <<<"$v"
    step chat_${name}_$round 60 env LLMLAB_EXP_PRE2=$pre LLMLAB_EXP_FUSED_LENS=$fl python3 -m llmlab.cli bench \
      --out "$OUT/r/ab_${name}_$round" --workload chat --model llama-3.2-1b --steps +triton_kernels --repeats 2
  done
done
ENVS=$(python3 tools/pick_variant.py "$OUT/r" base:LLMLAB_EXP_PRE2=0 pre2:LLMLAB_EXP_PRE2=1 \
  fusedlens:LLMLAB_EXP_FUSED_LENS=2048 | tee -a "$LOG" | tail -1)
step chat_1b 200 env $ENVS python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b \
  --steps all --peers --repeats 2 --time-budget 160
finish
