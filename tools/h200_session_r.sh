#!/usr/bin/env bash
# Device call R (session 4, last): the weight-only matmul benchmark with the pruned M = 1 configs; the long (8K)
# and batch (64 requests) workloads with the final code; Nsight Compute on the K-order int4 GEMV; the dequant tests.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-540}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 60 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py
step kernel_bench 70 python3 -m llmlab.kernels.bench_kernels --ops matmul --out "$OUT/r"
step long_1b 130 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps "+cuda_graphs,+triton_kernels" --peers --repeats 1 --time-budget 110
step batch_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload batch --model llama-3.2-1b \
  --steps "eager,+gpu_sampling,+cuda_graphs,+triton_kernels" --peers --repeats 1 --time-budget 150
step ncu 60 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats -f -o "$OUT/r/prof_r" python3 tools/ncu_targets.py
[ -f "$OUT/r/prof_r.ncu-rep" ] && ncu --import "$OUT/r/prof_r.ncu-rep" --page details > "$OUT/r/prof_r.txt" 2>&1
[ -f "$OUT/r/prof_r.txt" ] && grep -E "^  [a-z_]|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" "$OUT/r/prof_r.txt" | head -40
finish
