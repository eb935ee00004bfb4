"""Lab 05 reference answers, the checks the notebook runs, and the compile counter its recompile section uses."""

from __future__ import annotations

import math
from typing import Callable

import torch


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


def check_crossover(fn) -> None:
    for args in ((300, 6.8, 4277, 2), (500, 5.0, 3350, 1), (150, 2.3, 24, 4)):
        want, got = crossover_params(*args), fn(*args)
        assert got is not None and math.isclose(got, want, rel_tol=1e-6), (
            f"crossover_params{args}: expected {want:.4g} parameters, got {got}")


def check_bucket(fn, lengths: list[int]) -> int:
    """The buckets must hold their input, waste at most half, and need few compiles. Returns the compile count."""
    for n in range(1, 300):
        b = fn(n)
        assert b >= n, f"bucket({n}) = {b} cannot hold {n} tokens"
        assert b <= max(2 * n, 16), f"bucket({n}) = {b} pads more than twice over"
    n_compiles, same = count_compiles(lengths, dynamic=False, pad=fn)
    assert same, "padding changed the outputs"
    assert n_compiles <= len({bucket(n) for n in lengths}), (
        f"{n_compiles} compiles for {len(lengths)} lengths: the buckets are too fine")
    return n_compiles
