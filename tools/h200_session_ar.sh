#!/usr/bin/env bash
# Device call AR (session 8): the GPU tests call AQ did not reach (paged attention, the model's kernels, the
# quantized GEMVs) and the rewritten split-K test; the chat Triton rung A/B'd over two PDL experiments — the
# attention merge kernel lets the o projection launch early (LLMLAB_EXP_MERGE_TRIGGER=1) and the q/k/v and o
# GEMVs load their whole weight rows before waiting for the kernel before them (LLMLAB_EXP_WHOLE_ROW=1); the
# decode-attention micro-benchmark with and without the merge's trigger.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 170 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_paged_attention.py \
  tests/test_kernels_model.py tests/test_kernels_dequant_matmul.py tests/test_kernels_fused_gemv.py -k \
  "not fused_gemv or split_k"
for v in base:0:0 trigger:1:0 wholerow:0:1 both:1:1; do
  IFS=: read -r name tr wr <<<"$v"
  step chat_$name 70 env LLMLAB_EXP_MERGE_TRIGGER=$tr LLMLAB_EXP_WHOLE_ROW=$wr python3 -m llmlab.cli bench \
    --out "$OUT/r/ab_$name" --workload chat --model llama-3.2-1b --steps +triton_kernels --repeats 3
done
for tr in 0 1; do
  step attention_trigger_$tr 60 env LLMLAB_EXP_MERGE_TRIGGER=$tr python3 -m llmlab.kernels.bench_kernels \
    --ops attention --out "$OUT/r/attention_trigger_$tr"
done
finish
