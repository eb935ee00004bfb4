"""The pieces the two input-stationary GEMVs share (`int4_gemv.py` for int4, `int8_gemv.py` for int8 weights).

In an input-stationary GEMV a program spans whole rows: thread slot q owns a fixed run of k for the program's life,
so its values of x are loaded, put through the prologue and lifted once, and rows stream past (`int4_gemv.py` has
the long form). Both kernels then:

  * load x as a (Q, S) tile, slot q's S values in its thread, with the prologue of `fused_quant_gemv` applied:
    RMSNorm (times the norm weight; rstd = 1 / sqrt(mean(x^2) + eps) over the whole row, which every program holds,
    multiplies the row sums at the end) or SwiGLU (x is [gate | up], rounded where the unfused ops round): `x_once`;
  * write each chunk's R row sums from a FLAT (R * Q,) layout, slot 0 of each row storing, with the residual add:
    an (R,) store would first move the sums through shared memory: `store_rows`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def x_once(x_ptr, nw_ptr, kk, k_mask, K, eps, stride_xk, PROLOGUE: tl.constexpr):
    """x at positions kk, a (Q, S) tile (0 where k_mask is False), as fp32 after the prologue (0 none, 1 RMSNorm
    with the weight at nw_ptr, 2 SwiGLU: x holds [gate | up], 2K values), and rstd (1.0 without the RMSNorm)."""
    xt = tl.load(x_ptr + kk * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
    rstd = 1.0
    if PROLOGUE == 1:  # RMSNorm: W (x * nw), times rstd after the sums; this program holds the whole row
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(xt * xt, axis=1), axis=0) / K + eps)
        xt = xt * tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    if PROLOGUE == 2:  # SwiGLU: rounded where the unfused ops round (F.silu, the product)
        dt = x_ptr.dtype.element_ty
        u = tl.load(x_ptr + (K + kk) * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        xt = ((xt * tl.sigmoid(xt)).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
    return xt, rstd


@triton.jit
def flat(y, Q: tl.constexpr):
    """(R,) row sums, held by every thread of the row -> the flat (R * Q,) layout, f = r * Q + q."""
    return tl.reshape(tl.broadcast_to(y[:, None], (y.shape[0], Q)), (y.shape[0] * Q,))


@triton.jit
def store_rows(y_flat, y_ptr, res_ptr, rn, out_mask, stride_yn, HAS_RES: tl.constexpr):
    """Store the flat row sums y_flat at rows rn where out_mask (slot 0 of each row inside N), plus the residual
    (HAS_RES: the linear's output rounded to y's dtype first, as the unfused add sees it)."""
    if HAS_RES:
        r = tl.load(res_ptr + rn, mask=out_mask, other=0.0).to(tl.float32)
        y_flat = y_flat.to(y_ptr.dtype.element_ty).to(tl.float32) + r
    tl.store(y_ptr + rn * stride_yn, y_flat.to(y_ptr.dtype.element_ty), mask=out_mask)
