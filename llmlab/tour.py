"""`llmlab tour`: the course's main job, headless.

Loads the default model, climbs the optimization ladder (`llmlab.ladder`: without the KV cache, with it, then
every rung a later lesson registered) generating the same continuation on each rung that can run here, and prints
the device and a table of TTFT, TPOT and tokens/s per rung; the rungs that cannot run here are listed with the
reason. A setting is a dict of switch values (`llmlab.switches`); lessons add rungs with
`llmlab.ladder.register_step`, not here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from llmlab.checkpoint import DEFAULT_MODEL_DIR, resolve
from llmlab.engine import LLM, check_text_prompt
from llmlab.envinfo import device_name
from llmlab.generate import format_ms
from llmlab.measure.timing import cpu_threads_for, intra_op_threads
from llmlab.ladder import LADDER, available_steps
from llmlab.switches import apply_switches


@dataclass
class TourSetting:
    name: str  # shown in the table
    settings: dict = field(default_factory=dict)  # switch values (llmlab.switches), the rest at their defaults
    note: str = ""


def tour_settings(llm: LLM | None = None) -> list[TourSetting]:
    """The ladder's rungs as tour settings: with `llm`, only those that can run on it (settings accumulated)."""
    if llm is None:
        return [TourSetting(s.label, dict(s.settings), s.note) for s in LADDER]
    runnable, _ = available_steps(llm)
    return [TourSetting(r.step.label, r.settings, r.step.note) for r in runnable]


TOUR_SETTINGS: list[TourSetting] = tour_settings()  # every rung, as registered at import (see `tour_settings`)


def device_line(llm: LLM) -> str:
    """The tour's header line: device, activation dtype, weight format where it is not the dtype (a quantized
    model's, e.g. "int4 g64"), torch version."""
    from llmlab.measure.model_bytes import describe_weights
    from llmlab.quant import is_quantized

    weights = f" | weights: {describe_weights(llm.model, llm.dtype)}" if is_quantized(llm.model) else ""
    return (f"device: {device_name(llm.device)} | dtype: {str(llm.dtype).removeprefix('torch.')}{weights} | "
            f"torch {torch.__version__}")


def default_model_note(llm: LLM) -> str:
    """The line printed above the shipped default model's sample text: what the model is, so that its text is read
    as what it is."""
    return (f"({llm.name} is a {llm.config.num_params() / 1e6:.1f}M-parameter toy model trained on Python's "
            f"documentation: its text below is babble in the style of help() pages; the tour measures speed, not "
            f"the quality of the text)")


def _time_settings(llm: LLM, prompt: str, max_new_tokens: int, repeats: int) -> tuple[list[dict], list]:
    """Each tour setting run `repeats` times after one warm-up: (rows of medians, the ladder's skipped steps)."""
    rows, reference = [], None
    _, skipped = available_steps(llm)
    for setting in tour_settings(llm):
        run_llm, kwargs = apply_switches(llm, setting.settings)
        kwargs.update(max_new_tokens=max_new_tokens, stop_at_eos=False)
        run_llm.generate(prompt, **kwargs)  # warm-up on the whole run: first-call costs stay out of the table
        runs = [run_llm.generate(prompt, **kwargs) for _ in range(repeats)]
        tokens = runs[0].token_ids[0]
        reference = reference or tokens
        rows.append({
            "setting": setting.name,
            "quantized": bool(setting.settings.get("weights")),
            "batching": setting.settings.get("batching") is not None,
            "ttft_ms": statistics.median(r.ttft_ms for r in runs),
            "tpot_ms": statistics.median(r.tpot_ms for r in runs),
            "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
            "same_tokens": tokens == reference,
            "tpot_spread": max(r.tpot_ms for r in runs) / max(min(r.tpot_ms for r in runs), 1e-9),
            "text": runs[0].text,
            "note": setting.note,
        })
    return rows, skipped


def run_tour(model: str = "default", device=None, dtype=None, prompt: str = "The list",
             max_new_tokens: int = 128, repeats: int = 3, print_fn=print) -> list[dict]:
    """Run every setting `repeats` times (after one warm-up) and print a table of medians.

    Returns one dict per setting: name, ttft_ms, tpot_ms, tokens_per_s (medians), quantized, batching (a batching
    side rung, which serves the one prompt as a batch of one), same_tokens (greedy tokens equal the first
    setting's), tpot_spread (slowest / fastest run's TPOT: a note is printed when > 1.5), text. With
    max_new_tokens=1 there is no decode step: tpot_ms and tpot_spread are NaN, and the table shows TPOT "-".
    Raises ValueError for a prompt that is empty or only whitespace, before the model loads.
    """
    check_text_prompt(prompt)
    folder = resolve(model)
    llm = LLM.load(folder, device=device, dtype=dtype)
    print_fn(f"llmlab tour — {llm.name}: {llm.config.num_params() / 1e6:.1f}M parameters, "
             f"{llm.config.n_layers} layers, context {llm.config.max_seq_len}")
    print_fn(device_line(llm))
    shown = prompt if len(prompt) <= 80 else prompt[:80] + f"... ({len(prompt)} characters)"
    print_fn(f"prompt {shown!r}, {max_new_tokens} new token{'s' if max_new_tokens != 1 else ''}, greedy, "
             f"{f'median of {repeats} runs' if repeats > 1 else 'one run'}\n")
    threads = cpu_threads_for(llm.device, llm.config.num_params())
    if threads == 1:
        print_fn("(a small model on a CPU: timed on one intra-op thread, steadier and faster than one per core; "
                 "set OMP_NUM_THREADS to choose)\n")
    with intra_op_threads(threads):
        rows, skipped = _time_settings(llm, prompt, max_new_tokens, repeats)
    base = rows[0]["tokens_per_s"]
    w = max(16, 2 + max(len(name) for name in [*(r["setting"] for r in rows), *(s.label for s, _ in skipped)]))
    print_fn(f"{'setting':<{w}}{'TTFT ms':>10}{'TPOT ms':>10}{'tokens/s':>11}{'speed-up':>10}  same tokens")
    for r in rows:
        print_fn(f"{r['setting']:<{w}}{r['ttft_ms']:>10.2f}{format_ms(r['tpot_ms']):>10}{r['tokens_per_s']:>11.1f}"
                 f"{r['tokens_per_s'] / base:>9.2f}x  {'yes' if r['same_tokens'] else 'NO'}")
    rounded = [r["setting"] for r in rows if r["quantized"] and not r["same_tokens"]]
    if rounded:
        print_fn(f"({', '.join(rounded)}: the weights are rounded, so the model itself changed and its greedy "
                 f"tokens may part ways with the float model's; lab 04 measures what that costs in perplexity)")
    batched = [r["setting"] for r in rows if r["batching"]]
    if batched:
        print_fn(f"({', '.join(batched)}: rungs for many requests at once. Here they serve the tour's one prompt, a "
                 f"batch of one, so they show only the batcher's overhead; lab 06 measures what batching gains, and "
                 f"`llmlab bench --workload batch` runs them on 64 requests: on a GPU batching pays there, while a "
                 f"quick CPU run is mostly prefill, where a static batch's padding costs more than it saves)")
    if llm.dtype != torch.float32 and not all(r["same_tokens"] for r in rows if not r["quantized"]):
        print_fn("(in bf16/fp16 the settings round differently, so greedy tokens may part ways after a near-tie; "
                 "at fp32 they must be identical: try --dtype fp32)")
    noisy = [r["setting"] for r in rows if r["tpot_spread"] > 1.5]
    if noisy:
        print_fn(f"(TPOT varied more than 1.5x between runs of {', '.join(noisy)}: something else is using this "
                 f"machine, and the medians may not rank the settings. On a small or shared CPU, "
                 f"OMP_NUM_THREADS=1 llmlab tour is often steadier and faster)")
    for step, why in skipped:
        print_fn(f"{step.label:<{w}}skipped: {why}")
    sample = (prompt + rows[-1]["text"]).strip()
    print_fn("")
    if folder.resolve() == DEFAULT_MODEL_DIR.resolve():
        print_fn(default_model_note(llm))
    print_fn(sample[:300] + " ..." if len(sample) > 300 else sample)
    return rows
