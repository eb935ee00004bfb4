"""Lab 03 measurements in one run, written as JSON: the paged step vs the contiguous cache (tokens/s, TPOT), the
memory waste of max-length preallocation vs paging, int8/fp8 KV quality, and TTFT with and without prefix reuse.

    python tools/kv_cache_bench.py --out data/bench            # on the GPU (bf16 llama-3.2-1b shape + default model)
    python tools/kv_cache_bench.py --smoke --out /tmp/x        # a quick CPU check of the script itself

Rows of "steps" carry a "step" name like `llmlab bench` rows: "eager", "+paged_kv" (gather + SDPA), and on a GPU
"eager+triton" / "+paged_kv+triton" (the Triton kernels switch; with the paged cache, decode attention reads the
block pool in place through `PagedKVCache.decode_attention`). Elsewhere those two rows say "skipped".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python3 tools/...` from a plain checkout

import llmlab  # noqa: E402
from llmlab.cache import sizing, kv_quant  # noqa: E402
from llmlab.measure import kv_costs  # noqa: E402
from llmlab.engine import LLM  # noqa: E402
from llmlab.envinfo import describe, git_commit, versions  # noqa: E402
from llmlab.cache.paged_cache import PagedKVCache  # noqa: E402
from llmlab.cache.prefix_reuse import compare_ttft  # noqa: E402
from llmlab.switches import apply_switches  # noqa: E402


class CountingPagedKVCache(PagedKVCache):
    """A `PagedKVCache` that counts `decode_attention` calls: proof that a "+paged_kv+triton" row read the pool in
    place rather than gathering (the Triton switch uses the paged kernel only if the cache offers it)."""

    calls = 0

    def decode_attention(self, layer, q, scale=None):
        CountingPagedKVCache.calls += 1
        return super().decode_attention(layer, q, scale)


# (step name, Triton kernels switch on, cache class: None = the contiguous KVCache)
STEPS = (("eager", False, None), ("+paged_kv", False, PagedKVCache),
         ("eager+triton", True, None), ("+paged_kv+triton", True, CountingPagedKVCache))


@contextmanager
def triton_kernels(llm: LLM, on: bool):
    """Yield the `generate` keyword arguments with the Triton kernels switch set to `on`; switch it off after."""
    if not on:
        yield {}
        return
    llm, kwargs = apply_switches(llm, {"triton_kernels": True})  # swaps the kernel modules into llm.model
    try:
        yield kwargs
    finally:
        apply_switches(llm, {"triton_kernels": False})


def median_run(llm: LLM, prompts: list[list[int]], new_tokens: int, repeats: int, **kwargs):
    """The `Generation` with the median TPOT of `repeats` greedy runs, after a short warm-up (Triton compiles)."""
    llm.generate(prompts, max_new_tokens=4, stop_at_eos=False, **kwargs)
    runs = [llm.generate(prompts, max_new_tokens=new_tokens, stop_at_eos=False, **kwargs) for _ in range(repeats)]
    runs.sort(key=lambda g: g.tpot_ms)
    return runs[len(runs) // 2]


def decode_steps(llm: LLM, batch: int, prompt_tokens: int, new_tokens: int, repeats: int,
                 triton: bool) -> list[dict]:
    """One row per STEPS entry; the Triton rows carry only a "skipped" note unless `triton`."""
    torch.manual_seed(0)
    prompts = torch.randint(0, llm.config.vocab_size, (batch, prompt_tokens)).tolist()
    rows = []
    for step, use_triton, factory in STEPS:
        row = {"step": step, "model": llm.name, "batch": batch, "prompt_tokens": prompt_tokens,
               "new_tokens": new_tokens}
        if use_triton and not triton:
            rows.append(row | {"skipped": "the Triton kernels switch is measured on a CUDA GPU only (not --smoke)"})
            continue
        CountingPagedKVCache.calls = 0
        with triton_kernels(llm, use_triton) as kwargs:
            g = median_run(llm, prompts, new_tokens, repeats, cache_factory=factory, **kwargs)
        row |= {"ttft_ms": g.ttft_ms, "tpot_ms": g.tpot_ms, "tokens_per_s": g.tokens_per_s}
        if factory is CountingPagedKVCache:
            row["paged_kernel"] = CountingPagedKVCache.calls > 0  # False: the switch still gathered (update)
        rows.append(row)
    return rows


def random_chat(vocab_size: int, sizes: list[int], seed: int = 0) -> list[list[int]]:
    """Messages of random token ids, one per size."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in sizes]


def turn_summary(rows: list[dict], model: str) -> list[str]:
    """One line per mode: the last turn's TTFT and how many times lower it is than without reuse."""
    last = max(r["turn"] for r in rows)
    final = {r["mode"]: r for r in rows if r["turn"] == last}
    base = final["none"]["ttft_ms"]
    return [f"prefix reuse {model}, turn {last} ({r['prompt_tokens']} tokens): {mode:<10} TTFT "
            f"{r['ttft_ms']:8.2f} ms, prefilled {r['prefilled']:5d}, {base / r['ttft_ms']:5.1f}x lower than none"
            for mode, r in final.items()]


# the KV-quantization quality part (kv_quant.quality_report): decoded token by token, its cost grows with
# eval_tokens; under --smoke a residual window smaller than eval_tokens still sends tokens through the quantizer
QUALITY = {"new_tokens": 64, "residual": 32, "eval_tokens": 512}
SMOKE_QUALITY = {"new_tokens": 16, "residual": 8, "eval_tokens": 32}


def step_line(r: dict) -> str:
    """The printed line of one "steps" row. tokens/s is over the whole call, so TTFT is printed beside it."""
    head = f"{r['model']:<32}{r['step']:<17} batch {r['batch']}: "
    if "skipped" in r:
        return head + "skipped: " + r["skipped"]
    note = "" if r.get("paged_kernel", True) else " (the paged kernel was NOT called: the switch gathered)"
    return head + (f"TTFT {r['ttft_ms']:.1f} ms, TPOT {r['tpot_ms']:.2f} ms, {r['tokens_per_s']:.0f} tok/s "
                   f"(whole call, TTFT included)" + note)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--out", default="data/bench", help="folder for the JSON file (default data/bench)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the script)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    out: dict = {"device": torch.cuda.get_device_name() if gpu else "cpu", "commit": git_commit(),
                 "versions": versions(), "env": describe()}
    t0 = time.perf_counter()
    parts = out["part_seconds"] = {}  # where the time goes (the GPU run must stay under 2 minutes)

    def lap(name: str) -> None:
        parts[name] = time.perf_counter() - t0 - sum(parts.values())

    default = llmlab.load()
    shape = LLM.from_preset("smollm2-135m" if args.smoke else "llama-3.2-1b")
    lap("load")
    new = 8 if args.smoke else 128  # 128 new tokens: the rows took ~40 s on an H200 (eager decode, 4 runs each)
    triton = gpu and not args.smoke
    out["steps"] = decode_steps(default, 1, 32 if args.smoke else 128, new, 1 if args.smoke else 3, triton)
    out["steps"] += decode_steps(shape, 1 if args.smoke else 8, 32 if args.smoke else 128, new,
                                 1 if args.smoke else 3, triton)
    lap("steps")

    n_seqs, max_len = (16, 256) if args.smoke else (64, 1024)  # smoke: 64 x 1024 was a 3 GB fp32 cache on a CPU
    lengths = sizing.mixed_lengths(n_seqs, 16, max_len, seed=0)
    dev = shape.device
    out["memory_waste"] = [kv_costs.measured_waste(cfg, lengths, max_len, bs, dtype=shape.dtype, device=dev)
                           | {"model": name}
                           for name, cfg in (("pydoc-llama", default.config), (shape.name, shape.config))
                           for bs in (16, 32)]
    out["memory_waste_formula"] = [vars(w) | {"waste_fraction": w.waste_fraction}
                                   for w in sizing.waste(lengths, max_len, 16)]
    lap("memory_waste")

    out["kv_quant"] = kv_quant.quality_report(default, **(SMOKE_QUALITY if args.smoke else QUALITY))
    lap("kv_quant")
    ids = default.encode(kv_quant.heldout_text())
    msgs = [ids[:300], ids[300:340], ids[340:380], ids[380:420]]
    out["prefix_reuse"] = compare_ttft(default.model, msgs, max_new_tokens=4, repeats=1 if args.smoke else 5)
    lap("prefix_reuse")
    # a long first message, then short follow-ups: without reuse each turn prefills the whole conversation again.
    # 16K tokens: on an H200 an eager prefill of the 1B shape is host-launch-bound (~13 ms) up to a few thousand
    # tokens (2000 tokens: 13.9 ms without reuse vs 13.1 ms with it), so only a long history shows the saving
    sizes = [48, 8, 8, 8] if args.smoke else [16000, 64, 64, 64]
    chat = random_chat(shape.config.vocab_size, sizes)
    rows = compare_ttft(shape.model, chat, max_new_tokens=4, repeats=1 if args.smoke else 3,
                        max_seq_len=sum(sizes) + 4 * len(sizes), check_replies=False)  # random weights
    out["prefix_reuse_1b"] = [r | {"model": shape.name} for r in rows]
    lap("prefix_reuse_1b")
    out["seconds"] = time.perf_counter() - t0

    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{'nvidia-h200' if gpu and 'H200' in out['device'] else ('gpu' if gpu else 'cpu')}_kv_cache.json"
    (folder / name).write_text(json.dumps(out, indent=1))
    for r in out["steps"]:
        print(step_line(r))
    for w in out["memory_waste"]:
        print(f"waste {w['model']:<32} block {w['block_size']}: contiguous {w['contiguous_waste']:.1%}, "
              f"paged {w['paged_waste']:.1%}")
    print("\n".join(turn_summary(out["prefix_reuse_1b"], shape.name)))
    if not all(r["same_reply"] for r in out["prefix_reuse_1b"]):
        print("  (some replies differ from mode none: random weights in bf16, see compare_ttft's check_replies)")
    print("wrote", folder / name, f"({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
