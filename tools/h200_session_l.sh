#!/usr/bin/env bash
# Device call L: after call K showed the fused GEMVs at 51-74% of the copy bandwidth (one memory latency per loop
# step) and the attention tuned on the warm-up's 1-token rows (one split, 5 us a layer):
#   1. GPU tests of the changed kernels + CUDA graphs + GPU tests (autotuning off)                    -> session.log
#   2. chat on llama-3.2-1b, the +cuda_graphs and +triton_kernels rungs                             -> *_chat_*.json
#   3. the fused decode step profiled: per-kernel times                                              -> profile
#   4. kernel micro-benchmarks: fused GEMVs, decode attention, int8/int4 GEMVs (autotuned, CUDA-graph replay)
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 150 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_fused_gemv.py \
  tests/test_kernels_decode_attention.py tests/test_kernels_model.py tests/test_kernels_rope_cache.py \
  tests/test_cuda_graphs.py tests/test_gpu.py tests/test_sampling.py -k "not compile"
step chat_1b 100 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --repeats 2 --time-budget 80
step profile 40 python3 -c "
from llmlab.measure.bench import load_bench_model
from llmlab.measure.profiling import format_summary, profile_decode
llm, _, _ = load_bench_model('llama-3.2-1b')
s = profile_decode(llm, n_steps=8, settings={'cuda_graphs': True, 'triton_kernels': True},
                   trace_path='$OUT/r/profile_llama-3.2-1b_triton.json.gz')
print(format_summary(s))
"
step kernel_bench 220 python3 -m llmlab.kernels.bench_kernels --ops gemv,attention,matmul --out "$OUT/r"
finish
