#!/usr/bin/env bash
# The GPU part of `llmlab bench` / `llmlab profile`, for one device call on the lent H200.
#
#   bash tools/h200_bench.sh OUT_DIR          # main, < 4 min: chat on llama-3.2-1b, chat on default, a profile
#   bash tools/h200_bench.sh OUT_DIR extra    # a second call, < 4 min: batch and long on the llama-3.2-1b shape
#
# Runs from the repository root with PYTHONPATH=$PWD: no install, no network; needs torch, transformers and
# nvidia-ml-py only (no plotly / ipywidgets / nbval). Every step starts only if the script's remaining time
# (DEADLINE_S, default 230 s) allows it, and runs under `timeout` with what is left; `--time-budget` makes a bench
# skip rows that would start late (their reason is in the file's "skipped"). Bench files are rewritten after every
# row, so a run cut short still leaves its rows ("complete": false). Copy the bench *.json files into data/bench/
# and commit them: labs 02 and 05 replay them.
#
# Files in OUT_DIR (a device call brings back at most 8): device.txt, bench.log (everything printed), one JSON per
# bench run (2 per mode), profile_*.json.gz (Chrome traces for https://ui.perfetto.dev; main mode, if time is left).
#
# Expected time on an H200 — estimates from the course's notes, not measured yet (eager 1B decode step ~11-13 ms,
# CUDA-graph step ~2 ms, HF eager 61 tok/s, each torch.compile warm-up 30-90 s):
#   main:  device.txt + imports ~10 s; chat 1B, every rung + peers, 2 repeats ~120-220 s (two compile warm-ups:
#          +torch_compile and hf_static); chat default ~50-80 s (its time budget drops the last rows, the peers
#          first, when the 1B run was slow); profile 1B (eager and CUDA graphs) ~25 s only if time is left.
#   extra: batch 1B (no recompute rung; peers; 1 repeat; 4 groups x 16 x 128 tokens) ~100-150 s; long 1B (8K
#          context; same rungs; peers; 1 repeat) ~90-140 s, cut by the deadline when batch was slow.
set -uo pipefail
OUT=${1:?usage: bash tools/h200_bench.sh OUT_DIR [extra]}
MODE=${2:-main}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
export LLMLAB_PEAKS_CACHE=/tmp/llmlab-peaks.json  # measured once per call, shared by the runs below
DEADLINE_S=${DEADLINE_S:-230}
LOG="$OUT/bench.log"
START=$SECONDS

left() { echo $((DEADLINE_S - (SECONDS - START))); }

# step NAME MIN_SECONDS COMMAND...: run COMMAND if at least MIN_SECONDS remain, limited to what remains
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
  local rc=${PIPESTATUS[0]}
  echo "### $name: exit $rc after $((SECONDS - START))s" | tee -a "$LOG"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, torch, transformers; from importlib.metadata import version; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| nvidia-ml-py', version('nvidia-ml-py'))"
  git rev-parse HEAD 2>/dev/null || echo "commit: ${LLMLAB_COMMIT:-(not a git checkout)}"
  echo "mode: $MODE, deadline ${DEADLINE_S}s"
} 2>&1 | tee "$OUT/device.txt"

# BIG / BENCH_ARGS: for a dry run of this script on a CPU, e.g. BIG=default BENCH_ARGS=--quick DEADLINE_S=120
BIG=${BIG:-llama-3.2-1b}
BENCH="python3 -m llmlab.cli bench --out $OUT ${BENCH_ARGS:-}"
NO_RECOMPUTE="eager,+gpu_sampling,+pinned_memory,+cuda_graphs,+torch_compile"

if [[ $MODE == main ]]; then
  step chat_1b 90 $BENCH --workload chat --model $BIG --steps all --peers --repeats 2 --time-budget 120
  step chat_default 60 $BENCH --workload chat --model default --steps all --peers --repeats 2 \
    --time-budget $(($(left) - 50))
  step profile 30 python3 -c "
from llmlab.measure.bench import load_bench_model
from llmlab.measure.profiling import format_summary, profile_decode
llm, _, _ = load_bench_model('$BIG')
for name, settings in (('eager', {}), ('cuda_graphs', {'cuda_graphs': True})):
    try:
        s = profile_decode(llm, n_steps=8, settings=settings,
                           trace_path='$OUT/profile_$BIG' + '_' + name + '.json.gz')
        print(format_summary(s))
        print({k: s[k] for k in ('kernels_per_token', 'launches_per_token', 'gpu_busy_fraction',
                                 'idle_gap_between_steps_us')})
    except Exception as e:
        print(name, 'FAILED:', type(e).__name__, e)
"
else
  step batch_1b 90 $BENCH --workload batch --model $BIG --steps "$NO_RECOMPUTE" --peers --repeats 1 \
    --time-budget 80
  step long_1b 60 $BENCH --workload long --model $BIG --steps "$NO_RECOMPUTE" --peers --repeats 1 \
    --time-budget $(($(left) - 60))
fi

echo "### done in $((SECONDS - START))s" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"
