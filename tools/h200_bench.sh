#!/usr/bin/env bash
# The H200 benchmark behind labs 02 and 05 and the README's table: `OUT=DIR bash tools/h200_bench.sh [main|extra]`,
# run from the repository root on the GPU machine (torch, Triton, transformers and nvidia-ml-py; no install, no
# network). "main" (the default, ~6 min) runs `llmlab bench` on the chat workload for the Llama-3.2-1B shape (random
# bf16 weights) and for the shipped default model, every rung of the ladder with Hugging Face's eager and
# static-cache `generate` as peers, then `llmlab profile` of the 1B shape's eager and CUDA-graph decode; "extra"
# (~9 min) runs the batch (64 requests) and long (8K context) workloads on the 1B shape from eager up, with peers,
# the batch workload's batching rungs, and the serving curve (llmlab.batching.trace_runner: arrival rates x static /
# continuous batching, written as nvidia-h200_serving_*.json beside the bench files);
# "quant" (~8 min) runs the chat workload on the Llama-3.1-8B shape (QBIG) and the 1B shape from eager up to the
# weight-only +int8 and +int4 rungs and both with lm_head quantized too (the 8B one with the peers, torchao's
# quantized ones included where it is installed; the GPU tests of the quantized paths first); "batching" (~9 min)
# runs the batch workload's batching rungs (one at a time, static, continuous) with Hugging Face's static-cache and
# continuous-batching peers, then the serving curve (CURVE_ARGS: trace_runner's arguments, default 192 requests at 16
# to 128 per second), and the continuous server's curve again with an admission delay (ADMIT_DELAY, default 1;
# written into $OUT/admit_delay/) and with eager prefill passes instead of graph-replayed ones (into
# $OUT/eager_prefill/), then both servers' curve at a larger max batch (BIG_BATCH, default 64; into $OUT/max_batch/).
# It writes into $OUT: device.txt, bench.log (everything printed), one bench JSON per run (copy them into
# data/bench/ and commit them: `llmlab.measure.bench.latest_ladder` replays the newest of each workload) and, in main
# mode, profile_*.json.gz Chrome traces (https://ui.perfetto.dev). DEADLINE_S (default 540) bounds the whole run:
# each step runs under `timeout` with the time left and `--time-budget` makes a bench skip rows that would start late
# (its file lists them); bench files are rewritten after every row. BIG=default BENCH_ARGS=--quick runs it on a CPU.
set -uo pipefail
MODE=${1:-main}
[[ $MODE == main || $MODE == extra || $MODE == quant || $MODE == batching ]] ||
  { echo "usage: OUT=DIR bash tools/h200_bench.sh [main|extra|quant|batching]" >&2; exit 2; }
DEADLINE_S=${DEADLINE_S:-540} LOG_NAME=bench.log
source "$(dirname "$0")/h200_lib.sh"
echo "mode: $MODE, deadline ${DEADLINE_S}s" | tee -a "$OUT/device.txt"
# budget S: the seconds left minus S (at least 0), for a run that leaves S seconds to the steps after it
budget() { local b=$(($(left) - $1)); echo $((b > 0 ? b : 0)); }

BIG=${BIG:-llama-3.2-1b}
BENCH="python3 -m llmlab.cli bench --out $OUT ${BENCH_ARGS:-}"
# every rung from eager up (the no-KV-cache rung would recompute 8K-token contexts)
LADDER="eager,+gpu_sampling,+pinned_memory,+cuda_graphs,+torch_compile,+triton_kernels,+step_tuning,+prefill_graphs"
BATCHING="+one_at_a_time,+static_batching,+continuous_batching"
QUANT="+int8,+int4,+int8_lm_head,+int4_lm_head"

if [[ $MODE == main ]]; then
  step chat_1b 90 $BENCH --workload chat --model "$BIG" --steps all --peers --repeats 2 --time-budget 240
  step chat_default 60 $BENCH --workload chat --model default --steps all --peers --repeats 2 \
    --time-budget "$(budget 120)"
  step profile_eager 30 python3 -m llmlab.cli profile --model "$BIG" --trace "$OUT/profile_${BIG}_eager.json.gz"
  step profile_cuda_graphs 30 python3 -m llmlab.cli profile --model "$BIG" --setting cuda_graphs=true \
    --trace "$OUT/profile_${BIG}_cuda_graphs.json.gz"
elif [[ $MODE == quant ]]; then
  QBIG=${QBIG:-llama-3.1-8b}
  step gpu_tests 60 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST -m gpu tests/test_quant_runtime.py tests/test_quant_linear.py \
    tests/test_kernels_dequantize.py tests/test_kernels_fused_quant_gemv.py
  # the 8B shape skips the host-paced eager variants and torch.compile's minute of warm-up
  # its peers: Hugging Face, and torchao's int8 / int4 where torchao is importable (a carried wheel, see
  # tools/README.md); QPEERS="--peers torchao_int8,torchao_int4" runs only torchao's, QPEERS="" none
  step chat_8b_quant 200 $BENCH --workload chat --model "$QBIG" ${QPEERS---peers} \
    --steps "${QSTEPS:-eager,+cuda_graphs,+triton_kernels,+step_tuning,+prefill_graphs,$QUANT}" --repeats 1 \
    --time-budget "$(budget ${QRESERVE:-120})"
  step chat_1b_quant 60 $BENCH --workload chat --model "$BIG" --steps "$LADDER,$QUANT" --repeats 1 \
    --time-budget "$(budget 20)"
elif [[ $MODE == batching ]]; then
  step gpu_tests 40 env LLMLAB_TRITON_AUTOTUNE=0 $PYTEST tests/test_batching_gpu.py tests/test_prefill_graphs.py \
    tests/test_batching_paged_graphs.py tests/test_kernels_paged_attention.py
  # the peers the batching figures compare with (Hugging Face's eager generate is left out: it would take the time)
  step batching_1b 120 $BENCH --workload batch --model "$BIG" --steps "$BATCHING" --peers hf_static,hf_continuous \
    --repeats 1 --time-budget "$(budget 150)"
  # rates high enough and traces long enough that the servers' throughput, not the arrivals, sets the wall time
  step serving_curve 60 python3 -m llmlab.batching.trace_runner --preset "$BIG" --out "$OUT" \
    ${CURVE_ARGS:---rates 16,32,64,128 -n 192 --batches 1,8,32,64,128}
  step serving_admit_delay 40 python3 -m llmlab.batching.trace_runner --preset "$BIG" --out "$OUT/admit_delay" \
    ${CURVE_ARGS:---rates 16,32,64,128 -n 192} --modes continuous --batches "" --admit-delay "${ADMIT_DELAY:-1}"
  # the continuous server again with eager prefill passes of any shape (the curve above replays them from graphs)
  step serving_eager_prefill 40 python3 -m llmlab.batching.trace_runner --preset "$BIG" \
    --out "$OUT/eager_prefill" ${CURVE_ARGS:---rates 16,32,64,128 -n 192} --modes continuous --batches "" \
    --no-prefill-graphs
  # both servers again with room for twice the batch (BIG_BATCH, default 64): how the curve depends on that limit
  step serving_big_batch 90 python3 -m llmlab.batching.trace_runner --preset "$BIG" --out "$OUT/max_batch" \
    ${CURVE_ARGS:---rates 16,32,64,128 -n 192} --batches "" --max-batch "${BIG_BATCH:-64}"
else
  step batch_1b 90 $BENCH --workload batch --model "$BIG" --steps "$LADDER" --peers --repeats 1 \
    --time-budget 260
  step long_1b 60 $BENCH --workload long --model "$BIG" --steps "$LADDER" --peers --repeats 1 \
    --time-budget "$(budget 140)"
  step batching_1b 60 $BENCH --workload batch --model "$BIG" --steps "$BATCHING" \
    --repeats 1 --time-budget "$(budget 90)"
  step serving_curve 60 python3 -m llmlab.batching.trace_runner --preset "$BIG" --out "$OUT"
fi

echo "### done in $((SECONDS - START))s" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"
