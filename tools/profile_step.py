"""Where a captured batch-1 decode step spends its time, role by role, against the bytes each role reads.

    python3 tools/profile_step.py llama-3.1-8b OUT.json [--weights int8|int4|...] [--step-tuning] [--steps 16]

The step runs as `generate_fast` replays it (CUDA graphs, the Triton kernels' fused batch-1 step) and is traced
with torch.profiler (CUPTI's kernel records). With programmatic dependent launch a kernel's programs start while
the kernel before it still runs and then wait, so a kernel's own duration overlaps its neighbour's. What a kernel
ADDS to the step is its marginal time: from the latest end of the kernels before it to its own end. The marginal
times of one step add up to the step's span.

Each layer's kernels are given roles by their order, around the attention's split kernel ("decode_split" in its
name): before it RoPE with the K/V write, where that is a launch of its own (else the split kernel does that work
and the role stays 0), and before that the q/k/v GEMV; the attention's kernels (split, merge); then the o, gate/up
and down GEMVs ("gemv" in the kernel name) and SwiGLU where it has a launch of its own. What lies before the first
layer (the embedding, the token's copies) and after the last (the final norm, lm_head, the greedy pick) is
"head+tail". Per role the JSON has the median over steps of the marginal time per layer (us), the bytes of that
role's weights (packed values and scales for a quantized layer), and the GB/s those give, next to the measured copy
bandwidth (`llmlab.measure.peaks`).

MODEL is a preset with random weights (e.g. llama-3.1-8b), 'default' or a model folder, as for `llmlab bench`.
--weights quantizes first, as the `weights` switch does; --step-tuning uses the tiles `step_tuning` chooses (timed
first, as the ladder's `+step_tuning` rung). Needs a CUDA GPU.
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

ROLES = ("qkv", "rope", "attention", "o", "gate_up", "swiglu", "down")


def kernel_events(prof) -> list[dict]:
    """The GPU kernels and copies of a finished torch.profiler run (`llmlab.measure.profiling.events_from_profiler`):
    [{name, ts, dur}] (us), by start."""
    from llmlab.measure.profiling import events_from_profiler

    kept = [{"name": e.name, "ts": e.start_us, "dur": e.end_us - e.start_us} for e in events_from_profiler(prof)
            if e.kind in ("kernel", "memcpy")]
    return sorted(kept, key=lambda e: e["ts"])


def split_steps(kernels: list[dict], end_marker: str = "argmax") -> list[list[dict]]:
    """The kernels of each decode step: from after one greedy-pick kernel (`end_marker` in its name) to the next
    one, inclusive (what comes before the first pick, the prefill, is no step). The first and last of them are
    dropped as a margin: the trace's first replay and the one the profiler stops in."""
    ends = [i for i, e in enumerate(kernels) if end_marker in e["name"].lower()]
    return [kernels[a + 1:b + 1] for a, b in zip(ends, ends[1:])][1:-1]


def marginal_us(step: list[dict]) -> list[float]:
    """Each kernel's marginal time (us): its end minus the latest end of the kernels before it (0 if it ended
    earlier), the first kernel's its own duration. They add up to the step's span."""
    out, last = [], step[0]["ts"]
    for e in step:
        end = e["ts"] + e["dur"]
        out.append(max(0.0, end - last))
        last = max(last, end)
    return out


def roles_of_step(step: list[dict], n_layers: int) -> dict[str, float]:
    """{role: marginal us in this step, summed over layers} (`ROLES` and "head+tail"). Raises ValueError when the
    step does not hold n_layers attention split kernels after a GEMV (not the fused batch-1 step)."""
    names = [e["name"] for e in step]
    marg = marginal_us(step)
    splits = [i for i, n in enumerate(names) if "decode_split" in n.lower()]
    has_rope = [i >= 1 and "rope" in names[i - 1].lower() for i in splits]  # RoPE + K/V write in a launch of its own
    firsts = [i - 1 if rope else i for i, rope in zip(splits, has_rope)]  # each layer's first kernel after q/k/v
    if len(splits) != n_layers or firsts[0] < 1:
        raise ValueError(f"expected {n_layers} attention split kernels in a decode step, found {len(splits)}: not "
                         f"the fused batch-1 step (are the Triton kernels on?)")
    per = dict.fromkeys(ROLES, 0.0)
    counted = set()
    for li, (r, first) in enumerate(zip(splits, firsts)):
        per["qkv"] += marg[first - 1]
        per["rope"] += marg[r - 1] if first < r else 0.0
        counted |= set(range(first - 1, r))
        stop = firsts[li + 1] - 1 if li + 1 < len(splits) else len(step)
        gemvs = [i for i in range(r, stop) if "gemv" in names[i].lower()][:3]
        if len(gemvs) != 3:
            raise ValueError(f"layer {li}: expected the o, gate/up and down GEMVs after the attention, found "
                             f"{len(gemvs)} kernels named 'gemv'")
        for i in range(r, gemvs[0]):
            per["attention"] += marg[i]
            counted.add(i)
        for role, i in zip(("o", "gate_up", "down"), gemvs):
            per[role] += marg[i]
            counted.add(i)
        for i in range(gemvs[1] + 1, gemvs[2]):  # between gate/up and down: SwiGLU's own launch
            per["swiglu"] += marg[i]
            counted.add(i)
    per["head+tail"] = sum(m for i, m in enumerate(marg) if i not in counted)
    return per


def role_bytes(step) -> dict[str, int]:
    """Bytes of layer 0's weights for each GEMV role of a KernelDecodeStep (quantized: packed values + scales)."""
    from llmlab.kernels.decode_step import float_projections
    from llmlab.quant.quantize import weight_bytes

    if float_projections(step.model):
        return {role: w.numel() * w.element_size() for role, (w, _) in step.gemv_weights().items()}
    return {role: weight_bytes(layer) for role, layer in step.quantized_gemv_layers().items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--weights", default=None, help="int8, int4, int4-g64, ... (the weights switch's values)")
    ap.add_argument("--step-tuning", action="store_true", help="time the step's tiles first (step_tuning)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps traced (default 16)")
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step.py needs a CUDA GPU (it traces the captured decode step's kernels)", file=sys.stderr)
        return 2
    if args.steps < 3:
        ap.error("--steps must be at least 3")
    from torch.profiler import ProfilerActivity, profile

    from llmlab.envinfo import git_commit
    from llmlab.kernels import KernelDecodeStep, step_tuning, swap_in
    from llmlab.measure.bench import load_bench_model
    from llmlab.measure.peaks import measure_peaks
    from llmlab.runtime.cuda_graphs import GraphDecoder
    from llmlab.runtime.fast_generate import generate_fast
    from llmlab.switches import WEIGHT_FORMATS

    llm, model_id, _ = load_bench_model(args.model)
    if args.weights:
        if args.weights not in WEIGHT_FORMATS:
            ap.error(f"--weights {args.weights!r}: use one of {', '.join(WEIGHT_FORMATS)}")
        scheme, group, lm_head = WEIGHT_FORMATS[args.weights]
        llm = llm.quantize(scheme, group_size=group, include_lm_head=lm_head, inplace=True)
    model = swap_in(llm.model)
    step = KernelDecodeStep(model)
    prompt = torch.randint(0, llm.config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    # one cache size for the tuning and the traced runner: the attention's tile is chosen for a size
    context, new = args.prompt_len, args.steps + 16
    slots = step_tuning.runner_slots(model, context, new)
    generate_fast(model, prompt, max_new_tokens=8, kernels=step)  # the autotuner's picks first
    tuning_s = None
    if args.step_tuning:
        t0 = time.perf_counter()
        step_tuning.tune_decode_step(step, context=context, steps=new)
        tuning_s = time.perf_counter() - t0
    runner = GraphDecoder(model, max_batch=1, max_seq_len=slots, kernels=step)
    generate_fast(model, prompt, max_new_tokens=8, runner=runner)  # capture and warm up
    step_ms = statistics.median(statistics.fmean(generate_fast(model, prompt, max_new_tokens=new,
                                                               runner=runner).step_ms[1:]) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate_fast(model, prompt, max_new_tokens=args.steps + 2, runner=runner)
    steps = split_steps(kernel_events(prof))
    L = model.config.n_layers
    per_step = [roles_of_step(s, L) for s in steps]
    roles = {r: statistics.median(p[r] for p in per_step) for r in per_step[0]}
    nbytes = role_bytes(step)
    copy = measure_peaks(torch.device("cuda")).copy_bw_gb_s
    table = {}
    for role, us in roles.items():
        row = {"us_per_step": us, "us_per_layer": us / L if role != "head+tail" else None}
        if role in nbytes:
            row["bytes_per_layer"] = nbytes[role]
            row["gb_s"] = nbytes[role] / (us / L) / 1e3 if us > 0 else None
            row["us_per_layer_at_copy_speed"] = nbytes[role] / copy / 1e3
        table[role] = row
    span = statistics.median(sum(marginal_us(s)) for s in steps)
    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "model": model_id,
           "weights": args.weights or str(next(model.parameters()).dtype).replace("torch.", ""),
           "step_tiles": {r: str(c) for r, c in step.tiles.items()}, "step_tuning_s": tuning_s,
           "versions": {"torch": torch.__version__}, "copy_bw_gb_s": copy, "layers": L,
           "step_ms_untraced": step_ms, "traced_step_span_us": span, "traced_steps": len(steps), "roles": table,
           "notes": ["marginal time: a kernel's end minus the latest end before it (PDL overlaps kernels)",
                     "bytes: layer 0's weights for the role (quantized: packed values + scales)"]}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{doc['device']}  {doc['weights']}  step {step_ms:.3f} ms untraced, {span:.1f} us traced; copy "
          f"{copy:.0f} GB/s")
    for role, row in table.items():
        extra = (f"  {row['bytes_per_layer'] / 1e6:7.2f} MB  {row['gb_s']:6.0f} GB/s  (at copy speed "
                 f"{row['us_per_layer_at_copy_speed']:6.2f} us)" if "bytes_per_layer" in row and row["gb_s"] else "")
        per_layer = f"{row['us_per_layer']:7.2f} us/layer" if row["us_per_layer"] is not None else " " * 16
        print(f"  {role:10s} {row['us_per_step']:8.1f} us/step {per_layer}{extra}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
