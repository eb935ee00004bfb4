#!/usr/bin/env bash
# One device call for the foundation issue: train the default model on the GPU, then run the GPU-marked tests,
# the default-model tests and the tour there. Writes everything under $OUT (at most 8 files come back).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/llmlab-out}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rs"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, transformers, triton, tokenizers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__, '| tokenizers', tokenizers.__version__)"
  git rev-parse HEAD 2>/dev/null || echo "commit: (not a git checkout)"
} 2>&1 | tee "$OUT/device.txt"

python3 -m llmlab.train --out data/models/pydoc-llama --device cuda ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
tar czf "$OUT/pydoc-llama.tgz" -C data/models pydoc-llama

$PYTEST -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log"
$PYTEST tests/test_default_model.py 2>&1 | tee -a "$OUT/gpu_tests.log"
{ python3 -m llmlab.cli tour --device cuda; python3 -m llmlab.cli tour --device cuda --dtype fp32;
  python3 -m llmlab.cli tour --device cpu; } 2>&1 | tee "$OUT/tour.log"
