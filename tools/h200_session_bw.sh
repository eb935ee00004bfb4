#!/usr/bin/env bash
# Device call BW (session 14): the kernel micro-benchmarks at this commit (issue 5's figures), then the `long` (8K
# context) and `batch` (64 requests) workloads climbing the whole ladder from eager with their peers — lab 02
# replays the newest such file of each workload, and the ones in data/bench/ (2026-11-30 morning) predate the
# whole-workload warm-up, step tuning and the prefill graphs.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"
LADDER="eager,+gpu_sampling,+pinned_memory,+cuda_graphs,+torch_compile,+triton_kernels,+step_tuning,+prefill_graphs"
step kernel_bench 90 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step long_1b 230 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b --steps "$LADDER" \
  --peers --repeats 1 --time-budget 190
step batch_1b 220 python3 -m llmlab.cli bench --out "$OUT/r" --workload batch --model llama-3.2-1b --steps "$LADDER" \
  --peers --repeats 1 --time-budget $(($(left) - 40))
finish
