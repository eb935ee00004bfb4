#!/usr/bin/env bash
# Device call M: programmatic dependent launch (PDL) through the batch-1 decode chain, measured on and off, then the
# whole ladder with its peers in one run.
#   1. GPU tests of the PDL kernels (fused GEMV, RoPE + cache, attention split/merge, paged merge), CUDA graphs
#   2. chat, +triton_kernels only, LLMLAB_PDL=1 then LLMLAB_PDL=0                                   -> two JSON files
#   3. chat, every rung + hf_eager/hf_static, with the faster PDL setting of step 2                  -> JSON
#   4. the fused decode step profiled (per-kernel times, trace)                                      -> profile
#   5. decode attention micro-benchmarks (split + merge launched with PDL when it is on)             -> JSON
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-565}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 120 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_fused_gemv.py \
  tests/test_kernels_rope_cache.py tests/test_kernels_decode_attention.py tests/test_kernels_model.py \
  tests/test_kernels_paged_attention.py tests/test_paged_kernel_cache.py tests/test_cuda_graphs.py -k "not compile"
for pdl in 1 0; do
  mkdir -p "$OUT/r/pdl$pdl"
  step "chat_pdl$pdl" 55 env LLMLAB_PDL=$pdl python3 -m llmlab.cli bench --out "$OUT/r/pdl$pdl" --workload chat \
    --model llama-3.2-1b --steps "+triton_kernels" --repeats 2
done
best=$(python3 -c "
import glob, json
def tps(d):
    f = glob.glob('$OUT/r/pdl' + d + '/*.json')
    return json.load(open(f[0]))['results'][0]['tokens_per_s'] if f else 0.0
print(1 if tps('1') >= tps('0') else 0)
")
echo "### PDL for the ladder: LLMLAB_PDL=$best" | tee -a "$LOG"
export LLMLAB_PDL=$best
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 160
step profile 35 python3 -c "
from llmlab.measure.bench import load_bench_model
from llmlab.measure.profiling import format_summary, profile_decode
llm, _, _ = load_bench_model('llama-3.2-1b')
s = profile_decode(llm, n_steps=8, settings={'cuda_graphs': True, 'triton_kernels': True},
                   trace_path='$OUT/r/profile_llama-3.2-1b_triton.json.gz')
print(format_summary(s))
"
step kernel_bench 60 python3 -m llmlab.kernels.bench_kernels --ops attention --out "$OUT/r"
finish
