#!/usr/bin/env bash
# RECORD of call AM at commit 8e06020: rope_decode_attention with the cos/sin table was measured no
# faster and taken out again (see data/runs/2026-11-30_h200_call-am.log); its env switches do nothing at later commits.
# Device call AM (session 7): RoPE + the K/V cache write inside the decode-attention launch, now reading the step's
# cos/sin from a table computed once per step (`rope_cos_sin`) instead of computing sin/cos in every program (call
# AL: that made the split kernel 7.1 us against 3.5 and the chat rung 5% slower). GPU tests; the chat Triton rung
# with it off and on; each kernel's own time (LLMLAB_PDL=0); then the full chat ladder with its peers; the long
# (8K) workload's Triton rung off and on if time is left.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 90 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_decode_attention.py -k "rope or graph" \
  tests/test_kernels_rope_cache.py tests/test_kernels_model.py
for on in 0 1; do
  step chat_rope_in_attention_$on 70 env LLMLAB_ROPE_IN_ATTENTION=$on python3 -m llmlab.cli bench \
    --out "$OUT/r/rope_in_attention_$on" --workload chat --model llama-3.2-1b --steps +triton_kernels --repeats 3
done
step kernel_times_pdl0 50 env LLMLAB_PDL=0 python3 tools/decode_kernel_times.py llama-3.2-1b \
  cuda_graphs=true,triton_kernels=true "$OUT/r/kernel_times_pdl0_rope_in_attention_1.json"
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 160
for on in 0 1; do
  step long_rope_in_attention_$on 60 env LLMLAB_ROPE_IN_ATTENTION=$on python3 -m llmlab.cli bench \
    --out "$OUT/r/rope_in_attention_$on" --workload long --model llama-3.2-1b --steps +triton_kernels --repeats 2
done
finish
