#!/usr/bin/env bash
# Device call AB (session 5): the other two workloads with the GEMVs as tuned now (tune_bench, one-warp configs):
# long (8K context, batch 1) and batch (64 requests), the CUDA-graph and Triton rungs and Hugging Face's static cache.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"

step long_1b 170 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --peers --repeats 1 --time-budget 140
step batch_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload batch --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --peers --repeats 1 --time-budget 170
finish
