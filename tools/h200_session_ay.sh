#!/usr/bin/env bash
# Device call AY (session 9): the landed code (one-launch argmax, graph outputs without copies; the RoPE epilogue
# in the q/k/v GEMV taken out after call AX measured it slower). A/B in one process: decode attention's prefetch_kv
# (first K/V tile loaded before the PDL wait; the kernel before, rope_and_cache_, writes only the newest slot) on
# or off, chat and long; the winner (lower in both) is used for the figures of record: the chat ladder with peers,
# the kernel micro-benchmarks, the long workload.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 70 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_decode_attention.py -k "prefetch or graph"
step gpu_tests_pf 50 env LLMLAB_TRITON_AUTOTUNE=0 LLMLAB_AB_PREFETCH=1 $PYTEST tests/test_kernels_model.py \
  -k "graph_replayed or batch_one or static"
step ab_chat 110 python3 tools/ab_decode_step.py llama-3.2-1b "$OUT/r/ab_chat_pf.json" nopf=LLMLAB_AB_PREFETCH=0 \
  pf=LLMLAB_AB_PREFETCH=1 --rounds 5
step ab_long 90 python3 tools/ab_decode_step.py llama-3.2-1b "$OUT/r/ab_long_pf.json" nopf=LLMLAB_AB_PREFETCH=0 \
  pf=LLMLAB_AB_PREFETCH=1 --rounds 3 --prompt-len 7936
PF=$(python3 - "$OUT/r" <<'PY'
import json, sys
ok = True
for name in ("ab_chat_pf", "ab_long_pf"):
    try:
        r = {x["variant"]: x["step_ms_median"] for x in json.load(open(f"{sys.argv[1]}/{name}.json"))["results"]}
        ok = ok and r["pf"] < r["nopf"]
    except Exception:
        ok = False
print(1 if ok else 0)
PY
)
echo "### prefetch_kv for the figures: LLMLAB_AB_PREFETCH=$PF" | tee -a "$LOG"
export LLMLAB_AB_PREFETCH=$PF
step chat_1b 200 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 160
step kernel_bench 90 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step long_1b 40 python3 -m llmlab.cli bench --out "$OUT/r" --workload long --model llama-3.2-1b \
  --steps +triton_kernels --repeats 2
step chat_rung 40 python3 -m llmlab.cli bench --out "$OUT/r/rung" --workload chat --model llama-3.2-1b \
  --steps +triton_kernels --repeats 3
finish
