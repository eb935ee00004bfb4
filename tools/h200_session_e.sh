#!/usr/bin/env bash
# Device call E: the GPU tests of everything changed today, the KV-cache lab's measurements, the batch and long
# workloads of the ladder, and the kernel micro-benchmarks again (decode attention without its fill kernel).
#   1. GPU tests (kernels with LLMLAB_TRITON_AUTOTUNE=0 — one config per kernel, the bench checks the tuned
#      ones —, the paged-kernel cache, CUDA graphs without compile, tests/test_gpu.py)       -> session.log
#   2. tools/kv_cache_bench.py (paged steps incl. the Triton paged kernel, waste, int8/fp8 KV,
#      TTFT with prefix reuse on the default model and the 1B shape)                           -> nvidia-h200_kv_cache.json
#   3. batch (64 prompts) and long (8K context) on llama-3.2-1b, every fast rung + peers       -> *_batch_*, *_long_*
#   4. kernel micro-benchmarks                                                                 -> *_kernels_micro_*.json
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 170 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_*.py tests/test_paged_kernel_cache.py \
  tests/test_cuda_graphs.py tests/test_gpu.py -k "not compile"
step kv_cache_bench 120 python3 tools/kv_cache_bench.py --out "$OUT/r"
FAST="eager,+gpu_sampling,+cuda_graphs,+torch_compile,+triton_kernels"
step batch_1b 110 python3 -m llmlab.cli bench --out "$OUT/r" --workload batch --model llama-3.2-1b --steps "$FAST" \
  --peers --repeats 1 --time-budget 95
step long_1b 100 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b --steps "$FAST" \
  --peers --repeats 1 --time-budget 85
step kernel_bench 60 python3 -m llmlab.kernels.bench_kernels --out "$OUT/r"
finish
