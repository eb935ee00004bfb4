"""RMSNorm, optionally fused with the residual add that precedes it, as one Triton kernel.

    y = x / sqrt(mean(x^2) + eps) * weight            (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467)
    fused:  h = x + residual;  y = rmsnorm(h)          (returns y and h, as vLLM's `fused_add_rms_norm`)

One program normalizes one row of D elements: it reads the row once, reduces it in fp32 in registers, and writes
it once. PyTorch's eager version runs ~7 operators (float, pow, mean, rsqrt, mul, cast, mul), most of them a kernel that
reads and writes the row again. The sum of squares is taken in fp32, so fp16 rows around +-1000 (squares ~1e6, beyond fp16's
65504) stay finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_eps, check_tensors, demo_needs_cuda

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                      residual: torch.Tensor | None = None):
    """PyTorch reference, the same math as `llmlab.model.RMSNorm` (normalize in fp32, cast, times weight).

    Bytes: eager PyTorch moves each row ~8 times (x -> fp32 copy, its square, the mean, the product, the cast,
    the weight product: each a full read + write). The fused kernel moves 2 x rows x D x elem plus the weight's D x elem once
    (+2 x rows x D x elem with the residual: read it, write the sum). Returns y, or (y, h) when `residual` is given.
    """
    h = x if residual is None else x + residual
    h32 = h.float()
    y = weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y if residual is None else (y, h)


@triton.jit
def _rmsnorm_kernel(
    # pointers
    x_ptr, res_ptr, w_ptr, y_ptr, h_ptr,
    # sizes
    D, eps,
    # strides (elements)
    stride_x, stride_res, stride_y, stride_h,
    # meta-parameters
    BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum rounded to the input dtype, as PyTorch
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / D  # masked lanes loaded as 0: they add nothing
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (x32 * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, residual: torch.Tensor | None = None):
    """Triton RMSNorm over the last dimension.

    Args:
        x: (..., D) fp32 / fp16 / bf16 (fp32 only in the CPU interpreter); any strides (a last dimension that is
            not contiguous is copied first).
        weight: (D,) same dtype as x.
        eps: added to mean(x^2); a finite number >= 0.
        residual: optional (..., D), same shape and dtype as x: normalize x + residual instead.

    Returns:
        y (same shape and dtype as x), or (y, h) with h = x + residual when `residual` is given.

    Raises:
        ValueError: weight is not (D,), residual's shape differs, D is 0, eps negative or not finite, or a device
            problem (see `check_tensors`).
        TypeError: unsupported or mismatched dtypes, an eps that is not a number.
    """
    tensors = {"x": x, "weight": weight} | ({} if residual is None else {"residual": residual})
    check_tensors("rmsnorm", DTYPES, **tensors)
    eps = check_eps("rmsnorm", eps)
    if len({t.dtype for t in tensors.values()}) != 1:
        raise TypeError("rmsnorm: x, weight (and residual) must share one dtype, got " +
                        ", ".join(f"{n}={t.dtype}" for n, t in tensors.items()))
    D = x.shape[-1] if x.dim() > 0 else 0
    if D == 0:
        raise ValueError(f"rmsnorm: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"rmsnorm: weight must have shape ({D},) to match x {tuple(x.shape)}, got "
                         f"{tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rmsnorm: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    y = torch.empty_like(x2)
    if residual is not None:
        r2 = residual.reshape(-1, D).contiguous()
        h = torch.empty_like(x2)
    else:
        r2, h = x2, y  # unused by the kernel (HAS_RESIDUAL=False)
    BLOCK_D = triton.next_power_of_2(D)
    if x2.shape[0] > 0:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, y, h,
            D, eps,
            x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
            BLOCK_D=BLOCK_D, HAS_RESIDUAL=residual is not None,
            num_warps=min(max(BLOCK_D // 256, 1), 16),
        )
    y = y.view(x.shape)
    return y if residual is None else (y, h.view(x.shape))


class TritonRMSNorm(torch.nn.Module):
    """Drop-in for `llmlab.model.RMSNorm` (same `weight` and `eps` attributes) running the Triton kernel."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rmsnorm(x, self.weight, self.eps, residual)


if __name__ == "__main__":
    # GB/s of the kernel and of eager PyTorch against the device's copy bandwidth (bytes read + written).
    demo_needs_cuda("rmsnorm")
    from triton.testing import do_bench

    torch.manual_seed(0)
    for rows, D in [(1, 4096), (16, 4096), (4096, 4096), (8192, 8192)]:
        x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * x.numel() * x.element_size() + w.numel() * w.element_size()
        ms_t = do_bench(lambda: rmsnorm(x, w))
        ms_p = do_bench(lambda: rmsnorm_reference(x, w))
        print(f"rows={rows:5d} D={D}: triton {nbytes / ms_t / 1e6:7.1f} GB/s   eager {nbytes / ms_p / 1e6:7.1f} GB/s")
