#!/usr/bin/env bash
# Device call BX (session 15): call BW again without its batch part. BW's results (session 14) never reached the
# repository — its transfer was lost with the checkout — so its figures are measured again here: the kernel
# micro-benchmarks (issue 5's figures) and the `long` workload (8K context) climbing the whole ladder from eager,
# with its peers. The `batch` workload gets a call of its own (h200_session_by.sh): in BW it ran out of time.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-540}
source "$(dirname "$0")/h200_lib.sh"
LADDER="eager,+gpu_sampling,+pinned_memory,+cuda_graphs,+torch_compile,+triton_kernels,+step_tuning,+prefill_graphs"
step kernel_bench 120 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step long_1b 300 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b --steps "$LADDER" \
  --peers --repeats 1 --time-budget 220
finish
