"""The `llmlab` command: `llmlab generate "prompt"`, `llmlab tour` and `llmlab record` (GPU traces)."""

from __future__ import annotations

import argparse
import sys


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (shipped in data/models/), a local Hugging Face folder, or a hub id")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="weights and activations (default: bf16 on CUDA, fp32 on CPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmlab", description="Why LLM inference leaves a GPU idle — measured.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue a prompt with the default model (offline)")
    g.add_argument("prompt")
    _model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")

    t = sub.add_parser("tour", help="the main job: each setting's TTFT, TPOT and tokens/s on the default model")
    _model_args(t)
    t.add_argument("--prompt", default="The list")
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--repeats", type=int, default=3)

    r = sub.add_parser("record", help="on an NVIDIA GPU: record GPU-Util / SM activity / DRAM bandwidth traces of "
                                      "a decode into data/traces/ (replayed by the dashboard where there is no GPU)")
    r.add_argument("--model", default=None,
                   help="a checkpoint instead of a preset: 'default' (shipped), a local folder, or a hub id")
    r.add_argument("--preset", default="llama-3.2-1b", help="model shape with random bf16 weights (default llama-3.2-1b)")
    r.add_argument("--setting", action="append", default=None, metavar="KEY=VALUE,...",
                   help="switch values of one recording, e.g. kv_cache=false,dtype=bf16; repeat for more "
                        "(default: KV cache on, and off, both bf16)")
    r.add_argument("--out-dir", default=None, help="folder for the traces (default data/traces/)")
    r.add_argument("--duration", type=float, default=12.0, help="seconds of decoding per setting (default 12)")
    r.add_argument("--prompt-tokens", type=int, default=128, help="random prompt ids per call (default 128)")
    r.add_argument("--new-tokens", type=int, default=256, help="new tokens per generate call (default 256)")
    r.add_argument("--idle", type=float, default=1.0, help="idle seconds sampled before and after (default 1)")
    r.add_argument("--interval", type=float, default=0.1, help="sampler period, s (default 0.1 = 10 Hz)")
    r.add_argument("--device", default="cuda", help="cuda or cuda:N")
    r.add_argument("--no-profile", action="store_true", help="skip the torch.profiler kernel timeline")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "record":
        from .record import run_from_args

        return run_from_args(args)
    try:
        if args.command == "generate":
            from .engine import LLM
            from .tour import device_line

            llm = LLM.load(args.model, device=args.device, dtype=args.dtype)
            g = llm.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache)
            print(args.prompt + (g.text or " ".join(map(str, g.token_ids[0]))))
            print(f"\n[{llm.name} | {device_line(llm)} | {g.n_generated} tokens | TTFT {g.ttft_ms:.1f} ms | "
                  f"TPOT {g.tpot_ms:.2f} ms | {g.tokens_per_s:.1f} tokens/s]", file=sys.stderr)
        elif args.command == "tour":
            from .tour import run_tour

            run_tour(args.model, device=args.device, dtype=args.dtype, prompt=args.prompt,
                     max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    except (ValueError, FileNotFoundError, KeyError, MemoryError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"llmlab: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
