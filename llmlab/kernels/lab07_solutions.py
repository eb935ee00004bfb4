"""Reference answer and checks for labs/07_triton_kernels.ipynb (kept beside the kernels they teach).

Exercise 1: the body of a fused RMSNorm kernel (one program per row), checked through the student's wrapper
`fn(x, weight, eps) -> y` against `rmsnorm.rmsnorm_reference`. Exercise 2: the bytes an RMSNorm must move, from
which a time gives GB/s. The checks name the common mistakes; a kernel or function still holding the student copy's
`raise NotImplementedError(...)` stub is reported as not written, whether it ran in Triton's interpreter (the error
comes back wrapped) or went to the compiler (which refuses a `raise` statement).
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from llmlab.solutions.lab00 import check_cases

from .rmsnorm import rmsnorm_reference

__all__ = ["check_rmsnorm", "rmsnorm_bytes", "check_rmsnorm_bytes"]

_FIX = "replace the `raise NotImplementedError(...)` line in its cell with your answer"


def _stub_message(error: BaseException) -> str | None:
    """What to say when `error` comes from a stub still raising NotImplementedError, else None.

    Looks through the chain of causes (Triton's interpreter wraps the kernel's exception in an InterpreterError)
    and at the text of a compile error (the compiler rejects the `raise` statement and quotes the source)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            tb = seen.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = tb.tb_frame.f_code.co_name if tb is not None else "the function"
            return f"{where} is not written yet: {_FIX}"
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    if "NotImplementedError" in text:
        kernel = re.search(r"def (\w+)\(", text)
        return f"{kernel.group(1) if kernel else 'the kernel'} is not written yet: {_FIX}"
    return None


def _call(fn: Callable, *args):
    try:
        return fn(*args)
    except Exception as e:  # a stub's error (possibly wrapped) becomes a message; anything else goes on as it is
        message = _stub_message(e)
        if message is None:
            raise
        raise AssertionError(message) from e


def _mistakes(x: torch.Tensor, w: torch.Tensor, eps: float) -> list[tuple[torch.Tensor, str]]:
    """(the output of RMSNorm with one common mistake, the lesson), for the rows `x` and weight `w`."""
    x32, w32 = x.float().cpu(), w.float().cpu()
    D = x.shape[-1]
    block = 1 << (D - 1).bit_length()  # BLOCK_D: the next power of two >= D
    squares = (x32 * x32).sum(-1, keepdim=True)

    def out(mean_square, sqrt=True, weight=True):
        scale = 1 / torch.sqrt(mean_square + eps) if sqrt else 1 / (mean_square + eps)
        return x32 * scale * (w32 if weight else 1)

    return [(out(squares / block), "you divided the sum of squares by BLOCK_D: the lanes past D are padding (masked "
                                   "loads read them as 0); the mean is over the D real values, divide by D"),
            (out(squares), "you used the sum of squares: RMSNorm divides by the root of the MEAN square, sum / D"),
            (out(squares / D, sqrt=False), "rstd = 1 / sqrt(mean square + eps): take the square root"),
            (out(squares / D, weight=False), "multiply by the weight (loaded at w_ptr + cols, with the same mask)")]


def _unmasked_load(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tol: dict) -> bool:
    """Do the rows of contiguous `x` but its last match RMSNorm with x loaded over all BLOCK_D lanes, unmasked (the
    lanes past D reading the values that follow the row)? The last row's extra lanes read past the tensor: unknown."""
    R, D = x.shape
    block = 1 << (D - 1).bit_length()
    if R < 2 or block == D or not x.is_contiguous():
        return False
    flat = x.float().cpu().flatten()
    rows = torch.stack([flat[r * D:r * D + block] for r in range(R - 1)])  # (R - 1, BLOCK_D): what the lanes read
    rstd = 1 / torch.sqrt((rows * rows).sum(-1, keepdim=True) / D + 1e-5)
    wrong = (x[:-1].float().cpu() * rstd).to(x.dtype).float() * w.float().cpu()
    return torch.allclose(y[:-1].float().cpu(), wrong, **tol)


def _compare(what: str, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tol: dict) -> None:
    assert tuple(y.shape) == tuple(x.shape) and y.dtype == x.dtype, (
        f"{what}: got {tuple(y.shape)} {y.dtype}, expected {tuple(x.shape)} {x.dtype} (store in y's dtype: "
        f"y.to(y_ptr.dtype.element_ty))")
    want = rmsnorm_reference(x, w, 1e-5)
    if torch.isfinite(y).all() and torch.allclose(y.float(), want.float(), **tol):
        return
    for wrong, lesson in _mistakes(x, w, 1e-5):
        if torch.allclose(y.float().cpu(), wrong.to(x.dtype).float(), **tol):
            raise AssertionError(f"{what}: {lesson}")
    if _unmasked_load(y, x, w, tol):
        raise AssertionError(f"{what}: the lanes past D were loaded without a mask, so each row's sum of squares took "
                             f"in the values after it (the next row's): load x with mask=cols < D and other=0.0")
    if not torch.isfinite(y).all():
        raise AssertionError(f"{what}: non-finite outputs (did a masked lane or a wrong row offset read past the row?)")
    bad = (y.float() - want.float()).abs().flatten().argmax().item()
    raise AssertionError(f"{what}: y[{bad // x.shape[-1]}, {bad % x.shape[-1]}] = {y.flatten()[bad].item():.6g}, "
                         f"expected {want.flatten()[bad].item():.6g}")


def check_rmsnorm(fn: Callable, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Check `fn(x, weight, eps) -> y` against the PyTorch reference: a row of zeros (finite only with eps), then
    for D in 1, 7, 17, 999, 1001 contiguous rows and rows that are views with 5 huge values (1e30) after each
    (stride_x = D + 5: a wrong row offset or an unmasked lane reads them), then fp16 rows around +-1000 (whose
    squares overflow fp16 unless summed in fp32). Prints "Exercise 1: correct" when every case passes.

    Raises:
        AssertionError: the first case that fails and why (the mean over BLOCK_D lanes, a sum for a mean, no square
            root, no weight, no eps, x loaded without its mask, rows read at the wrong stride, squares in fp16), or
            that the kernel is still the stub.
    """
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    g = torch.Generator().manual_seed(7)
    x = torch.zeros(2, 7).to(device, dtype)
    w = torch.randn(7, generator=g).to(device, dtype)
    y = _call(fn, x, w, 1e-5)
    assert torch.isfinite(y).all(), (
        "a row of zeros gave non-finite outputs: its mean square is 0 and 1 / sqrt(0) is inf; add eps inside the "
        "square root: rstd = 1 / sqrt(sum / D + eps)")
    for D in (1, 7, 17, 999, 1001):
        g = torch.Generator().manual_seed(D)
        buf = torch.full((3, D + 5), 1e30)  # each row is followed by 5 huge values that must not leak in
        buf[:, :D] = torch.randn(3, D, generator=g)
        w = torch.randn(D, generator=g).to(device, dtype)
        x = buf[:, :D].contiguous().to(device, dtype)
        _compare(f"D={D}, contiguous rows", _call(fn, x, w, 1e-5), x, w, tol)
        x = buf.to(device, dtype)[:, :D]
        y = _call(fn, x, w, 1e-5)
        try:
            _compare(f"D={D}, rows {D + 5} elements apart", y, x, w, tol)
        except AssertionError as e:
            raise AssertionError(
                f"{e}. The same rows stored contiguously passed: a row starts stride_x elements after the one before "
                f"(x may be a view with padding between rows): load at x_ptr + row * stride_x + cols, store at "
                f"y_ptr + row * stride_y + cols") from None
    # fp16 rows around +-1000: their squares (~1e6) overflow fp16 (max 65504) unless summed in fp32
    g = torch.Generator().manual_seed(0)
    x = (1000 * torch.randn(2, 17, generator=g).sign()).to(device, torch.float16)
    w = torch.ones(17, device=device, dtype=torch.float16)
    y = _call(fn, x, w, 1e-5)
    want = rmsnorm_reference(x.float(), w.float(), 1e-5).to(torch.float16)
    assert torch.isfinite(y).all() and torch.allclose(y.float(), want.float(), atol=2e-2, rtol=2e-2), (
        f"fp16 rows of +-1000: got {y[0, :4].tolist()}..., expected {want[0, :4].tolist()}... (sum the squares "
        f"in fp32: x.to(tl.float32) before squaring)")
    print("Exercise 1: correct")


def rmsnorm_bytes(rows: int, D: int, elem_bytes: int) -> int:
    """Exercise 2's answer: the bytes a fused RMSNorm must move: read x, write y, read the weight once."""
    return 2 * rows * D * elem_bytes + D * elem_bytes


# (the reference with one mistake, the lesson), tried in order when an answer differs from the reference
_BYTES_MISTAKES: tuple[tuple[Callable[[int, int, int], int], str], ...] = (
    (lambda r, D, e: r * D * e + D * e,
     "the kernel also WRITES y, as many bytes as it reads of x: 2 x rows x D x elem_bytes, plus the weight"),
    (lambda r, D, e: 2 * r * D * e,
     "add the weight: D x elem_bytes, read once (it stays in cache for the other rows)"),
    (lambda r, D, e: 3 * r * D * e,
     "the weight is read ONCE (D x elem_bytes), not once per row: it stays in cache for the other rows"),
    (lambda r, D, e: 2 * r * D + D,
     "multiply by elem_bytes: the count is in bytes, not elements"),
)


def check_rmsnorm_bytes(fn: Callable[[int, int, int], int]) -> None:
    """Compare `fn(rows, D, elem_bytes)` with the reference on one row, a square bf16 matrix and an odd fp32 shape.
    Prints "Exercise 2: correct" when all agree.

    Raises:
        AssertionError: the first case that disagrees and, where the answer matches a common mistake (y not
            written, the weight left out or read per row, elements for bytes), the lesson. A stub still raising
            NotImplementedError is reported as not written.
    """
    check_cases("rmsnorm_bytes", fn, [(1, 4096, 2), (4096, 4096, 2), (7, 999, 4)], rmsnorm_bytes, _BYTES_MISTAKES,
                lambda case, want, got: f"rmsnorm_bytes{case} = {got!r}, expected {want}",
                otherwise="x read, y written (rows x D x elem_bytes each), w read once (D x elem_bytes)")
    print("Exercise 2: correct")
