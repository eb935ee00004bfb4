#!/usr/bin/env bash
# The system-overhead fixes on the GPU (CUDA graphs, torch.compile, GPU sampling, pinned memory):
# `OUT=DIR bash tools/h200_fast_decode.sh`, run from the repository root on the GPU machine (torch, transformers and
# pytest; no install, no network). It runs tests/test_cuda_graphs.py and tests/test_host_costs.py on the GPU (graph
# replay equal to eager at every batch bucket, pad rows never changing real rows, no host sync per token), then the
# torch.compile tests in a second run so that a slow compiler cannot hide the graph results, then
# tools/bench_fast_decode.py: batch-1 decode ms/step of eager `generate` against the static-cache step run eagerly,
# from CUDA graphs and through torch.compile, for the shipped default model and the Llama-3.2-1B shape (random bf16
# weights), with MBU and the host costs (~2 min in all; every part runs under `timeout`). It writes into $OUT:
# device.txt, fast_decode_tests.log, fast_decode_bench.log and fast_decode_bench.json (data/bench/
# nvidia-h200_fast-decode_<date>.json is that file, committed).
set -uo pipefail
LOG_NAME=fast_decode_bench.log
source "$(dirname "$0")/h200_lib.sh"

{
  echo "== tests/test_cuda_graphs.py + tests/test_host_costs.py (CUDA graphs, sampling, lengths, host costs) =="
  timeout 100 $PYTEST tests/test_cuda_graphs.py tests/test_host_costs.py -k "not compile"; echo "exit status $?"
  echo "== tests/test_cuda_graphs.py (torch.compile: one compilation per bucket) =="
  timeout 100 $PYTEST tests/test_cuda_graphs.py -k "compile"; echo "exit status $?"
} 2>&1 | tee "$OUT/fast_decode_tests.log"

# starts no compilation after 60 s; rows are saved to the JSON as they come
timeout 150 python3 tools/bench_fast_decode.py --json "$OUT/fast_decode_bench.json" --budget-s 60 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
echo "bench exit status $status" | tee -a "$LOG"
exit "$status"
