#!/usr/bin/env bash
# Device call DD (session 22): the figures of record for issues 4 and 5 re-measured on the code as it will close
# (no kernel changed since the kernel file of record, call CS; the package around them did): the full kernel
# micro-benchmark, then the chat ladder with its peers on the Llama-3.2-1B shape, all rungs.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"
step kernel_bench 200 python3 -m llmlab.kernels.bench_kernels --ops all --out "$OUT/r"
step chat_1b 330 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 300
cp "$LOG" "$OUT/call-dd.log"
finish
