"""The weight-quantization quality table of the default model, written as JSON: perplexity on held-out tokens and
greedy agreement with the unquantized model, for fp32 and bf16, int8 and int4 at group sizes 128 / 64 / 32, each
rounded to nearest (RTN) and with activation-aware scaling (AWQ, `llmlab.quant.awq`), with lm_head kept in the model's
dtype; and int8 / int4 g128 RTN with lm_head quantized too (the ladder's `+int8_lm_head` / `+int4_lm_head`).

    python tools/quant_quality.py                                   # writes data/quant/perplexity_default.json
    python tools/quant_quality.py --quick --out /tmp/q.json         # a quick CPU check of the script itself

Tokens: the default model's held-out documents (`llmlab.quant.heldout_text`). AWQ is calibrated on their first
n_samples * seq_len tokens (`calibration_ids`); perplexity is measured on the tokens after those
(`evaluation_ids`), so no scored token was seen by the calibration; the greedy-agreement prompts are cut from the
same evaluation tokens. Each quantized model is built from the shipped weights (bf16 values) and run with the
activations of `--act` (default fp32, which isolates the rounding of the weights; bf16 or fp32,bf16 add rows run
in bf16); its agreement is measured against the unquantized model in the same activation dtype. The AWQ scales are
searched once per scheme (in fp32) and folded into each activation dtype's copy. `weight_bytes` of a quantized row
is what a bf16 model quantized that way stores (embedding and norms in bf16, int8/int4 values with fp32 scales),
whatever its activations; `step_weight_bytes` is what one decode step of that model reads (with the default model's
tied embeddings, a quantized lm_head is a copy stored beside the bf16 embedding: more bytes stored, fewer read).
Runs on a CPU: 10-50 minutes per activation dtype on a 2-core machine, depending on its load.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python3 tools/...` from a plain checkout

import llmlab  # noqa: E402
from llmlab.measure.model_bytes import step_weight_bytes  # noqa: E402
from llmlab.quant import (apply_awq, awq_scales, calibration_ids, evaluation_ids, greedy_agreement,  # noqa: E402
                          heldout_text, perplexity, quantize_model, weight_bytes)
from llmlab.quant.calibration import heldout_ids  # noqa: E402
from llmlab.train.corpus import EOT  # noqa: E402

# (scheme, group size) of the quantized rows, each done with RTN and AWQ
FORMATS = (("int8", None), ("int4", 128), ("int4", 64), ("int4", 32))
ACT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def prompts_from(ids: torch.Tensor, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens, spread evenly over the evaluation tokens."""
    step = (ids.numel() - length) // max(n - 1, 1)
    return [ids[i * step:i * step + length].tolist() for i in range(n)]


def measure(name: str, model, ref_model, ev: torch.Tensor, prompts, args, stored) -> dict:
    """Perplexity and greedy agreement of `model`; the bytes of `stored` (the same weights as a bf16 model stores
    them): weight_bytes (every weight once) and step_weight_bytes (what a decode step reads: with tied embeddings a
    quantized lm_head is a copy, stored beside the float embedding, and the step reads the copy)."""
    t0 = time.perf_counter()
    ppl = perplexity(model, ev, context=args.context, stride=args.context // 2)
    agree = greedy_agreement(ref_model, model, prompts, n_tokens=args.new_tokens)
    nbytes = weight_bytes(stored)
    row = {"perplexity": round(ppl, 4), "agreement": round(agree, 4), "weight_bytes": nbytes,
           "step_weight_bytes": step_weight_bytes(stored)}
    print(f"  {name:<22} perplexity {ppl:9.4f}  agreement {agree:6.1%}  weight bytes {row['weight_bytes']:>10,}  "
          f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "quant" / "perplexity_default.json")
    ap.add_argument("--act", default="fp32", help="activation dtypes of the quantized rows: fp32, bf16 or fp32,bf16")
    ap.add_argument("--n-samples", type=int, default=16, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    ap.add_argument("--grid", type=int, default=20, help="AWQ: alphas tried per group of layers")
    ap.add_argument("--context", type=int, default=1024, help="perplexity window (stride: half of it)")
    ap.add_argument("--prompts", type=int, default=8, help="greedy agreement: prompts")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy agreement: tokens generated per prompt")
    ap.add_argument("--eval-tokens", type=int, default=None, help="score only the first N evaluation tokens")
    ap.add_argument("--quick", action="store_true", help="a quick check of the script: few tokens, a small grid")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_samples, args.grid, args.context, args.prompts, args.new_tokens = 2, 4, 256, 2, 8
        args.eval_tokens = args.eval_tokens or 512
    acts = [a.strip() for a in args.act.split(",") if a.strip()]
    if not acts or any(a not in ACT for a in acts):
        ap.error(f"--act {args.act!r}: give fp32, bf16 or fp32,bf16")

    base = llmlab.load(device="cpu", dtype="fp32")
    text = heldout_text()
    all_ids = heldout_ids(base, text)
    calib = calibration_ids(base, text, args.n_samples, args.seq_len)
    ev = evaluation_ids(base, text, args.n_samples, args.seq_len)
    if args.eval_tokens:
        ev = ev[:args.eval_tokens]
    prompts = prompts_from(ev, args.prompts, args.prompt_tokens)
    print(f"held-out: {text.count(EOT) + 1} documents, {all_ids.numel():,} tokens; calibration "
          f"{tuple(calib.shape)}; evaluation {ev.numel():,} tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)

    floats = {"fp32": base.model, "bf16": copy.deepcopy(base.model).to(torch.bfloat16)}
    rows = []
    for act in ("fp32", "bf16"):
        row = {"name": act, "weights": act, "group_size": None, "method": None, "lm_head": None, "activations": act,
               "agreement_ref": "fp32", "quantize_s": None, "calibration_s": None}
        row.update(measure(act, floats[act], floats["fp32"], ev, prompts, args, floats[act]))
        rows.append(row)
    search = {}
    for scheme, g in FORMATS:
        fmt = scheme + (f" g{g}" if g else "")
        t0 = time.perf_counter()
        scales = awq_scales(base.model, calib, scheme, group_size=g or 128, grid=args.grid, progress=True)
        search_s = time.perf_counter() - t0
        search[fmt] = {r["key"]: r["alpha"] for r in scales.search}
        # bytes as a bf16 model stores them (the unquantized embedding and norms in bf16), whatever the activations
        stored = quantize_model(copy.deepcopy(floats["bf16"]), scheme, group_size=g or 128)
        for act in acts:
            for method in ("rtn", "awq"):
                model = copy.deepcopy(floats[act])
                t0 = time.perf_counter()
                if method == "awq":
                    apply_awq(model, scales)
                quantize_model(model, scheme, group_size=g or 128)
                quant_s = time.perf_counter() - t0
                name = f"{fmt} {method}" + ("" if act == "fp32" else f" ({act})")
                row = {"name": name, "weights": scheme, "group_size": g, "method": method, "lm_head": False,
                       "activations": act,
                       "agreement_ref": act, "quantize_s": round(quant_s + (search_s if method == "awq" else 0), 2),
                       "calibration_s": round(search_s, 2) if method == "awq" else None}
                row.update(measure(name, model, floats[act], ev, prompts, args, stored))
                rows.append(row)
    # the ladder's +int8_lm_head / +int4_lm_head rungs: round-to-nearest with the output layer quantized too
    for scheme, g in (("int8", None), ("int4", 128)):
        fmt = scheme + (f" g{g}" if g else "")
        stored = quantize_model(copy.deepcopy(floats["bf16"]), scheme, group_size=g or 128, include_lm_head=True)
        for act in acts:
            model = copy.deepcopy(floats[act])
            t0 = time.perf_counter()
            quantize_model(model, scheme, group_size=g or 128, include_lm_head=True)
            name = f"{fmt} rtn +lm_head" + ("" if act == "fp32" else f" ({act})")
            row = {"name": name, "weights": scheme, "group_size": g, "method": "rtn", "lm_head": True,
                   "activations": act, "agreement_ref": act, "quantize_s": round(time.perf_counter() - t0, 2),
                   "calibration_s": None}
            row.update(measure(name, model, floats[act], ev, prompts, args, stored))
            rows.append(row)
    ppl = {r["name"]: r["perplexity"] for r in rows}
    for r in rows:
        r["ppl_change_vs_fp32"] = round(r["perplexity"] / ppl["fp32"] - 1, 5)
        r["ppl_change_vs_bf16"] = round(r["perplexity"] / ppl["bf16"] - 1, 5)

    def named(fmt, method, act):
        return f"{fmt} {method}" + ("" if act == "fp32" else f" ({act})")

    checks = {}
    for act in acts:
        checks[f"int4 g128 awq below rtn ({act})"] = ppl[named("int4 g128", "awq", act)] < \
            ppl[named("int4 g128", "rtn", act)]
        checks[f"int8 rtn within 1% of bf16 ({act})"] = abs(ppl[named("int8", "rtn", act)] / ppl["bf16"] - 1) < 0.01
    result = {
        "what": "Perplexity and greedy agreement of the default model (data/models/pydoc-llama) with weight-only "
                "quantization: RTN vs AWQ (tools/quant_quality.py)",
        "model": base.name, "parameters": sum(p.numel() for p in base.model.parameters()),
        "metadata": {
            "commit": git("rev-parse", "HEAD") or "-",
            "uncommitted_changes_in_llmlab": bool(git("status", "--porcelain", "llmlab", "tools")),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__, "python": platform.python_version(), "device": "cpu",
            "threads": torch.get_num_threads(),
            "heldout": {"documents": text.count(EOT) + 1, "tokens": all_ids.numel(),
                        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                        "source": "llmlab.quant.heldout_text(): the held-out documents listed in "
                                  "data/models/pydoc-llama/training.json, rebuilt from this Python"},
            "calibration": {"n_samples": args.n_samples, "seq_len": args.seq_len, "tokens": calib.numel(),
                            "first_token": 0, "grid": args.grid},
            "evaluation": {"tokens": ev.numel(), "first_token": calib.numel(), "context": args.context,
                           "stride": args.context // 2},
            "agreement": {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                          "new_tokens": args.new_tokens,
                          "reference": "the unquantized model in the row's activation dtype (fp32 for bf16)"},
            "activations": acts,
        },
        "checks": checks,
        "rows": rows,
        "awq_alphas": search,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"checks: {checks}\nwrote {args.out}")


if __name__ == "__main__":
    main()
