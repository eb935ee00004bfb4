#!/usr/bin/env bash
# RECORD of call AN at commit 0397480: the L2 prefetch was measured no
# faster and taken out again (see data/runs/2026-11-30_h200_call-an.log); its env switches do nothing at later commits.
# Device call AN (session 7): the batch-1 decode step's attention asks the L2 to fetch the weights of the GEMVs after
# it (cp.async.bulk.prefetch.L2): the o projection's, and the next layer's q/k/v weight (the MLP GEMVs between then
# read with evict-first priority). GPU tests; the chat Triton rung with LLMLAB_L2_PREFETCH=0 / o / 1; each kernel's
# own time (LLMLAB_PDL=0); the long (8K) rung with 0 / 1; the full chat ladder with its peers.
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-570}
source "$(dirname "$0")/h200_lib.sh"

step gpu_tests 90 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_kernels_decode_attention.py \
  -k "rope or graph or prefetch" tests/test_kernels_model.py tests/test_kernels_fused_gemv.py
for pf in 0 o 1; do
  step chat_l2_prefetch_$pf 70 env LLMLAB_L2_PREFETCH=$pf python3 -m llmlab.cli bench \
    --out "$OUT/r/l2_prefetch_$pf" --workload chat --model llama-3.2-1b --steps +triton_kernels --repeats 3
done
step kernel_times_pdl0 45 env LLMLAB_PDL=0 python3 tools/decode_kernel_times.py llama-3.2-1b \
  cuda_graphs=true,triton_kernels=true "$OUT/r/kernel_times_pdl0_l2_prefetch_1.json"
for pf in 0 1; do
  step long_l2_prefetch_$pf 45 env LLMLAB_L2_PREFETCH=$pf python3 -m llmlab.cli bench \
    --out "$OUT/r/l2_prefetch_$pf" --workload long --model llama-3.2-1b --steps +triton_kernels --repeats 2
done
step chat_1b 190 python3 -m llmlab.cli bench --out "$OUT/r" --workload chat --model llama-3.2-1b --steps all \
  --peers --repeats 2 --time-budget 150
finish
