#!/usr/bin/env bash
# Device call BR (session 13): (1) why the static-cache rungs of call BP's chat ladder got slower than call BN's
# (tools/exp_static_regression.py on the code of ac9c12c, unpacked from old_code.tar — made, untracked, by
# `git archive ac9c12c llmlab kernels > old_code.tar` — then on this checkout's);
# (2) the whole test suite AND the labs under nbval on the GPU (never run there before), 8 xdist workers, one file
# per worker; the failures re-run alone after it (a failure that passes alone came from sharing the GPU).
# Needs the notebook stack as wheels in .whl (carry it).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=2 LLMLAB_TRITON_AUTOTUNE=0
mkdir -p /tmp/old && tar -xf old_code.tar -C /tmp/old && ln -sfn ../kernels /tmp/old/llmlab/kernels

step static_ab 170 bash -c "python3 tools/exp_static_regression.py /tmp/old old $OUT/r/static_old.json 2>&1 | grep -v '^USDT'; \
  python3 tools/exp_static_regression.py $PWD new $OUT/r/static_new.json 2>&1 | grep -v '^USDT'"
NB="--nbval-lax --nbval-current-env --nbval-cell-timeout=300"
step gpu_suite 330 python3 -m pytest -o addopts= -o cache_dir=/tmp/pc $NB -q -rfs -n 8 --dist loadfile --timeout 300 \
  --durations=15 tests labs
step rerun_failed 120 python3 -m pytest -o addopts= -o cache_dir=/tmp/pc $NB -q -rfs --lf --last-failed-no-failures none \
  --timeout 110 tests labs
finish
