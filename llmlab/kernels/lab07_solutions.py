"""Reference answers and checks for labs/07_triton_kernels.ipynb (kept beside the kernels they teach).

Exercise 1: the body of a fused RMSNorm kernel (one program per row). Exercise 2: the bytes an RMSNorm must move
and the GB/s that follows from a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rmsnorm import rmsnorm_reference


@triton.jit
def rmsnorm_row(x_ptr, w_ptr, y_ptr, D, eps, stride_x, stride_y, row, cols, mask):
    """Exercise 1's answer: normalize row `row` (cols = tl.arange(0, BLOCK_D), mask = cols < D)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # masked lanes read as 0: they add nothing
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / D + eps)  # the sum of squares in fp32
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x32 * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)  # masked lanes: not written


def check_rmsnorm(fn, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Check `fn(x, weight, eps) -> y` against the PyTorch reference on awkward sizes, with a poisoned neighbour,
    and on fp16 rows around +-1000 (whose squares overflow fp16 unless summed in fp32).

    Raises AssertionError saying which size failed and how.
    """
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for D in (1, 7, 17, 999, 1001):
        g = torch.Generator().manual_seed(D)
        buf = torch.full((3, D + 5), 1e30)  # each row is followed by 5 huge values that must not leak in
        buf[:, :D] = torch.randn(3, D, generator=g)
        x = buf.to(device, dtype)[:, :D]
        w = torch.randn(D, generator=g).to(device, dtype)
        y = fn(x, w, 1e-5)
        assert y.shape == x.shape and y.dtype == x.dtype, f"D={D}: got {tuple(y.shape)} {y.dtype}"
        assert torch.isfinite(y).all(), f"D={D}: non-finite outputs (did a masked lane leak into the sum?)"
        torch.testing.assert_close(y, rmsnorm_reference(x, w, 1e-5), **tol, msg=lambda m: f"D={D}: {m}")
    # fp16 rows around +-1000: their squares (~1e6) overflow fp16 (max 65504) unless summed in fp32
    g = torch.Generator().manual_seed(0)
    x = (1000 * torch.randn(2, 17, generator=g).sign()).to(device, torch.float16)
    w = torch.ones(17, device=device, dtype=torch.float16)
    y = fn(x, w, 1e-5)
    want = rmsnorm_reference(x.float(), w.float(), 1e-5).to(torch.float16)
    assert torch.isfinite(y).all() and torch.allclose(y.float(), want.float(), atol=2e-2, rtol=2e-2), (
        f"fp16 rows of +-1000: got {y[0, :4].tolist()}..., expected {want[0, :4].tolist()}... (sum the squares "
        f"in fp32: x.to(tl.float32) before squaring)")
    print("Exercise 1: correct")


def rmsnorm_bytes(rows: int, D: int, elem_bytes: int) -> int:
    """Exercise 2's answer: the bytes a fused RMSNorm must move: read x, write y, read the weight once."""
    return 2 * rows * D * elem_bytes + D * elem_bytes


def check_rmsnorm_bytes(fn) -> None:
    for rows, D, e in ((1, 4096, 2), (4096, 4096, 2), (7, 999, 4)):
        got, want = fn(rows, D, e), rmsnorm_bytes(rows, D, e)
        assert got == want, f"rmsnorm_bytes({rows}, {D}, {e}) = {got}, expected {want} (x read, y written, w read)"
    print("Exercise 2: correct")
