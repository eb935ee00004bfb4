#!/usr/bin/env bash
# Device call DB (session 21): what call DA could not run, the notebook stack now with anywidget (plotly's
# FigureWidget needs it): the dashboard tests (the new live-NVML one on the shipped model included) and lab 01 under
# nbval on the GPU; then test_record's real-NVML test alone (under 8 xdist workers in call DA the other workers
# kept the GPU busy in its "idle" window).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-230}
source "$(dirname "$0")/h200_lib.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=2
NB="--nbval-lax --nbval-current-env --nbval-cell-timeout=200"
step dashboard_lab01 150 python3 -m pytest -o addopts= -p no:cacheprovider $NB -q -rfs --durations=5 \
  tests/test_dashboard.py labs/01_gpu_utilization.ipynb
step record_alone 60 python3 -m pytest -o addopts= -p no:cacheprovider -q -rfs -s tests/test_record.py -k real_nvml
cp "$LOG" "$OUT/call-db.log"
finish
