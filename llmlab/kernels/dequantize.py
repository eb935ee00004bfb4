"""int8 / int4 weights dequantized to the activations' dtype in ONE pass: the prefill half of a quantized layer.

At decode (M = 1..16 rows of x) a quantized layer's kernels (`int8_matmul`, `int4_matmul`) read the packed weights
and convert them in registers: the step is memory-bound and the packed bytes are what it reads. A prefill has
hundreds of rows: its matmul is compute-bound, and a dense bf16 GEMM (cuBLAS, through F.linear) is the fastest way
to do it. So a quantized layer's prefill turns its weight into a temporary (N, K) tensor of x's dtype first.

In plain PyTorch (`weight_quant.dequantize_int4(...).to(dtype)`) that is a chain of elementwise passes over fp32
temporaries: unpack both nibbles, stack, subtract 8, widen the scales to one per weight, multiply, cast. For int4
that moves about 30 bytes per weight, which made a quantized model's prefill many times slower than bf16's
(docs/results.md). These kernels read the packed bytes and the scales once and write the result once: 0.5 + 2 bytes
per weight for int4 (plus a scale per group), 1 + 2 for int8, so the temporary costs about as much as reading a
bf16 weight would.

Values: EXACTLY `weight_quant.dequantize_int8 / dequantize_int4(...).to(dtype)` — each weight is code x scale in
fp32 (exact: an integer below 2^8 times an fp32), rounded once to the output dtype, as the reference does.

Layout: the weight's rows must be contiguous (the quantized layers' buffers are, and so are the row blocks that
`llmlab.quant.fused` makes of them); `int4` tiles never straddle a group (BLOCK_K divides the group size), so each
row of a tile reads one scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_tensors
from .weight_quant import check_group

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_N = 32


@triton.jit
def _int8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_on,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    q = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0)  # (BLOCK_N, BLOCK_K) int8
    s = tl.load(s_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)  # one scale per row
    w = q.to(tl.float32) * s[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_dequant_kernel(p_ptr, s_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_on,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # BLOCK_K weights of each of BLOCK_N rows: BLOCK_K // 2 bytes, inside one group (BLOCK_K divides GROUP)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    row_ok = rows < N
    p = tl.load(p_ptr + rows[:, None] * stride_pn + half[None, :], mask=row_ok[:, None], other=0)  # uint8
    lo = (p & 0xF).to(tl.float32) - 8.0  # weight 2j
    hi = (p >> 4).to(tl.float32) - 8.0  # weight 2j + 1
    codes = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # join pairs (2j, 2j + 1): back in K order
    s = tl.load(s_ptr + rows * stride_sn + k0 // GROUP, mask=row_ok, other=0.0).to(tl.float32)
    w = codes * s[:, None]
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def _check_out_dtype(op: str, dtype, device: torch.device) -> None:
    if dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: dtype must be one of {', '.join(map(str, OUT_DTYPES))} (the activations' dtype), "
                        f"got {dtype!r}")
    if dtype == torch.bfloat16 and device.type != "cuda":
        raise TypeError(f"{op}: the Triton interpreter (CPU) has no bf16 arithmetic; ask for fp32 or fp16 on a CPU")


def _check_inputs(op: str, code_dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    """The codes (the first tensor) in `code_dtype`, the scales in a float dtype, both on a device where Triton runs
    (`check_tensors`)."""
    (codes_name, codes), (scales_name, scales) = tensors.items()
    if all(isinstance(t, torch.Tensor) for t in tensors.values()) and (
            codes.dtype != code_dtype or not scales.is_floating_point()):
        raise TypeError(f"{op}: {codes_name} must be {code_dtype} and {scales_name} floating point, got "
                        f"{codes.dtype} and {scales.dtype}; pass the layer's buffers as quantize_* made them")
    check_tensors(op, (code_dtype, *OUT_DTYPES), **tensors)  # tensors, one device, where Triton runs


def _check_rows(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{op}: {name} must be a 2-D tensor with contiguous rows, got shape {tuple(t.shape)} and "
                         f"strides {t.stride()}; pass the layer's own buffer (or .contiguous())")


def int8_dequantize(w_q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w_q (N, K) int8 and scales (N,) float -> W (N, K) in `dtype`: w_q[n, k] * scales[n], in one pass.

    Equals `weight_quant.dequantize_int8(w_q, scales).to(dtype)` exactly.

    Raises:
        TypeError: w_q not int8, scales not floating point, dtype not fp32 / fp16 / bf16.
        ValueError: shapes that do not match, rows that are not contiguous, tensors on different devices or where
            Triton cannot run (`check_tensors`).
    """
    _check_inputs("int8_dequantize", torch.int8, w_q=w_q, scales=scales)
    _check_out_dtype("int8_dequantize", dtype, w_q.device)
    _check_rows("int8_dequantize", "w_q", w_q)
    N, K = w_q.shape
    if scales.shape != (N,):
        raise ValueError(f"int8_dequantize: scales must be (N,) = ({N},), one per row of w_q, got "
                         f"{tuple(scales.shape)}")
    scales = scales.contiguous()
    out = torch.empty((N, K), dtype=dtype, device=w_q.device)
    if out.numel():
        block_k = 128
        grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(K, block_k))
        _int8_dequant_kernel[grid](w_q, scales, out, N, K, w_q.stride(0), out.stride(0),
                                   BLOCK_N=BLOCK_N, BLOCK_K=block_k)
    return out


def _block_k(group: int) -> int:
    """The largest power of two <= 128 that divides the group size (a multiple of 32): 32, 64 or 128."""
    block = 128
    while group % block:
        block //= 2
    return block


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed (N, K // 2) uint8 (low nibble = even k, codes stored as value + 8) and scales (N, K // G) float ->
    W (N, K) in `dtype`: (code - 8) * scales[n, k // G], in one pass.

    Equals `weight_quant.dequantize_int4(packed, scales).to(dtype)` exactly. G must be a multiple of 32 (the int4
    kernels' rule, `weight_quant.check_group`).

    Raises:
        TypeError: packed not uint8, scales not floating point, dtype not fp32 / fp16 / bf16.
        ValueError: shapes that do not match or a group size that is not a multiple of 32, rows that are not
            contiguous, tensors on different devices or where Triton cannot run (`check_tensors`).
    """
    _check_inputs("int4_dequantize", torch.uint8, packed=packed, scales=scales)
    _check_out_dtype("int4_dequantize", dtype, packed.device)
    _check_rows("int4_dequantize", "packed", packed)
    N, half = packed.shape
    K = 2 * half
    if scales.dim() != 2 or scales.shape[0] != N or not scales.shape[1] or K % scales.shape[1]:
        raise ValueError(f"int4_dequantize: scales must be (N, K // G) = ({N}, {K} // G), one per group of G "
                         f"weights of a row, got {tuple(scales.shape)}")
    check_group(K, K // scales.shape[1])  # the kernels' rule: a multiple of 32 that divides K
    G = K // scales.shape[1]
    scales = scales.contiguous()  # the kernel reads group g of a row at offset g: adjacent columns
    out = torch.empty((N, K), dtype=dtype, device=packed.device)
    if out.numel():
        block_k = _block_k(G)
        grid = (triton.cdiv(N, BLOCK_N), K // block_k)
        _int4_dequant_kernel[grid](packed, scales, out, N, K, packed.stride(0), scales.stride(0), out.stride(0),
                                   GROUP=G, BLOCK_N=BLOCK_N, BLOCK_K=block_k)
    return out
