#!/usr/bin/env bash
# The system-overhead fixes on the lent H200: CUDA graphs, torch.compile, GPU sampling, pinned memory.
#
#   bash tools/h200_fast_decode.sh [OUT_DIR]          (default $OUT, else /tmp/llmlab-out; ~2.5 min)
#
# Runs from the repository root with PYTHONPATH=$PWD (no install, no network; nbval/plotly/ipywidgets are not
# needed). Self-contained: paste it as a section of a larger device script.
#   1. the GPU tests of tests/test_cuda_graphs.py — graph replay == eager for 64 steps at every bucket, pad rows
#      never change real rows, one graph per bucket, lengths never cause a device error, no host sync per token —
#      and tests/test_host_costs.py; then the torch.compile tests (one compilation per bucket: the slow part) in a
#      second run, so that a slow compiler cannot hide the graph results;
#   2. tools/bench_fast_decode.py: batch-1 decode ms/step, eager vs static vs graphs vs compile, for the default
#      model and Llama-3.2-1B's shape (bf16, random weights), with MBU and the host costs (tokenizer, H2D, sampling).
# Expected: tests ~1 min, bench ~1.5 min. Every step has a hard time limit (`timeout`), so the whole section ends
# within ~6 min even if something hangs.
# Writes into OUT_DIR: fast_decode_tests.log, fast_decode_bench.log, fast_decode_bench.json.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/llmlab-out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rs"

{
  echo "== tests/test_cuda_graphs.py + tests/test_host_costs.py (CUDA graphs, sampling, lengths, host costs) =="
  timeout 100 $PYTEST tests/test_cuda_graphs.py tests/test_host_costs.py -k "not compile"; echo "exit status $?"
  echo "== tests/test_cuda_graphs.py (torch.compile: 4 compilations of a 2-layer model) =="
  timeout 100 $PYTEST tests/test_cuda_graphs.py -k "compile"; echo "exit status $?"
} 2>&1 | tee "$OUT/fast_decode_tests.log"

# starts no compilation after 60 s; rows are saved to the JSON as they come
timeout 150 python3 tools/bench_fast_decode.py --json "$OUT/fast_decode_bench.json" --budget-s 60 2>&1 \
  | tee "$OUT/fast_decode_bench.log"
echo "bench exit status ${PIPESTATUS[0]}" | tee -a "$OUT/fast_decode_bench.log"
