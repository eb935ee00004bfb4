#!/usr/bin/env bash
# Device call AV (session 8): where the attention's split kernel lets the next kernel launch. Call AR: a merge that
# let the next split kernel launch at its start made the 8K attention micro-benchmark 15% slower (programs that
# only wait still hold SM slots), so the split kernel's own trigger at its START (the merge's programs then wait
# on SMs for the whole split) may cost the same. LLMLAB_EXP_LATE_TRIGGER=1 moves it after the split's K/V loop.
# A/B: the attention micro-benchmark (two rounds), the chat and long Triton rungs.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-280}
source "$(dirname "$0")/h200_lib.sh"

for round in 1 2; do
  for late in 0 1; do
    step attention_late${late}_$round 45 env LLMLAB_EXP_LATE_TRIGGER=$late python3 -m llmlab.kernels.bench_kernels \
      --ops attention --out "$OUT/r/attention_late${late}_$round"
  done
done
for late in 0 1; do
  step chat_late$late 50 env LLMLAB_EXP_LATE_TRIGGER=$late python3 -m llmlab.cli bench \
    --out "$OUT/r/ab_chat_late$late" --workload chat --model llama-3.2-1b --steps +triton_kernels --repeats 2
done
for late in 0 1; do
  step long_late$late 40 env LLMLAB_EXP_LATE_TRIGGER=$late python3 -m llmlab.cli bench \
    --out "$OUT/r/ab_long_late$late" --workload long --model llama-3.2-1b --steps +triton_kernels --repeats 2
done
finish
