#!/usr/bin/env bash
# Device call AW (session 9): the decode step's tail and the RoPE launch.
#   tail:  the greedy token in one Triton launch (kernels/argmax.py) instead of ~6 PyTorch kernels, and the graph's
#          own output tensors returned instead of copies (predicted: -20..-35 us/token)
#   rope:  RoPE + K/V cache write in the q/k/v GEMV's epilogue, no rope_cache launch (-1.5..-2.5 us/layer)
#   pf:    the attention's split programs load their first K/V tile before the PDL wait (-0.5..-1 us/layer)
# A/B (two rounds, chat Triton rung), GPU tests of the new code, per-kernel times of the new default (PDL off).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-560}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 150 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_argmax.py tests/test_kernels_fused_gemv.py \
  tests/test_kernels_decode_attention.py tests/test_kernels_model.py tests/test_kernels_rope_cache.py \
  tests/test_cuda_graphs.py tests/test_static_cache.py
step gpu_tests_prefetch 60 env LLMLAB_TRITON_AUTOTUNE=0 LLMLAB_AB_PREFETCH=1 $PYTEST tests/test_kernels_model.py \
  -k "graph_replayed or batch_one or static"
step argmax_micro 30 python3 -m llmlab.kernels.argmax

declare -A VAR=([base]="LLMLAB_AB_TAIL=0 LLMLAB_AB_ROPE_GEMV=0 LLMLAB_AB_PREFETCH=0"
                [tail]="LLMLAB_AB_TAIL=1 LLMLAB_AB_ROPE_GEMV=0 LLMLAB_AB_PREFETCH=0"
                [rope]="LLMLAB_AB_TAIL=1 LLMLAB_AB_ROPE_GEMV=1 LLMLAB_AB_PREFETCH=0"
                [pf]="LLMLAB_AB_TAIL=1 LLMLAB_AB_ROPE_GEMV=1 LLMLAB_AB_PREFETCH=1")
for round in 1 2; do
  for v in base tail rope pf; do
    step chat_${v}_$round 50 env ${VAR[$v]} python3 -m llmlab.cli bench --out "$OUT/r/ab_${v}_$round" \
      --workload chat --model llama-3.2-1b --steps +triton_kernels --repeats 2
  done
done
python3 tools/pick_variant.py "$OUT/r" base: tail: rope: pf: 2>&1 | tee -a "$LOG"
for v in base pf; do
  step long_$v 40 env ${VAR[$v]} python3 -m llmlab.cli bench --out "$OUT/r/ab_long_$v" --workload long \
    --model llama-3.2-1b --steps +triton_kernels --repeats 2
done
step kernel_times_pdl0 60 env LLMLAB_PDL=0 python3 tools/decode_kernel_times.py llama-3.2-1b \
  cuda_graphs=true,triton_kernels=true "$OUT/r/kernel_times_pdl0_rope.json"
finish
