#!/usr/bin/env bash
# Device call BB (session 10): diagnostics and same-process A/Bs before changing anything.
# 1. decode attention's fixed ~6 us per call (tools/exp_attention_tail.py): a plain read of the same bytes, the
#    split kernel alone, split + merge, the split kernel's own merge at 8-32 splits, a later PDL trigger;
# 2. the chat decode step (tools/ab_decode_step.py): the split kernel's PDL trigger after its wait
#    (LLMLAB_AB_LATE_TRIGGER) and the two large GEMVs (down 2048 x 8192, gate/up 8192 x 2048 with the SwiGLU
#    epilogue) forced to other configs than the isolated autotuner picked (LLMLAB_AB_GEMV) — timed in the step;
# 3. the long (8K) step with the later trigger; the two argmax GPU tests session 9 had no time for.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-540}
source "$(dirname "$0")/h200_lib.sh"

step attention_tail 170 python3 tools/exp_attention_tail.py "$OUT/r/attention_tail.json"
D=LLMLAB_AB_GEMV=2048x8192
G=LLMLAB_AB_GEMV=8192x2048
step ab_chat 150 python3 tools/ab_decode_step.py llama-3.2-1b "$OUT/r/ab_chat.json" base= \
  late=LLMLAB_AB_LATE_TRIGGER=1 \
  d16x256=$D:16/256/4/3 d8x512=$D:8/512/4/3 d16x512=$D:16/512/8/2 d4x1024=$D:4/1024/4/3 d8x256=$D:8/256/4/4 \
  d32x256=$D:32/256/8/3 \
  g4x512=$G:4/512/4/3 g8x256=$G:8/256/4/4 g4x1024=$G:4/1024/4/3 g2x1024=$G:2/1024/4/3 g8x512=$G:8/512/8/2 \
  --rounds 4
step ab_long 90 python3 tools/ab_decode_step.py llama-3.2-1b "$OUT/r/ab_long.json" base= \
  late=LLMLAB_AB_LATE_TRIGGER=1 --rounds 3 --prompt-len 7936
step gpu_tests_argmax 60 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_argmax.py -k "graph or apart or 2_31 or capture"
finish
