#!/usr/bin/env bash
# RECORD of call AL at commit 1aeb7ee: rope_decode_attention (first form) was measured no
# faster and taken out again (see data/runs/2026-11-30_h200_call-al.log); its env switches do nothing at later commits.
# Device call AL (session 7): RoPE + the K/V cache write moved into the decode-attention launch
# (`rope_decode_attention`, one launch fewer per layer in the batch-1 decode step). GPU tests of it; the chat
# workload's Triton rung with it off and on (LLMLAB_ROPE_IN_ATTENTION); each kernel's own time per token
# (LLMLAB_PDL=0) in both forms.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 110 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_decode_attention.py \
  tests/test_kernels_rope_cache.py tests/test_kernels_model.py
for on in 0 1; do
  step chat_rope_in_attention_$on 90 env LLMLAB_ROPE_IN_ATTENTION=$on python3 -m llmlab.cli bench \
    --out "$OUT/r/rope_in_attention_$on" --workload chat --model llama-3.2-1b --steps +cuda_graphs,+triton_kernels \
    --repeats 3
done
for on in 0 1; do
  step kernel_times_rope_in_attention_$on 70 env LLMLAB_PDL=0 LLMLAB_ROPE_IN_ATTENTION=$on python3 \
    tools/decode_kernel_times.py llama-3.2-1b cuda_graphs=true,triton_kernels=true \
    "$OUT/r/kernel_times_pdl0_rope_in_attention_$on.json"
done
step kernel_times_pdl1 70 python3 tools/decode_kernel_times.py llama-3.2-1b cuda_graphs=true,triton_kernels=true \
  "$OUT/r/kernel_times_pdl1_rope_in_attention_1.json"
finish
