#!/usr/bin/env bash
# Record the GPU traces that lab 01's dashboard replays on machines without a GPU, on the lent H200.
#
#   bash tools/h200_record.sh OUT_DIR
#
# Runs from the repository root with PYTHONPATH=$PWD (no install, no network). The GPU machine has torch,
# transformers, nvidia-ml-py and pytest but no jupyter/ipywidgets/plotly: nothing here imports them.
#   1. the GPU checks: the real NVML sampler and the torch.profiler kernel timeline (tests marked gpu), plus the
#      CPU-side trace/record/sampler tests; pytest runs with `-o addopts=` because nbval is not installed there;
#   2. `llmlab record`: llama-3.2-1b shape, random bf16 weights, batch 1, 128-token prompt, 256 new tokens per call,
#      ~12 s of decoding per setting between 1 s of idle, with the KV cache and without it.
# Writes into OUT_DIR: the traces (*.json, one per setting: copy them into data/traces/ and commit them),
# device.txt, gpu_tests.log, record.log.
set -uo pipefail
OUT=${1:?usage: bash tools/h200_record.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rs"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, transformers; from importlib.metadata import version; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| nvidia-ml-py', version('nvidia-ml-py'))"
  git rev-parse HEAD 2>/dev/null || echo "commit: (not a git checkout)"
} 2>&1 | tee "$OUT/device.txt"

$PYTEST -s tests/test_record.py tests/test_trace.py tests/test_nvml_sampler.py 2>&1 | tee "$OUT/gpu_tests.log"

python3 -m llmlab.cli record --out-dir "$OUT" 2>&1 | tee "$OUT/record.log"
status=${PIPESTATUS[0]}
ls -la "$OUT"/*.json 2>&1 | tee -a "$OUT/record.log"
exit "$status"
