#!/usr/bin/env bash
# Device call C (2026-11-30, second session): what the first session could not run on the H200.
#   1. the Triton kernels' tests on the GPU (fp32/fp16/bf16, gpu-marked cases included)      -> kernel_tests.log
#   2. the kernel micro-benchmarks (bw_fraction, speedup_vs_bf16)                            -> *_kernels_micro_*.json
#   3. the CUDA-graph / GPU tests again (a precondition was relaxed after the last GPU run)   -> gpu_tests.log
#   4. tools/kv_cache_bench.py: paged step, memory waste, int8/fp8 KV, TTFT with prefix reuse -> nvidia-h200_kv_cache.json
#   5. chat on the Llama-3.2-1B shape: +cuda_graphs vs +triton_kernels (the kernels' ladder gain) -> *_chat_*.json
#   6. kernels per token of the Triton path (profile summary)                                 -> session.log
# Every step runs under `timeout`; the whole script ends within DEADLINE_S (default 540 s). Everything printed
# goes to $OUT/session.log; results are packed in $OUT/results.tar.gz.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-540}
source "$(dirname "$0")/h200_lib.sh"

step kernel_tests 170 $PYTEST tests/test_kernels_*.py
step kernel_bench 80 python3 -m llmlab.kernels.bench_kernels --out "$OUT/r"
step gpu_tests 90 $PYTEST tests/test_cuda_graphs.py tests/test_gpu.py -k "not compile"
step kv_cache_bench 130 python3 tools/kv_cache_bench.py --out "$OUT/r"
step chat_triton 90 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --repeats 2 --time-budget 70
step profile_triton 40 python3 -c "
from llmlab.measure.bench import load_bench_model
from llmlab.measure.profiling import format_summary, profile_decode
llm, _, _ = load_bench_model('llama-3.2-1b')
for name, settings in (('cuda_graphs', {'cuda_graphs': True}), ('triton', {'cuda_graphs': True, 'triton_kernels': True})):
    s = profile_decode(llm, n_steps=8, settings=settings)
    print(name, {k: s[k] for k in ('kernels_per_token', 'launches_per_token', 'gpu_busy_fraction')})
    print(format_summary(s))
"
finish
