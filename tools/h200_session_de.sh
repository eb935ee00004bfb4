#!/usr/bin/env bash
# Device call DE (session 22): the whole test suite AND every lab under nbval on the GPU at the closing code
# (session 22: the review fixes — positions required on a cache that holds tokens, SHA-256 prefix hashes,
# generation_config EOS ids, config checks — and the docs audit's lab edits). 8 xdist workers, one file per
# worker, autotuning off; failures re-run alone. Needs the notebook stack as wheels in .whl (carry it): nbval,
# ipykernel, ipywidgets, plotly, anywidget and what they need that the image lacks.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-500}
source "$(dirname "$0")/h200_lib.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=2
NB="--nbval-lax --nbval-current-env --nbval-cell-timeout=300"
step gpu_suite 300 env LLMLAB_TRITON_AUTOTUNE=0 python3 -m pytest -o addopts= -o cache_dir=/tmp/pc $NB -q -rfs -n 8 \
  --dist loadfile --timeout 280 --durations=15 tests labs
step rerun_failed 90 env LLMLAB_TRITON_AUTOTUNE=0 python3 -m pytest -o addopts= -o cache_dir=/tmp/pc $NB -q -rfs --lf \
  --last-failed-no-failures none --timeout 85 tests labs
cp "$LOG" "$OUT/call-de.log"
finish
