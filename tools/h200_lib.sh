# Shared by the device-call scripts (tools/h200_session_*.sh): source it after `set -uo pipefail`.
#
# Sets up $OUT/r (results, packed by `finish` into $OUT/results.tar.gz: a call brings back at most 8 files), the
# environment for running from a plain checkout (PYTHONPATH=$PWD, no network), $LOG (everything printed), $PYTEST,
# and `step NAME MAX_SECONDS COMMAND...`: runs COMMAND under `timeout`, limited to what is left of DEADLINE_S
# (default 540 s) for the whole script, and skipped when less than 20 s are left.
OUT=${OUT:-/tmp/llmlab-out}; mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
export LLMLAB_PEAKS_CACHE=/tmp/llmlab-peaks.json  # measured once per call, shared by the runs
DEADLINE_S=${DEADLINE_S:-540}
START=$SECONDS
LOG="$OUT/session.log"
# OMP_NUM_THREADS=1: with -n 14 workers, torch's CPU-side tests otherwise run 14 x 16 threads on 16 cores and take
# minutes (call CO)
PYTEST="env OMP_NUM_THREADS=1 python3 -m pytest -o addopts= -p no:cacheprovider -q -rs --durations=5"

left() { echo $((DEADLINE_S - (SECONDS - START))); }

step() {
  local name=$1 max=$2 remaining
  shift 2
  remaining=$(left)
  ((remaining < 20)) && { echo "### $name: SKIPPED (${remaining}s left)" | tee -a "$LOG"; return 0; }
  ((max > remaining)) && max=$remaining
  echo "### $name (at $((SECONDS - START))s, limit ${max}s)" | tee -a "$LOG"
  timeout --kill-after=5 "$max" "$@" 2>&1 | grep -v '^USDT' | tee -a "$LOG"
  echo "### $name: exit ${PIPESTATUS[0]} at $((SECONDS - START))s" | tee -a "$LOG"
}

finish() {
  echo "### done in $((SECONDS - START))s" | tee -a "$LOG"
  tar -czf "$OUT/results.tar.gz" -C "$OUT" r && rm -rf "$OUT/r"
  ls -la "$OUT"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
  echo "commit: ${LLMLAB_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
} 2>&1 | tee -a "$LOG"
