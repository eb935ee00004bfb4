"""Rotary position embedding applied to q and k in place, as a Triton kernel (Su et al. 2021,
https://arxiv.org/abs/2104.09864).

Channel pairing is Hugging Face's "rotate half" (as `llmlab.model.apply_rope`): channel i pairs with i + hd/2,

    out[i]        = x[i] * cos[i] - x[i + hd/2] * sin[i]
    out[i + hd/2] = x[i + hd/2] * cos[i] + x[i] * sin[i]          (i < hd/2)

The kernel reads only the first half of cos/sin (the model's tables repeat it: `cat([angles, angles])`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_tensors, demo_needs_cuda

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`llmlab.model.apply_rope`: x (B, heads, T, hd); cos/sin (T, hd) or (B, T, hd) -> new tensor like x.

    Bytes: eager PyTorch runs chunk/neg/cat (rotate_half: read + write x), two products and a sum (~5 more passes
    over x) and reads cos/sin twice; the in-place kernel reads x and cos/sin once and writes x once.
    """
    from llmlab.model import apply_rope

    return apply_rope(x, cos, sin)


@triton.jit
def _rope_kernel(
    # pointers
    x_ptr, cos_ptr, sin_ptr,
    # sizes
    H, T,
    # strides (elements)
    stride_xb, stride_xh, stride_xt, stride_cb, stride_ct,
    # meta-parameters
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    pid_bh = tl.program_id(0)  # one (batch, head) ...
    b = pid_bh // H
    h = pid_bh % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # ... and a block of positions
    i = tl.arange(0, BLOCK_HALF)
    mask = (t[:, None] < T) & (i[None, :] < HALF)
    x1_ptrs = x_ptr + b * stride_xb + h * stride_xh + t[:, None] * stride_xt + i[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0)
    cs_off = b * stride_cb + t[:, None] * stride_ct + i[None, :]
    c = tl.load(cos_ptr + cs_off, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_off, mask=mask, other=0.0).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(x1_ptrs, (x1f * c - x2f * s).to(x1.dtype), mask=mask)
    tl.store(x1_ptrs + HALF, (x2f * c + x1f * s).to(x1.dtype), mask=mask)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    B, H, T, hd = x.shape
    stride_cb = cos.stride(0) if cos.dim() == 3 else 0
    BLOCK_T = min(triton.next_power_of_2(T), 32)
    grid = (B * H, triton.cdiv(T, BLOCK_T))
    _rope_kernel[grid](
        x, cos, sin,
        H, T,
        x.stride(0), x.stride(1), x.stride(2), stride_cb, cos.stride(-2),
        HALF=hd // 2, BLOCK_T=BLOCK_T, BLOCK_HALF=triton.next_power_of_2(hd // 2),
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory spans (first to last element they can reach) intersect in one storage. Spans,
    not elements: q and k as interleaved views of one fused buffer would count as overlapping even if no element
    is shared (the model's q and k are separate tensors)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        lo = t.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k IN PLACE (two launches) and return them.

    Args:
        q: (B, H, T, hd); k: (B, Hkv, T, hd); any strides as long as the last dimension is contiguous (the
            model's `view(B, T, H, hd).transpose(1, 2)` qualifies). fp32 / fp16 / bf16 (fp32 in the interpreter).
        cos, sin: (T, hd) or (B, T, hd), the model's tables (`RotaryEmbedding.forward`), fp32 / fp16 / bf16;
            only [..., :hd/2] is read.

    Returns:
        (q, k), the same tensors, rotated.

    Raises:
        ValueError: odd head_dim, mismatched B / T / hd, a last dimension that is not contiguous, q and k that
            share memory (one tensor passed twice would be rotated twice).
        TypeError: unsupported dtypes, q and k of different dtypes.
    """
    check_tensors("rope_", DTYPES, q=q, k=k, cos=cos, sin=sin)
    if q.dtype != k.dtype:
        raise TypeError(f"rope_: q ({q.dtype}) and k ({k.dtype}) must share one dtype")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope_: q and k must be (B, heads, T, hd), got {tuple(q.shape)} and {tuple(k.shape)}")
    B, _, T, hd = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, hd):
        raise ValueError(f"rope_: k {tuple(k.shape)} must match q {tuple(q.shape)} in B, T and hd")
    if hd % 2:
        raise ValueError(f"rope_: head_dim must be even to pair channel i with i + hd/2, got {hd}")
    want = [(T, hd), (B, T, hd)]
    if tuple(cos.shape) not in want or cos.shape != sin.shape:
        raise ValueError(f"rope_: cos/sin must be (T, hd) = {want[0]} or (B, T, hd) = {want[1]}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_: {name}'s last dimension must be contiguous (stride 1), got {t.stride()}")
    if _overlap(q, k):
        raise ValueError("rope_: q and k share memory (the same tensor passed twice?): each element would be rotated "
                         "twice; rotate one tensor with rope_one(x, cos, sin)")
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    for x in (q, k):
        if x.numel() > 0:
            _rope_one(x, cos, sin)
    return q, k


def rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, hd) IN PLACE with one launch and return it; checks as `rope_`.

    For q and k side by side in one buffer (a fused q/k/v projection): pass the view of both, shape
    (B, H + Hkv, T, hd), and both are rotated by one kernel.
    """
    rope_(x, x[:, :0], cos, sin)  # the checks; k with no heads launches nothing
    return x


if __name__ == "__main__":
    demo_needs_cuda("rope")
    from triton.testing import do_bench

    B, H, Hkv, hd = 1, 32, 8, 128
    for T in (1, 128, 4096):
        q = torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, T, Hkv, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        ang = torch.randn(T, hd // 2, device="cuda").repeat(1, 2)
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
        nbytes = 2 * (q.numel() + k.numel()) * 2 + cos.numel() * 2  # read + write q, k; read half of cos, sin
        ms_t = do_bench(lambda: rope_(q, k, cos, sin))
        ms_p = do_bench(lambda: (rope_reference(q, cos, sin), rope_reference(k, cos, sin)))
        print(f"T={T:5d}: triton {nbytes / ms_t / 1e6:7.1f} GB/s   eager {nbytes / ms_p / 1e6:7.1f} GB/s (same bytes)")
