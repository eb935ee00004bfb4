"""One decode step's RoPE and KV-cache write, fused: rotate q in place, rotate k and write it, and v, straight into a
static KV cache at each row's position — one launch instead of three (RoPE, then a scatter for K and one for V).

The input is the output of a fused q/k/v projection for ONE new token per row, viewed as (B, H + 2 * Hkv, hd):
heads 0..H-1 are q, then Hkv heads of k, then Hkv heads of v. One program handles one (row, head):

    q head:  x <- rope(x)                                   (in place, in the projection's output)
    k head:  k_cache[b, h, pos[b]] <- rope(x)
    v head:  v_cache[b, h, pos[b]] <- x

RoPE pairing as `llmlab.model.apply_rope` ("rotate half"; see `rope.py`), computed in fp32 and rounded once to the
cache dtype. The cache layout is `llmlab.cache.static_cache.StaticKVCache`'s: (B, Hkv, S, hd) per layer.

The angles come either as cos/sin rows (`llmlab.model.RotaryEmbedding`'s output) or are computed in the kernel from
the positions and the inverse frequencies (`inv_freq=`): the ~7 small kernels that build cos/sin each step go away.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_tensors, demo_needs_cuda, pdl_kwargs

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_and_cache_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int) -> None:
    """The unfused ops: RoPE on q and k (llmlab.model.apply_rope), then K and V written at each row's position."""
    from llmlab.model import apply_rope

    B, heads, hd = qkv.shape
    Hkv = (heads - n_heads) // 2
    x = qkv[:, :, None]  # (B, heads, 1, hd)
    c, s = cos.reshape(B, 1, hd), sin.reshape(B, 1, hd)
    q = apply_rope(x[:, :n_heads], c, s)
    k = apply_rope(x[:, n_heads:n_heads + Hkv], c, s)
    qkv[:, :n_heads] = q[:, :, 0]
    rows = torch.arange(B, device=qkv.device)
    k_cache[rows, :, positions] = k[:, :, 0]
    v_cache[rows, :, positions] = x[:, n_heads + Hkv:, 0]


@triton.jit
def rope_angles(pos, freq_ptr, i, mask, like):
    """cos and sin of the angles pos * inv_freq[i] (freq_ptr: inv_freq, (hd/2,) fp32; i: frequency indices), as
    `RotaryEmbedding` computes them: the angle in fp32, cos and sin rounded to `like`'s dtype (the activations'),
    returned in fp32 for the rotation. Masked lanes get angle 0. Shared with the attention that applies RoPE itself
    (`split_attention.py`, ROPE)."""
    ang = pos.to(tl.float32) * tl.load(freq_ptr + i, mask=mask, other=0.0)
    # the same angle brought into [-pi, pi] in fp64 first: the GPU's fast sin/cos are accurate only near 0, and at
    # position 100K the angle is ~1e5 rad
    a64 = ang.to(tl.float64)
    two_pi = tl.full((), 6.283185307179586, tl.float64)
    red = (a64 - two_pi * tl.floor(a64 / two_pi + 0.5)).to(tl.float32)
    return tl.cos(red).to(like.dtype).to(tl.float32), tl.sin(red).to(like.dtype).to(tl.float32)


@triton.jit
def _rope_cache_kernel(
    # pointers
    x_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr,
    # sizes
    H, HKV, HEADS, S,
    # strides (elements)
    stride_xb, stride_xh, stride_cb, stride_pb,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    # meta-parameters
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, FROM_FREQ: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched early (`pdl_enabled` in _util.py): let the next kernel come, wait for the one before
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    b = pid // HEADS
    h = pid % HEADS
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    x_row = x_ptr + b * stride_xb + h * stride_xh
    x1 = tl.load(x_row + i, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + i, mask=mask, other=0.0)
    pos = tl.load(pos_ptr + b * stride_pb)
    slot = pos + 0 * i  # the position on every lane: a slot outside the cache is never written (nor q rotated;
    mask = mask & (slot >= 0) & (slot < S)  # the callers check positions on the host and raise)
    if h < H + HKV:  # q or k: rotate
        if FROM_FREQ:  # cos_ptr holds inv_freq (HALF,) fp32: the angles as RotaryEmbedding computes them
            c, s = rope_angles(pos, cos_ptr, i, mask, x1)
        else:
            c = tl.load(cos_ptr + b * stride_cb + i, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + b * stride_cb + i, mask=mask, other=0.0).to(tl.float32)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        y1 = x1f * c - x2f * s
        y2 = x2f * c + x1f * s
        if h < H:  # q: in place
            tl.store(x_row + i, y1.to(x1.dtype), mask=mask)
            tl.store(x_row + HALF + i, y2.to(x1.dtype), mask=mask)
        else:  # k: into the cache at this row's position
            dst = kc_ptr + b * stride_kb + (h - H) * stride_kh + pos * stride_ks
            tl.store(dst + i, y1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF + i, y2.to(kc_ptr.dtype.element_ty), mask=mask)
    else:  # v: copied into the cache
        dst = vc_ptr + b * stride_vb + (h - H - HKV) * stride_vh + pos * stride_vs
        tl.store(dst + i, x1.to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + i, x2.to(vc_ptr.dtype.element_ty), mask=mask)


def rope_and_cache_(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int,
                    inv_freq: torch.Tensor | None = None) -> None:
    """Rotate q in place and write rotated k and v into the cache, for one new token per row (one launch).

    Args:
        qkv: (B, H + 2 * Hkv, hd) one token's fused projection per row (q heads, k heads, v heads); last dimension
            contiguous. q is rotated in place.
        cos, sin: (B, hd) or (B, 1, hd) angles of each row's position (only [..., :hd/2] is read); or None with
            `inv_freq`.
        inv_freq: instead of cos/sin: (hd/2,) fp32 inverse frequencies (`RotaryEmbedding.inv_freq`); the kernel
            computes angle = position * inv_freq, and cos/sin rounded to qkv's dtype, as `RotaryEmbedding` does.
        positions: (B,) int64/int32 on the device: the cache slot of each row's token, each < S (not checked on the
            device: the caller checks lengths on the host, as `llmlab.runtime.cuda_graphs` does).
        k_cache, v_cache: (B, Hkv, S, hd) one layer of a static cache (rows 0..B-1), last dimension contiguous.
        n_heads: H, the query heads.

    Raises:
        ValueError: shapes that do not fit together, odd hd, non-contiguous last dimensions.
        TypeError: unsupported dtypes (see `check_tensors`).
    """
    if (cos is None) != (sin is None):
        raise ValueError("rope_and_cache_: give both cos and sin (or neither, with inv_freq)")
    if (inv_freq is None) == (cos is None):
        raise ValueError("rope_and_cache_: give the angles either as cos and sin, or as inv_freq (not both)")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"rope_and_cache_: positions must be int32 or int64 cache slots, got {positions.dtype}")
    if inv_freq is not None:
        check_tensors("rope_and_cache_", DTYPES, qkv=qkv, k_cache=k_cache, v_cache=v_cache)
        if inv_freq.dtype != torch.float32 or inv_freq.device != qkv.device or inv_freq.dim() != 1:
            raise ValueError(f"rope_and_cache_: inv_freq must be a (hd/2,) fp32 tensor on {qkv.device}, got "
                             f"{tuple(inv_freq.shape)} {inv_freq.dtype} on {inv_freq.device}")
    else:
        check_tensors("rope_and_cache_", DTYPES, qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    if qkv.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"rope_and_cache_: qkv must be (B, H + 2*Hkv, hd) and the caches (B, Hkv, S, hd), got "
                         f"{tuple(qkv.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, heads, hd = qkv.shape
    Hkv = k_cache.shape[1]
    if heads != n_heads + 2 * Hkv or k_cache.shape[0] != B or k_cache.shape[3] != hd or hd % 2:
        raise ValueError(f"rope_and_cache_: qkv {tuple(qkv.shape)} does not hold {n_heads} q heads + 2 x {Hkv} "
                         f"k/v heads of the cache {tuple(k_cache.shape)} (and hd must be even)")
    if positions.shape != (B,):
        raise ValueError(f"rope_and_cache_: positions must be ({B},), got {tuple(positions.shape)}")
    if inv_freq is not None:
        if inv_freq.shape != (hd // 2,):
            raise ValueError(f"rope_and_cache_: inv_freq must be (hd/2,) = ({hd // 2},), got {tuple(inv_freq.shape)}")
        cos2 = sin2 = inv_freq.contiguous()  # the kernel reads inv_freq where it would read cos (FROM_FREQ)
    else:
        cos2, sin2 = cos.reshape(B, -1), sin.reshape(B, -1)
        if cos2.shape[1] != hd or sin2.shape != cos2.shape:
            raise ValueError(f"rope_and_cache_: cos/sin must be (B, hd) = ({B}, {hd}), got {tuple(cos.shape)}, "
                             f"{tuple(sin.shape)}")
        if cos2.stride() != sin2.stride():
            cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    for name, t in (("qkv", qkv), ("cos", cos2), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_and_cache_: {name}'s last dimension must be contiguous, strides {t.stride()}")
    _rope_cache_kernel[(B * heads,)](
        qkv, cos2, sin2, positions, k_cache, v_cache,
        n_heads, Hkv, heads, k_cache.shape[2],
        qkv.stride(0), qkv.stride(1), 0 if inv_freq is not None else cos2.stride(0), positions.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HALF=hd // 2, BLOCK_HALF=triton.next_power_of_2(hd // 2), FROM_FREQ=inv_freq is not None,
        **pdl_kwargs(qkv.device),
    )


if __name__ == "__main__":
    # One decode step of Llama-3.1-8B's attention input at batch 1 and 64: fused launch vs RoPE + two scatters.
    demo_needs_cuda("rope_cache")
    from triton.testing import do_bench

    H, Hkv, hd, S = 32, 8, 128, 4096
    for B in (1, 64):
        qkv = torch.randn(B, H + 2 * Hkv, hd, device="cuda", dtype=torch.bfloat16)
        ang = torch.randn(B, hd // 2, device="cuda").repeat(1, 2)
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
        pos = torch.randint(0, S, (B,), device="cuda")
        kc = torch.zeros(B, Hkv, S, hd, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        t_fused = do_bench(lambda: rope_and_cache_(qkv, cos, sin, pos, kc, vc, n_heads=H))
        t_ref = do_bench(lambda: rope_and_cache_reference(qkv.clone(), cos, sin, pos, kc, vc, n_heads=H))
        print(f"B={B:3d}: fused {t_fused * 1e3:6.1f} us   unfused PyTorch {t_ref * 1e3:6.1f} us (launches included)")
