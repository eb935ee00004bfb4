"""The roofline of LLM decoding: how fast a decode step *could* be, and how close a measured one came (MBU, MFU).

A decode step turns one new token per sequence into logits. To do it the GPU must read every weight once and the
KV cache of every sequence, but it does only ~2 FLOPs per weight per token. At batch 1 that is ~1 FLOP per byte,
while an H200 can do ~200 FLOPs in the time it reads one byte (989 TFLOP/s / 4.8 TB/s): decoding is limited by
memory bandwidth, not arithmetic, and its speed limit is

    tokens/s  <=  batch x peak bandwidth / bytes read per step.

This file is that bookkeeping in plain Python (no torch), from a `ModelConfig`:

* bytes read per step = weight bytes + KV-cache bytes (`decode_step_bytes`);
* FLOPs per step = 2 x matmul weights x tokens + attention (`decode_step_flops`);
* the ceilings (`roofline_tokens_per_s`, `roofline_step_time_s`) and the utilisations of a measured step time
  (`mbu`, `mfu`);
* `RunMetrics`: TTFT, TPOT (mean, p50, p90) and tokens/s from a list of per-step latencies.

What is counted (and what is not):

* Weights: every parameter except the *input* embedding table of an untied model. Embedding lookup gathers one
  row per token (batch x dim elements, ~4 KB for a 1B model) rather than reading the table, so the table is left
  out and the gathered rows too (negligible). A tied model's matrix IS counted once: the lm_head reads all of it.
  This matches the convention of gpt-fast and of the peers in the course notes ("bytes exclude the input
  embedding"). For Llama-3.2-1B (tied) that is 1.236 B parameters = 2.47 GB in bf16.
* KV cache: batch x context_len x `KVCache.bytes_per_token` (2 x layers x KV heads x head_dim x bytes/element),
  where context_len is the number of cached tokens each sequence attends to at this step. The write of the new
  token's K/V (1/context_len of the read), activations, and RoPE tables are not counted.
* FLOPs: 2 per multiply-add of the linear layers (q, k, v, o, gate, up, down in every layer, plus lm_head) per
  token, plus attention scores QK^T (2 x n_heads x head_dim x context per layer) and the weighted sum of V
  (the same again): 4 x n_layers x n_heads x head_dim x context_len per token. Norms, RoPE, softmax, SiLU,
  residual adds and biases (elementwise, O(dim) per token) are not counted.

Units: bytes, FLOP, seconds in and out of the counting functions; bandwidth in GB/s (1e9 bytes/s) and compute in
TFLOP/s (1e12 FLOP/s) wherever a peak is passed, as on datasheets and in `llmlab.measure.peaks`; utilisations are
fractions (0.22 = 22%).

Sources:
    S. Williams, A. Waterman, D. Patterson, "Roofline: an insightful visual performance model for multicore
    architectures", CACM 52(4), 2009, https://doi.org/10.1145/1498765.1498785.
    Databricks, "LLM Inference Performance Engineering: Best Practices" (2023) — MBU, TTFT, TPOT,
    https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices.
    Chowdhery et al., "PaLM" (2022), Appendix B — MFU, https://arxiv.org/abs/2204.02311.
    gpt-fast (pytorch-labs), generate.py — reports achieved GB/s as model bytes x tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmlab.config import ModelConfig

# -- guards against unit slips (a bandwidth passed in bytes/s instead of GB/s, ...) ------------------------------


def _check_peak(value: float, name: str, unit: str, too_big: float) -> None:
    if not value > 0:
        raise ValueError(f"{name}={value} must be > 0 {unit}")
    if value > too_big:
        raise ValueError(
            f"{name}={value:.3g} {unit} is implausibly large; did you pass base units? "
            f"(e.g. 4.28e12 bytes/s is 4280 GB/s, 989e12 FLOP/s is 989 TFLOP/s)"
        )


def _check_batch_context(batch: int, context_len: float) -> None:
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    if context_len < 0:
        raise ValueError(f"context_len={context_len} must be >= 0 tokens")


# -- bytes ------------------------------------------------------------------------------------------------------


def weight_params_read(config: ModelConfig) -> int:
    """Parameters read from memory once per decode step (see the module docstring for the convention).

    Every parameter except an untied model's input embedding table; a tied embedding matrix counted once.
    """
    return config.num_params(include_embedding=config.tie_embeddings)


def weight_bytes(config: ModelConfig, bytes_per_param: float = 2) -> float:
    """Bytes of weights read per decode step: `weight_params_read(config) x bytes_per_param`.

    bytes_per_param: 2 for bf16/fp16, 1 for int8, 0.5 for int4 (add the scales' share yourself for group-wise
    quantization, e.g. + 2/32 bytes per weight for bf16 scales with group size 32).
    Raises ValueError if bytes_per_param <= 0.
    """
    if not bytes_per_param > 0:
        raise ValueError(f"bytes_per_param={bytes_per_param} must be > 0")
    return weight_params_read(config) * bytes_per_param


def kv_bytes_per_token(config: ModelConfig, kv_bytes_per_elem: float = 2) -> float:
    """2 (K and V) x layers x KV heads x head_dim x bytes per element: one token of one sequence.

    Equals `KVCache.bytes_per_token(config, dtype)` for a dtype of `kv_bytes_per_elem` bytes (no torch needed).
    """
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * kv_bytes_per_elem


def kv_cache_bytes(config: ModelConfig, batch: int, context_len: float, kv_bytes_per_elem: float = 2) -> float:
    """Bytes of KV cache read per decode step: batch x context_len x `kv_bytes_per_token`.

    Raises ValueError for batch < 1 or context_len < 0.
    """
    _check_batch_context(batch, context_len)
    return batch * context_len * kv_bytes_per_token(config, kv_bytes_per_elem)


def decode_step_bytes(config: ModelConfig, batch: int, context_len: float, weight_bytes_per_param: float = 2,
                      kv_bytes_per_elem: float = 2) -> float:
    """Bytes read from GPU memory by one decode step: weights once + every sequence's KV cache.

    Args:
        batch: sequences decoded together (each adds one token this step).
        context_len: cached tokens each sequence attends to (prompt + tokens generated so far). It enters
            linearly, so the mean context length over a run gives the exact mean bytes per step.
        weight_bytes_per_param: 2 = bf16; see `weight_bytes`.
        kv_bytes_per_elem: 2 = bf16 cache.

    Returns bytes (float). Raises ValueError for batch < 1, context_len < 0, bytes_per_param <= 0.

    Example: Llama-3.2-1B, bf16, batch 1, empty cache: 2.47e9 bytes.
    """
    return weight_bytes(config, weight_bytes_per_param) + kv_cache_bytes(config, batch, context_len,
                                                                         kv_bytes_per_elem)


# -- FLOPs ------------------------------------------------------------------------------------------------------


def matmul_params(config: ModelConfig) -> int:
    """Weights that take part in a matrix multiply per token: q, k, v, o, gate, up, down of every layer + lm_head.

    Excludes norms, biases and the input embedding (a lookup, not a matmul). A tied matrix counts once (as lm_head).
    """
    hd, d = config.head_dim, config.dim
    attn = d * config.n_heads * hd + 2 * d * config.n_kv_heads * hd + config.n_heads * hd * d
    mlp = 3 * d * config.intermediate_size
    return config.n_layers * (attn + mlp) + config.vocab_size * d


def attention_flops_per_token(config: ModelConfig, context_len: float) -> float:
    """QK^T scores + weights x V for one query token against `context_len` keys: 4 x layers x heads x hd x ctx.

    Counted per *query* head (GQA shares K/V memory, not arithmetic). Softmax and masking are not counted.
    """
    return 4 * config.n_layers * config.n_heads * config.head_dim * context_len


def decode_step_flops(config: ModelConfig, batch: int, context_len: float) -> float:
    """FLOPs of one decode step (one new token per sequence): batch x (2 x matmul_params + attention).

    context_len as in `decode_step_bytes`. Returns FLOP (float). Raises ValueError for batch < 1 or
    context_len < 0. Example: Llama-3.2-1B, batch 1, empty cache: 2.47e9 FLOP (~1 FLOP per bf16 byte).
    """
    _check_batch_context(batch, context_len)
    return batch * (2 * matmul_params(config) + attention_flops_per_token(config, context_len))


def prefill_flops(config: ModelConfig, batch: int, prompt_len: int) -> float:
    """FLOPs to prefill `prompt_len` tokens per sequence with causal attention.

    = batch x (2 x matmul_params x prompt_len + 4 x layers x heads x hd x prompt_len (prompt_len + 1) / 2):
    token i attends to i keys (only the unmasked pairs are counted, as a fused attention kernel would skip the
    rest). lm_head is counted for every prompt token (an implementation that computes logits only for the last
    position does less). Raises ValueError for batch < 1 or prompt_len < 0.
    """
    _check_batch_context(batch, prompt_len)
    pairs = prompt_len * (prompt_len + 1) / 2
    return batch * (2 * matmul_params(config) * prompt_len + attention_flops_per_token(config, pairs))


def arithmetic_intensity(config: ModelConfig, batch: int, context_len: float, weight_bytes_per_param: float = 2,
                         kv_bytes_per_elem: float = 2) -> float:
    """FLOP per byte of one decode step: `decode_step_flops / decode_step_bytes`.

    Compare with `ridge_point(peak)`: below it a step is memory-bound. Grows ~linearly with batch while the
    weights dominate the bytes (the weights are read once for the whole batch), and stalls once the KV cache
    (read per sequence) dominates.
    """
    return decode_step_flops(config, batch, context_len) / decode_step_bytes(
        config, batch, context_len, weight_bytes_per_param, kv_bytes_per_elem)


# -- ceilings ---------------------------------------------------------------------------------------------------


def ridge_point(peak_tflops: float, peak_bw_gb_s: float) -> float:
    """The machine balance (FLOP/byte) where the roofline bends: peak FLOP/s / peak bytes/s.

    H200: 989 TFLOP/s / 4800 GB/s ~ 206 FLOP/byte (datasheet); ~188 with the measured 804 / 4277.
    """
    _check_peak(peak_tflops, "peak_tflops", "TFLOP/s", 1e5)
    _check_peak(peak_bw_gb_s, "peak_bw_gb_s", "GB/s", 1e6)
    return peak_tflops * 1e12 / (peak_bw_gb_s * 1e9)


def attainable_tflops(intensity: float, peak_tflops: float, peak_bw_gb_s: float) -> float:
    """The roofline itself (Williams et al. 2009): min(peak TFLOP/s, intensity (FLOP/byte) x bandwidth), TFLOP/s."""
    _check_peak(peak_tflops, "peak_tflops", "TFLOP/s", 1e5)
    _check_peak(peak_bw_gb_s, "peak_bw_gb_s", "GB/s", 1e6)
    return min(peak_tflops, intensity * peak_bw_gb_s * 1e9 / 1e12)


def roofline_step_time_s(config: ModelConfig, batch: int, context_len: float, peak_bw_gb_s: float,
                         peak_tflops: float | None = None, weight_bytes_per_param: float = 2,
                         kv_bytes_per_elem: float = 2) -> float:
    """Lower bound on one decode step's time (s): max(bytes / bandwidth, FLOPs / compute).

    peak_bw_gb_s in GB/s (1e9 bytes/s), peak_tflops in TFLOP/s. peak_tflops=None gives the bandwidth bound alone.
    Ignores kernel-launch overhead, which the course shows to dominate small models.
    Raises ValueError for non-positive peaks or peaks given in base units, batch < 1, context_len < 0.
    """
    _check_peak(peak_bw_gb_s, "peak_bw_gb_s", "GB/s", 1e6)
    moved = decode_step_bytes(config, batch, context_len, weight_bytes_per_param, kv_bytes_per_elem)
    t = moved / (peak_bw_gb_s * 1e9)
    if peak_tflops is not None:
        _check_peak(peak_tflops, "peak_tflops", "TFLOP/s", 1e5)
        t = max(t, decode_step_flops(config, batch, context_len) / (peak_tflops * 1e12))
    return t


def roofline_tokens_per_s(config: ModelConfig, peak_bw_gb_s: float, batch: int = 1, context_len: float = 0,
                          peak_tflops: float | None = None, weight_bytes_per_param: float = 2,
                          kv_bytes_per_elem: float = 2) -> float:
    """The speed limit of decoding (tokens/s over the whole batch): batch / `roofline_step_time_s`.

    With peak_tflops=None this is the bandwidth ceiling, batch x bandwidth / bytes per step.
    Example: Llama-3.2-1B bf16 at 4280 GB/s (H200, measured copy), batch 1, empty cache: ~1730 tokens/s.
    Raises ValueError for non-positive peaks or peaks given in base units (bytes/s, FLOP/s).
    """
    return batch / roofline_step_time_s(config, batch, context_len, peak_bw_gb_s, peak_tflops,
                                        weight_bytes_per_param, kv_bytes_per_elem)


# -- utilisation of a measured step ------------------------------------------------------------------------------


def achieved_bandwidth(bytes_moved: float, time_s: float) -> float:
    """GB/s (1e9 bytes/s) achieved by moving `bytes_moved` bytes in `time_s` seconds.

    Raises ValueError if time_s <= 0.
    """
    if not time_s > 0:
        raise ValueError(f"time_s={time_s} must be > 0 seconds")
    return bytes_moved / time_s / 1e9


def mbu(step_time_s: float, config: ModelConfig, batch: int, context_len: float, peak_bw_gb_s: float,
        weight_bytes_per_param: float = 2, kv_bytes_per_elem: float = 2) -> float:
    """Model bandwidth utilisation of a decode step: achieved bandwidth / peak bandwidth (fraction; x100 for %).

    achieved = `decode_step_bytes(...)` / step_time_s (Databricks 2023). Use the measured copy bandwidth
    (`llmlab.measure.peaks`) as the peak for what is attainable, the datasheet value for the marketing number.
    For a whole run pass the mean decode step time (TPOT) and `decode_mean_context_len(...)`.
    Example: Llama-3.2-1B bf16, 1.89 ms per step on an H200 (4280 GB/s): 2.47e9 / 1.89e-3 = 1308 GB/s = 31%.
    Raises ValueError if step_time_s <= 0, the peak is not positive or is given in bytes/s, or for batch < 1,
    context_len < 0.
    """
    _check_peak(peak_bw_gb_s, "peak_bw_gb_s", "GB/s", 1e6)
    moved = decode_step_bytes(config, batch, context_len, weight_bytes_per_param, kv_bytes_per_elem)
    return achieved_bandwidth(moved, step_time_s) / peak_bw_gb_s


def mfu(step_time_s: float, config: ModelConfig, batch: int, context_len: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation of a decode step: (`decode_step_flops` / step_time_s) / peak (fraction).

    Raises ValueError if step_time_s <= 0 or the peak is not positive. Source: PaLM (Chowdhery et al. 2022) App. B.
    """
    _check_peak(peak_tflops, "peak_tflops", "TFLOP/s", 1e5)
    if not step_time_s > 0:
        raise ValueError(f"step_time_s={step_time_s} must be > 0 seconds")
    return decode_step_flops(config, batch, context_len) / step_time_s / (peak_tflops * 1e12)


def decode_mean_context_len(prompt_len: int, new_tokens: int) -> float:
    """Mean cached tokens per sequence over the decode steps of a run: prompt_len + new_tokens / 2.

    The first new token comes from prefill; decode step j (j = 1 .. new_tokens - 1) attends to prompt_len + j
    tokens, whose mean is prompt_len + new_tokens / 2. With new_tokens <= 1 there are no decode steps and
    prompt_len is returned. Raises ValueError for negative arguments.
    """
    if prompt_len < 0 or new_tokens < 0:
        raise ValueError(f"prompt_len={prompt_len} and new_tokens={new_tokens} must be >= 0")
    return float(prompt_len) if new_tokens <= 1 else prompt_len + new_tokens / 2


# -- per-run latency metrics -------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default method).

    Raises ValueError for an empty list or q outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class RunMetrics:
    """Latency and throughput of one generation run (Databricks 2023 definitions).

    Fields, as `from_step_times` defines them (`from_requests` instead: ttft_ms and tpot_ms means over the
    requests, batch the number of requests, n_tokens the most one made, tokens_per_s every generated token over
    total_s, decode_tokens_per_s nan):
        n_tokens: tokens generated per sequence (= steps timed; the first includes prefill).
        batch: sequences generated together.
        total_s: sum of the step times, seconds.
        ttft_ms: time to first token — the first step (prefill + first token), ms.
        tpot_ms: time per output token — mean of the steps after the first, ms (nan if n_tokens == 1).
        tpot_p50_ms, tpot_p90_ms: median and 90th percentile of those steps, ms (nan if n_tokens == 1).
        tokens_per_s: batch x n_tokens / total_s — throughput over the whole run, prefill included.
        decode_tokens_per_s: batch x 1000 / tpot_ms — the steady decode rate (nan if n_tokens == 1).
        timed: "steps" (`from_step_times`: every step one token of every sequence) or "requests"
            (`from_requests`: each request's own TTFT and TPOT, for runs whose steps are not one token a row).
    """

    n_tokens: int
    batch: int
    total_s: float
    ttft_ms: float
    tpot_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    tokens_per_s: float
    decode_tokens_per_s: float
    timed: str = "steps"

    @classmethod
    def from_step_times(cls, step_times_s: list[float], batch: int = 1) -> "RunMetrics":
        """Build from per-step latencies in seconds, first step first (e.g. perf_counter deltas after a sync).

        Raises ValueError: empty list, a negative or non-finite time, or batch < 1.
        """
        times = [float(t) for t in step_times_s]
        if not times:
            raise ValueError("step_times_s is empty: time at least the first step (prefill)")
        if any(not math.isfinite(t) or t < 0 for t in times):
            raise ValueError("step times must be finite and >= 0 seconds")
        if batch < 1:
            raise ValueError(f"batch={batch} must be >= 1")
        total = sum(times)
        decode = times[1:]
        nan = float("nan")
        tpot = sum(decode) / len(decode) if decode else nan
        return cls(
            n_tokens=len(times),
            batch=batch,
            total_s=total,
            ttft_ms=times[0] * 1e3,
            tpot_ms=tpot * 1e3,
            tpot_p50_ms=percentile(decode, 50) * 1e3 if decode else nan,
            tpot_p90_ms=percentile(decode, 90) * 1e3 if decode else nan,
            tokens_per_s=batch * len(times) / total if total > 0 else nan,
            decode_tokens_per_s=batch / tpot if decode and tpot > 0 else nan,
        )

    @classmethod
    def from_requests(cls, requests: list[dict], tokens: list[int], total_s: float) -> "RunMetrics":
        """Build from each request's own timings, for a run whose steps are not one token of every request:
        continuous batching (a step may prefill a chunk of one prompt and decode the others) or requests served one
        after the other. `requests`: one dict a request with "ttft_ms" (from the run's start, waiting included) and
        "tpot_ms" (its mean decode step, None with one token); `tokens`: each request's generated tokens;
        `total_s`: the run's wall time, seconds.

        ttft_ms and tpot_ms are means over the requests (tpot over those with a decode step; p50 and p90 of their
        TPOTs), batch the number of requests, n_tokens the most one made, tokens_per_s every generated token over
        total_s. decode_tokens_per_s is nan: the requests' decode steps share steps with other requests' prefills,
        or follow each other, so no one step rate holds; nor does `mbu`.

        Raises ValueError: no requests, a count of tokens per request that does not match, a negative or
        non-finite time.
        """
        if not requests or len(tokens) != len(requests):
            raise ValueError(f"from_requests: {len(requests)} requests and {len(tokens)} token counts; give one "
                             f"count per request, at least one")
        ttfts = [float(r["ttft_ms"]) for r in requests]
        tpots = [float(r["tpot_ms"]) for r in requests if r.get("tpot_ms") is not None]
        if any(not math.isfinite(t) or t < 0 for t in [*ttfts, *tpots, total_s]):
            raise ValueError("request times must be finite and >= 0")
        nan = float("nan")
        return cls(n_tokens=max(tokens), batch=len(requests), total_s=total_s, ttft_ms=sum(ttfts) / len(ttfts),
                   tpot_ms=sum(tpots) / len(tpots) if tpots else nan,
                   tpot_p50_ms=percentile(tpots, 50) if tpots else nan,
                   tpot_p90_ms=percentile(tpots, 90) if tpots else nan,
                   tokens_per_s=sum(tokens) / total_s if total_s > 0 else nan, decode_tokens_per_s=nan,
                   timed="requests")

    def mbu(self, config: ModelConfig, prompt_len: int, peak_bw_gb_s: float, weight_bytes_per_param: float = 2,
            kv_bytes_per_elem: float = 2) -> float:
        """MBU of the decode steps (mean TPOT at the run's mean context length), fraction. nan if no decode step,
        and for metrics timed by request (`from_requests`), whose steps read a varying batch."""
        if not self.tpot_ms > 0 or self.timed != "steps":
            return float("nan")
        ctx = decode_mean_context_len(prompt_len, self.n_tokens)
        return mbu(self.tpot_ms / 1e3, config, self.batch, ctx, peak_bw_gb_s, weight_bytes_per_param,
                   kv_bytes_per_elem)

    def __str__(self) -> str:
        if self.timed == "requests":
            tpot = "-" if not math.isfinite(self.tpot_ms) else f"{self.tpot_ms:.2f} ms (p50 {self.tpot_p50_ms:.2f}, " \
                                                                f"p90 {self.tpot_p90_ms:.2f})"
            return (f"{self.batch} request{'s' if self.batch != 1 else ''}, up to {self.n_tokens} "
                    f"token{'s' if self.n_tokens != 1 else ''} each: mean TTFT {self.ttft_ms:.1f} ms, mean "
                    f"TPOT {tpot}, {self.tokens_per_s:.1f} tokens/s overall")
        if not math.isfinite(self.tpot_ms):  # one token: no decode step, so no TPOT (printed "-", as the CLI does)
            return (f"{self.n_tokens} token{'s' if self.n_tokens != 1 else ''} x batch {self.batch}: TTFT "
                    f"{self.ttft_ms:.1f} ms, TPOT - (no decode step), {self.tokens_per_s:.1f} tokens/s overall")
        return (f"{self.n_tokens} tokens x batch {self.batch}: TTFT {self.ttft_ms:.1f} ms, TPOT {self.tpot_ms:.2f} ms "
                f"(p50 {self.tpot_p50_ms:.2f}, p90 {self.tpot_p90_ms:.2f}), {self.tokens_per_s:.1f} tokens/s "
                f"overall, {self.decode_tokens_per_s:.1f} tokens/s decoding")
