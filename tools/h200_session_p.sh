#!/usr/bin/env bash
# Device call P (session 4): split-K int4/int8 M = 1 GEMVs (one launch, the last split adds the partials) swept over
# every config at Llama-3.1-8B's shapes; decode attention with the split kernel's own merge vs the merge kernel;
# Nsight Compute on the int4/int8 GEMVs, cuBLAS bf16, attention at 8K and the fused q/k/v GEMV; GPU tests of the
# changed kernels.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step sweep 260 python3 tools/exp_quant_gemv.py "$OUT/r/sweep.json"
step ncu 100 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis -f -o "$OUT/r/prof" \
  python3 tools/ncu_targets.py
[ -f "$OUT/r/prof.ncu-rep" ] && ncu --import "$OUT/r/prof.ncu-rep" --page details > "$OUT/r/prof.txt" 2>&1
[ -f "$OUT/r/prof.txt" ] && grep -E "^  [a-z_]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit Reg|Issue Slots Busy|Grid Size|Block Size|Warp Cycles Per Issued|No Eligible|Executed Ipc A" "$OUT/r/prof.txt" | head -120
step gpu_tests 170 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_dequant_matmul.py \
  tests/test_kernels_decode_attention.py tests/test_kernels_paged_attention.py tests/test_kernels_model.py
finish
