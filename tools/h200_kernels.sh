#!/usr/bin/env bash
# One device call for the Triton kernels issue: the kernels' tests on the GPU (fp32, fp16, bf16, including the
# gpu-marked cases: fp16 RMSNorm at +-1000, softmax sums at context 2048 in fp16, int8 with K = 14336), then the
# micro-benchmarks written as an llmlab bench file. Everything goes under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/llmlab-out}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rs"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null || echo "commit: (not a git checkout)"
} 2>&1 | tee "$OUT/device.txt"


$PYTEST tests/test_kernels_*.py 2>&1 | tee "$OUT/kernel_tests.log"
python3 -m llmlab.kernels.bench_kernels --out "$OUT" 2>&1 | tee "$OUT/kernel_bench.log"
