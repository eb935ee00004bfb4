#!/usr/bin/env bash
# Device call BZ (session 15): the whole test suite AND the labs under nbval on the GPU at this session's last code
# (the fresh-user fixes: argument checks in the train CLI, kv_memory, kv_quant, generate and checkpoint; call BV
# ran the suite at 5129a94). 8 xdist workers, one file per worker, autotuning off; failures re-run alone. Needs the
# notebook stack as wheels in .whl (carry it).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=2
NB="--nbval-lax --nbval-current-env --nbval-cell-timeout=300"
step gpu_suite 280 env LLMLAB_TRITON_AUTOTUNE=0 python3 -m pytest -o addopts= -o cache_dir=/tmp/pc $NB -q -rfs -n 8 \
  --dist loadfile --timeout 250 --durations=15 tests labs
step rerun_failed 80 env LLMLAB_TRITON_AUTOTUNE=0 python3 -m pytest -o addopts= -o cache_dir=/tmp/pc $NB -q -rfs --lf \
  --last-failed-no-failures none --timeout 75 tests labs
finish
