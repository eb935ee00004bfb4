"""SwiGLU's elementwise part, silu(gate) * up, as one Triton kernel (Shazeer 2020, https://arxiv.org/abs/2002.05202).

In a Llama MLP, `down(silu(gate(x)) * up(x))`: between the two matmuls PyTorch runs silu (read gate, write a
temporary) and the product (read the temporary and up, write the result). The kernel reads gate and up once and
writes the result once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_tensors, demo_needs_cuda

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, as `llmlab.model.MLP`. Bytes: eager = 5 x N x elem (silu: 1 read + 1 write; product:
    2 reads + 1 write); fused = 3 x N x elem."""
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _swiglu_kernel(
    # pointers
    gate_ptr, up_ptr, out_ptr,
    # sizes
    N,
    # strides (elements)
    stride_gate, stride_up, stride_out,
    # meta-parameters
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    g32 = g.to(tl.float32)
    act = (g32 * tl.sigmoid(g32)).to(g.dtype)  # silu rounded to the input dtype, as PyTorch's F.silu
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with one Triton kernel.

    Args:
        gate, up: (..., N), same shape and dtype (fp32 / fp16 / bf16; fp32 in the CPU interpreter).

    Returns:
        (..., N) in the same dtype (empty when the inputs are: no rows, or N = 0).

    Raises:
        ValueError: shapes differ; device problems (see `check_tensors`).
        TypeError: unsupported or mismatched dtypes.
    """
    check_tensors("swiglu", DTYPES, gate=gate, up=up)
    if gate.dtype != up.dtype:
        raise TypeError(f"swiglu: gate ({gate.dtype}) and up ({up.dtype}) must share one dtype")
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one (non-scalar) shape")
    if gate.numel() == 0:  # no rows, or rows of length 0: nothing to compute (reshape(-1, 0) would fail)
        return torch.empty_like(gate)
    N = gate.shape[-1]
    g2, u2 = gate.reshape(-1, N), up.reshape(-1, N)  # views when they can be (halves of a fused gate_up output)
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    u2 = u2 if u2.stride(-1) == 1 else u2.contiguous()
    out = torch.empty_like(g2)
    if out.numel() > 0:
        BLOCK_N = min(triton.next_power_of_2(N), 1024)
        _swiglu_kernel[(g2.shape[0], triton.cdiv(N, BLOCK_N))](
            g2, u2, out,
            N,
            g2.stride(0), u2.stride(0), out.stride(0),
            BLOCK_N=BLOCK_N,
        )
    return out.view(gate.shape)


if __name__ == "__main__":
    demo_needs_cuda("swiglu")
    from triton.testing import do_bench

    for rows, N in [(1, 14336), (16, 14336), (4096, 14336)]:
        g = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
        u = torch.randn_like(g)
        nbytes = 3 * g.numel() * g.element_size()
        ms_t, ms_p = do_bench(lambda: swiglu(g, u)), do_bench(lambda: swiglu_reference(g, u))
        print(f"rows={rows:5d} N={N}: triton {nbytes / ms_t / 1e6:7.1f} GB/s   eager {nbytes / ms_p / 1e6:7.1f} GB/s")
