#!/usr/bin/env bash
# Device call AS (session 8): the kernels after call AR's findings, made permanent — small GEMVs tuned over
# whole-row configs only (their weights load before gdc_wait), the attention's merge letting the o projection launch
# early (trigger_next) — plus the SwiGLU epilogue (the gate/up GEMV writes silu(gate) * up; the down projection
# reads I numbers with no prologue), A/B'd on the chat rung (LLMLAB_EXP_GLU_OUT=1 the new path, 0 the old);
# GPU tests of what changed; the chat ladder with its peers; the kernel micro-benchmarks; the long workload.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 120 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_fused_gemv.py tests/test_kernels_model.py \
  tests/test_kernels_decode_attention.py -k "not decode_attention or trigger or graph or static"
for glu in 1 0; do
  step chat_glu_$glu 70 env LLMLAB_EXP_GLU_OUT=$glu python3 -m llmlab.cli bench --out "$OUT/r/ab_glu_$glu" \
    --workload chat --model llama-3.2-1b --steps +triton_kernels --repeats 3
done
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 160
step kernel_bench 110 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step long_1b 50 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps +triton_kernels --repeats 2
finish
