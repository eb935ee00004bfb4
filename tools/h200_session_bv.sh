#!/usr/bin/env bash
# Device call BV (session 14): (1) the whole test suite AND the labs under nbval on the GPU (code after call BU:
# check_fast_paths, the bench's timed loop, the switches' messages), 8 xdist workers, one file per worker,
# autotuning off; failures re-run alone; (2) `llmlab record` again: lab 01's traces, now warmed up on the whole
# workload (the 2026-11-30 traces kept the eager decode's one-off first-run cost); (3) the chat ladder with its
# peers at this commit. Needs the notebook stack as wheels in .whl (carry it).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=2
NB="--nbval-lax --nbval-current-env --nbval-cell-timeout=300"
step gpu_suite 230 env LLMLAB_TRITON_AUTOTUNE=0 python3 -m pytest -o addopts= -o cache_dir=/tmp/pc $NB -q -rfs -n 8 \
  --dist loadfile --timeout 220 --durations=15 tests labs
step rerun_failed 60 env LLMLAB_TRITON_AUTOTUNE=0 python3 -m pytest -o addopts= -o cache_dir=/tmp/pc $NB -q -rfs --lf \
  --last-failed-no-failures none --timeout 55 tests labs
step record 110 python3 -m llmlab.cli record --out-dir "$OUT/r/traces"
step chat_ladder 240 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 200
finish
