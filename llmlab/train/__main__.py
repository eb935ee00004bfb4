"""Train the shipped default model: `python -m llmlab.train --out data/models/pydoc-llama --overwrite`.

The defaults are the shipped recipe (see `TrainConfig`); the recipe is meant for a CUDA GPU (on a CPU the time
budget stops it after a few hundred steps, far from converged). A folder that already holds a model (config.json,
*.safetensors) is never overwritten without `--overwrite`, so a trial run cannot silently replace the shipped
model. `--smoke` trains a tiny model on a slice of the corpus on the CPU in seconds, to test the pipeline end to
end.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from ..checkpoint import DEFAULT_MODEL_DIR
from ..cli import _positive_int  # a whole number >= 1: 0 or a negative count would train nothing
from .export import export
from .trainer import TrainConfig, prepare_data, resolve_device, train


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not (0 < value < float("inf")):  # also catches NaN
        raise argparse.ArgumentTypeError(f"{text} is not a finite number > 0")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m llmlab.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help=f"model folder to write (default {DEFAULT_MODEL_DIR}; with --smoke a temp folder)")
    p.add_argument("--overwrite", action="store_true",
                   help="allow replacing a model already in --out (needed to re-create the shipped default model)")
    p.add_argument("--smoke", action="store_true", help="tiny model, corpus slice, 30 CPU steps: a plumbing test")
    p.add_argument("--device", default=None, help="auto (default: cuda if available), cuda, cuda:1, cpu")
    p.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default: from --epochs)")
    p.add_argument("--epochs", type=_positive_float, default=None, help=f"passes over the train tokens (default {d.epochs})")
    p.add_argument("--time-budget-s", type=_positive_float, default=None,
                   help=f"stop the training loop after this many seconds (default {d.time_budget_s})")
    p.add_argument("--batch-size", type=_positive_int, default=None, help=f"windows per step (default {d.batch_size})")
    p.add_argument("--seq-len", type=_positive_int, default=None, help=f"tokens per window (default {d.seq_len})")
    p.add_argument("--lr", type=_positive_float, default=None, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--eval-every", type=_positive_int, default=None, help=f"steps between held-out evaluations "
                                                                 f"(default {d.eval_every})")
    p.add_argument("--patience", type=_positive_int, default=None, help=f"early-stopping patience in evaluations "
                                                               f"(default {d.patience})")
    p.add_argument("--seed", type=int, default=None, help=f"seed for init and batches (default {d.seed})")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    return p.parse_args(argv)


def check_out_folder(out: Path, overwrite: bool) -> None:
    """Refuse, before any training time is spent, to replace a model already in `out` unless `overwrite`.

    A model is a config.json or any *.safetensors file (one file or the shards of a hub checkpoint: writing a new
    config.json beside old shards would leave a folder that no longer loads).

    Raises:
        SystemExit: `out` holds a model and `overwrite` is False (the message says how to proceed); `out` is a file
            or cannot be created or written (checked with a probe file, removed again).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"python -m llmlab.train: error: --out {out} is a file; give a folder for the model")
    try:  # the folder must be creatable and writable before hours of training, not after
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".llmlab-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"python -m llmlab.train: error: cannot write the model to {out} ({e.strerror or e}); "
                         f"give a folder you can write to with --out") from None
    if overwrite or not ((out / "config.json").is_file() or any(out.glob("*.safetensors"))):
        return
    try:
        shipped = Path(out).resolve() == DEFAULT_MODEL_DIR.resolve()
    except OSError:
        shipped = False
    what = "the shipped default model that every lab loads" if shipped else "the model already there"
    raise SystemExit(
        f"python -m llmlab.train: error: {out} already holds a model (config.json / *.safetensors); training "
        f"would replace {what}. Write elsewhere with `--out <new folder>`, or pass `--overwrite` to replace it on "
        f"purpose (the shipped recipe is meant for a CUDA GPU)"
    )


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    overrides = {k: v for k, v in {
        "device": args.device, "steps": args.steps, "epochs": args.epochs, "time_budget_s": args.time_budget_s,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr, "eval_every": args.eval_every,
        "patience": args.patience, "seed": args.seed,
    }.items() if v is not None}
    if args.compile:
        overrides["compile"] = True
    cfg = TrainConfig.smoke(**overrides) if args.smoke else TrainConfig(**overrides)
    if cfg.seq_len > cfg.max_seq_len:
        raise SystemExit(f"python -m llmlab.train: error: --seq-len {cfg.seq_len} exceeds the model's context length "
                         f"{cfg.max_seq_len}; use --seq-len {cfg.max_seq_len} or less")
    out = args.out
    if out is None:
        import tempfile

        out = Path(tempfile.gettempdir()) / "pydoc-llama-smoke" if args.smoke else DEFAULT_MODEL_DIR
    if args.out is not None or not args.smoke:  # the smoke run's own temp folder is scratch space
        check_out_folder(out, args.overwrite)
    try:
        resolve_device(cfg.device)  # a bad --device fails here, not after the corpus is built
    except ValueError as e:
        raise SystemExit(f"python -m llmlab.train: error: --device: {e}") from None
    command = "python -m llmlab.train " + shlex.join(argv)

    threads = torch.get_num_threads()
    if args.smoke and resolve_device(cfg.device).type == "cpu":
        torch.set_num_threads(1)  # the smoke model's matrices are tiny: thread wake-ups cost more than they save
    try:
        t0 = time.perf_counter()
        data = prepare_data(cfg)
        res = train(cfg, data)
        facts = export(out, cfg, data, res, command.strip(), t_start=t0)
    finally:
        torch.set_num_threads(threads)
    total = time.perf_counter() - t0
    print(f"wrote {out} in {total:.1f} s total")
    return facts


if __name__ == "__main__":
    main()
