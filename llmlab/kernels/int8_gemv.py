"""The input-stationary int8 GEMV at batch 1 (M = 1): y = [residual +] x' @ (w_q * scales)^T, x held in registers.

`int8_matmul`'s batch-1 GEMV walks K: each of its thousands of programs owns a few rows, reloads and re-lifts x at
every K tile, and reads each row in short pieces. That suits the long-row, many-row GEMVs. For the small ones of a
decode step (q/k/v and o: a few thousand rows of 4096) its programs are short and their start-up is a large share
of the time. This GEMV is the other dataflow, the one the int4 GEMVs use (`int4_gemv.py`, "input-stationary"):

  * a program spans whole rows. Thread slot q owns k in [16q, 16q + 16), one 16-byte quad of each int8 row, for
    the program's life: its 16 values of x are loaded, put through the prologue and lifted ONCE;
  * rows stream past R at a time (one 16-byte load per thread and row), on a few persistent programs per SM
    walking chunks c, c + P, ...; the next chunk's weights are requested before this chunk's math, the first
    chunk's before the PDL wait;
  * per row a thread does 16 masks and 16 FMAs in one chain (`_byte_fma`: XOR 0x80 turns each signed byte into
    w + 128, read as an fp32 subnormal by `field_f32`), then the program sums the row across its threads, takes
    off 128 x the slot's x sum (once per row) and multiplies by the row's scale.

The prologue (RMSNorm, or SwiGLU on [gate | up]) and the residual epilogue are `fused_quant_gemv`'s; every program
holds the whole row of x, so the RMSNorm's rstd is computed in each program, with any number of programs.

Which of the two int8 GEMVs a decode step runs for each of its roles is chosen by timing the captured step
(`step_tuning`): an input-stationary config is a `triton.Config` with the keys R and PPS (`candidate_configs`), a
K-walking one has BLOCK_N, BLOCK_K, SPLIT_K and STAGES, and one with R and GLUON runs this GEMV's Gluon build
(`int8_gemv_gluon.py`); `int8_matmul.candidate_configs` returns all three kinds.

Shapes: x (1, K), or (1, 2K) [gate | up] with SwiGLU; w_q (N, K) int8 with K a multiple of 16 and rows 4-byte
aligned; scales (N,) float; y (1, N). Numerics as the K-walking GEMV's (`int8_matmul.int8_matmul`): exact products
and fp32 sums for 2^-62 <= |x| < 2^43.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._util import num_sms, pdl_kwargs
from .input_stationary import flat, store_rows, x_once
from .packed_fields import X_EXP, field_f32, lift, quad_words, split4

# Rows per chunk R and persistent programs per SM PPS that `candidate_configs` offers; DEFAULT when none is given.
SHAPES = ((8, 2), (8, 1), (4, 2), (8, 4), (16, 1))
DEFAULT = (8, 2)
# The longest rows it takes: 1024 slots of 16 weights (16 warps, two slots a thread). Longer rows run the K-walking
# GEMV.
MAX_K = 16384


def _warps(K: int) -> int:
    """Warps a program of rows of K weights runs: one slot of 16 weights a thread, at most 16 warps."""
    return max(1, min(16, triton.next_power_of_2(K // 16) // 32))


def takes(K: int) -> bool:
    """Can this GEMV run rows of K int8 weights? K a positive multiple of 16 (whole 16-byte quads) up to MAX_K."""
    return 0 < K <= MAX_K and K % 16 == 0


def launch(x, w_q, scales, y, R: int = DEFAULT[0], pps: int = DEFAULT[1], norm_weight=None, eps: float = 1e-5,
           swiglu: bool = False, residual=None) -> None:
    """Launch `_int8_gemv_is_kernel` for one row of x into y: R rows per chunk on min(chunks, pps x SMs)
    persistent programs, PDL as `pdl_kwargs` says; the RMSNorm (`norm_weight`) or SwiGLU prologue and the residual
    add as `fused_quant_gemv` describes them. The callers check the arguments (`int8_matmul.launch_gemv`,
    `fused_quant_gemv`); K must satisfy `takes`."""
    N, K = w_q.shape
    Q = triton.next_power_of_2(K // 16)
    programs = min(triton.cdiv(N, R), pps * num_sms(x.device))
    _int8_gemv_is_kernel[(programs,)](
        x, w_q, scales, y, x if norm_weight is None else norm_weight, x if residual is None else residual,
        N, K, float(eps),
        x.stride(-1), w_q.stride(0) // 4, scales.stride(0), y.stride(-1),
        Q=Q, R=R, PROLOGUE=2 if swiglu else 1 if norm_weight is not None else 0, HAS_RES=residual is not None,
        num_warps=_warps(K), **pdl_kwargs(x.device),
    )


@triton.jit
def _is_chunk(w_ptr, s_ptr, c, N, stride_wn, stride_sn, rw, w_mask, rf_row, rf_q, R: tl.constexpr):
    """Chunk c's weights, (R, 4Q) int32 words, and its rows' scales in the flat (R * Q,) layout (read by slot 0
    only), both zero past N rows (a program past the last chunk loads nothing)."""
    rn = c * R + tl.arange(0, R)
    w = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * stride_wn + rw[None, :],
                mask=(rn < N)[:, None] & w_mask[None, :], other=0)
    sn = c * R + rf_row
    s = tl.load(s_ptr + sn * stride_sn, mask=(sn < N) & (rf_q == 0), other=0.0)
    return w, s.to(tl.float32)


@triton.jit
def _byte_fma(w, a0, a1, a2, a3, acc):
    """acc (R, Q) + sum_i (byte_i(w) + 128) * a_i * 2^-X_EXP for (R, Q) int32 words of signed bytes and (Q,)
    lifted partners: XOR 0x80 makes each byte w + 128 in 0..255; bytes 2 and 3 are read from the upper half."""
    u = w ^ -0x7F7F7F80  # = 0x80808080 as int32
    top = u >> 16
    acc += field_f32(u, 0, 8) * a0[None, :]
    acc += field_f32(u, 8, 8) * a1[None, :]
    acc += field_f32(top, 0, 8) * a2[None, :]
    acc += field_f32(top, 8, 8) * a3[None, :]
    return acc


@triton.jit
def _int8_gemv_is_kernel(
    # pointers (nw: the RMSNorm weight, res: the residual; read only with PROLOGUE == 1 / HAS_RES)
    x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, res_ptr,
    # sizes; RMSNorm's eps
    N, K, eps,
    # strides (elements; stride_wn in 32-bit words)
    stride_xk, stride_wn, stride_sn, stride_yn,
    # meta-parameters: Q thread-slots (power of 2 >= K / 16), R rows per chunk
    Q: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr,
    # the small ops inside (`fused_quant_gemv`): prologue 0 none, 1 RMSNorm, 2 SwiGLU; the residual add
    PROLOGUE: tl.constexpr = 0, HAS_RES: tl.constexpr = False,
):
    rq = tl.arange(0, Q)
    q_mask = rq < K // 16  # slots past the row (Q rounded up to a power of two) load nothing
    # The layouts follow `_int4_gemv_is_kernel`'s (int4_gemv.py): one (R, 4Q) tile of words, contiguous along its
    # rows, so slot q's quad lands in one thread; the scales and the output in a flat r * Q + q index.
    rw = tl.arange(0, 4 * Q)
    rf = tl.arange(0, R * Q)
    rf_row, rf_q = rf // Q, rf % Q
    w_mask = (rw // 4) < K // 16  # whole quads: the loads stay 16 bytes wide
    n_chunks = tl.cdiv(N, R)
    c = tl.program_id(0)
    step = tl.num_programs(0)
    if PDL:  # let the next kernel's programs start arriving (see `pdl_enabled` in _util.py)
        tl.extra.cuda.gdc_launch_dependents()
    # the first chunk's weights and scales depend on no earlier kernel: request them before waiting for x
    w, s = _is_chunk(w_ptr, s_ptr, c, N, stride_wn, stride_sn, rw, w_mask, rf_row, rf_q, R)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # x once per program: slot q's 16 values, after the prologue, split into the lifted partners aJi of byte i of
    # word J: x[16q + 4J + i] * 2^(149 - shift_i - X_EXP) (bytes 0 and 2 sit at shift 0, bytes 1 and 3 at 8)
    kk = 16 * rq[:, None] + tl.arange(0, 16)[None, :]
    xt, rstd = x_once(x_ptr, nw_ptr, kk, q_mask[:, None], K, eps, stride_xk, PROLOGUE)  # (Q, 16)
    off = tl.sum(xt, axis=1) * (128.0 * 2.0 ** -X_EXP)  # (Q,): the bytes' offset of 128, taken off once per row
    c0, c1, c2, c3 = split4(tl.reshape(xt, (Q * 4, 4)))  # c_i[4q + J] = x[16q + 4J + i]
    a00, a10, a20, a30 = split4(tl.reshape(lift(c0, 0), (Q, 4)))
    a01, a11, a21, a31 = split4(tl.reshape(lift(c1, 8), (Q, 4)))
    a02, a12, a22, a32 = split4(tl.reshape(lift(c2, 0), (Q, 4)))  # bytes 2, 3 are read from w >> 16
    a03, a13, a23, a33 = split4(tl.reshape(lift(c3, 8), (Q, 4)))
    for c in tl.range(c, n_chunks, step, num_stages=1):
        w_next, s_next = _is_chunk(w_ptr, s_ptr, c + step, N, stride_wn, stride_sn, rw, w_mask, rf_row, rf_q, R)
        w0, w1, w2, w3 = quad_words(w)
        acc = tl.zeros([R, Q], tl.float32) - off[None, :]
        acc = _byte_fma(w0, a00, a01, a02, a03, acc)
        acc = _byte_fma(w1, a10, a11, a12, a13, acc)
        acc = _byte_fma(w2, a20, a21, a22, a23, acc)
        acc = _byte_fma(w3, a30, a31, a32, a33, acc)
        y = tl.sum(acc, axis=1) * 2.0 ** X_EXP  # (R,) in every thread; back from the sums' scale before the
        # row's scale (s * 2^64 could overflow)
        y_flat = flat(y, Q) * s  # the scales sit in the flat layout (`_is_chunk`)
        if PROLOGUE == 1:
            y_flat = y_flat * rstd
        rn = c * R + rf_row
        store_rows(y_flat, y_ptr, res_ptr, rn, (rf_q == 0) & (rn < N), stride_yn, HAS_RES)
        w = w_next
        s = s_next


def candidate_configs(K: int) -> list:
    """The input-stationary configs a step's tuning may time for rows of K weights: triton.Config({"R", "PPS"})
    for each of SHAPES (num_warps as `launch` sets them), none where `takes(K)` is False."""
    if not takes(K):
        return []
    return [triton.Config({"R": r, "PPS": p}, num_warps=_warps(K)) for r, p in SHAPES]
