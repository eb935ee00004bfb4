"""Batch-1 decode ms/step on a GPU: eager `generate` vs the static-cache step run eagerly, from CUDA graphs, and
through torch.compile — for the shipped default model and for Llama-3.2-1B's shape (random weights), bf16.

    python3 tools/bench_fast_decode.py [--json out.json] [--budget-s 60] [--all]

Per model and mode: the median over `--repeats` runs of the median decode-step time (TPOT, CUDA events), tokens/s
of the decode steps, the speed-up over eager `generate`, MBU against the measured copy bandwidth (weights + the
KV cache actually attended, by the `llmlab.measure.roofline` convention) and the one-off setup time (capture /
compile). Also the host costs of `llmlab.measure.host_costs` (tokenizer, pinned vs pageable copies, sampling).
Compilation is skipped once the time budget is spent (the output says so). Needs a CUDA GPU; no network.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python3 tools/...` from a plain checkout

from llmlab.engine import LLM  # noqa: E402
from llmlab.runtime.fast_generate import generate_fast  # noqa: E402
from llmlab.generate import generate  # noqa: E402
from llmlab.measure.host_costs import h2d_copy_cost, sampling_cost, tokenizer_cost  # noqa: E402
from llmlab.measure.peaks import measure_copy_bandwidth  # noqa: E402
from llmlab.measure.roofline import decode_mean_context_len, mbu  # noqa: E402

T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def tpot_ms(g) -> float:
    return statistics.median(g.step_ms[1:])


def bench(llm: LLM, name: str, label: str, kw: dict, prompt_len: int, new_tokens: int, repeats: int,
          peak_bw: float, eager_ms: float | None) -> dict:
    """One (model, mode): warm-up (builds the runner), then the median over `repeats` runs of the median TPOT."""
    model, config = llm.model, llm.config
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        t0 = time.time()
        if kw.get("mode") is None:
            run = lambda n: generate(model, prompt, max_new_tokens=n)  # noqa: E731
        else:
            run = lambda n: generate_fast(model, prompt, max_new_tokens=n, runners=llm.runners, **kw)  # noqa: E731
        run(8)  # warm-up; builds (captures / compiles) the runner
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        setup_s = time.time() - t0
        ms = statistics.median(tpot_ms(run(new_tokens)) for _ in range(repeats))
    except Exception as e:  # report and go on: one failing mode must not hide the others
        say(f"{name} {label}: FAILED {type(e).__name__}: {e}")
        return {"model": name, "mode": label, "error": f"{type(e).__name__}: {e}"}
    eager_ms = ms if eager_ms is None else eager_ms
    row = {"model": name, "mode": label, "ms_per_step": ms, "tokens_per_s": 1e3 / ms,
           "speedup_vs_eager": eager_ms / ms, "setup_s": setup_s,
           "mbu_pct": 100 * mbu(ms / 1e3, config, 1, decode_mean_context_len(prompt_len, new_tokens), peak_bw)}
    say(f"{name:22s} {label:28s} {ms:8.3f} ms/step {row['tokens_per_s']:8.0f} tok/s "
        f"x{row['speedup_vs_eager']:5.1f} vs eager  MBU {row['mbu_pct']:5.1f}%  setup {setup_s:5.1f} s")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--budget-s", type=float, default=60.0, help="start no compilation after this many seconds")
    ap.add_argument("--all", action="store_true", help="also the sync-per-token variants for 1B")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    say(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    peak_bw = measure_copy_bandwidth("cuda", nbytes=1 << 30)
    say(f"copy bandwidth {peak_bw:.0f} GB/s (the MBU peak)")

    eager = ("eager generate", {})
    static_sync = ("static, sync per token", {"mode": "static", "gpu_sampling": False})
    static = ("static", {"mode": "static"})
    graphs_sync = ("graphs, sync per token", {"mode": "graphs", "gpu_sampling": False})
    graphs = ("graphs", {"mode": "graphs"})
    compiled = ("compile (reduce-overhead)", {"mode": "compile"})
    compiled_graphs = ("compile+graphs", {"mode": "compile+graphs"})
    D, L = "default (pydoc-llama)", "llama-3.2-1b (random)"
    llms = {D: LLM.load("default", device="cuda", dtype="bf16"),
            L: LLM.from_preset("llama-3.2-1b", device="cuda", dtype="bf16")}
    # the cheap modes of both models first, then the compilations, most wanted first, while the budget lasts
    plan = [(D, eager), (D, static_sync), (D, static), (D, graphs_sync), (D, graphs),
            (L, eager), (L, static), (L, graphs)] + ([(L, static_sync), (L, graphs_sync)] if args.all else []) + \
           [(D, compiled), (L, compiled), (D, compiled_graphs), (L, compiled_graphs)]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bw_gb_s": peak_bw,
               "prompt_len": args.prompt, "new_tokens": args.new, "rows": []}

    def save() -> None:  # after every row: a time limit that kills the run still leaves the rows so far
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    say("host costs")
    try:
        results["tokenizer"] = tokenizer_cost(llms[D].tokenizer, repeats=10)
        results["h2d_copy"] = h2d_copy_cost(repeats=10)
        results["sampling"] = {v: sampling_cost(vocab_size=v, repeats=20) for v in (8192, 128256)}
        for r in results["tokenizer"]["prompts"]:
            say(f"  tokenizer encode {r['tokens']:5d} tokens: {r['encode_ms']:.3f} ms")
        say(f"  tokenizer decode of one token: {results['tokenizer']['decode_one_token_us']:.2f} us")
        for r in results["h2d_copy"]["rows"]:
            say(f"  H2D {r['bytes']:>9d} B: pageable {r['pageable_total_ms']:.4f} ms "
                f"(host {r['pageable_host_ms']:.4f}) pinned {r['pinned_total_ms']:.4f} ms "
                f"(host {r['pinned_host_ms']:.4f})")
        for v, s in results["sampling"].items():
            say(f"  sampling V={v}: gpu {s['gpu_ms']:.3f} ms, gpu+read {s['gpu_then_host_ms']:.3f} ms, "
                f"cpu {s['cpu_ms']:.3f} ms; greedy gpu {s['greedy_gpu_ms']:.3f} / cpu {s['greedy_cpu_ms']:.3f} ms")
    except Exception as e:
        say(f"host costs FAILED {type(e).__name__}: {e}")
    save()
    eager_ms: dict[str, float] = {}
    for name, (label, kw) in plan:
        if "compile" in kw.get("mode", "") and time.time() - T0 > args.budget_s:
            say(f"{name} {label}: skipped (time budget of {args.budget_s:.0f} s spent; --budget-s to raise it)")
            results["rows"].append({"model": name, "mode": label, "skipped": "time budget"})
            continue
        row = bench(llms[name], name, label, kw, args.prompt, args.new, args.repeats, peak_bw, eager_ms.get(name))
        results["rows"].append(row)
        if label == eager[0] and "ms_per_step" in row:
            eager_ms[name] = row["ms_per_step"]
        save()

    ok = {(r["model"], r["mode"]): r for r in results["rows"] if "ms_per_step" in r}
    d_eager, d_graph = ok.get((D, "eager generate")), ok.get((D, "graphs"))
    if d_eager and d_graph:
        say(f"default model: graph step {d_eager['ms_per_step'] / d_graph['ms_per_step']:.1f}x faster than the eager "
            f"step (target >= 5x)")
    best_1b = max((r for (m, _), r in ok.items() if m.startswith("llama")), key=lambda r: r["mbu_pct"], default=None)
    if best_1b:
        say(f"llama-3.2-1b best: {best_1b['mode']} {best_1b['tokens_per_s']:.0f} tok/s, MBU {best_1b['mbu_pct']:.1f}% "
            f"(target >= 75%, ~1300 tok/s)")

    save()
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
