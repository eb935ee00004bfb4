#!/usr/bin/env bash
# Device call Q (session 4): the int4 M = 1 GEMV with weights put back in K order (tl.join) so x is one contiguous
# load (call P's ncu: the two strided x loads made the old kernel issue-bound), swept over its configs; the kernel
# micro-benchmarks (attention with the fused merge as a tuned option, int8/int4 split-K); the chat ladder with peers;
# the GPU tests of the changed kernels.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-565}
source "$(dirname "$0")/h200_lib.sh"

step sweep_int4 70 python3 tools/exp_quant_gemv.py "$OUT/r/sweep_int4.json" int4
step kernel_bench 90 python3 -m llmlab.kernels.bench_kernels --ops attention,matmul --out "$OUT/r"
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 160
step gpu_tests 190 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py \
  tests/test_kernels_decode_attention.py tests/test_kernels_paged_attention.py tests/test_kernels_model.py \
  tests/test_paged_kernel_cache.py tests/test_cuda_graphs.py tests/test_gpu.py -k "not compile"
finish
