#!/usr/bin/env bash
# Device call B: re-record the telemetry traces (with the sampler's own cost measured), run the fast-decode GPU
# tests and benchmark (CUDA graphs, torch.compile, GPU sampling), then `llmlab bench` (the ladder + HF peers).
#   LLMLAB_COMMIT=<sha> bash tools/h200_session_b.sh OUT_DIR
# Ends within ~540 s; brings back session.log and three archives (traces, fast-decode, bench).
set -uo pipefail
OUT=${1:?usage: bash tools/h200_session_b.sh OUT_DIR}
mkdir -p "$OUT/rec" "$OUT/fast" "$OUT/bench"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
START=$SECONDS
LOG="$OUT/session.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "commit: ${LLMLAB_COMMIT:-unknown}"
  echo "=== llmlab record (at $((SECONDS - START)) s) ==="
  timeout 150 python3 -m llmlab.cli record --out-dir "$OUT/rec"; echo "record exit $?"
  echo "=== fast decode (at $((SECONDS - START)) s) ==="
  timeout 210 bash tools/h200_fast_decode.sh "$OUT/fast"; echo "fast decode exit $?"
  echo "=== llmlab bench (at $((SECONDS - START)) s) ==="
  DEADLINE_S=$((530 - (SECONDS - START))) bash tools/h200_bench.sh "$OUT/bench"; echo "bench exit $?"
  echo "=== done at $((SECONDS - START)) s ==="
} > "$LOG" 2>&1
for d in rec fast bench; do tar czf "$OUT/$d.tgz" -C "$OUT/$d" . && rm -rf "${OUT:?}/$d"; done
tail -c 11000 "$LOG"
