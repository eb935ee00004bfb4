#!/usr/bin/env bash
# Device call F: the KV-cache bench with a 16K-token first message (prefix reuse), and the batch workload with the
# rungs that fit one call (no +torch_compile: one compilation per batch bucket, 7 buckets up to 64, took > 100 s).
set -uo pipefail
OUT=${OUT:-/tmp/llmlab-out}; mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
export LLMLAB_PEAKS_CACHE=/tmp/llmlab-peaks.json
LOG="$OUT/session.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "commit: ${LLMLAB_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
} 2>&1 | tee -a "$LOG"
python3 -c "import llmlab.kernels" 2>/dev/null || ln -sfn ../kernels llmlab/kernels
echo "### kv_cache_bench" | tee -a "$LOG"
timeout 150 python3 tools/kv_cache_bench.py --out "$OUT/r" 2>&1 | tee -a "$LOG"
echo "### batch_1b" | tee -a "$LOG"
timeout 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload batch --model llama-3.2-1b \
  --steps "eager,+gpu_sampling,+cuda_graphs,+triton_kernels" --peers --repeats 1 --time-budget 150 2>&1 | tee -a "$LOG"
tar -czf "$OUT/results.tar.gz" -C "$OUT" r && rm -rf "$OUT/r"
