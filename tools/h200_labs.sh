#!/usr/bin/env bash
# Every lab executed on the GPU machine, outputs kept: `OUT=DIR bash tools/h200_labs.sh`, run from the repository
# root there (torch, Triton, transformers and nvidia-ml-py are in its image; nbclient, ipykernel, plotly, ipywidgets,
# anywidget and what they need travel as wheels in .whl/: install them into /tmp/site and put that on PYTHONPATH
# first, see tools/README.md). It runs tools/run_labs.py: each labs/NN_*.ipynb in order (LABS="00 04" for a subset) in
# a fresh kernel with labs/ as its folder, a first cell added whose output names the GPU, the UTC date and the commit,
# LAB_TIMEOUT_S (default 300) seconds per lab at most. A lab that raises is recorded as failed and the others go on; a
# lab is not started when less than a minute of DEADLINE_S (default 560) is left: the log lists the labs not run
# and the LABS=... that runs them. It writes into $OUT: device.txt, session.log (everything printed), labs.log (each
# lab's status, seconds and size, the failing cell and error) and gpu-outputs.tar.gz (the executed notebooks;
# gpu-outputs-2.tar.gz ... too if one file would pass 16 MiB; unpack them with
# `python3 tools/unpack_gpu_outputs.py gpu-outputs*.tar.gz` into labs/gpu-outputs/). On a CPU it runs too (the first
# cell then says "no CUDA GPU").
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560} LOG_NAME=session.log
source "$(dirname "$0")/h200_lib.sh"
echo "labs: ${LABS:-all}, ${LAB_TIMEOUT_S:-300} s per lab at most, deadline ${DEADLINE_S}s" | tee -a "$OUT/device.txt"

# run_labs.py stops starting labs 20 s before the step's own limit, so it writes its summary and archive itself
export LABS=${LABS:-}  # run_labs.py reads it: lab numbers or names, spaces or commas between them
step labs 60 python3 tools/run_labs.py --out "$OUT" --lab-timeout-s "${LAB_TIMEOUT_S:-300}" \
  --deadline-s "$(($(left) - 20))" --min-lab-s "${MIN_LAB_S:-60}"

echo "### done in $((SECONDS - START))s" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"
# the exit status is run_labs.py's: 0 when every lab asked for ran clean
[[ $(grep '^### labs: exit' "$LOG" | tail -n 1) == "### labs: exit 0 "* ]]
