"""Shared checks for the Triton kernels: where they may run, and the errors a wrapper raises before launching.

A Triton kernel runs on a CUDA GPU, or — for tests and for machines without a GPU — in Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is imported), which runs each program as numpy on CPU tensors. The
interpreter has no bf16 arithmetic, so on a CPU the kernels accept fp32 (and fp16 where numpy can do it).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import sys

import numpy as np
import torch

INTERPRET_TOO_LATE = ("TRITON_INTERPRET must be set before triton is imported: triton was imported in this process "
                      "while it was off, so its kernels were built for a GPU; restart the kernel/process and set "
                      "TRITON_INTERPRET=1 first (in a notebook: os.environ['TRITON_INTERPRET'] = '1' in the first "
                      "cell, before importing triton or llmlab.kernels' ops)")


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_imported_without_interpreter() -> bool:
    """True when triton is already imported in this process and was imported while TRITON_INTERPRET was off.

    Triton reads TRITON_INTERPRET when it decorates a `@triton.jit` function (its own helpers in triton.language at
    `import triton`, this package's kernels at their import). Set later, the kernels stay GPU kernels, and a launch
    on CPU tensors fails inside triton ("0 active drivers", "Cannot call @triton.jit'd outside of the scope of a
    kernel"). Checked on triton's own state: `triton.language.cdiv` is a `JITFunction` then (an
    `InterpretedFunction` under the interpreter). False when triton is not imported yet or the check does not apply.
    """
    tl = sys.modules.get("triton.language")
    jit = sys.modules.get("triton.runtime.jit")
    if tl is None or jit is None:
        return False
    return isinstance(getattr(tl, "cdiv", None), getattr(jit, "JITFunction", ()))


def autotune_configs(configs: list, default) -> list:
    """The configs a `triton.autotune` decorator should try: all of them on a GPU, only `default` in the
    interpreter (which would run every config, slowly) or when LLMLAB_TRITON_AUTOTUNE=0 (set before importing the
    kernels; the GPU test run uses it: autotuning every shape a test tries costs one compilation per config).
    The kernel benchmark (`bench_kernels`) keeps autotuning on and checks each tuned kernel against its reference."""
    if interpret_mode() or os.environ.get("LLMLAB_TRITON_AUTOTUNE", "1") == "0":
        return [default]
    return configs


def triton_status() -> tuple[bool, str]:
    """(True, "") if Triton kernels can run here (CUDA + triton, or the interpreter); else (False, the reason)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - triton ships with Linux torch
        return False, f"triton is not installed ({e}); pip install triton (Linux only)"
    if interpret_mode() and not triton_imported_without_interpreter():
        return True, ""
    if not torch.cuda.is_available():
        if interpret_mode():
            return False, INTERPRET_TOO_LATE
        return False, "Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 for the slow CPU interpreter)"
    return True, ""


def check_tensors(op: str, dtypes: tuple[torch.dtype, ...], **tensors: torch.Tensor) -> torch.device:
    """Raise a clear error unless every tensor is on one device where Triton can run and has an allowed dtype.

    Raises:
        TypeError: an argument that is not a tensor; a tensor's dtype is not in `dtypes`, or the tensors' dtypes
            differ. ValueError (also): a meta tensor.
        ValueError: tensors on different devices; a CPU tensor without the interpreter, or with TRITON_INTERPRET set
            only after triton was imported (`INTERPRET_TOO_LATE`); bf16 in the interpreter.
    """
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}; convert it with "
                            f"torch.as_tensor(...)")
        if t.is_meta:
            raise ValueError(f"{op}: {name} is a meta tensor (a shape without data); pass a tensor on a CUDA GPU "
                             f"(or the CPU with TRITON_INTERPRET=1)")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got " +
                         ", ".join(f"{n} on {t.device}" for n, t in tensors.items()))
    device = devices.pop()
    for name, t in tensors.items():
        if t.dtype not in dtypes:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
    if device.type != "cuda":
        if not interpret_mode():
            raise ValueError(f"{op}: tensors are on {device}; Triton kernels run on a CUDA GPU "
                             f"(or set TRITON_INTERPRET=1 before importing triton to run them on a CPU, slowly)")
        if triton_imported_without_interpreter():
            raise ValueError(f"{op}: {INTERPRET_TOO_LATE}")
        if any(t.dtype == torch.bfloat16 for t in tensors.values()):
            raise TypeError(f"{op}: the Triton interpreter (CPU) has no bf16 arithmetic; use fp32 on a CPU")
    return device


# Programmatic dependent launch (PDL, Hopper and later; https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html
# #programmatic-dependent-launch-and-synchronization): a kernel launched with `launch_pdl=True` may start while the
# kernel before it is still finishing, once every program of that one has run `gdc_launch_dependents()`. Its
# programs then sit on the SMs as the previous kernel drains, do what depends on nothing before (load weights), and
# wait in `gdc_wait()` until the previous kernel has completed and its writes are visible. The gap between two
# kernels — launch, fill, drain, a few microseconds each, a hundred times per decode step of a 1B model — mostly
# overlaps.
# The rule every PDL kernel here follows: read nothing but constant weights, and write nothing, before `gdc_wait()`.
PDL_ENV = "LLMLAB_PDL"  # "0" switches it off (to measure with and without)


@functools.lru_cache(maxsize=None)
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9  # griddepcontrol: sm_90 and later


def pdl_supported(device: torch.device) -> bool:
    """True where PDL can run: a CUDA device of compute capability >= 9.0, not the interpreter."""
    if device.type != "cuda" or interpret_mode():
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 elsewhere (the interpreter, where it only sizes grids and steers config choices)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pdl_enabled(device: torch.device) -> bool:
    """True where the kernels launch with PDL: `pdl_supported` and LLMLAB_PDL is not "0" (read at each call)."""
    return os.environ.get(PDL_ENV, "1") != "0" and pdl_supported(device)


def pdl_kwargs(device: torch.device) -> dict:
    """A PDL-aware kernel's `PDL` meta-parameter and the `launch_pdl` launch option, for a launch on `device`."""
    on = pdl_enabled(device)
    return {"PDL": on, **({"launch_pdl": True} if on else {})}


@contextlib.contextmanager
def zero_on_error(counters: torch.Tensor):
    """Around a launch of a kernel whose programs count themselves done on `counters` (the split-K GEMVs, decode
    attention's fused merge; each launch's last program zeroes them): if the launch stops part-way — an error or a
    Ctrl-C / notebook interrupt in the CPU interpreter, which runs the programs one after another — some counters
    would keep their counts and the next launch would merge too early. Zero them, then re-raise."""
    try:
        yield
    except BaseException:
        counters.zero_()
        raise


_FLUSH_BYTES = 256 << 20  # read between timed launches: several times the L2 (50 MB on an H200)
_QUEUE_CYCLES = 200_000  # GPU clock cycles to spin before each timed launch (see `tune_bench`)
_flush_buffers: dict = {}


def tune_bench(kernel_call, quantiles, reps: int = 30):
    """How the GEMVs' and decode attention's autotuners time a config (`do_bench=tune_bench`): each launch after
    READING a 256 MB buffer, so the weights come from HBM and the L2 holds clean lines — as in a decode step, where
    the layer before streamed its own weights.
    Triton's default (`triton.testing.do_bench`) clears the L2 by WRITING 256 MB first: the launch then also pays
    for writing those dirty lines back, and it picks configs that are slower under CUDA-graph replay than the best
    ones (docs/results.md). Returns the `quantiles` of the times (ms), as do_bench does."""
    device = torch.cuda.current_device()
    if device not in _flush_buffers:
        _flush_buffers[device] = torch.ones(_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    flush = _flush_buffers[device]
    kernel_call()  # compile and warm up
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.sum()
        # keep the GPU busy (~0.1 ms) while the host queues the launch(es): a config whose call is two launches
        # (decode attention's split + merge, the merge queued from the autotuner's post_hook) is then timed
        # without the host's launch gap between them, as in a CUDA graph — otherwise one-launch configs win
        # unfairly, and the pick can be one that is slower under graph replay (docs/results.md)
        torch.cuda._sleep(_QUEUE_CYCLES)
        start.record()
        kernel_call()
        end.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)])
    return [float(torch.quantile(times, q)) for q in quantiles]


def check_eps(op: str, eps) -> float:
    """`eps` as a float if it is a finite number >= 0 (RMSNorm's epsilon); else TypeError (a string, a bool) or
    ValueError (negative, NaN, inf), naming the argument."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a number (RMSNorm's epsilon, e.g. 1e-5), got {eps!r}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0 (e.g. 1e-5), got {eps!r}")
    return float(eps)


def check_flag(op: str, name: str, value) -> bool:
    """`value` if it is a bool (numpy's too); else a TypeError naming the argument — a string like "no" would
    otherwise count as True."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{op}: {name} must be True or False, got {value!r}")


def demo_needs_cuda(module: str) -> None:
    """The first line of a kernel file's `__main__` benchmark: a clear exit where there is no CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{module}: this benchmark times the kernel on a CUDA GPU, and there is none here. On a "
                         f"CPU: TRITON_INTERPRET=1 python -m llmlab.kernels.bench_kernels --smoke")
