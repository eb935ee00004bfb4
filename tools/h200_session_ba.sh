#!/usr/bin/env bash
# Device call BA (session 9): after the review and the fresh user's findings (64-bit row offsets in the attention's
# split kernel and in argmax, prefetch_kv's re-read with .cg loads, refusals): the GPU tests of what changed, the
# attention and argmax micro-benchmarks, and the chat Triton rung (does the 64-bit offset cost anything?).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-330}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests_attn 120 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_decode_attention.py \
  tests/test_kernels_argmax.py -k "not equals_torch_argmax"
step gpu_tests_model 70 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_model.py tests/test_static_cache.py \
  -k "not compiled"
step kernel_bench 60 python3 -m llmlab.kernels.bench_kernels --ops attention,elementwise --out "$OUT/r"
step chat_rung 45 python3 -m llmlab.cli bench --out "$OUT/r/rung" --workload chat --model llama-3.2-1b \
  --steps +triton_kernels --repeats 3
finish
