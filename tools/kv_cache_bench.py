"""Lab 03 measurements in one run, written as JSON: the paged step vs the contiguous cache (tokens/s, TPOT), the
memory waste of max-length preallocation vs paging, int8/fp8 KV quality, and TTFT with and without prefix reuse.

    python tools/kv_cache_bench.py --out data/bench            # on the GPU (bf16 llama-3.2-1b shape + default model)
    python tools/kv_cache_bench.py --smoke --out /tmp/x        # a quick CPU check of the script itself

Rows of "steps" carry a "step" name ("eager", "+paged_kv") like `llmlab bench` rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import llmlab
from llmlab import kv_memory, kv_quant
from llmlab.engine import LLM
from llmlab.envinfo import describe
from llmlab.paged_cache import PagedKVCache
from llmlab.prefix_reuse import compare_ttft


def decode_steps(llm: LLM, batch: int, prompt_tokens: int, new_tokens: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    prompts = torch.randint(0, llm.config.vocab_size, (batch, prompt_tokens)).tolist()
    rows = []
    for step, factory in (("eager", None), ("+paged_kv", PagedKVCache)):
        llm.generate(prompts, max_new_tokens=4, stop_at_eos=False, cache_factory=factory)  # warm-up
        runs = [llm.generate(prompts, max_new_tokens=new_tokens, stop_at_eos=False, cache_factory=factory)
                for _ in range(repeats)]
        runs.sort(key=lambda g: g.tpot_ms)
        g = runs[len(runs) // 2]
        rows.append({"step": step, "model": llm.name, "batch": batch, "prompt_tokens": prompt_tokens,
                     "new_tokens": new_tokens, "ttft_ms": g.ttft_ms, "tpot_ms": g.tpot_ms,
                     "tokens_per_s": g.tokens_per_s})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/bench")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the script)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    out: dict = {"env": describe(), "device": torch.cuda.get_device_name() if gpu else "cpu"}
    t0 = time.perf_counter()

    default = llmlab.load()
    shape = LLM.from_preset("smollm2-135m" if args.smoke else "llama-3.2-1b")
    new = 8 if args.smoke else 128
    out["steps"] = decode_steps(default, 1, 32 if args.smoke else 128, new, 1 if args.smoke else 3)
    out["steps"] += decode_steps(shape, 1 if args.smoke else 8, 32 if args.smoke else 128, new, 1 if args.smoke else 3)

    lengths = kv_memory.mixed_lengths(64, 16, 1024, seed=0)
    dev = shape.device
    out["memory_waste"] = [kv_memory.measured_waste(cfg, lengths, 1024, bs, dtype=shape.dtype, device=dev)
                           | {"model": name}
                           for name, cfg in (("pydoc-llama", default.config), (shape.name, shape.config))
                           for bs in (16, 32)]
    out["memory_waste_formula"] = [vars(w) | {"waste_fraction": w.waste_fraction}
                                   for w in kv_memory.waste(lengths, 1024, 16)]

    out["kv_quant"] = kv_quant.quality_report(default, residual=32, eval_tokens=128 if args.smoke else 512)
    ids = default.encode(kv_quant.heldout_text())
    msgs = [ids[:300], ids[300:340], ids[340:380], ids[380:420]]
    out["prefix_reuse"] = compare_ttft(default.model, msgs, max_new_tokens=4, repeats=1 if args.smoke else 5)
    out["seconds"] = time.perf_counter() - t0

    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{'nvidia-h200' if gpu and 'H200' in out['device'] else ('gpu' if gpu else 'cpu')}_kv_cache.json"
    (folder / name).write_text(json.dumps(out, indent=1))
    for r in out["steps"]:
        print(f"{r['model']:<32}{r['step']:<11} batch {r['batch']}: TPOT {r['tpot_ms']:.2f} ms, "
              f"{r['tokens_per_s']:.0f} tok/s")
    for w in out["memory_waste"]:
        print(f"waste {w['model']:<32} block {w['block_size']}: contiguous {w['contiguous_waste']:.1%}, "
              f"paged {w['paged_waste']:.1%}")
    print("wrote", folder / name, f"({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
