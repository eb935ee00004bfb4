"""Same-process A/B of batch-1 decode-step variants (a device-call tool; CUDA only).

    python tools/ab_decode_step.py llama-3.2-1b out.json off=MY_SWITCH=0 on=MY_SWITCH=1,OTHER=1 \
        [--rounds 4] [--prompt-len 128] [--new-tokens 256]

A variant is NAME=ENV,ENV...: environment variables set while its runner is captured — the temporary A/B
switches a device call adds to the code under test (calls AX-AY used LLMLAB_AB_TAIL, LLMLAB_AB_ROPE_GEMV and
LLMLAB_AB_PREFETCH, call BB LLMLAB_AB_LATE_TRIGGER and LLMLAB_AB_GEMV, since removed), or settings the kernels
read at launch such as LLMLAB_PDL. STEP_TUNING=1 (not an environment setting): the variant's runner is captured
with the GEMV tiles `llmlab.kernels.step_tuning` chooses (tuned once, before that variant's capture; the time it
took and its report go into the JSON).

Separate `llmlab bench` runs of two variants differ by 1-3% from run to run (each process autotunes its kernels
anew, clocks drift), which hides a change of a few microseconds per token. Here ONE model with ONE set of
autotuned kernels gets a CUDA-graph runner per variant, captured with that variant's environment variables set
(the A/B switches are read while the step is captured), and the rounds alternate the variants (A B C A B C ...)
so that drift hits them alike. Per variant: the median over rounds of the mean decode step (ms, CUDA events,
prefill excluded), and each round's value. The "Triton kernels" switch is on for every variant.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch


def _tuned_configs() -> dict:
    """{kernel: {autotuning key: chosen config}} of the decode step's autotuned kernels, as strings."""
    from llmlab.kernels import decode_attention, fused_gemv

    return {name: {str(key): str(cfg) for key, cfg in kernel.cache.items()}
            for name, kernel in (("fused_gemv", fused_gemv._fused_gemv_kernel),
                                 ("decode_attention", decode_attention._decode_split_tuned))}


def main(argv: list[str]) -> None:
    from llmlab.measure.bench import load_bench_model
    from llmlab.runtime.cuda_graphs import GraphDecoder
    from llmlab.runtime.fast_generate import generate_fast
    from llmlab.kernels import patch_model

    opts = {"--rounds": 4, "--prompt-len": 128, "--new-tokens": 256}
    args = []
    it = iter(argv)
    for a in it:
        if a in opts:
            opts[a] = int(next(it, "0"))
        else:
            args.append(a)
    if len(args) < 3 or opts["--new-tokens"] < 2:
        raise SystemExit(__doc__)
    model_name, out, specs = args[0], args[1], args[2:]
    variants = {}
    for spec in specs:
        name, _, env = spec.partition("=")
        variants[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    llm, _, _ = load_bench_model(model_name)
    model = patch_model.enable(llm.model)
    n_prompt, n_new = opts["--prompt-len"], opts["--new-tokens"]
    prompt = torch.randint(0, llm.config.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = max(1024, -(-(n_prompt + n_new) // 512) * 512)
    runners = {}
    tuning = {}
    for name, env in variants.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            if env.get("STEP_TUNING") == "1":  # the GEMV tiles chosen by timing the step (kernels/step_tuning.py)
                if not tuning:
                    import time

                    from llmlab.kernels import step_tuning

                    generate_fast(model, prompt, max_new_tokens=8, mode="graphs")  # the autotuner's picks first
                    t0 = time.perf_counter()
                    tuning["report"] = step_tuning.tune_decode_step(model, log=print)
                    tuning["seconds"] = time.perf_counter() - t0
                    tuning["tiles"] = dict(model.__dict__.get(patch_model.STEP_TILES_ATTR, {}))
                    print(f"step tuning took {tuning['seconds']:.1f} s", flush=True)
                model.__dict__[patch_model.STEP_TILES_ATTR] = dict(tuning["tiles"])
            runners[name] = GraphDecoder(model, max_batch=1, max_seq_len=seq)  # captured with env set
            generate_fast(model, prompt, max_new_tokens=8, runner=runners[name])  # warm-up
        finally:
            model.__dict__.pop(patch_model.STEP_TILES_ATTR, None)  # tiles are baked into the captured graph
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
    base = statistics.median(per[next(iter(per))])
    rows = []
    for name, ms in per.items():
        med = statistics.median(ms)
        rows.append({"variant": name, "env": variants[name], "step_ms_median": med, "rounds_ms": ms,
                     "vs_first": med / base - 1})
        print(f"{name:12s} {med * 1e3:7.1f} us/step ({(med / base - 1) * 100:+5.1f}% vs {next(iter(per))})  "
              f"rounds {[round(m * 1e3, 1) for m in ms]}", flush=True)
    import triton

    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "commit": os.environ.get("LLMLAB_COMMIT", "?"),
                   "versions": {"torch": torch.__version__, "triton": triton.__version__}, "model": model_name,
                   "prompt_len": n_prompt, "new_tokens": n_new, "rounds": opts["--rounds"], "results": rows,
                   "tuned_configs": tuned,
                   "step_tuning": {"seconds": tuning.get("seconds"), "report": tuning.get("report")}}, f,
                  indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
