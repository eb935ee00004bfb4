#!/usr/bin/env bash
# Device call BP (session 12): the GPU tests of the prefill graphs and the one-step-late token reads, then their A/B
# in one process (tools/exp_read_and_prefill.py), then the full chat ladder with its peers (the new top rung,
# +prefill_graphs, against +step_tuning and Hugging Face in the same run). The bench test whose sampler fix (9d0d5d4,
# session 11) was only checked on a CPU rides with the GPU tests.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-580}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 170 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_cuda_graphs.py tests/test_kernels_model.py \
  tests/test_static_cache.py tests/test_ladder.py "tests/test_bench.py::test_gpu_chat_quick_fills_the_gpu_columns"
step exp_read_prefill 130 python3 tools/exp_read_and_prefill.py "$OUT/r/exp_read_and_prefill.json" 5
step chat_ladder 270 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 250
finish
