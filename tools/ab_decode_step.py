"""Same-process A/B of batch-1 decode-step variants on a CUDA GPU, written as JSON (lab 05 reads such a file).

    python3 tools/ab_decode_step.py MODEL OUT.json NAME=ENV,... NAME=ENV,... [--rounds 4] [--prompt-len 128]
        [--new-tokens 256]
    e.g. python3 tools/ab_decode_step.py llama-3.2-1b /tmp/ab.json base= tuned=STEP_TUNING=1
         python3 tools/ab_decode_step.py llama-3.2-1b /tmp/pdl.json pdl_off=LLMLAB_PDL=0 pdl_on=LLMLAB_PDL=1

A variant is NAME=ENV,ENV,...: environment variables set while its CUDA-graph runner is captured — settings the
kernels read when the step is captured, such as LLMLAB_PDL, or a temporary switch added to the code under test.
STEP_TUNING=1 (not an environment setting) captures that variant with the tiles `llmlab.kernels.step_tuning`
chooses (tuned once, before its capture; the time taken and the report go into the JSON). FUSED_STEP=0 (not one
either) captures the batch-1 step module by module (`KernelDecodeStep(fuse_step=False)`: RMSNorm and SwiGLU in
launches of their own). ROPE_IN_ATTENTION=0 (not one either) captures it with RoPE and the K/V write in a launch of
their own before the attention (`llmlab.kernels.modules.ROPE_IN_ATTENTION`), the baseline of the attention that
applies them itself. --weights VALUE quantizes the model first, as the `weights` switch does (int8, int4,
int4-g64, ...): e.g. `... llama-3.1-8b /tmp/q.json --weights int4 fused= modules=FUSED_STEP=0`.

Separate `llmlab bench` runs of one code differ by 1-3% (each process autotunes its kernels anew, clocks drift),
which hides a change of a few microseconds per token. Here ONE model with ONE set of autotuned kernels gets a
runner per variant, and the rounds alternate the variants (A B C A B C ...) so that drift hits them alike. Per
variant: the median over rounds of the mean decode step (ms, CUDA events, prefill excluded) and each round's value.
The Triton kernels are on for every variant. MODEL is a preset with random weights (e.g. llama-3.2-1b), 'default'
or a model folder, as for `llmlab bench --model`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python3 tools/...` from a plain checkout


def _tuned_configs() -> dict:
    """{kernel: {autotuning key: chosen config}} of the decode step's autotuned kernels, as strings."""
    from llmlab.kernels import decode_attention, fused_gemv

    return {name: {str(key): str(cfg) for key, cfg in getattr(kernel, "cache", {}).items()}
            for name, kernel in (("fused_gemv", fused_gemv._fused_gemv_kernel),
                                 ("decode_attention", decode_attention._decode_split_tuned))}


def _parse(argv: list[str]) -> tuple[str, str, dict, dict]:
    """(model, out, {variant: {env: value}}, options) from the command line; prints the usage and exits if wrong."""
    opts = {"--rounds": 4, "--prompt-len": 128, "--new-tokens": 256, "--weights": None}
    args = []
    it = iter(argv)
    for a in it:
        if a == "--weights":
            opts[a] = next(it, "")
        elif a in opts:
            opts[a] = int(next(it, "0"))
        else:
            args.append(a)
    if len(args) < 3 or opts["--new-tokens"] < 2 or opts["--rounds"] < 1 or {"-h", "--help"} & set(args):
        print(__doc__.strip())
        raise SystemExit(0 if {"-h", "--help"} & set(args) else 2)
    variants = {}
    for spec in args[2:]:
        name, _, env = spec.partition("=")
        variants[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return args[0], args[1], variants, opts


def main(argv: list[str]) -> None:
    import time

    import triton

    from llmlab.envinfo import git_commit
    from llmlab.kernels import KernelDecodeStep, modules, step_tuning, swap_in
    from llmlab.measure.bench import load_bench_model
    from llmlab.runtime.cuda_graphs import GraphDecoder
    from llmlab.runtime.fast_generate import generate_fast

    model_name, out, variants, opts = _parse(argv)
    if not torch.cuda.is_available():
        print("ab_decode_step.py needs a CUDA GPU (it captures and times the Triton kernels' decode step)",
              file=sys.stderr)
        raise SystemExit(2)
    llm, _, _ = load_bench_model(model_name)
    if opts["--weights"]:
        from llmlab.switches import WEIGHT_FORMATS

        if opts["--weights"] not in WEIGHT_FORMATS:
            raise SystemExit(f"--weights {opts['--weights']!r}: use one of {', '.join(WEIGHT_FORMATS)}")
        scheme, group_size, lm_head = WEIGHT_FORMATS[opts["--weights"]]
        llm = llm.quantize(scheme, group_size=group_size, include_lm_head=lm_head, inplace=True)
    model = swap_in(llm.model)  # the Triton kernels' modules, for every variant
    n_prompt, n_new = opts["--prompt-len"], opts["--new-tokens"]
    prompt = torch.randint(0, llm.config.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = max(1024, -(-(n_prompt + n_new) // 512) * 512)
    runners = {}
    tuning = {}
    for name, env in variants.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        modules.ROPE_IN_ATTENTION = env.get("ROPE_IN_ATTENTION") != "0"  # read while the step is captured
        try:
            tiles = {}
            if env.get("STEP_TUNING") == "1":  # the tiles chosen by timing the whole step (kernels/step_tuning.py)
                if not tuning:
                    step = KernelDecodeStep(model)
                    generate_fast(model, prompt, max_new_tokens=8, kernels=step)  # the autotuner's picks first
                    t0 = time.perf_counter()
                    tuning["report"] = step_tuning.tune_decode_step(step, log=print)
                    tuning["seconds"] = time.perf_counter() - t0
                    tuning["tiles"] = dict(step.tiles)
                    print(f"step tuning took {tuning['seconds']:.1f} s", flush=True)
                tiles = tuning["tiles"]
            # captured with the variant's environment set: the tiles and switches are baked into the graph
            step = KernelDecodeStep(model, tiles, fuse_step=env.get("FUSED_STEP") != "0")
            runners[name] = GraphDecoder(model, max_batch=1, max_seq_len=seq, kernels=step)
            generate_fast(model, prompt, max_new_tokens=8, runner=runners[name])  # warm-up
        finally:
            modules.ROPE_IN_ATTENTION = True
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    tuned = _tuned_configs()
    for kernel, picks in tuned.items():
        for key, cfg in picks.items():
            print(f"tuned {kernel}: {key} -> {cfg}", flush=True)
    per = {name: [] for name in variants}
    for _ in range(opts["--rounds"]):
        for name, runner in runners.items():
            g = generate_fast(model, prompt, max_new_tokens=n_new, runner=runner)
            per[name].append(statistics.fmean(g.step_ms[1:]))
    first = next(iter(per))
    base = statistics.median(per[first])
    rows = []
    for name, ms in per.items():
        med = statistics.median(ms)
        rows.append({"variant": name, "env": variants[name], "step_ms_median": med, "rounds_ms": ms,
                     "vs_first": med / base - 1})
        print(f"{name:12s} {med * 1e3:7.1f} us/step ({(med / base - 1) * 100:+5.1f}% vs {first})  "
              f"rounds {[round(m * 1e3, 1) for m in ms]}", flush=True)
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "commit": git_commit(), "versions": {"torch": torch.__version__, "triton": triton.__version__},
                   "model": model_name, "weights": opts["--weights"], "prompt_len": n_prompt, "new_tokens": n_new,
                   "rounds": opts["--rounds"],
                   "results": rows, "tuned_configs": tuned,
                   "step_tuning": {"seconds": tuning.get("seconds"), "report": tuning.get("report")}}, f,
                  indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
