"""A batch sweep: the same decode at growing batch sizes, to see where bandwidth-bound turns into compute-bound."""

from __future__ import annotations

import statistics

import torch

from llmlab.engine import LLM
from llmlab.measure import roofline
from llmlab.measure.bench_file import peaks_dict
from llmlab.measure.model_bytes import bytes_per_param_read
from llmlab.switches import apply_switches


def batch_sweep(llm: LLM, batch_sizes=(1, 2, 4, 8, 16, 32, 64), prompt_len: int = 32, new_tokens: int = 32,
                settings: dict | None = None, peaks: dict | None = None, repeats: int = 1) -> list[dict]:
    """Decode the same workload at growing batch sizes: where bandwidth-bound turns into compute-bound.

    Every batch size runs `batch` random prompts of `prompt_len` tokens for `new_tokens` tokens (a short untimed
    warm-up of 4 tokens, then the median of `repeats`). Returns one dict per batch size: batch, tpot_ms (mean decode
    step), tokens_per_s (decode: batch x 1000 / tpot_ms), intensity (FLOP/byte of a decode step,
    `llmlab.measure.roofline`), achieved_tflops, achieved_GBps, mbu, mfu (against `peaks`, default the measured ones:
    `llmlab.measure.bench_file.peaks_dict`).
    Raises ValueError if prompt_len + new_tokens exceeds the context or new_tokens < 2.
    """
    if new_tokens < 2:
        raise ValueError("new_tokens must be >= 2: the decode steps come after the first token")
    settings = settings or {}
    peaks = peaks or peaks_dict(llm.device)
    run_llm, kwargs = apply_switches(llm, settings)
    cfg = llm.config
    wbpp = bytes_per_param_read(run_llm.model, cfg, run_llm.dtype)  # a quantized model's: its packed tensors
    kv = torch.empty((), dtype=run_llm.dtype).element_size()
    ctx = roofline.decode_mean_context_len(prompt_len, new_tokens)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batch_sizes:
        prompts = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=gen).tolist()
        run_llm.generate(prompts, max_new_tokens=min(4, new_tokens), stop_at_eos=False, **kwargs)  # first-call costs
        tpots = []
        for _ in range(repeats):
            g = run_llm.generate(prompts, max_new_tokens=new_tokens, stop_at_eos=False, **kwargs)
            tpots.append(statistics.fmean(g.step_ms[1:]))
        tpot = statistics.median(tpots)
        step_s = tpot / 1e3
        rows.append({
            "batch": b, "tpot_ms": tpot, "tokens_per_s": b * 1e3 / tpot,
            "intensity": roofline.arithmetic_intensity(cfg, b, ctx, wbpp, kv),
            "achieved_tflops": roofline.decode_step_flops(cfg, b, ctx) / step_s / 1e12,
            "achieved_GBps": roofline.decode_step_bytes(cfg, b, ctx, wbpp, kv) / step_s / 1e9,
            "mbu": roofline.mbu(step_s, cfg, b, ctx, peaks["copy_GBps"], wbpp, kv),
            "mfu": roofline.mfu(step_s, cfg, b, ctx, peaks["bf16_TFLOPs"]),
        })
    return rows
