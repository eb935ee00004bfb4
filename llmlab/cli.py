"""The `llmlab` command: `llmlab generate "prompt"`, `llmlab tour`, `llmlab record` (GPU traces), `llmlab bench`
(workloads x the optimization ladder, against Hugging Face and the roofline) and `llmlab profile` (torch.profiler
over a few decode steps)."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

SEED_RANGE = (-2**63, 2**64 - 1)  # what a torch generator takes (llmlab.generate.SEED_RANGE)

# Argument types: each refuses a bad value while the arguments are parsed, before torch is imported or a model
# loaded. argparse prefixes the message with the flag ("argument --repeats: ...") and exits with status 2.


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give one such as 8") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give one such as 0.8") from None


def _positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number: give 1 or more")
    return value


def _seconds(text: str) -> float:
    value = _number(text)
    if not value >= 0:  # also catches NaN
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0: give e.g. 1")
    return value


def _positive_seconds(text: str) -> float:
    value = _number(text)
    if not value > 0 or value == float("inf"):  # also catches NaN
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds > 0: give e.g. 0.5")
    return value


def _temperature(text: str) -> float:
    value = _number(text)
    if not 0 <= value < float("inf"):  # also catches NaN
        raise argparse.ArgumentTypeError(f"{text} is not a temperature: give 0 for greedy decoding or a finite "
                                          f"positive number, e.g. 0.8")
    return value


def _top_p(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:  # also catches NaN
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1]: give e.g. 0.9, or leave it out to keep every "
                                          f"token")
    return value


def _seed(text: str) -> int:
    value = _whole_number(text)
    if not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{value} is outside the seeds a torch generator takes (-2**63 .. "
                                          f"2**64 - 1): give e.g. 0")
    return value


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the prompt {text!r} is empty or only whitespace: give some text to "
                                          f"continue, e.g. \"The list\"")
    return text


def _writable_folder(out: str) -> None:
    """Create the folder `out` and write a scratch file in it, so that a bad --out fails before any work is done.

    Raises:
        ValueError: `out` is a file, or the folder cannot be created or written to (the message says why).
    """
    from llmlab.checkpoint import make_writable_folder

    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the JSON files")
    make_writable_folder(path, f"--out {out}", "the JSON files")


DTYPE_HELP = "weights and activations (default: bf16 on CUDA, fp32 on CPU)"
DEVICE_HELP = "auto (cuda if present), cpu, cuda, cuda:1, ... (default: %(default)s)"


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (shipped in data/models/), a local Hugging Face folder, or a hub id "
                        "(default: %(default)s)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help=DTYPE_HELP)


def _subcommand(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand whose `--help` starts with the same line as its entry in `llmlab --help`."""
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmlab", description="Why LLM inference leaves a GPU idle — measured.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = _subcommand(sub, "generate", "continue a prompt with the default model (offline)")
    g.add_argument("prompt", type=_prompt, help="the text to continue; one that starts with - goes last, after --: "
                   "llmlab generate --max-new-tokens 8 -- \"-x\"")
    _model_args(g)
    g.add_argument("--max-new-tokens", type=_positive_int, default=64,
                   help="tokens to generate, at most (default: %(default)s)")
    g.add_argument("--temperature", type=_temperature, default=0.0,
                   help="0 = greedy; higher samples more freely (default: %(default)s)")
    g.add_argument("--top-k", type=_positive_int, default=None,
                   help="sample from the k most likely tokens only (default: all tokens)")
    g.add_argument("--top-p", type=_top_p, default=None,
                   help="sample from the most likely tokens that make up this probability, in (0, 1] (default: "
                        "all tokens)")
    g.add_argument("--seed", type=_seed, default=None, help="seed of the sampler (default: none, a different "
                                                             "sample each run)")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence every step (default: use the KV cache)")

    t = _subcommand(sub, "tour", "the main job: each setting's TTFT, TPOT and tokens/s on the default model")
    _model_args(t)
    t.add_argument("--prompt", type=_prompt, default="The list",
                   help="the text every setting continues (default: %(default)r)")
    t.add_argument("--max-new-tokens", type=_positive_int, default=128,
                   help="tokens generated per run, greedy, not stopping at EOS (default: %(default)s)")
    t.add_argument("--repeats", type=_positive_int, default=3,
                   help="timed runs per setting after one warm-up; the table shows their median "
                        "(default: %(default)s)")

    r = _subcommand(sub, "record", "on an NVIDIA GPU: record GPU-Util / SM activity / DRAM bandwidth traces of a "
                                   "decode into data/traces/ (replayed by the dashboard where there is no GPU)")
    r.add_argument("--model", default=None,
                   help="a checkpoint instead of a preset: 'default' (shipped), a local folder, or a hub id "
                        "(default: none, the --preset)")
    r.add_argument("--preset", default="llama-3.2-1b",
                   help="model shape with random bf16 weights (default: %(default)s)")
    r.add_argument("--setting", action="append", default=None, metavar="KEY=VALUE,...",
                   help="switch values of one recording, e.g. kv_cache=false,dtype=bf16; repeat for more "
                        "(default: KV cache on, and off, both bf16)")
    r.add_argument("--out-dir", default=None, help="folder for the traces (default: data/traces/)")
    r.add_argument("--duration", type=_positive_seconds, default=12.0,
                   help="seconds of decoding per setting (default: %(default)s)")
    r.add_argument("--prompt-tokens", type=_positive_int, default=128,
                   help="random prompt ids per call (default: %(default)s)")
    r.add_argument("--new-tokens", type=_positive_int, default=256,
                   help="new tokens per generate call (default: %(default)s)")
    r.add_argument("--idle", type=_seconds, default=1.0,
                   help="idle seconds sampled before and after (default: %(default)s)")
    r.add_argument("--interval", type=_positive_seconds, default=0.1,
                   help="sampler period, s (default: %(default)s = 10 Hz)")
    r.add_argument("--device", default="cuda", help="cuda or cuda:N (default: %(default)s)")
    r.add_argument("--no-profile", action="store_true",
                   help="skip the torch.profiler kernel timeline (default: record it)")

    b = _subcommand(sub, "bench", "workloads x the optimization ladder, with Hugging Face peers and the roofline; "
                                  "one JSON file per run into data/bench/")
    b.add_argument("--workload", default="chat",
                   help="chat, batch, long, a comma-separated list, or 'all' (default: %(default)s)")
    b.add_argument("--model", default="default",
                   help="'default' (shipped), a preset with random weights (e.g. llama-3.2-1b), or a model folder "
                        "(default: %(default)s)")
    b.add_argument("--steps", default="all", help="ladder steps, comma-separated, e.g. eager,+cuda_graphs (default: "
                                                  "all: every rung that can run here; the others are listed with "
                                                  "the reason)")
    b.add_argument("--peers", nargs="?", const="all", default=None, metavar="NAMES",
                   help="also run the peers: Hugging Face generate (eager, static cache, continuous batching) and "
                        "torchao's quantized layers beside the quantized rungs; alone: every one that applies, or "
                        "some of them, comma-separated, e.g. torchao_int8,torchao_int4 (default: none)")
    b.add_argument("--out", default=None, help="folder for the JSON files (default: data/bench/)")
    b.add_argument("--no-save", action="store_true", help="print the table only (default: save a JSON file)")
    b.add_argument("--quick", action="store_true",
                   help="few new tokens and one timed repeat (tests, CPU smoke runs; default: off)")
    b.add_argument("--repeats", type=_positive_int, default=None,
                   help="timed runs per row, median reported (default: 3)")
    b.add_argument("--time-budget", type=_seconds, default=None, metavar="S",
                   help="skip rows that would start after S seconds (per workload; S >= 0); the first row "
                        "always runs, however long it takes (default: no budget)")
    b.add_argument("--device", default="auto", help=DEVICE_HELP)
    b.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help=DTYPE_HELP)
    b.add_argument("--refresh-peaks", action="store_true",
                   help="measure the device's peak copy bandwidth and matmul rate again and rewrite their cache "
                        "file (~/.cache/llmlab/peaks.json, or $LLMLAB_PEAKS_CACHE), e.g. when they were measured "
                        "while the machine was busy; by default they are read from it (the 'peaks:' line says "
                        "which, with the file and the date measured)")

    pr = _subcommand(sub, "profile", "torch.profiler over a few decode steps: kernels and launches per token, GPU "
                                     "idle gaps, and a Chrome trace for https://ui.perfetto.dev")
    pr.add_argument("--model", default="default",
                    help="'default', a preset (random weights) or a model folder (default: %(default)s)")
    pr.add_argument("--setting", default="", metavar="KEY=VALUE,...",
                    help="switch values, e.g. cuda_graphs=true (default: the defaults)")
    pr.add_argument("--steps", type=_positive_int, default=8, help="decode steps to profile (default: %(default)s)")
    pr.add_argument("--prompt-tokens", type=_positive_int, default=128,
                    help="random prompt ids prefilled before the profiled steps (default: %(default)s)")
    pr.add_argument("--batch", type=_positive_int, default=1,
                    help="sequences decoded together (default: %(default)s)")
    pr.add_argument("--trace", default=None,
                    help="Chrome trace file to write, .json or .json.gz (default: none written)")
    pr.add_argument("--device", default="auto", help=DEVICE_HELP)
    pr.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help=DTYPE_HELP)
    return parser


def _bench(args) -> int:
    if args.no_save and args.out:
        raise ValueError("--no-save writes no file, so --out has nothing to name: drop one of them")
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if not steps:
        raise ValueError(f"--steps {args.steps!r} names no ladder step; give 'all' or comma-separated rungs "
                         f"(see llmlab/ladder.py, e.g. eager,+cuda_graphs)")
    from llmlab.measure.bench import DEFAULT_OUT, WORKLOADS, NothingToRun, load_bench_model, plan_steps, run_bench
    from llmlab.measure.peaks import measure_peaks

    names = list(WORKLOADS) if args.workload == "all" else [w.strip() for w in args.workload.split(",") if w.strip()]
    if not names:
        raise ValueError(f"--workload {args.workload!r} names no workload; give one or more of "
                         f"{', '.join(WORKLOADS)} (comma-separated) or 'all'")
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    if len(set(names)) < len(names):
        raise ValueError(f"--workload {args.workload!r} names a workload twice; give each once (a repeat would run "
                         f"and save it twice)")
    from llmlab.measure.peers import select_peers

    try:
        select_peers(args.peers)  # a misspelt peer, before the model loads
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    out = None if args.no_save else (args.out or DEFAULT_OUT)
    if out is not None:
        _writable_folder(out)  # before the model loads and the first row runs
    llm, model_id, _ = load_bench_model(args.model, device=args.device, dtype=args.dtype)
    try:
        # before the peaks are measured and any file is written
        plan_steps(llm, steps, args.peers, [WORKLOADS[n].n_requests for n in names])
    except NothingToRun as e:
        print(f"llmlab bench: {e}", file=sys.stderr)
        return 2
    peaks = measure_peaks(llm.device, refresh=args.refresh_peaks)  # once: every workload divides by the same
    ran = 0
    for name in names:
        try:
            run_bench(name, model_id, steps=steps, peers=args.peers, out=out, quick=args.quick,
                      repeats=args.repeats, time_budget_s=args.time_budget, llm=llm, measured_peaks=peaks)
            ran += 1
        except ValueError as e:
            if "does not fit" not in str(e):
                raise
            print(f"llmlab bench: skipped {name}: {e}", file=sys.stderr)
        print()
    return 0 if ran else 2


class _DeviceOnly:
    """Stands in for an `LLM` that is not loaded yet: it has a device and nothing else, so a switch's
    `available(llm)` that reads only `llm.device` answers, and one that needs the model raises AttributeError."""

    def __init__(self, device):
        self.device = device


def _setting_text(key: str, value) -> str:
    """How `--setting` spells a value: cuda_graphs=true, dtype=none, dtype=bf16."""
    text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}"


def _check_settings_for_device(settings: dict, device: str) -> None:
    """Refuse, before any model is built or loaded, a --setting that cannot run on `device` (the --device value).

    Each switch set away from its default is asked `available(...)` with a stand-in that has only the resolved
    device (`_DeviceOnly`): a switch that needs a CUDA GPU (`llmlab.switches.NEEDS_CUDA`), triton or a C++ compiler
    is refused here; a switch whose answer depends on the model itself (step tuning's fusable layers) is left to
    `apply_switches`, after the load. Then the rules `LLM.generate` keeps between switches (`check_fast_paths`,
    e.g. GPU sampling without the KV cache; `check_batching`, e.g. continuous batching without it) are checked for
    the same device, and a batching mode the profiler's per-token timing cannot run (`check_per_token_settings`).

    Raises:
        ValueError: an unknown --device, cuda asked for without a CUDA GPU (`llmlab.engine.pick_device`), or a
            setting not available here — the message names the setting as --setting spells it, why, and the fix.
    """
    import torch

    from llmlab.engine import check_fast_paths, pick_device
    from llmlab.switches import NEEDS_CUDA, SWITCHES, check_batching, check_per_token_settings

    dev = pick_device(device)
    probe = _DeviceOnly(dev)
    for key, value in settings.items():
        switch = SWITCHES[key]  # parse_setting has refused unknown names
        if value == switch.default:
            continue
        try:
            ok, why = switch.available(probe)
        except AttributeError:  # the answer needs the model: apply_switches asks again after the load
            continue
        if ok:
            continue
        fix = f"drop {_setting_text(key, value)} from --setting"
        if why == NEEDS_CUDA:
            if torch.cuda.is_available():
                fix += f" or run it on the GPU with --device cuda (the model would load on {dev.type})"
            else:
                fix += " or run on a machine with an NVIDIA GPU (PyTorch sees no CUDA device here)"
        raise ValueError(f"--setting {_setting_text(key, value)}: switch {switch.label!r} cannot run here: {why}; "
                         f"{fix}")
    values = {key: settings.get(key, switch.default) for key, switch in SWITCHES.items()}
    try:
        check_fast_paths(dev, use_cache=values.get("kv_cache", True), cuda_graphs=bool(values.get("cuda_graphs")),
                         torch_compile=bool(values.get("torch_compile")), gpu_sampling=bool(values.get("gpu_sampling")),
                         prefill_graphs=bool(values.get("prefill_graphs")))
        check_batching(values)
        check_per_token_settings(values, "llmlab profile")
    except ValueError as e:
        given = ",".join(_setting_text(key, value) for key, value in settings.items())
        raise ValueError(f"--setting {given}: {e}") from None


def _profile(args) -> int:
    from llmlab.measure.bench import load_bench_model
    from llmlab.measure.profiling import check_trace_path, format_summary, profile_decode
    from llmlab.telemetry.record import parse_setting

    trace = check_trace_path(args.trace) if args.trace else None  # before any model is loaded or step profiled
    settings = parse_setting(args.setting) if args.setting else {}
    if args.dtype is not None and settings.get("dtype") not in (None, args.dtype):
        raise ValueError(f"--dtype {args.dtype} and --setting dtype={settings['dtype']} disagree (the setting would "
                         f"win): give the dtype once")
    _check_settings_for_device(settings, args.device)  # a GPU-only setting on a CPU: refused before the load
    llm, _, _ = load_bench_model(args.model, device=args.device, dtype=args.dtype)
    s = profile_decode(llm, n_steps=args.steps, settings=settings, prompt_len=args.prompt_tokens,
                       batch=args.batch, trace_path=trace)
    print(format_summary(s))
    if s["trace_error"]:
        print(f"llmlab: error: {s['trace_error']}", file=sys.stderr)
        return 2
    return 0


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Show a warning as one line on stderr: on the command line the source line a Python warning quotes (the
    console script's `sys.exit(main())`) tells the user nothing. A warning llmlab does not raise (any kind but a
    UserWarning, or one from another installed package: a peer's library, a module compiled on import) also names
    its kind and file, which its message alone may not say."""
    parts = Path(str(filename)).parts
    foreign = not issubclass(category, UserWarning) or ("site-packages" in parts and "llmlab" not in parts)
    whose = f" ({category.__name__} from {'/'.join(parts[-2:])}:{lineno})" if foreign else ""
    print(f"llmlab: warning: {message}{whose}", file=sys.stderr if file is None else file)


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():  # restores the caller's showwarning afterwards (tests call main())
        warnings.showwarning = _warning_line
        try:
            return _main(argv)
        except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; 130 as a shell reports SIGINT
            command = (sys.argv[1:] if argv is None else argv)[:1]
            kept = " (the bench keeps the rows it finished in its JSON file, marked incomplete)"
            print(f"\nllmlab: interrupted{kept if command == ['bench'] else ''}", file=sys.stderr)
            return 130


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "record":
        from llmlab.telemetry.record import run_from_args

        return run_from_args(args)
    try:
        if args.command == "generate":
            from llmlab.engine import LLM
            from llmlab.generate import format_ms
            from llmlab.tour import device_line

            llm = LLM.load(args.model, device=args.device, dtype=args.dtype)
            if llm.tokenizer is None:
                raise ValueError(f"the model {llm.name!r} has no tokenizer.json, so the command line cannot turn the "
                                 f"prompt into token ids: put the model's tokenizer.json in its folder, or call "
                                 f"llmlab.load(...).generate(token_ids) from Python with a list of ints")
            if args.seed is not None and args.temperature == 0:
                warnings.warn("--seed has no effect with greedy decoding (temperature 0 draws nothing at random): "
                              "set --temperature > 0 (e.g. 0.8) to sample with it, or leave it out", UserWarning)
            g = llm.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache)
            print(args.prompt + g.text)
            eos = " | ended at EOS" if g.finish_reason == "eos" else ""
            n = f"{g.n_generated} token{'s' if g.n_generated != 1 else ''}"
            print(f"\n[{llm.name} | {device_line(llm)} | {n}{eos} | TTFT {g.ttft_ms:.1f} ms | "
                  f"TPOT {format_ms(g.tpot_ms, unit=' ms')} | {g.tokens_per_s:.1f} tokens/s]", file=sys.stderr)
        elif args.command == "tour":
            from llmlab.tour import run_tour

            run_tour(args.model, device=args.device, dtype=args.dtype, prompt=args.prompt,
                     max_new_tokens=args.max_new_tokens, repeats=args.repeats)
        elif args.command == "bench":
            return _bench(args)
        elif args.command == "profile":
            return _profile(args)
    except (ValueError, FileNotFoundError, KeyError, MemoryError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"llmlab: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
