"""int4 GEMV at batch 1 written in Gluon: the input-stationary GEMV of int4_gemv.py with its row sums laid out by
hand.

`int4_matmul` runs this kernel for M = 1 on a CUDA GPU, for rows of up to MAX_K weights, when Triton ships Gluon
(`triton.experimental.gluon`, Triton 3.6 and later) and the kernel compiles. Otherwise, and in the CPU interpreter
(which does not run Gluon), it runs the Triton kernel `_int4_gemv_is_kernel` in int4_gemv.py. Both form the same
products the same way; they sum them in a different order, as each chunk's row sums cross the threads differently.

The design (see int4_gemv.py's notes on the input-stationary GEMV for the long form): a program spans whole rows.
Thread slot q owns k in [32q, 32q + 32) for the program's life, so its 32 values of x are loaded and lifted once;
rows stream past R at a time, each chunk of R rows one 16-byte load per thread and row, the next chunk requested
before this one's math. Per row a thread does 32 masks and 32 FMAs (`_field`, `_lift`: packed_fields.py's
`field_f32` and `lift`).

What Gluon adds is control of the layouts (https://triton-lang.org/main/getting-started/tutorials/ and
triton/python/tutorials/gluon in the Triton repository). Per chunk the (R, Q) partial sums must be summed over Q.
Triton's reduction does it row by row: a 5-step butterfly in every warp for each of the R rows, then two trips
through shared memory (3 barriers). Here:
1. The sums are viewed as (R, Q // 32, 32) (dim 2 = the lane) and converted to a layout where the rows sit on the
   lanes and log2(R) lane bits sit in registers instead: a transpose inside each warp (no barrier).
2. Each thread adds its registers, then 5 - log2(R) butterfly steps finish the warp's sums: (R, warps) values.
3. The warps meet in shared memory: one store, one barrier, one load, and a thread holding a row's partials from
   every warp writes y.
Two shared arrays are used alternately (the turn's parity); Triton's barrier analysis cannot tell the two apart, so
it adds one barrier before the store: 2 barriers per chunk, against 3 plus 5R shuffle steps.

It is faster than int4_gemv.py's Triton kernels at every Llama-3.1-8B shape (docs/results.md has the figures
against cuBLAS bf16). Rows of K = 14336, the down projection, gain least: the 448 slots of a row need 16 warps, so
one program fills an SM and the configs barely differ there; the same bytes as shorter rows run faster.

Configs (`config`): R = 8 rows per chunk and one slot per thread up to K = 4096, R = 4 above; as many persistent
programs as fit the GPU at once (one wave: the compiled kernel's registers set how many fit an SM), or one per chunk
when there are fewer chunks — the best program count, or close to it, at every shape; fewer programs (the fewest
that keep one wave's chunks per program) leave less in flight. Each program keeps DEPTH chunks requested ahead of
the one it sums (default 1). With one 16-warp program an SM (K = 14336), one chunk of 4 rows ahead is ~29 KB in
flight per SM, near what the memory's latency needs to keep copy speed; DEPTH 2-3, or more rows a chunk, put more
in flight at the cost of registers. Split-K (SPLITS, offered for such rows): SPLITS programs of 8 or 4 warps share
each chunk's rows, each summing a half or a quarter of every row, so several programs share an SM and each one's
SwiGLU prologue covers only its share of x; each split writes its partial sums to `split_k.scratch`, and the last
of a chunk's splits to finish adds them in split order and writes y (split_k.py's serial split-K; not with the
RMSNorm prologue, whose rstd needs the whole row). A decode step's tuning (`step_tuning`) times R and DEPTH per
role inside the captured step (`candidate_configs`, `check_config`), and for the 16-warp programs the split
configs and the default with its registers capped (`maxnreg`) so that the next GEMV's first program fits on the SM
beside it and, under PDL, starts loading its weights before this one ends (NEXT_PROGRAM_REGS); the chosen config
reaches the kernel as `int4_gemv(..., tile=)`.
"""

from __future__ import annotations

import functools

import torch
import triton

try:  # Gluon is experimental: present from Triton 3.6, its names still move between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # `thread_barrier` in 3.6, `barrier` later
    GLUON_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means: use the Triton kernel
    GLUON_ERROR = f"{type(e).__name__}: {e}"

X_EXP = 64  # as packed_fields.X_EXP: the sums are kept times 2^-X_EXP (see `field_f32` there)
# The longest rows it takes: up to 512 slots of 32 weights, one slot per thread in 16 warps. Longer rows would put
# two or more slots in each thread, where ptxas spills registers, so int4_matmul sends them to int4_gemv.py's
# K-walking GEMV.
MAX_K = 16384


def available(device: torch.device) -> tuple[bool, str]:
    """(True, "") when the Gluon GEMV can run on `device`, else (False, why): not CUDA, the interpreter, or a
    Triton without Gluon."""
    from ._util import interpret_mode
    if device.type != "cuda":
        return False, f"the Gluon GEMV runs on CUDA GPUs, not {device.type}"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is available"
    if interpret_mode():
        return False, "the Triton interpreter (TRITON_INTERPRET=1) does not run Gluon kernels"
    if GLUON_ERROR:
        return False, f"this Triton ({triton.__version__}) has no usable Gluon ({GLUON_ERROR})"
    return True, ""


if GLUON_ERROR is None:
    from .split_k_gluon import finish_splits, store_partial

    @gluon.jit
    def _field(w, SHIFT: gl.constexpr):
        """The 4-bit field at bits SHIFT.. of int32 words w, read as an fp32 subnormal: field * 2^(SHIFT - 149).
        (packed_fields.`field_f32`; a Gluon kernel cannot call a Triton function.)"""
        return (w & (15 << SHIFT)).to(gl.float32, bitcast=True)

    @gluon.jit
    def _lift(x, SHIFT: gl.constexpr):
        """x * 2^(149 - SHIFT - X_EXP), the partner of `_field(w, SHIFT)` (packed_fields.`lift`)."""
        return x * (2.0 ** (149 - SHIFT - 64))

    @gluon.jit
    def _word_fma(w, a0, a1, a2, a3, a4, a5, a6, a7, acc):
        """acc (R, Q) + sum_i code_i(w) * a_i for (R, Q) int32 words and (Q,) lifted partners: 8 FMAs. Codes 5..7
        sit at bits 20..31, beyond the fp32 mantissa: they are read from w >> 12."""
        top = w >> 12
        acc += _field(w, 0) * a0[None, :]
        acc += _field(w, 4) * a1[None, :]
        acc += _field(w, 8) * a2[None, :]
        acc += _field(w, 12) * a3[None, :]
        acc += _field(w, 16) * a4[None, :]
        acc += _field(top, 8) * a5[None, :]
        acc += _field(top, 12) * a6[None, :]
        acc += _field(top, 16) * a7[None, :]
        return acc

    @gluon.jit
    def _split2(t, L: gl.constexpr):
        """Split t's last axis (size 2, in each thread) into two tensors, asserted to already be in layout L."""
        a, b = gl.split(t)
        return gl.convert_layout(a, L, assert_trivial=True), gl.convert_layout(b, L, assert_trivial=True)

    @gluon.jit
    def _partners(xq, LQ: gl.constexpr):
        """xq (Q, 8) fp32: word J's x values of every slot -> their 8 lifted partners (code i at bits 4i), (Q,)
        each, in the slots' layout LQ."""
        t = gl.reshape(xq, [xq.shape[0], 2, 2, 2])  # (q, i2, i1, i0): i = 4 i2 + 2 i1 + i0
        e, o = gl.split(t)  # i0 = 0 / 1
        e0, e1 = gl.split(e)  # i1
        o0, o1 = gl.split(o)
        x0, x4 = _split2(e0, LQ)  # i2
        x2, x6 = _split2(e1, LQ)
        x1, x5 = _split2(o0, LQ)
        x3, x7 = _split2(o1, LQ)
        return (_lift(x0, 0), _lift(x1, 4), _lift(x2, 8), _lift(x3, 12), _lift(x4, 16), _lift(x5, 8),
                _lift(x6, 12), _lift(x7, 16))

    @gluon.jit
    def _chunk(w_words, s_ptr, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R: gl.constexpr,
               LW: gl.constexpr, LA: gl.constexpr):
        """Chunk c's weights, (R, 4Q) int32 in LW, and scales, (R, Q) fp32 in LA (slot q's group's scale in row
        r). Rows past N load nothing; their values are never stored."""
        rn_w = c * R + gl.arange(0, R, layout=gl.SliceLayout(1, LW))
        w = gl.load(w_words + rn_w[:, None] * stride_wn + rw[None, :], mask=(rn_w < N)[:, None] & q_ok[None, :])
        rn_s = c * R + gl.arange(0, R, layout=gl.SliceLayout(1, LA))
        s = gl.load(s_ptr + rn_s[:, None] * stride_sn + grp[None, :] * stride_sg, mask=(rn_s < N)[:, None])
        return w, s.to(gl.float32)

    @gluon.jit
    def _chunk_sums(w, s, a0, a1, a2, a3, off, L3A: gl.constexpr, L3B: gl.constexpr, LA: gl.constexpr,
                    R: gl.constexpr, Q: gl.constexpr):
        """One chunk: (R, Q // 32) fp32 row sums of each warp (rows on lanes), lifted by 2^(X_EXP / 2)."""
        t = gl.reshape(w, [R, Q, 2, 2])  # word 4q + 2 j1 + j0 of each row
        ev, od = gl.split(t)  # j0 = 0 / 1
        w0, w2 = _split2(ev, LA)
        w1, w3 = _split2(od, LA)
        acc = gl.zeros([R, Q], gl.float32, LA) - off[None, :]  # the codes' offset of 8, once per row
        acc = _word_fma(w0, a0[0], a0[1], a0[2], a0[3], a0[4], a0[5], a0[6], a0[7], acc)
        acc = _word_fma(w1, a1[0], a1[1], a1[2], a1[3], a1[4], a1[5], a1[6], a1[7], acc)
        acc = _word_fma(w2, a2[0], a2[1], a2[2], a2[3], a2[4], a2[5], a2[6], a2[7], acc)
        acc = _word_fma(w3, a3[0], a3[1], a3[2], a3[3], a3[4], a3[5], a3[6], a3[7], acc)
        acc = acc * (s * 2.0 ** 32)  # scaled, and lifted by half of 2^X_EXP so small sums do not underflow
        t3 = gl.convert_layout(gl.reshape(acc, [R, Q // 32, 32]), L3A, assert_trivial=True)
        t3 = gl.convert_layout(t3, L3B)  # step 1: the in-warp transpose, rows onto lanes
        return gl.sum(t3, axis=2)  # step 2: registers, then the butterfly over the lanes left

    @gluon.jit
    def _store_rows(p, buf, y_ptr, res_ptr, rstd, c, N, stride_yn, LT: gl.constexpr, R: gl.constexpr,
                    NORM: gl.constexpr, HAS_RES: gl.constexpr):
        """Step 3: the warps' partial row sums p through shared memory `buf`; y = their sum, for chunk c's rows,
        times rstd (NORM: the RMSNorm prologue's scale) and plus the residual (HAS_RES: the output rounded to y's
        dtype first, as the unfused add sees it)."""
        buf.store(p)
        _cta_barrier()
        v = buf.load(LT)
        y = gl.sum(v, axis=1) * 2.0 ** 32  # the other half of 2^X_EXP
        if NORM:
            y = y * rstd
        rn = c * R + gl.arange(0, R, layout=gl.SliceLayout(1, LT))
        if HAS_RES:
            r = gl.load(res_ptr + rn, mask=rn < N, other=0.0).to(gl.float32)
            y = y.to(y_ptr.dtype.element_ty).to(gl.float32) + r
        gl.store(y_ptr + rn * stride_yn, y.to(y_ptr.dtype.element_ty), mask=rn < N)

    @gluon.jit
    def _slots(K, GROUP: gl.constexpr, Q: gl.constexpr, LW: gl.constexpr, LQ: gl.constexpr):
        """Per thread: its word columns of the (R, 4Q) tile (rw), which of them lie inside the row (whole slots, so
        the loads stay 16 bytes wide), and each slot's scale group (slots past K, when Q > K / 32, read a real
        scale: the last group's)."""
        rw = gl.arange(0, 4 * Q, layout=gl.SliceLayout(0, LW))
        rq = gl.arange(0, Q, layout=LQ)
        return rw, (rw // 4) < K // 32, gl.minimum((32 * rq) // GROUP, K // GROUP - 1)

    @gluon.jit
    def _pdl(WAIT: gl.constexpr):
        """Programmatic dependent launch (see `pdl_enabled` in _util.py): WAIT = False lets the next kernel's
        programs start arriving; WAIT = True waits until the kernel before this one has finished."""
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
        else:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def x_slots(x_ptr, nw_ptr, K, k_up, eps, stride_xk, Q: gl.constexpr, SPAN: gl.constexpr, LX: gl.constexpr,
                PROLOGUE: gl.constexpr):
        """x, once per program: each slot's SPAN values loaded into its thread as one (Q, SPAN) tile in layout LX
        (k = SPAN q + j; 0 past K), after the prologue (PROLOGUE 1: times the RMSNorm weight, and rstd = 1 /
        sqrt(mean(x^2) + eps) over the whole row, which this program holds; 2: x is [gate | up] and the GEMV's
        input is silu(gate) * up, rounded where the unfused ops round, the up value of k at k_up + k: K for a
        whole row, the full row's K for a split of it). Returns (the tile, rstd: 1.0 without the RMSNorm). Shared
        with the int8 Gluon GEMV (`int8_gemv_gluon.py`)."""
        rqx = gl.arange(0, Q, layout=gl.SliceLayout(1, LX))
        rk = gl.arange(0, SPAN, layout=gl.SliceLayout(0, LX))
        kk = SPAN * rqx[:, None] + rk[None, :]
        k_ok = (rqx < K // SPAN)[:, None]
        xt = gl.load(x_ptr + kk * stride_xk, mask=k_ok, other=0.0).to(gl.float32)
        rstd = 1.0
        if PROLOGUE == 1:
            rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(xt * xt, axis=1), axis=0) / K + eps)
            xt = xt * gl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(gl.float32)
        if PROLOGUE == 2:
            dt: gl.constexpr = x_ptr.dtype.element_ty
            u = gl.load(x_ptr + (k_up + kk) * stride_xk, mask=k_ok, other=0.0).to(gl.float32)
            silu = (xt / (1.0 + gl.exp(-xt))).to(dt).to(gl.float32)
            xt = (silu * u).to(dt).to(gl.float32)
        return xt, rstd

    @gluon.jit
    def _x_once(x_ptr, nw_ptr, K, k_up, eps, stride_xk, Q: gl.constexpr, LX: gl.constexpr, LQ: gl.constexpr,
                PROLOGUE: gl.constexpr):
        """x, once per program, after the prologue (`x_slots`, slots of 32 values: k = 32 q + 8 J + i). Returns
        rstd (1.0 without the RMSNorm), 8 x each slot's sum (the codes' offset of 8) and the lifted partners of
        words J = 0..3, each a tuple of 8 (Q,) tensors in the slots' layout LQ."""
        xt, rstd = x_slots(x_ptr, nw_ptr, K, k_up, eps, stride_xk, Q, 32, LX, PROLOGUE)
        off = gl.convert_layout(gl.sum(xt, axis=1), LQ) * (8.0 * 2.0 ** -64)
        xj = gl.reshape(xt, [Q, 2, 2, 8]).permute(0, 2, 3, 1)  # (q, J0, i, J1), J = 2 J1 + J0
        lo, hi = gl.split(xj)  # J1 = 0 / 1
        x0, x1 = gl.split(lo.permute(0, 2, 1))  # J = 0, 1: (q, i)
        x2, x3 = gl.split(hi.permute(0, 2, 1))  # J = 2, 3
        return rstd, off, _partners(x0, LQ), _partners(x1, LQ), _partners(x2, LQ), _partners(x3, LQ)

    @gluon.jit
    def _int4_gemv_gluon_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, res_ptr,
        # split-K (SPLITS > 1): the scratch's partial rows (SPLITS, N) fp32 and one counter per chunk
        ws_ptr, cnt_ptr, stride_ws,
        # K: the weights of a row each program sums (a split's share of the row with SPLITS > 1)
        N, K, eps,
        # strides in elements (stride_wn in 32-bit words); the row strides are constants: per-row offsets then
        # fold into the loads' addresses
        stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_sg, stride_yn,
        GROUP: gl.constexpr, R: gl.constexpr, Q: gl.constexpr, PDL: gl.constexpr,
        # the small ops inside (`fused_quant_gemv`): 0 none, 1 RMSNorm, 2 SwiGLU; the residual add
        PROLOGUE: gl.constexpr, HAS_RES: gl.constexpr,
        # chunks requested ahead of the one being summed (1..3); programs sharing each chunk's rows, each summing
        # K weights of them (1: whole rows)
        DEPTH: gl.constexpr, SPLITS: gl.constexpr, MAXC: gl.constexpr,
        # register layouts, built by `_layouts` (a jit function cannot loop over layout bases)
        LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr,
        LT: gl.constexpr, LF: gl.constexpr,
    ):
        gl.static_assert(DEPTH >= 1 and DEPTH <= 3, "the loop below rotates 1 to 3 chunks ahead (MAX_DEPTH)")
        LQ: gl.constexpr = gl.SliceLayout(0, LA)
        buf = gl.allocate_shared_memory(gl.float32, [2, R, Q // 32], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rw, q_ok, grp = _slots(K, GROUP, Q, LW, LQ)
        w_words = w_ptr.to(gl.pointer_type(gl.int32))
        n_chunks = (N + R - 1) // R
        c = gl.program_id(0)
        step = gl.num_programs(0)  # a multiple of SPLITS
        j = 0
        if SPLITS > 1:  # program p sums split p % SPLITS of chunks p // SPLITS, + step / SPLITS, ...
            gl.static_assert(PROLOGUE != 1, "the RMSNorm's rstd needs the whole row of x in one program")
            j = c % SPLITS
            c = c // SPLITS
            step = step // SPLITS
            w_words += j * (K // 8)
            s_ptr += j * (K // GROUP) * stride_sg
            x_ptr += j * K * stride_xk
        if PDL:
            _pdl(False)
        # the first DEPTH chunks depend on no earlier kernel: request them before waiting for x. In flight from
        # then on: DEPTH chunks ahead of the one being summed (w, s; then w1, s1; then w2, s2)
        w, s = _chunk(w_words, s_ptr, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
        if DEPTH >= 2:
            w1, s1 = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
        if DEPTH >= 3:
            w2, s2 = _chunk(w_words, s_ptr, c + 2 * step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW,
                            LA)
        if PDL:
            _pdl(True)
        rstd, off, a0, a1, a2, a3 = _x_once(x_ptr, nw_ptr, K, K * SPLITS, eps, stride_xk, Q, LX, LQ, PROLOGUE)
        turn = 0
        c0 = c
        for c in range(c, n_chunks, step):
            w_new, s_new = _chunk(w_words, s_ptr, c + DEPTH * step, N, stride_wn, stride_sn, stride_sg, rw, q_ok,
                                  grp, R, LW, LA)
            p = _chunk_sums(w, s, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            if SPLITS == 1:
                _store_rows(p, buf.index(turn % 2), y_ptr, res_ptr, rstd, c, N, stride_yn, LT, R, PROLOGUE == 1,
                            HAS_RES)
            else:
                store_partial(p, buf.index(turn % 2), ws_ptr + j * stride_ws, c, N, LT, R)
            if DEPTH == 1:
                w = w_new
                s = s_new
            if DEPTH == 2:
                w = w1
                s = s1
                w1 = w_new
                s1 = s_new
            if DEPTH == 3:
                w = w1
                s = s1
                w1 = w2
                s1 = s2
                w2 = w_new
                s2 = s_new
            turn += 1
        if SPLITS > 1:
            finish_splits(ws_ptr, cnt_ptr, y_ptr, res_ptr, c0, step, n_chunks, N, stride_ws, stride_yn, R, SPLITS,
                          MAXC, HAS_RES, LF)


def _layouts(R: int, NW: int, S: int, span: int = 32) -> dict:
    """The kernel's register layouts for R rows per chunk, NW warps, S slots per thread: Q = 32 NW S slots, slot
    q = s * 32 NW + warp * 32 + lane. (R, Q // 32, 32) views put s * NW + warp on dim 1 and the lane on dim 2.
    span: the values of x a slot owns (32 int4 weights = 16 bytes; the int8 Gluon GEMV's slots own 16)."""
    log2 = lambda v: v.bit_length() - 1  # noqa: E731
    Q = 32 * NW * S
    rows = [[1 << i, 0, 0] for i in range(log2(R))]
    reps = [[0, NW << i, 0] for i in range(log2(S))]
    warps = [[0, 1 << i, 0] for i in range(log2(NW))]
    return dict(
        Q=Q,
        LW=gl.BlockedLayout([R, 4], [1, 32], [1, NW], [1, 0]),  # (R, 4Q) words: 4 words of each of R rows
        LA=gl.BlockedLayout([R, 1], [1, 32], [1, NW], [1, 0]),  # (R, Q) sums: a slot's R rows in its thread
        LX=gl.BlockedLayout([1, span], [32, 1], [NW, 1], [1, 0]),  # (Q, span) x: a slot's values in its thread
        # LA seen in 3-D; then with dim 2's lowest log2(R) bits in registers and the rows on those lanes
        L3A=gl.DistributedLinearLayout(rows + reps, [[0, 0, 1 << i] for i in range(5)], warps, [], [R, Q // 32, 32]),
        L3B=gl.DistributedLinearLayout([[0, 0, 1 << i] for i in range(log2(R))] + reps,
                                       rows + [[0, 0, 1 << i] for i in range(log2(R), 5)], warps, [],
                                       [R, Q // 32, 32]),
        LT=gl.BlockedLayout([1, Q // 32], [32, 1], [NW, 1], [1, 0]),  # (R, Q // 32): a row's partials together
    )


def _split_layout(R: int, NW: int):
    """LF, the layout of split-K's fixup (`split_k_gluon.finish_splits`): (chunks, R), one chunk's rows a thread."""
    return gl.BlockedLayout([1, R], [32, 1], [NW, 1], [1, 0])


def config(K: int) -> tuple[int, int, int]:
    """(R rows per chunk, NW warps, S slots per thread) for rows of K weights (see the module notes)."""
    Q = max(32, triton.next_power_of_2(K // 32))
    NW = min(16, Q // 32)
    return (8 if Q <= 128 else 4), NW, Q // (32 * NW)


# The most chunks a program keeps requested ahead of the one it sums (DEPTH), and the most words of weights a thread
# may hold: (DEPTH + 1) chunks of R rows x 4 words a slot. A 16-warp program has at most 128 registers a thread
# (65,536 an SM); half of them stay for x's 32 partners a slot, the sums and the addresses.
MAX_DEPTH = 3
MAX_AHEAD_WORDS = 64
# Under PDL the next kernel's programs start (and request their first weights) on an SM with room for them while this
# kernel still runs. A 16-warp program (K > 8192: the down projection) at its natural ~96 registers a thread leaves
# ~16K of an SM's 65,536, less than one 4-warp program of the GEMVs that follow it (q/k/v, gate/up at K = 4096: up to
# 144 registers a thread, 18,432 in all). The capped candidate limits it to the registers that leave that room.
NEXT_PROGRAM_REGS = 4 * 32 * 144


def check_config(config) -> tuple[int, int]:
    """(R, DEPTH) of a config for this GEMV: a triton.Config whose kwargs are R (rows per chunk, a power of 2 in
    1..32, as the cross-thread sums lay out), DEPTH (chunks requested ahead, 1..MAX_DEPTH) and optionally SPLITS
    (`splits_of`), and whose maxnreg (registers a thread, for ptxas) is None or an int in 32..255. TypeError
    otherwise, naming what is wrong."""
    keys = set(config.kwargs) - {"SPLITS"} if isinstance(config, triton.Config) else None
    if keys != {"R", "DEPTH"}:
        got = f"triton.Config {config}" if isinstance(config, triton.Config) else repr(config)
        raise TypeError(f"int4 GEMV: config must be a triton.Config with R and DEPTH (and SPLITS) and nothing else "
                        f"(see int4_gemv_gluon.candidate_configs), got {got}; a tile chosen for another weight "
                        f"format (int8, float) does not fit: clear the step's tiles or tune again")
    r, d = config.kwargs["R"], config.kwargs["DEPTH"]
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (r, d))
    if not ints or not 1 <= r <= 32 or r & (r - 1) or not 1 <= d <= MAX_DEPTH:
        raise TypeError(f"int4 GEMV: a config's R must be a power of 2 in 1..32 and DEPTH in 1..{MAX_DEPTH}, got "
                        f"R={r!r}, DEPTH={d!r}")
    cap = getattr(config, "maxnreg", None)
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or not 32 <= cap <= 255):
        raise TypeError(f"int4 GEMV: a config's maxnreg must be None or an int in 32..255, got {cap!r}")
    splits_of(config)
    return r, d


def splits_of(config) -> int:
    """The config's SPLITS (1 without one): how many programs share each chunk's rows, each summing K / SPLITS of
    their weights (split-K, module notes). TypeError unless a power of 2 in 1..split_k.MAX_SPLIT_K."""
    from .split_k import MAX_SPLIT_K

    splits = config.kwargs.get("SPLITS", 1) if isinstance(config, triton.Config) else 1
    if not isinstance(splits, int) or isinstance(splits, bool) or not 1 <= splits <= MAX_SPLIT_K \
            or splits & (splits - 1):
        raise TypeError(f"int4 GEMV: a config's SPLITS must be a power of 2 in 1..{MAX_SPLIT_K}, got {splits!r}")
    return splits


def candidate_configs(K: int, device: torch.device | str | None = None) -> list:
    """The configs a decode step's tuning (`step_tuning`) times for rows of K weights: triton.Config({"R",
    "DEPTH"}) for R in 2..8 and DEPTH in 1..MAX_DEPTH whose words in flight fit MAX_AHEAD_WORDS a thread,
    `config(K)`'s R with DEPTH 1 (the default) first, only that one where autotuning is off; for 16-warp programs
    also the default with its registers capped (`maxnreg`) to leave NEXT_PROGRAM_REGS free on the SM, and split-K
    over halves and quarters of the rows (SPLITS 2 and 4, each with `config`'s R for its share) (`_util.
    autotune_configs`); none where the kernel does not run on `device` (a CPU, the interpreter, no Gluon,
    switched off or failed: `int4_matmul.gluon_gemv_status`; None: the current CUDA device) or cannot take K
    (K > MAX_K, or not a multiple of 32)."""
    from ._util import autotune_configs
    from .int4_matmul import gluon_gemv_status

    dev = torch.device("cuda") if device is None else torch.device(device)
    if not 0 < K <= MAX_K or K % 32 or gluon_gemv_status(dev) != "gluon":
        return []
    R0, NW, S = config(K)
    shapes = [(R0, 1)] + [(r, d) for r in (2, 4, 8) for d in range(1, MAX_DEPTH + 1)
                          if (r, d) != (R0, 1) and (d + 1) * r * 4 * S <= MAX_AHEAD_WORDS]
    configs = [triton.Config({"R": r, "DEPTH": d}, num_warps=NW) for r, d in shapes]
    if NW == 16:  # one program an SM: cap it so that the next GEMV's first program fits beside it (see above)
        cap = (65536 - NEXT_PROGRAM_REGS) // (32 * NW) // 8 * 8  # registers are allocated 8 a thread at a time
        configs.append(triton.Config({"R": R0, "DEPTH": 1}, num_warps=NW, maxnreg=cap))
        # split-K: 8- or 4-warp programs over a half or a quarter of each row, several an SM (module notes)
        for splits in (2, 4):
            if K % (32 * splits) == 0:
                r_split, nw_split, _ = config(K // splits)
                configs.append(triton.Config({"R": r_split, "DEPTH": 1, "SPLITS": splits}, num_warps=nw_split))
    return autotune_configs(configs, configs[0])


@functools.lru_cache(maxsize=None)
def _programs_per_sm(n_regs: int, NW: int) -> int:
    """Programs of NW warps and n_regs registers a thread that fit one SM at once (65536 registers, 64 warps)."""
    return max(1, min(65536 // (max(n_regs, 1) * 32 * NW), 64 // NW))


def _max_chunks(N: int, R: int, step: int, splits: int) -> int:
    """MAXC: a power of 2 >= the chunks a split program sums (1 for whole rows, which do not use it)."""
    return triton.next_power_of_2(triton.cdiv(triton.cdiv(N, R), step)) if splits > 1 else 1


_LAUNCH: dict = {}  # what a launch depends on -> (its meta-parameters, programs in one wave), built once per shape


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, pdl: dict,
              norm_weight: torch.Tensor | None = None, eps: float = 1e-5, swiglu: bool = False,
              residual: torch.Tensor | None = None, tile=None) -> None:
    """y = [residual +] x' @ dequant(packed, scales)^T for ONE row of x, on a CUDA GPU, with the Gluon kernel
    (writes y in place); x' = x, RMSNorm(x) with `norm_weight`, or silu(gate) * up with `swiglu`
    (`fused_quant_gemv` says what each does and checks the arguments).

    Args:
        x: (1, K) fp32 / fp16 / bf16, any stride along K (only row 0 is read); (1, 2K) contiguous [gate | up]
            with swiglu.
        packed: (N, K // 2) uint8, two int4 codes per byte (weight_quant's layout), rows contiguous and 4-byte
            aligned; K <= MAX_K.
        scales: (N, K // G) float (fp32 from quantize_int4), any strides.
        y: (1, N) in x's dtype, any stride along N.
        pdl: `pdl_kwargs(device)` from _util.py.
        norm_weight: (K,) contiguous, x's dtype, or None. residual: (1, N) contiguous, x's dtype, or None.
        tile: a triton.Config with R and DEPTH, maxnreg or None, and optionally SPLITS (`check_config`,
            `candidate_configs`), or None: `config(K)`'s R and DEPTH 1, whole rows.

    int4_matmul checks all of this first (K a multiple of 32, G a multiple of 32 dividing K); called directly, bad
    arguments give whatever Triton raises, or wrong numbers. Raises what Triton raises when the kernel cannot be
    built (int4_matmul then falls back to the Triton GEMV); ValueError for a tile whose SPLITS does not fit (K /
    SPLITS not a multiple of G, or with norm_weight: the RMSNorm needs the whole row). A split tile uses
    `split_k.scratch`, as the other split-K GEMVs do: run it once before a CUDA-graph capture (a warm-up)."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    prologue = 2 if swiglu else 1 if norm_weight is not None else 0
    splits = 1 if tile is None else splits_of(tile)
    k_split = K // splits  # the weights of a row each program sums
    if splits > 1 and (prologue == 1 or K % splits or k_split % G):
        raise ValueError(f"int4 GEMV: SPLITS={splits} does not fit this layer: each split must hold whole groups "
                         f"of {G} (K = {K}) and see no RMSNorm (it needs the whole row); use a tile without SPLITS")
    R, depth = (config(k_split)[0], 1) if tile is None else check_config(tile)
    cap = getattr(tile, "maxnreg", None)
    ws = cnt = y  # the split-K scratch: unused by whole rows
    if splits > 1:
        from .split_k import scratch
        ws, cnt = scratch(x.device, N)
    args = (x, packed, scales, y, x if norm_weight is None else norm_weight, x if residual is None else residual,
            ws, cnt, ws.stride(0), N, k_split, float(eps), x.stride(-1), packed.stride(0) // 4, scales.stride(0),
            scales.stride(1), y.stride(-1))
    # what the meta-parameters and the compiled kernel's registers depend on (Triton also specializes on strides of
    # 1 and 16-byte alignment, which change no register count that matters here: the wave only sizes the grid)
    key = (x.device.index, x.dtype, y.dtype, scales.dtype, K, packed.stride(0), scales.stride(0), scales.shape[1],
           pdl.get("PDL"), prologue, residual is not None, R, depth, cap, splits)
    launch = _LAUNCH.get(key)
    if launch is None:  # once per shape and config: the layouts (~0.1 ms of Python to build) and a compile
        _, NW, S = config(k_split)
        meta = dict(GROUP=G, R=R, DEPTH=depth, SPLITS=splits, num_warps=NW, PROLOGUE=prologue,
                    HAS_RES=residual is not None, **_layouts(R, NW, S), LF=_split_layout(R, NW), **pdl,
                    **({"maxnreg": cap} if cap else {}))
        # registers (the wave) from a build for up to 8 chunks a split program; the launch builds its own MAXC
        kernel = _int4_gemv_gluon_kernel.warmup(*args, grid=(splits,), **meta, MAXC=8 if splits > 1 else 1)
        kernel._init_handles()  # loads the binary, which sets n_regs
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        wave = _programs_per_sm(kernel.n_regs, NW) * sms
        launch = _LAUNCH[key] = meta, max(splits, wave // splits * splits)  # whole chunks' worth of splits
    meta, wave = launch
    grid = min(triton.cdiv(N, meta["R"]) * splits, wave)  # one wave (module notes), every chunk's splits in it
    _int4_gemv_gluon_kernel[(grid,)](*args, **meta, MAXC=_max_chunks(N, meta["R"], grid // splits, splits))


def build_offline(K: int, group: int = 128, arch: int = 90, prologue: int = 0, residual: bool = False,
                  tile=None):
    """Compile the kernel for rows of K weights for a CUDA GPU of compute capability `arch` (90: Hopper) without one
    (bf16 x and y; `prologue` 0 / 1 RMSNorm / 2 SwiGLU, `residual` and `tile` as `int4_gemv` takes them): the
    CompiledKernel, whose .asm holds its "ttgir", "ptx" and "cubin". A layout conversion asserted trivial that
    would move data fails here. Not under TRITON_INTERPRET=1, which swaps Triton's library functions for
    interpreted ones."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if GLUON_ERROR:
        raise RuntimeError(f"this Triton ({triton.__version__}) has no usable Gluon: {GLUON_ERROR}")
    if K % 32 or group % 32 or K % group:
        raise ValueError(f"build_offline: K = {K} and group = {group} must be multiples of 32, the group dividing K")
    splits = 1 if tile is None else splits_of(tile)
    R, NW, S = config(K // splits)
    R, depth = (R, 1) if tile is None else check_config(tile)
    fn = _int4_gemv_gluon_kernel
    constexprs = {"GROUP": group, "R": R, "DEPTH": depth, "SPLITS": splits, "MAXC": 8 if splits > 1 else 1,
                  "PDL": False, "PROLOGUE": prologue,
                  "HAS_RES": residual,
                  "stride_xk": 1, "stride_sg": 1, "stride_yn": 1, "stride_wn": K // 8, "stride_sn": K // group,
                  **_layouts(R, NW, S), "LF": _split_layout(R, NW)}
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16", "nw_ptr": "*bf16",
             "res_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "eps": "fp32"}
    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    # the pointers 16-byte aligned and K a multiple of 16, as a launch on torch's allocations specializes them (the
    # weight loads are then 16 bytes wide, as on the GPU)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a in types and a != "eps" or a == "K"}
    cap = getattr(tile, "maxnreg", None)
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": NW, **({"maxnreg": cap} if cap else {})})
