#!/usr/bin/env bash
# Device call H: the kernel tests after the fused RoPE + cache write and the int4/int8 M=1 GEMVs, the GEMV bench,
# and the ladder's last two rungs on the Llama-3.2-1B shape, with kernels per token.
set -uo pipefail
OUT=${OUT:-/tmp/llmlab-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
python3 -c "import llmlab.kernels" 2>/dev/null || ln -sfn ../kernels llmlab/kernels
{
echo "commit: ${LLMLAB_COMMIT:-?}"
LLMLAB_TRITON_AUTOTUNE=0 timeout 80 python3 -m pytest -o addopts= -p no:cacheprovider -q tests/test_kernels_*.py tests/test_paged_kernel_cache.py
timeout 60 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT"
timeout 70 python3 -m llmlab.cli bench --out "$OUT" --workload chat --model llama-3.2-1b --steps "+cuda_graphs,+triton_kernels" --repeats 2 --time-budget 55
timeout 25 python3 -c "
from llmlab.measure.bench import load_bench_model
from llmlab.measure.profiling import profile_decode
llm, _, _ = load_bench_model('llama-3.2-1b')
s = profile_decode(llm, n_steps=8, settings={'cuda_graphs': True, 'triton_kernels': True})
print('triton kernels per token', s['kernels_per_token'])
"
} 2>&1 | grep -v '^USDT' | tee "$OUT/call-h.log"
