#!/usr/bin/env bash
# The GPU traces that lab 01's dashboard replays on machines without a GPU: `OUT=DIR bash tools/h200_record.sh`, run
# from the repository root on the GPU machine (torch, transformers, nvidia-ml-py and pytest; no install, no network,
# no jupyter/ipywidgets/plotly). It first runs the telemetry tests on the GPU (the real NVML sampler, the
# torch.profiler kernel timeline, and the CPU-side record/trace/sampler tests), then `llmlab record`: the
# Llama-3.2-1B shape with random bf16 weights, batch 1, a 128-token prompt and 256 new tokens per call, ~12 s of
# decoding per setting between 1 s of idle, with the KV cache and without it (~3 min in all). It writes into $OUT:
# device.txt, gpu_tests.log, record.log and one trace JSON per setting (copy those into data/traces/ and commit
# them). It exits with `llmlab record`'s status.
set -uo pipefail
LOG_NAME=record.log
source "$(dirname "$0")/h200_lib.sh"

$PYTEST -s tests/test_record.py tests/test_trace.py tests/test_nvml_sampler.py 2>&1 | tee "$OUT/gpu_tests.log"

python3 -m llmlab.cli record --out-dir "$OUT" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
ls -la "$OUT"/*.json 2>&1 | tee -a "$LOG"
exit "$status"
