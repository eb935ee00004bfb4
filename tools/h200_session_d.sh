#!/usr/bin/env bash
# Device call D: the kernels after autotuning / fusion, and the whole ladder on the Llama-3.2-1B shape.
#   1. the Triton kernels' tests + the CUDA-graph tests on the GPU                  -> session.log
#   2. kernel micro-benchmarks, timed from CUDA-graph replay                         -> *_kernels_micro_*.json
#   3. chat on llama-3.2-1b: every rung + hf_eager/hf_static peers, 2 repeats        -> *_chat_llama-3.2-1b_*.json
#   4. kernels per token: CUDA graphs vs CUDA graphs + Triton kernels (profile)     -> session.log
# Every step runs under `timeout`; the script ends within DEADLINE_S (default 560 s).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 150 $PYTEST -x tests/test_kernels_*.py tests/test_cuda_graphs.py -k "not compile"
step kernel_bench 150 python3 -m llmlab.kernels.bench_kernels --out "$OUT/r"
step chat_1b 170 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 150
step profile 40 python3 -c "
from llmlab.measure.bench import load_bench_model
from llmlab.measure.profiling import format_summary, profile_decode
llm, _, _ = load_bench_model('llama-3.2-1b')
for name, settings in (('cuda_graphs', {'cuda_graphs': True}), ('triton', {'cuda_graphs': True, 'triton_kernels': True})):
    s = profile_decode(llm, n_steps=8, settings=settings, trace_path='$OUT/r/profile_llama-3.2-1b_' + name + '.json.gz')
    print(name, {k: s[k] for k in ('kernels_per_token', 'launches_per_token', 'gpu_busy_fraction')})
    print(format_summary(s))
"
finish
