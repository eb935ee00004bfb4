#!/usr/bin/env bash
# Device call K (session 2026-11-30, third): the batch-1 decode with the small ops fused into the GEMVs
# (kernels/fused_gemv.py), the two-stage greedy argmax, the int4/int8 M=1 GEMVs on 32-bit words and the tuned
# split length of decode attention.
#   1. the Triton kernels' tests + the CUDA-graph and GPU tests (autotuning off: one config per kernel)  -> session.log
#   2. chat on llama-3.2-1b: every rung + hf_eager/hf_static peers in the same run                  -> *_chat_llama-3.2-1b_*.json
#   3. the Triton decode step profiled with and without the one-token fusion: kernels and GPU time per token,
#      the top kernels (a trace of the fused step)                                                   -> session.log, profile
#   4. kernel micro-benchmarks of the fused GEMVs (CUDA-graph replay)                                -> *_kernels_micro_*.json
# Every step runs under `timeout`; the script ends within DEADLINE_S (default 560 s).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 150 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_*.py tests/test_paged_kernel_cache.py \
  tests/test_cuda_graphs.py tests/test_gpu.py tests/test_sampling.py -k "not compile"
step chat_1b 210 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 170
step profile 60 python3 -c "
from llmlab.measure.bench import load_bench_model
from llmlab.measure.profiling import format_summary, profile_decode
from llmlab.kernels import patch_model
llm, _, _ = load_bench_model('llama-3.2-1b')
keys = ('kernels_per_token', 'step_ms', 'gpu_busy_ms_per_token', 'gpu_idle_ms_per_token', 'gpu_busy_fraction')
for name in ('fused', 'per_module'):
    if name == 'per_module':
        patch_model._one_token_fusable = lambda model, h: False
        llm.model.__dict__.pop('_llmlab_runners', None)  # recapture: the cached graphs hold the fused step
    s = profile_decode(llm, n_steps=8, settings={'cuda_graphs': True, 'triton_kernels': True},
                       trace_path='$OUT/r/profile_llama-3.2-1b_triton.json.gz' if name == 'fused' else None)
    print('###', name, {k: s[k] for k in keys})
    print(format_summary(s))
"
step kernel_bench 120 python3 -m llmlab.kernels.bench_kernels --ops gemv --out "$OUT/r"
finish
