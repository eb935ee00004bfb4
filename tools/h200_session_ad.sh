#!/usr/bin/env bash
# Measured: chat +triton_kernels 1044.2 tok/s (TPOT 0.908 ms, MBU 64.0%) against 1046.4 (0.898 ms) without the
# epilogue in call Z: no gain within run-to-run noise, so the change (a31ed7c) was reverted; its JSON is in data/runs/.
# Device call AD (session 5): RoPE + the K/V cache write moved into the q/k/v GEMV's epilogue (the last program of
# each head rotates it), one launch per layer fewer in the batch-1 decode step. (1) GPU tests of the kernels and the
# model switch (autotuning off); (2) the chat workload's graph and Triton rungs (issue 4's MBU: 64.6% before).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-230}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 90 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_fused_gemv.py \
  tests/test_kernels_rope_cache.py tests/test_kernels_model.py tests/test_cuda_graphs.py
step chat_1b 120 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --repeats 2 --time-budget 95
finish
