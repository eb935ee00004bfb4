"""gpt-fast's batch-1 decode as a peer of the `chat` workload, bf16 and int8 weight-only, written as JSON beside the
bench files (`data/bench/`).

    python3 tools/gpt_fast_peer.py --gpt-fast DIR --out FILE.json [--model llama-3.1-8b] [--variants bf16,int8]
        [--runs 3] [--prompt-len 128] [--new-tokens 256] [--deadline-s S]

DIR is a checkout of https://github.com/pytorch-labs/gpt-fast (its model.py, generate.py and quantize.py are
imported from there; nothing of it is copied here). The model is gpt-fast's `Transformer.from_name(--model)` with
random bf16 weights (normal, std 0.02; the speed of a decode does not depend on the values). "int8" is gpt-fast's
`WeightOnlyInt8QuantHandler`: every nn.Linear, the output layer included, per-channel int8 with bf16 scales, run
as F.linear on the weight converted to bf16 times the scales, which torch.compile fuses. The decode step is
compiled as gpt-fast's `generate.py --compile` does it (`torch.compile(decode_one_token, mode="reduce-overhead",
fullgraph=True)`, the prefill eager), and sampled with its defaults (temperature 0.8, top-k 200).

tokens/s as `llmlab bench` counts it: new tokens over the wall time of the request, prefill included (one warm-up
request first, which compiles). tokenizer.py (sentencepiece, tiktoken) is not needed: the prompt is token ids; where
those packages are missing, a stand-in module satisfies gpt-fast's import of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python3 tools/...` from a plain checkout


def _import_gpt_fast(folder: Path):
    """gpt-fast's (model, generate, quantize) modules from a checkout."""
    if not (folder / "generate.py").is_file():
        raise SystemExit(f"--gpt-fast {folder}: no generate.py there; give a checkout of "
                         f"https://github.com/pytorch-labs/gpt-fast")
    sys.path.insert(0, str(folder))
    try:
        import tokenizer  # noqa: F401
    except ImportError:  # sentencepiece / tiktoken missing: the prompt is token ids, no tokenizer is used
        sys.modules["tokenizer"] = types.SimpleNamespace(get_tokenizer=None)
    import generate
    import model
    import quantize
    return model, generate, quantize


def _random_model(gf_model, name: str, device: str):
    """gpt-fast's Transformer for `name`, built without memory on the meta device, then given random bf16 weights
    on `device` (norm weights 1)."""
    with torch.device("meta"):
        m = gf_model.Transformer.from_name(name)
    m = m.to_empty(device=device).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if pname.endswith("norm.weight"):  # norm, attention_norm, ffn_norm
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return m.eval()


def _gpt_fast_commit(folder: Path) -> str:
    """The checkout's commit, or "-" when the folder is not the root of a git checkout (a copy of its files)."""
    def git(*a):
        return subprocess.run(["git", "-C", str(folder), *a], capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel") or "/nonexistent").resolve() != folder.resolve():
            return "-"
        return git("rev-parse", "HEAD") or "-"
    except (OSError, subprocess.SubprocessError):
        return "-"


def run_variant(gf, name: str, variant: str, args, device: str) -> dict:
    gf_model, gf_gen, gf_quant = gf
    t0 = time.perf_counter()
    m = _random_model(gf_model, name, device)
    if variant == "int8":
        handler = gf_quant.WeightOnlyInt8QuantHandler(m)
        state = handler.create_quantized_state_dict()
        m = handler.convert_for_runtime()
        m.load_state_dict(state, assign=True)
        m = m.to(device)
    build_s = time.perf_counter() - t0
    weight_bytes = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers())
                       if t.dtype != torch.bool)
    prompt = torch.randint(0, m.config.vocab_size, (args.prompt_len,), device=device,
                           generator=torch.Generator(device=device).manual_seed(1))

    def one_request() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        seq, _ = gf_gen.generate(m, prompt, args.new_tokens, batch_size=1, interactive=False, draft_model=None,
                                 temperature=0.8, top_k=200)
        if device == "cuda":
            torch.cuda.synchronize()
        assert seq.shape[-1] == args.prompt_len + args.new_tokens
        return time.perf_counter() - t

    t0 = time.perf_counter()
    one_request()  # warm-up: compiles the decode step
    warmup_s = time.perf_counter() - t0
    walls = [one_request() for _ in range(args.runs)]
    wall = statistics.median(walls)
    row = {"step": f"gpt_fast_{variant}", "weights": variant, "tokens_per_s": args.new_tokens / wall,
           "runs_s": walls, "warmup_s": warmup_s, "build_s": build_s, "weight_and_buffer_GB": weight_bytes / 1e9,
           "lm_head": "int8" if variant == "int8" else "bf16"}
    print(f"gpt_fast_{variant}: {row['tokens_per_s']:.1f} tokens/s (median of {args.runs}; warm-up {warmup_s:.0f} s)",
          flush=True)
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpt-fast", required=True, type=Path, help="a checkout of pytorch-labs/gpt-fast")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="llama-3.1-8b", help="a name of gpt-fast's transformer_configs")
    p.add_argument("--gpt-fast-commit", default=None, help="the commit the files are from, when DIR is a copy")
    p.add_argument("--variants", default="bf16,int8")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--deadline-s", type=float, default=None, help="start no variant after this many seconds")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", action="store_true", help="eager decode (a check of the script on a CPU)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not set(variants) <= {"bf16", "int8"} or args.runs < 1 or args.new_tokens < 2:
        raise SystemExit("--variants takes bf16 and/or int8; --runs >= 1; --new-tokens >= 2")
    gf = _import_gpt_fast(args.gpt_fast.resolve())
    if not args.no_compile:
        gf[1].decode_one_token = torch.compile(gf[1].decode_one_token, mode="reduce-overhead", fullgraph=True)
    start = time.perf_counter()
    doc = {"format": "llmlab-peer", "peer": "gpt-fast",
           "gpt_fast_commit": args.gpt_fast_commit or _gpt_fast_commit(args.gpt_fast),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
           "model": args.model, "workload": "chat", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "compiled": not args.no_compile, "sampling": "temperature 0.8, top-k 200 (gpt-fast's defaults)",
           "rows": [], "skipped": []}
    try:
        import triton
        doc["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    from llmlab.envinfo import git_commit
    doc["commit"] = git_commit()
    for v in variants:
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            doc["skipped"].append({"step": f"gpt_fast_{v}", "reason": f"past --deadline-s {args.deadline_s:.0f}"})
            continue
        doc["rows"].append(run_variant(gf, args.model, v, args, args.device))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
