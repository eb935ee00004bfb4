"""Roofline / MBU / latency bookkeeping against hand-computed numbers."""

import math

import pytest
import torch

from llmlab.measure import roofline as rl
from llmlab.config import ModelConfig
from llmlab.cache.kv_cache import KVCache

# A tiny untied config, small enough to count by hand:
#   vocab 10, dim 4, 1 layer, 2 query heads, 1 KV head, head_dim 2, intermediate 8.
#   per layer: q 4*2*2 = 16, k+v 2*4*1*2 = 16, o 2*2*4 = 16, mlp 3*4*8 = 96, 2 norms 8   -> 152
#   final norm 4, lm_head 10*4 = 40, input embedding 10*4 = 40 (not read: rows are gathered)
#   weights read = 152 + 4 + 40 = 196 params -> 392 bytes in bf16
#   KV per token = 2 (K,V) * 1 layer * 1 KV head * 2 head_dim * 2 bytes = 8 bytes
#   batch 3, context 5: KV read = 3 * 5 * 8 = 120 bytes            -> step bytes 512
#   matmul params = 16 + 16 + 16 + 96 + 40 (lm_head) = 184 -> 2 * 184 = 368 FLOP per token
#   attention per token = 4 * 1 layer * 2 heads * 2 hd * 5 ctx = 80 -> (368 + 80) * 3 = 1344 FLOP per step
TINY = dict(vocab_size=10, dim=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, intermediate_size=8)


def test_tiny_bytes_by_hand():
    c = ModelConfig(**TINY)
    assert rl.weight_params_read(c) == 196
    assert rl.weight_bytes(c) == 392
    assert rl.kv_bytes_per_token(c) == 8
    assert rl.kv_cache_bytes(c, batch=3, context_len=5) == 120
    assert rl.decode_step_bytes(c, batch=3, context_len=5) == 512
    assert rl.decode_step_bytes(c, 3, 5, weight_bytes_per_param=1, kv_bytes_per_elem=1) == 196 + 60


def test_tiny_tied_counts_the_matrix_once():
    # Tied: no separate lm_head, but the lm_head reads the embedding matrix: 152 + 4 + 40 = 196 again.
    c = ModelConfig(**TINY, tie_embeddings=True)
    assert c.num_params() == 196
    assert rl.weight_params_read(c) == 196
    assert rl.matmul_params(c) == 184


def test_tiny_flops_by_hand():
    c = ModelConfig(**TINY)
    assert rl.matmul_params(c) == 184
    assert rl.attention_flops_per_token(c, 5) == 80
    assert rl.decode_step_flops(c, batch=3, context_len=5) == 1344
    assert rl.arithmetic_intensity(c, 3, 5) == pytest.approx(1344 / 512)
    # prefill of 3 tokens, batch 1: 2 * 184 * 3 = 1104 matmul + causal pairs 1+2+3 = 6 -> 4*1*2*2*6 = 96
    assert rl.prefill_flops(c, 1, 3) == 1104 + 96


def test_kv_bytes_match_kv_cache():
    for name in ("llama-3.2-1b", "qwen2.5-0.5b", "llama-2-7b"):
        c = ModelConfig.from_preset(name)
        assert rl.kv_bytes_per_token(c, 2) == KVCache.bytes_per_token(c, torch.bfloat16)
        assert rl.kv_bytes_per_token(c, 4) == KVCache.bytes_per_token(c, torch.float32)


def test_llama_3_2_1b_roofline():
    c = ModelConfig.from_preset("llama-3.2-1b")
    # tied: 1.236 B parameters, all read per step -> 2.47 GB in bf16 (course notes)
    assert rl.weight_bytes(c) == pytest.approx(2.47e9, rel=0.01)
    assert rl.decode_step_bytes(c, 1, 0) == rl.weight_bytes(c)
    # bandwidth ceiling at the measured H200 copy bandwidth: ~1730 tokens/s at batch 1
    assert rl.roofline_tokens_per_s(c, 4280) == pytest.approx(1730, rel=0.03)
    # KV of 32 K tokens: 2 * 16 * 8 * 64 * 2 B = 32 KiB per token -> +1.07 GB; ceiling drops accordingly
    assert rl.kv_bytes_per_token(c) == 32768
    assert rl.roofline_tokens_per_s(c, 4280, 1, 32768) == pytest.approx(4280e9 / (2.4716e9 + 32768**2), rel=1e-3)
    # batch 64: weights shared, so ~64x the tokens/s while the KV cache is small
    assert rl.roofline_tokens_per_s(c, 4280, batch=64) == pytest.approx(64 * 1731.7, rel=1e-3)
    # ~1 FLOP per byte at batch 1: far below the H200 ridge (~200 FLOP/byte) -> memory-bound
    assert rl.arithmetic_intensity(c, 1, 0) == pytest.approx(1.0, rel=0.01)
    assert rl.ridge_point(989, 4800) == pytest.approx(206, rel=0.01)
    assert rl.attainable_tflops(1.0, 989, 4800) == pytest.approx(4.8)
    assert rl.attainable_tflops(1000, 989, 4800) == 989


def test_llama_3_1_8b_matches_notes():
    c = ModelConfig.from_preset("llama-3.1-8b")  # untied: input embedding excluded -> 15.0 GB, ~285 tokens/s
    assert rl.weight_bytes(c) == pytest.approx(15.0e9, rel=0.01)
    assert rl.roofline_tokens_per_s(c, 4280) == pytest.approx(285, rel=0.01)


def test_compute_ceiling_takes_over_at_large_batch():
    c = ModelConfig.from_preset("llama-3.2-1b")
    bw_only = rl.roofline_tokens_per_s(c, 4280, batch=1024)
    both = rl.roofline_tokens_per_s(c, 4280, batch=1024, peak_tflops=804)
    assert both < bw_only
    assert both == pytest.approx(1024 / (rl.decode_step_flops(c, 1024, 0) / 804e12))
    assert rl.roofline_tokens_per_s(c, 4280, peak_tflops=804) == pytest.approx(rl.roofline_tokens_per_s(c, 4280))


def test_mbu_and_mfu_of_known_case():
    c = ModelConfig.from_preset("llama-3.2-1b")
    # course notes: a 1.89 ms CUDA-graph step at bs=1 on the H200 is 31% MBU of 4280 GB/s
    assert rl.achieved_bandwidth(2.4716288e9, 1.89e-3) == pytest.approx(1307.7, rel=1e-3)
    assert rl.mbu(1.89e-3, c, 1, 0, 4280) == pytest.approx(0.3055, abs=0.001)
    # a step at exactly the roofline time is 100% MBU
    assert rl.mbu(rl.roofline_step_time_s(c, 8, 512, 4280), c, 8, 512, 4280) == pytest.approx(1.0)
    # MFU: 2.4715 GFLOP in 1 ms = 2.47 TFLOP/s of 989 -> 0.25%
    assert rl.mfu(1e-3, c, 1, 0, 989) == pytest.approx(2.471493632e12 / 989e12)


def test_unit_slips_and_bad_arguments_raise():
    c = ModelConfig(**TINY)
    with pytest.raises(ValueError, match="base units"):
        rl.roofline_tokens_per_s(c, 4.28e12)
    with pytest.raises(ValueError, match="base units"):
        rl.mfu(1e-3, c, 1, 0, 989e12)
    with pytest.raises(ValueError):
        rl.decode_step_bytes(c, 0, 5)
    with pytest.raises(ValueError):
        rl.decode_step_flops(c, 1, -1)
    with pytest.raises(ValueError):
        rl.achieved_bandwidth(1e9, 0)
    with pytest.raises(ValueError):
        rl.weight_bytes(c, 0)


def test_mean_context():
    assert rl.decode_mean_context_len(128, 256) == 256  # steps attend to 129 .. 383 tokens: mean 256
    assert sum(128 + j for j in range(1, 256)) / 255 == 256
    assert rl.decode_mean_context_len(10, 1) == 10


def test_percentile_matches_numpy_linear():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4
    assert rl.percentile(xs, 50) == 2.5
    assert rl.percentile(xs, 90) == pytest.approx(3.7)  # position 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert rl.percentile(xs, 0) == 1 and rl.percentile(xs, 100) == 4
    assert rl.percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        rl.percentile([], 50)


def test_run_metrics_from_latencies():
    # prefill+first token 50 ms, then six decode steps (ms): 10 10 12 10 20 10
    steps = [0.050, 0.010, 0.010, 0.012, 0.010, 0.020, 0.010]
    m = rl.RunMetrics.from_step_times(steps, batch=2)
    assert m.n_tokens == 7 and m.batch == 2
    assert m.ttft_ms == pytest.approx(50)
    assert m.tpot_ms == pytest.approx(72 / 6)  # (10+10+12+10+20+10) / 6 = 12 ms
    assert m.tpot_p50_ms == pytest.approx(10)  # sorted 10 10 10 10 12 20 -> middle pair 10, 10
    assert m.tpot_p90_ms == pytest.approx(16)  # position 0.9 * 5 = 4.5 -> 12 + 0.5 * (20 - 12)
    assert m.total_s == pytest.approx(0.122)
    assert m.tokens_per_s == pytest.approx(2 * 7 / 0.122)
    assert m.decode_tokens_per_s == pytest.approx(2 / 0.012)
    assert "TTFT 50.0 ms" in str(m)


def test_run_metrics_single_step_and_errors():
    m = rl.RunMetrics.from_step_times([0.03])
    assert m.ttft_ms == pytest.approx(30) and math.isnan(m.tpot_ms) and math.isnan(m.tpot_p90_ms)
    assert m.tokens_per_s == pytest.approx(1 / 0.03)
    assert math.isnan(m.mbu(ModelConfig(**TINY), 4, 100))
    with pytest.raises(ValueError):
        rl.RunMetrics.from_step_times([])
    with pytest.raises(ValueError):
        rl.RunMetrics.from_step_times([0.01, -0.001])
    with pytest.raises(ValueError):
        rl.RunMetrics.from_step_times([0.01], batch=0)


def test_run_metrics_mbu():
    c = ModelConfig.from_preset("llama-3.2-1b")
    m = rl.RunMetrics.from_step_times([0.02] + [1.89e-3] * 256)  # 257 tokens after a 128-token prompt
    ctx = rl.decode_mean_context_len(128, 257)
    assert m.mbu(c, 128, 4280) == pytest.approx(rl.mbu(1.89e-3, c, 1, ctx, 4280))
