#!/usr/bin/env bash
# The Triton kernels on the GPU: `OUT=DIR bash tools/h200_kernels.sh`, run from the repository root on the GPU
# machine (torch, Triton and pytest; no install, no network). It runs the kernels' tests (tests/test_kernels_*.py:
# fp32, fp16 and bf16, the gpu-marked cases included) with autotuning off, so that each kernel runs its one default
# config, spread over pytest-xdist workers where xdist is installed (with autotuning on, one process takes over
# 20 min). Then `python3 -m llmlab.kernels.bench_kernels --ops all` times RMSNorm, RoPE, SwiGLU, decode attention at
# 1K-32K keys, the fused GEMVs and the int8/int4 weight-only matmuls at Llama-3.1-8B's shapes from CUDA-graph replay,
# autotuned, against the copy bandwidth and PyTorch / cuBLAS (a few minutes in all). It writes into $OUT: device.txt,
# kernel_tests.log, kernel_bench.log and the bench file nvidia-h200_kernels_micro_<time>.json (copy it into
# data/bench/ and commit it: the README quotes the newest one). KERNEL_OPS picks fewer ops (a comma list of
# elementwise, attention, matmul, gemv); PYTEST_WORKERS sets the number of xdist workers (default: one per core).
set -uo pipefail
LOG_NAME=kernels.log
source "$(dirname "$0")/h200_lib.sh"

XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-auto} --dist load")
env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST $XDIST tests/test_kernels_*.py 2>&1 | tee "$OUT/kernel_tests.log"
python3 -m llmlab.kernels.bench_kernels --ops "${KERNEL_OPS:-all}" --out "$OUT" 2>&1 | tee "$OUT/kernel_bench.log"
exit "${PIPESTATUS[0]}"
