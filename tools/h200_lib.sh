# Shared helper of tools/h200_*.sh; sourced, not run. It needs $OUT (an output folder; created, made absolute) and
# moves to the root of the checkout it is in. It exports PYTHONPATH (that root, then what PYTHONPATH held, e.g. the
# folder carried wheels were installed into; so `python3 -m llmlab.cli` and
# `llmlab.kernels` import with no install), HF_HUB_OFFLINE=1 (no network), LLMLAB_PEAKS_CACHE (the device's peak
# bandwidth, measured once per run and shared by every bench in it) and LLMLAB_COMMIT (the commit the bench files
# record: set it yourself when the tree is a copy whose git HEAD is not what it holds). It writes $OUT/device.txt
# (GPU, driver, Python/torch/Triton/transformers versions, commit) and defines $PYTEST (pytest without the
# project's addopts: nbval is not needed) and `step NAME NEED_S COMMAND...`, which runs COMMAND under `timeout` with
# the time left of DEADLINE_S (seconds for the whole script) and skips it when fewer than NEED_S seconds are left.
# Everything a step prints also goes to $LOG, the file $LOG_NAME (default session.log) in $OUT.
: "${OUT:?set OUT to an output folder, e.g. OUT=/tmp/llmlab-out bash tools/h200_bench.sh}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export LLMLAB_PEAKS_CACHE=${LLMLAB_PEAKS_CACHE:-$OUT/peaks.json}
export LLMLAB_COMMIT=${LLMLAB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "-")}
# OMP_NUM_THREADS=1: torch's CPU-side tests otherwise start one thread per core in every pytest worker
PYTEST="env OMP_NUM_THREADS=1 python3 -m pytest -o addopts= -p no:cacheprovider -q -rs --durations=5"
DEADLINE_S=${DEADLINE_S:-3600}
LOG=$OUT/${LOG_NAME:-session.log}
START=$SECONDS

left() { echo $((DEADLINE_S - (SECONDS - START))); }

step() {
  local name=$1 need=$2 remaining
  shift 2
  remaining=$(left)
  if ((remaining < need)); then
    echo "### $name: SKIPPED, ${remaining}s left of ${DEADLINE_S}s (needs ~${need}s)" | tee -a "$LOG"
    return 0
  fi
  echo "### $name (at $((SECONDS - START))s, limit ${remaining}s): $*" | tee -a "$LOG"
  timeout --kill-after=5 "$remaining" "$@" 2>&1 | grep -v '^USDT' | tee -a "$LOG"
  echo "### $name: exit ${PIPESTATUS[0]} after $((SECONDS - START))s" | tee -a "$LOG"
}

{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  python3 - <<'EOF'
import sys
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

parts = ["python " + sys.version.split()[0]]
for name in ("torch", "triton", "transformers", "nvidia-ml-py"):
    try:
        parts.append(f"{name} {import_module(name).__version__ if name != 'nvidia-ml-py' else version(name)}")
    except (ImportError, PackageNotFoundError):
        parts.append(f"{name} -")
print(" | ".join(parts))
EOF
  echo "commit: $LLMLAB_COMMIT"
} 2>&1 | tee "$OUT/device.txt"
