"""Lab 05 reference answers (the launch-bound / bandwidth-bound crossover, buckets of prompt lengths), the checks the
notebook runs on the student's versions (naming the common mistakes), and the compile counter its recompile section
uses."""

from __future__ import annotations

import numbers
from typing import Callable

import torch

from llmlab.solutions.lab00 import call_answer, check_cases, close


def crossover_params(launches_per_token: float, us_per_launch: float, bandwidth_gb_s: float,
                     bytes_per_param: float = 2) -> float:
    """The model size (parameters) at which reading the weights once takes as long as launching a token's kernels.

    launch time per token = launches x us_per_launch x 1e-6 s; weight-read time = params x bytes_per_param /
    (bandwidth_gb_s x 1e9). Equal when params = launch time x bandwidth / bytes_per_param. Models smaller than
    this are launch-bound in eager mode (the GPU waits for the host); larger ones are bandwidth-bound.
    """
    launch_s = launches_per_token * us_per_launch * 1e-6
    return launch_s * bandwidth_gb_s * 1e9 / bytes_per_param


def bucket(n: int, smallest: int = 8) -> int:
    """The padded length for a sequence of n tokens: the next power of two >= max(n, smallest)."""
    n = max(int(n), smallest)
    return 1 << (n - 1).bit_length()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dimension (row by row: padding rows does not change the other rows)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def count_compiles(lengths: list[int], dynamic: bool | None = False, pad: Callable[[int], int] | None = None,
                   width: int = 64) -> tuple[int, bool]:
    """Call a torch.compile'd RMSNorm on (length, width) inputs, one per length, and count the graphs compiled.

    A counting backend (a documented custom-backend hook: it records the graph and runs it unchanged) stands in
    for Inductor, so counting costs no code generation. pad(n) -> the length to pad each input to (then the
    output is sliced back). Returns (graphs compiled, every output equal to the uncompiled function's).
    """
    compiled = 0

    def counting_backend(gm, example_inputs):
        nonlocal compiled
        compiled += 1
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(rms_norm, backend=counting_backend, dynamic=dynamic)
    weight = torch.linspace(0.5, 1.5, width)
    gen = torch.Generator().manual_seed(0)
    same = True
    for n in lengths:
        x = torch.randn(n, width, generator=gen)
        if pad is not None:
            m = pad(n)
            if m < n:
                raise ValueError(f"pad({n}) = {m} is shorter than the input")
            x_in = torch.cat([x, x.new_zeros(m - n, width)])
            y = fn(x_in, weight)[:n]
        else:
            y = fn(x, weight)
        same &= torch.allclose(y, rms_norm(x, weight), atol=1e-6)
    torch._dynamo.reset()
    return compiled, bool(same)


# -- checks -------------------------------------------------------------------------------------------------------

# (the reference with one mistake, what it misses), tried in order when an answer differs from the reference
_CROSSOVER_MISTAKES: tuple[tuple[Callable[..., float], str], ...] = (
    (lambda n, us, bw, bpp: n * us * bw * 1e9 / bpp,
     "us_per_launch is in microseconds: multiply by 1e-6 to get seconds"),
    (lambda n, us, bw, bpp: n * us * 1e-3 * bw * 1e9 / bpp,
     "a microsecond is 1e-6 s (1e-3 s is a millisecond)"),
    (lambda n, us, bw, bpp: n * us * 1e-6 * bw / bpp,
     "bandwidth_gb_s is in GB/s: multiply by 1e9 to get bytes per second"),
    (lambda n, us, bw, bpp: n * us * 1e-6 * bw * 2 ** 30 / bpp,
     "GB/s means 1e9 bytes per second, not 2**30"),
    (lambda n, us, bw, bpp: n * us * 1e-6 * bw * 1e9 * bpp,
     "the bytes the launch time could read are params x bytes_per_param, so params = bytes / bytes_per_param "
     "(divide, do not multiply)"),
    (lambda n, us, bw, bpp: n * us * 1e-6 * bw * 1e9 / 2,
     "use the bytes_per_param argument, not a fixed 2"),
    (lambda n, us, bw, bpp: n * us * 1e-6 * bw * 1e9,
     "that is bytes: divide by bytes_per_param to get parameters"),
    (lambda n, us, bw, bpp: us * 1e-6 * bw * 1e9 / bpp,
     "the host pays for EVERY launch of a token: launch time per token = launches_per_token x us_per_launch"),
)


def check_crossover(fn) -> None:
    """Compare `fn(launches_per_token, us_per_launch, bandwidth_gb_s, bytes_per_param)` with the reference on an H200-
    like, an A100-like and a laptop-CPU-like case (bytes per parameter 2, 1, 4), to a relative 1e-6.

    Raises:
        AssertionError: the first case that disagrees and, where the answer matches a common mistake (µs or GB/s
            not converted, GiB for GB, bytes per parameter multiplied or ignored, one launch instead of all), what
            it misses. A stub still raising NotImplementedError is reported as not written.
    """
    def describe(case, want, got):
        what = f"crossover_params{case}: expected {want:.4g} parameters, got {got!r}"
        return what if isinstance(got, numbers.Real) else f"{what}; return the number of parameters"

    check_cases("crossover_params", fn, [(300, 6.8, 4277, 2), (500, 5.0, 3350, 1), (150, 2.3, 24, 4)],
                crossover_params, _CROSSOVER_MISTAKES, describe, close,
                otherwise="equal times: launches x us_per_launch x 1e-6 s = params x bytes_per_param / "
                          "(bandwidth_gb_s x 1e9 bytes/s); solve for params")


def check_bucket(fn, lengths: list[int]) -> int:
    """Check `fn(n) -> padded length`: an int >= n, at most twice n (or 16 for short inputs) for every n in 1..299,
    and few sizes: over 1..299 and over `lengths` no more distinct sizes than the next powers of two give, and no more
    graphs compiled (`count_compiles` with dynamic=False) than that, with unchanged outputs.

    Returns the number of graphs compiled for `lengths`.

    Raises:
        AssertionError: the first rule broken, with the length and the fix (a bucket shorter than its input, one
            more than twice too long, too many distinct sizes). A stub still raising NotImplementedError is reported
            as not written.
    """
    span = range(1, 300)
    every = set()
    for n in span:
        b = call_answer(fn, "bucket", n)
        assert isinstance(b, numbers.Integral) and not isinstance(b, bool), (
            f"bucket({n}) returned {b!r} ({type(b).__name__}): return a whole number of tokens (an int; "
            f"math.ceil and // give ints, 2 ** x with a float x does not)")
        every.add(b)
        assert b >= n, (f"bucket({n}) = {b} cannot hold {n} tokens: round UP (the next bucket at or above n), never "
                        f"down")
        assert b <= max(2 * n, 16), (f"bucket({n}) = {b} pads {n} tokens to more than twice their length: the "
                                     f"padding is wasted compute; make the sizes grow with n (e.g. each bucket "
                                     f"twice the one before)")
    geometric = len({bucket(n, smallest=1) for n in span})  # the next power of two, with no smallest bucket
    assert len(every) <= geometric, (
        f"the lengths 1..{span[-1]} are padded to {len(every)} different sizes: a compiled graph per size; the "
        f"buckets are too fine. Sizes that grow geometrically (each twice the one before) cover them with "
        f"{geometric} and still pad at most twice; sizes a fixed step apart grow in number with the longest input")
    allowed = len({bucket(n, smallest=1) for n in lengths})
    best = len({bucket(n) for n in lengths})
    sizes = sorted({fn(n) for n in lengths})
    assert len(sizes) <= allowed, (
        f"the {len(lengths)} lengths {lengths} are padded to {len(sizes)} different sizes {sizes}: a compiled graph "
        f"per size, {len(sizes)} compiles; the buckets are too fine. Sizes that grow geometrically (the next power "
        f"of two) cover these lengths with {allowed} sizes ({best} with a smallest bucket of 8), and still pad at "
        f"most twice")
    n_compiles, same = count_compiles(lengths, dynamic=False, pad=fn)
    assert same, "padding changed the outputs"
    assert n_compiles <= allowed, f"{n_compiles} compiles for {len(lengths)} lengths: the buckets are too fine"
    return n_compiles
