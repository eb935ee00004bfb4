#!/usr/bin/env bash
# Device call AQ (session 8, the first): GPU tests of the kernels changed since call AO (input checks, split-K in
# the fused GEMV, dense seq_lens/block tables in the attention); the chat Triton rung A/B'd over two experiment
# switches — split-K configs offered to the fused GEMV's autotuner (LLMLAB_EXP_SPLITK=1) and the attention's fused
# merge with a static cache of <= 2048 slots (LLMLAB_EXP_FUSED_LENS=2048); the fused-GEMV sweep with the split-K
# candidates; an int4 GEMV whose loop prefetches the next tile into registers (tools/exp_int4_prefetch.py).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 150 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_fused_gemv.py \
  tests/test_kernels_decode_attention.py tests/test_kernels_paged_attention.py tests/test_kernels_model.py \
  tests/test_kernels_dequant_matmul.py
for v in base:0:0 splitk:1:0 fusedlens:0:2048 both:1:2048; do
  IFS=: read -r name sk fl <<<"$v"
  step chat_$name 70 env LLMLAB_EXP_SPLITK=$sk LLMLAB_EXP_FUSED_LENS=$fl python3 -m llmlab.cli bench \
    --out "$OUT/r/ab_$name" --workload chat --model llama-3.2-1b --steps +triton_kernels --repeats 3
done
step sweep_fused_gemv 130 python3 tools/exp_fused_gemv.py "$OUT/r/sweep_fused_gemv_splitk.json" splitk
step int4_prefetch 120 python3 tools/exp_int4_prefetch.py "$OUT/r/int4_prefetch.json"
finish
