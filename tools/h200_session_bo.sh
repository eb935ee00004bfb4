#!/usr/bin/env bash
# Device call BO (session 11): the whole test suite on the GPU after this session's changes (the bench's warm-up,
# the fresh user's fixes: group-size, dtype, weights-memory, checkpoint, profile-path and train checks), autotuning
# off; then the step-tuning tests with autotuning on (their real-step test needs it).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step all_tests 440 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests
step step_tuning_tuned 90 $PYTEST tests/test_step_tuning.py
finish
