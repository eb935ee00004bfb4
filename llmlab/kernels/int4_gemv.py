"""The int4 GEMVs at batch 1 (M = 1) in Triton: y = x @ dequant(packed, scales)^T for one row of x.

`int4_matmul` (`llmlab.kernels.int4_matmul`) runs one of them where the Gluon GEMV (`int4_gemv_gluon.py`) cannot:
in the CPU interpreter, in a Triton without Gluon, for rows longer than the Gluon kernel takes. Both read the packed
rows 32 bits (8 weights) at a time and make each 4-bit code a float in one instruction (`packed_fields.field_f32`);
the group scale multiplies a sum of products, not every weight.

  * the input-stationary GEMV (`_int4_gemv_is_kernel`, `launch_input_stationary`), for rows of up to IS_MAX_K
    weights: x stays in registers, whole rows stream past;
  * the K-walking GEMV (`_int4_gemv_kernel`, `launch_k_walking`) for longer rows: each program walks K over a few
    rows, with split-K (`split_k.py`).

Shapes: x (1, K); packed (N, K // 2) uint8, rows contiguous and 4-byte aligned; scales (N, K // G) with G a multiple
of 32 dividing K; y (1, N). The wrapper checks them (`int4_matmul`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import split_k
from ._util import num_sms, pdl_kwargs, tune_bench, zero_on_error
from .input_stationary import flat, store_rows, x_once
from .packed_fields import X_EXP, field_f32, lift, quad_words, split4, split8
from .quant_tiles import GEMV1_CONFIGS, gemv1_prune
from .split_k import split_k_range, split_k_store

# -- the input-stationary GEMV -------------------------------------------------------------------------------------
# An INPUT-STATIONARY GEMV (the dataflow names of SCALE-Sim, https://arxiv.org/abs/1811.02883: what stays put in a
# processing element — here x in a thread's registers). A K-walking GEMV reloads and re-lifts x at every K step and
# reads each row in short pieces at different times. Here a program spans whole rows: thread-slot q owns k in
# [32q, 32q + 32) (one 16-byte word quad of each packed row) for its whole life, so its 32 x values are loaded and
# lifted ONCE, and rows stream past R at a time — a program's load is R whole rows, contiguous. Per row a thread does
# 32 masks, 32 FMAs in one chain (words split in registers: no multiply to start a word, no sum over words), one
# scale; then the program sums each row across its threads. Programs are persistent (a few per SM, walking chunks
# p, p + P, ...): the next chunk's weights are requested before this chunk's math, the first chunk's before the PDL
# wait. Q (threads per row) is the power of two >= K / 32, num_warps = Q / 32 (one slot per thread).
# One config, not autotuned: under CUDA-graph replay the times over R in {2, 4, 8} x 1-6 programs per SM are
# uneven, and the autotuner, timing one launch at a time, picks badly among them; R = 8 at 2 programs per SM is the
# best or close to it at every Llama-3.1-8B shape (docs/results.md).
IS_R, IS_PPS = 8, 2  # rows per chunk, persistent programs per SM
# Longer rows (K = 14336: Q = 512, 16 warps, one program per SM) run slower here than in the K-walking GEMV: they
# take that one (docs/results.md).
IS_MAX_K = 8192


def launch_input_stationary(x, packed, scales, y, N: int, K: int, G: int, R: int = IS_R, programs: int | None = None,
                             pdl: bool | None = None, norm_weight=None, eps: float = 1e-5, swiglu: bool = False,
                             residual=None) -> None:
    """Launch `_int4_gemv_is_kernel`: R rows per chunk on `programs` persistent programs (default IS_PPS per SM,
    at most one per chunk), PDL as `pdl_kwargs` says unless `pdl` is given; the RMSNorm (norm_weight) or SwiGLU
    prologue and the residual add as `fused_quant_gemv` describes them."""
    Q = triton.next_power_of_2(K // 32)
    if programs is None:
        programs = min(triton.cdiv(N, R), IS_PPS * num_sms(x.device))
    launch = pdl_kwargs(x.device) if pdl is None else {"PDL": pdl, **({"launch_pdl": True} if pdl else {})}
    _int4_gemv_is_kernel[(programs,)](
        x, packed, scales, y, x if norm_weight is None else norm_weight, x if residual is None else residual,
        N, K, float(eps),
        x.stride(-1), packed.stride(0) // 4, scales.stride(0), scales.stride(1), y.stride(-1),
        GROUP=G, Q=Q, R=R, PROLOGUE=2 if swiglu else 1 if norm_weight is not None else 0,
        HAS_RES=residual is not None, num_warps=max(1, min(16, Q // 32)), **launch,
    )


@triton.jit
def _is_chunk(w_ptr, s_ptr, c, N, K, stride_wn, stride_sn, stride_sg, rw, w_mask, rf_row, rf_q, grp,
              R: tl.constexpr, Q: tl.constexpr):
    """Chunk c's weights, (R, 4Q) int32 words, and scales, (R, Q) fp32 (scale of slot q's group in row r), both
    zero past N rows (a program past the last chunk loads nothing)."""
    rn = c * R + tl.arange(0, R)
    w = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * stride_wn + rw[None, :],
                mask=(rn < N)[:, None] & w_mask[None, :], other=0)
    sn = c * R + rf_row
    s = tl.load(s_ptr + sn * stride_sn + grp * stride_sg, mask=(sn < N) & (rf_q < K // 32), other=0.0)
    return w, tl.reshape(s.to(tl.float32), (R, Q))


@triton.jit
def _word_fma(w, a0, a1, a2, a3, a4, a5, a6, a7, acc):
    """acc (R, Q) + sum_i code_i(w) * a_i * 2^-X_EXP for (R, Q) int32 words and (Q,) lifted partners: 8 FMAs."""
    top = w >> 12
    acc += field_f32(w, 0, 4) * a0[None, :]
    acc += field_f32(w, 4, 4) * a1[None, :]
    acc += field_f32(w, 8, 4) * a2[None, :]
    acc += field_f32(w, 12, 4) * a3[None, :]
    acc += field_f32(w, 16, 4) * a4[None, :]
    acc += field_f32(top, 8, 4) * a5[None, :]
    acc += field_f32(top, 12, 4) * a6[None, :]
    acc += field_f32(top, 16, 4) * a7[None, :]
    return acc


@triton.jit
def _int4_gemv_is_kernel(
    # pointers (nw: the RMSNorm weight, res: the residual; read only with PROLOGUE == 1 / HAS_RES)
    x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, res_ptr,
    # sizes; RMSNorm's eps
    N, K, eps,
    # strides (elements; stride_wn in 32-bit words)
    stride_xk, stride_wn, stride_sn, stride_sg, stride_yn,
    # meta-parameters: Q thread-slots (power of 2 >= K / 32), R rows per chunk
    GROUP: tl.constexpr, Q: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr,
    # the small ops inside (`fused_quant_gemv`): prologue 0 none, 1 RMSNorm, 2 SwiGLU; the residual add
    PROLOGUE: tl.constexpr = 0, HAS_RES: tl.constexpr = False,
):
    rq = tl.arange(0, Q)
    q_mask = rq < K // 32  # slots past the row (Q rounded up to a power of two) load nothing
    # Layouts. Triton picks how a load's elements map to threads from the address pattern; every tile here must map
    # slot q of every row to the same thread, or the compiler moves data through shared memory to line them up.
    # The weights: ONE (R, 4Q) tile of 32-bit words, contiguous along its rows, so each thread gets 4 consecutive
    # words (16 bytes) of a row, the quad of slot q = its thread. (An (R, Q, 4) tile left the order of its first
    # two axes to the compiler: Triton 3.6 put rows along the lanes, 4 slots per thread, 4x the x registers.)
    # The scales and the output: addressed by a FLAT index f = r * Q + q (`rf`) and reshaped, as an (R, Q)
    # scale tile is contiguous along neither axis and Triton 3.6 then puts rows along the lanes too.
    rw = tl.arange(0, 4 * Q)
    rf = tl.arange(0, R * Q)
    rf_row, rf_q = rf // Q, rf % Q
    grp = (32 * rf_q) // GROUP  # a slot's 32 k lie in one group (32 divides GROUP)
    w_mask = (rw // 4) < K // 32  # whole quads: the loads stay 16 bytes wide (`rw < K // 8` split them in two)
    n_chunks = tl.cdiv(N, R)
    c = tl.program_id(0)
    step = tl.num_programs(0)
    if PDL:  # let the next kernel's programs start arriving (see `pdl_enabled` in _util.py)
        tl.extra.cuda.gdc_launch_dependents()
    # the first chunk's weights and scales depend on no earlier kernel: request them before waiting for x
    w, s = _is_chunk(w_ptr, s_ptr, c, N, K, stride_wn, stride_sn, stride_sg, rw, w_mask, rf_row, rf_q, grp, R, Q)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # x once per program: each slot's 32 values in one (Q, 32) load (32 two-byte loads per thread made a program's
    # start cost more than its rows at 4+ programs per SM), then split in registers into the 32 lifted
    # partners aJi of code i of word J: x[32q + 8J + i] * 2^(149 - shift_i - X_EXP) (see `field_f32`, `int4_codes`)
    kk = 32 * rq[:, None] + tl.arange(0, 32)[None, :]
    xt, rstd = x_once(x_ptr, nw_ptr, kk, q_mask[:, None], K, eps, stride_xk, PROLOGUE)  # (Q, 32)
    off = tl.sum(xt, axis=1) * (8.0 * 2.0 ** -X_EXP)  # (Q,): the codes' offset of 8, taken off once per row
    c0, c1, c2, c3, c4, c5, c6, c7 = split8(tl.reshape(xt, (Q * 4, 8)))  # c_i[4q + J] = x[32q + 8J + i]
    a00, a10, a20, a30 = split4(tl.reshape(lift(c0, 0), (Q, 4)))
    a01, a11, a21, a31 = split4(tl.reshape(lift(c1, 4), (Q, 4)))
    a02, a12, a22, a32 = split4(tl.reshape(lift(c2, 8), (Q, 4)))
    a03, a13, a23, a33 = split4(tl.reshape(lift(c3, 12), (Q, 4)))
    a04, a14, a24, a34 = split4(tl.reshape(lift(c4, 16), (Q, 4)))
    a05, a15, a25, a35 = split4(tl.reshape(lift(c5, 8), (Q, 4)))  # codes 5..7 are read from w >> 12
    a06, a16, a26, a36 = split4(tl.reshape(lift(c6, 12), (Q, 4)))
    a07, a17, a27, a37 = split4(tl.reshape(lift(c7, 16), (Q, 4)))
    for c in tl.range(c, n_chunks, step, num_stages=1):
        w_next, s_next = _is_chunk(w_ptr, s_ptr, c + step, N, K, stride_wn, stride_sn, stride_sg, rw, w_mask, rf_row,
                                   rf_q, grp, R, Q)
        w0, w1, w2, w3 = quad_words(w)
        acc = tl.zeros([R, Q], tl.float32) - off[None, :]
        acc = _word_fma(w0, a00, a01, a02, a03, a04, a05, a06, a07, acc)
        acc = _word_fma(w1, a10, a11, a12, a13, a14, a15, a16, a17, acc)
        acc = _word_fma(w2, a20, a21, a22, a23, a24, a25, a26, a27, acc)
        acc = _word_fma(w3, a30, a31, a32, a33, a34, a35, a36, a37, acc)
        # lifted by half of 2^X_EXP before the sum so that small parts times small scales do not underflow
        y = tl.sum(acc * (s * 2.0 ** (X_EXP // 2)), axis=1) * 2.0 ** (X_EXP - X_EXP // 2)  # (R,), in every thread
        if PROLOGUE == 1:
            y = y * rstd
        rn = c * R + rf_row
        store_rows(flat(y, Q), y_ptr, res_ptr, rn, (rf_q == 0) & (rn < N), stride_yn, HAS_RES)
        w = w_next
        s = s_next

# -- the K-walking GEMV --------------------------------------------------------------------------------------------
# Each program owns BLOCK_N rows and walks its split of K, one (BLOCK_N, BLOCK_K) tile of 32-bit words at a time. x
# is loaded once per K tile as a (J, 8) tile and split into the x of each code position, so a word's eight products
# are one FMA chain in one thread (no cross-thread reduction inside the loop). A K tile lies in one group (BLOCK_K
# divides GROUP), so the scale multiplies the tile's sums, one scale per row. Its tiles (`quant_tiles.GEMV1_CONFIGS`)
# favour many one-warp programs: what limits it is latency with too few warps in flight (Nsight Compute: under two
# warps per scheduler, an instruction issued on little more than half the cycles; docs/results.md), more than the
# instruction count.


@triton.jit
def _int4_word_sums(w, top, x):
    """(BLOCK_N, J) int32 words w (code i at bits 4i; top = w >> 12) and their x as a (J, 8) fp32 tile ->
    sum_i (code_i - 8) x_i * 2^-X_EXP per (row, word): one FMA chain per (row, word), in one thread, the codes'
    offset of 8 taken off as 8 x the word's x sum (see `field_f32`, `lift`)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = split8(x)  # x_i: the x of code i of each word
    sx = (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7) * (8.0 * 2.0 ** -X_EXP)  # (J,): the codes' offset of 8
    part = field_f32(w, 0, 4) * lift(x0, 0)[None, :] - sx[None, :]
    part += field_f32(w, 4, 4) * lift(x1, 4)[None, :]
    part += field_f32(w, 8, 4) * lift(x2, 8)[None, :]
    part += field_f32(w, 12, 4) * lift(x3, 12)[None, :]
    part += field_f32(w, 16, 4) * lift(x4, 16)[None, :]
    part += field_f32(top, 8, 4) * lift(x5, 8)[None, :]
    part += field_f32(top, 12, 4) * lift(x6, 12)[None, :]
    part += field_f32(top, 16, 4) * lift(x7, 16)[None, :]
    return part


@triton.autotune(configs=GEMV1_CONFIGS, key=["N", "K", "GROUP"], prune_configs_by={"early_config_prune": gemv1_prune},
                 do_bench=tune_bench)
@triton.jit
def _int4_gemv_kernel(
    # pointers (ws, cnt: the split-K scratch, see `split_k_store`)
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    # sizes
    N, K,
    # strides (elements; stride_wn in 32-bit words: the packed rows are read 4 bytes = 8 weights at a time)
    stride_xk, stride_wn, stride_sn, stride_sg, stride_yn, stride_ws,
    # meta-parameters
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    J: tl.constexpr = BLOCK_K // 8  # int32 words per row in a K tile; BLOCK_K divides GROUP, GROUP divides K
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    ri = tl.arange(0, 8)
    n_mask = rn < N
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    k_start, k_end = split_k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_N, J], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :],
                    mask=n_mask[:, None], other=0)  # (BLOCK_N, J): word j holds weights 8j..8j+7, code i at bit 4i
        top = w >> 12  # codes 5, 6, 7 (bits 20..31) down to bits 8..19, inside the fp32 mantissa
        x = tl.load(x_ptr + (k0 + 8 * rj[:, None] + ri[None, :]) * stride_xk).to(tl.float32)  # (J, 8)
        part = _int4_word_sums(w, top, x)  # (BLOCK_N, J)
        s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * (s * 2.0 ** (X_EXP // 2))[:, None]  # one scale per row (the tile lies in one group), lifted
        # by half of 2^X_EXP so that small parts times small scales do not underflow
    y = tl.sum(acc, axis=1) * 2.0 ** (X_EXP - X_EXP // 2)  # the rest of the way back
    split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)


def launch_k_walking(x, packed, scales, y, N: int, K: int, G: int) -> None:
    """Launch `_int4_gemv_kernel` over a grid of cdiv(N, BLOCK_N) row blocks x SPLIT_K splits (the autotuned
    config's), with the split-K scratch of this N (`split_k.scratch`)."""
    ws, cnt = split_k.scratch(x.device, N)
    with zero_on_error(cnt):
        _int4_gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
            x, packed, scales, y, ws, cnt,
            N, K,
            x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1), y.stride(1), ws.stride(0),
            GROUP=G,
        )
