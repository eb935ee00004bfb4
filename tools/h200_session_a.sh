#!/usr/bin/env bash
# Device call A: the foundation's and the telemetry's GPU evidence in one run.
#   LLMLAB_COMMIT=<sha> bash tools/h200_session_a.sh OUT_DIR
# 1. tools/h200_record.sh: device.txt, the record/trace/sampler tests (gpu_tests.log), `llmlab record` (traces)
# 2. the foundation tests on CUDA (bf16/fp16/fp32 paths, default model, transformers parity): foundation_tests.log
# 3. `llmlab tour` on the GPU in bf16 and fp32: tour.log
set -uo pipefail
OUT=${1:?usage: bash tools/h200_session_a.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rs"

timeout 240 bash tools/h200_record.sh "$OUT"
echo "record exit: $?"
timeout 200 $PYTEST tests/test_gpu.py tests/test_default_model.py tests/test_model_vs_transformers.py \
  tests/test_generate.py tests/test_errors.py tests/test_checkpoint.py tests/test_gqa.py tests/test_sampling.py \
  tests/test_roofline.py tests/test_peaks.py 2>&1 | tee "$OUT/foundation_tests.log"
{ timeout 60 python3 -m llmlab.cli tour --device cuda; timeout 60 python3 -m llmlab.cli tour --device cuda --dtype fp32; } \
  2>&1 | tee "$OUT/tour.log"
