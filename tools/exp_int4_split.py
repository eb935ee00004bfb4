"""Device experiment (session 20): the Gluon int4 GEMV with each row split into P parts, joined in the same kernel.

Issue 5 asks for the int4 GEMV at >= 3x cuBLAS's bf16 GEMV at M = 1 on Llama-3.1-8B's layer shapes. The package's
Gluon kernel (kernels/int4_gemv_gluon.py) takes 13.1 us at 4096 x 14336 (2.47x; the down projection): a row of 14336
weights spans 448 slots, so a program is 16 warps and one fits an SM. In call CR the same bytes as 16384 rows of 3584
took 10.3 us (4-warp programs, four per SM). This file splits each row into P parts (K / P weights each, one
program per (part, chunk of R rows) turn, the package's per-chunk math on a slice of x and of the weights) and joins
the parts' row sums in the kernel:

- JOIN = 0: every part stores its row sums to a workspace and nothing adds them (y is not written). The bound: what
  the split costs without its join.
- JOIN = 1: the part stores its sums, the program's threads meet at a barrier, one thread adds 1 to the chunk's
  counter (acq_rel, GPU scope: the barrier then the release publish every thread's stores), and the program that
  brings it to P adds the P sums in the order of the parts (the same y whichever part comes last: deterministic),
  writes y and sets the counter back to 0 for the next launch. The program waits for the counter's answer (one L2
  round trip) before its next chunk.
- JOIN = 2: the same, but the counter's answer is read one chunk later: thread 0 issues the atomic after the next
  chunk's cross-warp barrier (which also orders this chunk's stores), and the answer is broadcast (a reduction over
  the program) a chunk after that; the last chunks are joined after the loop.
- DIAG16: the package's 16-warp kernel with its cross-warp step left out (each warp stores its own sums, no
  barrier): does the per-chunk barrier of 16 warps cost the 3 us?

    /tmp/t36/bin/python tools/exp_int4_split.py --inspect     # compile for sm_90a on a CPU machine (Triton 3.6)
    python3 tools/exp_int4_split.py OUT.json                   # on the GPU
"""

import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from llmlab.kernels.int4_gemv_gluon import _chunk, _chunk_sums, _cta_barrier, _layouts, _pdl, _slots, _store_rows, _x_once


@gluon.jit
def _join(ws_ptr, y_ptr, cnt_ptr, c, N, stride_yn, P: gl.constexpr, LT: gl.constexpr, R: gl.constexpr):
    """Chunk c's y = the sum of its P parts' row sums (in the order of the parts), and its counter back to 0."""
    rn = c * R + gl.arange(0, R, layout=gl.SliceLayout(1, LT))
    ok = rn < N
    acc = gl.load(ws_ptr + rn, mask=ok, other=0.0, cache_modifier=".cg")
    for pp in gl.static_range(1, P):
        acc += gl.load(ws_ptr + pp * N + rn, mask=ok, other=0.0, cache_modifier=".cg")
    gl.store(y_ptr + rn * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=ok)
    gl.store(cnt_ptr + c, 0)


@gluon.jit
def _arrive(cnt_ptr, c, tid):
    """Thread 0 adds 1 to chunk c's counter (acq_rel, GPU scope); (NT,) int32: the old count in thread 0, 0 elsewhere.
    Nothing waits for it until the result is used."""
    ptrs = cnt_ptr + c + tid * 0
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; mov.u32 $0, 0; setp.eq.s32 p, $1, 0; @p atom.acq_rel.gpu.global.add.u32 $0, [$2], 1; }",
        "=r,r,l", [tid, ptrs], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def split_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_sg, stride_yn,
    GROUP: gl.constexpr, R: gl.constexpr, Q: gl.constexpr, P: gl.constexpr, JOIN: gl.constexpr, PDL: gl.constexpr,
    LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr, LT: gl.constexpr,
    LP: gl.constexpr, NT: gl.constexpr,
):
    LQ: gl.constexpr = gl.SliceLayout(0, LA)
    buf = gl.allocate_shared_memory(gl.float32, [2, R, Q // 32], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    KP = K // P
    pid = gl.program_id(0)
    part = pid % P
    step = gl.num_programs(0) // P
    rw, q_ok, grp = _slots(KP, GROUP, Q, LW, LQ)
    w_words = w_ptr.to(gl.pointer_type(gl.int32)) + part * (KP // 8)
    s_p = s_ptr + part * (KP // GROUP) * stride_sg
    x_p = x_ptr + part * KP * stride_xk
    ws_p = ws_ptr + part * N
    n_chunks = (N + R - 1) // R
    c = pid // P
    if PDL:
        _pdl(False)
    w, s = _chunk(w_words, s_p, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PDL:
        _pdl(True)
    off, a0, a1, a2, a3 = _x_once(x_p, KP, stride_xk, Q, LX, LQ)
    tid = gl.arange(0, NT, layout=LP)
    tk = tid * 0
    pend = -1  # the chunk whose counter's answer is in tk (JOIN = 2)
    done = -1  # the chunk whose sums are stored but not yet counted (JOIN = 2)
    turn = 0
    for c in range(c, n_chunks, step):
        w_next, s_next = _chunk(w_words, s_p, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
        p = _chunk_sums(w, s, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
        b = buf.index(turn % 2)
        b.store(p)
        _cta_barrier()
        v = b.load(LT)
        part_sum = gl.sum(v, axis=1) * 2.0 ** 32
        rn = c * R + gl.arange(0, R, layout=gl.SliceLayout(1, LT))
        if JOIN == 2:
            if pend >= 0:
                if gl.max(tk, axis=0) == P - 1:
                    _join(ws_ptr, y_ptr, cnt_ptr, pend, N, stride_yn, P, LT, R)
            pend = -1
            if done >= 0:  # the barrier above ordered chunk `done`'s stores of every thread before this release
                tk = _arrive(cnt_ptr, done, tid)
                pend = done
        gl.store(ws_p + rn, part_sum, mask=rn < N)
        if JOIN == 1:
            _cta_barrier()
            old = gl.atomic_add(cnt_ptr + c, 1, sem="acq_rel", scope="gpu")
            if old == P - 1:
                _join(ws_ptr, y_ptr, cnt_ptr, c, N, stride_yn, P, LT, R)
        done = c
        w = w_next
        s = s_next
        turn += 1
    if JOIN == 2:
        _cta_barrier()
        if pend >= 0:
            if gl.max(tk, axis=0) == P - 1:
                _join(ws_ptr, y_ptr, cnt_ptr, pend, N, stride_yn, P, LT, R)
        if done >= 0:
            tk = _arrive(cnt_ptr, done, tid)
            if gl.max(tk, axis=0) == P - 1:
                _join(ws_ptr, y_ptr, cnt_ptr, done, N, stride_yn, P, LT, R)


@gluon.jit
def diag16_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr,
    N, K,
    stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_sg, stride_yn,
    GROUP: gl.constexpr, R: gl.constexpr, Q: gl.constexpr, PDL: gl.constexpr,
    LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr,
):
    """The package kernel without its cross-warp step: each warp stores its (R,) sums to ws (y is not written)."""
    LQ: gl.constexpr = gl.SliceLayout(0, LA)
    LP2: gl.constexpr = gl.SliceLayout(2, L3B)
    rw, q_ok, grp = _slots(K, GROUP, Q, LW, LQ)
    w_words = w_ptr.to(gl.pointer_type(gl.int32))
    n_chunks = (N + R - 1) // R
    c = gl.program_id(0)
    step = gl.num_programs(0)
    if PDL:
        _pdl(False)
    w, s = _chunk(w_words, s_ptr, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PDL:
        _pdl(True)
    off, a0, a1, a2, a3 = _x_once(x_ptr, K, stride_xk, Q, LX, LQ)
    rr = gl.arange(0, R, layout=gl.SliceLayout(1, LP2))
    rq = gl.arange(0, Q // 32, layout=gl.SliceLayout(0, LP2))
    for c in range(c, n_chunks, step):
        w_next, s_next = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW,
                                LA)
        p = _chunk_sums(w, s, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
        rn = c * R + rr
        gl.store(ws_ptr + rn[:, None] * (Q // 32) + rq[None, :], p, mask=(rn < N)[:, None])
        w = w_next
        s = s_next


@gluon.jit
def pf_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    N, K,
    stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_sg, stride_yn,
    GROUP: gl.constexpr, R: gl.constexpr, Q: gl.constexpr, PF: gl.constexpr, PDL: gl.constexpr,
    LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr, LT: gl.constexpr,
):
    """The package kernel (kernels/int4_gemv_gluon.py) with PF chunks in flight instead of 1 (PF = 1: the package's
    loop). Call CT: its 16-warp programs at K = 14336 took 13.0 us, 11.1 without the cross-warp step (DIAG16): a
    warp's next-but-one loads wait for the barrier, so for the slowest warp's loads. More chunks in flight keep
    loads issued across it."""
    LQ: gl.constexpr = gl.SliceLayout(0, LA)
    buf = gl.allocate_shared_memory(gl.float32, [2, R, Q // 32], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    rw, q_ok, grp = _slots(K, GROUP, Q, LW, LQ)
    w_words = w_ptr.to(gl.pointer_type(gl.int32))
    n_chunks = (N + R - 1) // R
    c = gl.program_id(0)
    step = gl.num_programs(0)
    if PDL:
        _pdl(False)
    w0, s0 = _chunk(w_words, s_ptr, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PF >= 2:
        w1, s1 = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PF >= 3:
        w2, s2 = _chunk(w_words, s_ptr, c + 2 * step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PF >= 4:
        w3, s3 = _chunk(w_words, s_ptr, c + 3 * step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PDL:
        _pdl(True)
    off, a0, a1, a2, a3 = _x_once(x_ptr, K, stride_xk, Q, LX, LQ)
    turn = 0
    if PF == 1:
        for c in range(c, n_chunks, step):
            wn, sn = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
            p = _chunk_sums(w0, s0, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            _store_rows(p, buf.index(turn % 2), y_ptr, c, N, stride_yn, LT, R)
            w0 = wn
            s0 = sn
            turn += 1
    elif PF == 2:
        for c in range(c, n_chunks, step):
            wn, sn = _chunk(w_words, s_ptr, c + 2 * step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW,
                            LA)
            p = _chunk_sums(w0, s0, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            _store_rows(p, buf.index(turn % 2), y_ptr, c, N, stride_yn, LT, R)
            w0 = w1
            s0 = s1
            w1 = wn
            s1 = sn
            turn += 1
    elif PF == 3:
        for c in range(c, n_chunks, step):
            wn, sn = _chunk(w_words, s_ptr, c + 3 * step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW,
                            LA)
            p = _chunk_sums(w0, s0, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            _store_rows(p, buf.index(turn % 2), y_ptr, c, N, stride_yn, LT, R)
            w0 = w1
            s0 = s1
            w1 = w2
            s1 = s2
            w2 = wn
            s2 = sn
            turn += 1
    else:
        for c in range(c, n_chunks, step):
            wn, sn = _chunk(w_words, s_ptr, c + 4 * step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW,
                            LA)
            p = _chunk_sums(w0, s0, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            _store_rows(p, buf.index(turn % 2), y_ptr, c, N, stride_yn, LT, R)
            w0 = w1
            s0 = s1
            w1 = w2
            s1 = s2
            w2 = w3
            s2 = s3
            w3 = wn
            s3 = sn
            turn += 1


@gluon.jit
def _flush(buf, half, y_ptr, c_g, step, count, N, stride_yn, D: gl.constexpr, R: gl.constexpr, LT: gl.constexpr):
    """The warps' partial row sums of `count` turns (chunks c_g, c_g + step, ...) in group `half` of the shared
    buffer (2 D turns of (R, warps)): y = their sums."""
    for t in gl.static_range(D):
        v = buf.index(half * D + t).load(LT)
        yv = gl.sum(v, axis=1) * 2.0 ** 32
        rn = (c_g + t * step) * R + gl.arange(0, R, layout=gl.SliceLayout(1, LT))
        gl.store(y_ptr + rn * stride_yn, yv.to(y_ptr.dtype.element_ty), mask=(rn < N) & (t < count))


@gluon.jit
def batch_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    N, K,
    stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_sg, stride_yn,
    GROUP: gl.constexpr, R: gl.constexpr, Q: gl.constexpr, D: gl.constexpr, PDL: gl.constexpr,
    LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr, LT: gl.constexpr,
    LT3: gl.constexpr,
):
    """The package kernel with its cross-warp step done once per D turns: each turn's per-warp sums go to shared
    memory, and every D turns one barrier, then y for those D chunks (two groups of D slots used alternately)."""
    LQ: gl.constexpr = gl.SliceLayout(0, LA)
    buf = gl.allocate_shared_memory(gl.float32, [2 * D, R, Q // 32], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    rw, q_ok, grp = _slots(K, GROUP, Q, LW, LQ)
    w_words = w_ptr.to(gl.pointer_type(gl.int32))
    n_chunks = (N + R - 1) // R
    c = gl.program_id(0)
    step = gl.num_programs(0)
    if PDL:
        _pdl(False)
    w, s = _chunk(w_words, s_ptr, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PDL:
        _pdl(True)
    off, a0, a1, a2, a3 = _x_once(x_ptr, K, stride_xk, Q, LX, LQ)
    turn = 0
    c_g = c
    for c in range(c, n_chunks, step):
        w_next, s_next = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW,
                                LA)
        p = _chunk_sums(w, s, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
        if turn % D == 0:
            c_g = c
        buf.index((turn // D) % 2 * D + turn % D).store(p)
        if turn % D == D - 1:
            _cta_barrier()
            _flush(buf, (turn // D) % 2, y_ptr, c_g, step, D, N, stride_yn, D, R, LT)
        w = w_next
        s = s_next
        turn += 1
    if turn % D != 0:
        _cta_barrier()
        _flush(buf, (turn // D) % 2, y_ptr, c_g, step, turn % D, N, stride_yn, D, R, LT)


@gluon.jit
def _gflush(ws, half, y_ptr, c_g, step, count, N, stride_yn, D: gl.constexpr, R: gl.constexpr, W: gl.constexpr,
            LT: gl.constexpr):
    """As `_flush`, the partials read back from the program's global scratch (written by its own warps before the
    barrier: __syncthreads orders global memory within a block)."""
    rr = gl.arange(0, R, layout=gl.SliceLayout(1, LT))
    ww = gl.arange(0, W, layout=gl.SliceLayout(0, LT))
    for t in gl.static_range(D):
        v = gl.load(ws + (half * D + t) * (R * W) + rr[:, None] * W + ww[None, :])
        yv = gl.sum(v, axis=1) * 2.0 ** 32
        rn = (c_g + t * step) * R + rr
        gl.store(y_ptr + rn * stride_yn, yv.to(y_ptr.dtype.element_ty), mask=(rn < N) & (t < count))


@gluon.jit
def gbatch_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr,
    N, K,
    stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_sg, stride_yn,
    GROUP: gl.constexpr, R: gl.constexpr, Q: gl.constexpr, D: gl.constexpr, PDL: gl.constexpr,
    LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr, LT: gl.constexpr,
):
    """batch_kernel with the per-warp partials kept in a global scratch (2 D turns x (R, Q // 32) per program):
    Triton's shared-memory barrier analysis then adds no barrier per turn. One barrier per D turns."""
    LQ: gl.constexpr = gl.SliceLayout(0, LA)
    W: gl.constexpr = Q // 32
    LP2: gl.constexpr = gl.SliceLayout(2, L3B)
    rw, q_ok, grp = _slots(K, GROUP, Q, LW, LQ)
    w_words = w_ptr.to(gl.pointer_type(gl.int32))
    n_chunks = (N + R - 1) // R
    c = gl.program_id(0)
    step = gl.num_programs(0)
    ws = ws_ptr + c * (2 * D * R * W)
    if PDL:
        _pdl(False)
    w, s = _chunk(w_words, s_ptr, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
    if PDL:
        _pdl(True)
    off, a0, a1, a2, a3 = _x_once(x_ptr, K, stride_xk, Q, LX, LQ)
    pr = gl.arange(0, R, layout=gl.SliceLayout(1, LP2))
    pw = gl.arange(0, W, layout=gl.SliceLayout(0, LP2))
    turn = 0
    c_g = c
    for c in range(c, n_chunks, step):
        w_next, s_next = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp, R, LW,
                                LA)
        p = _chunk_sums(w, s, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
        if turn % D == 0:
            c_g = c
        gl.store(ws + ((turn // D) % 2 * D + turn % D) * (R * W) + pr[:, None] * W + pw[None, :], p)
        if turn % D == D - 1:
            _cta_barrier()
            _gflush(ws, (turn // D) % 2, y_ptr, c_g, step, D, N, stride_yn, D, R, W, LT)
        w = w_next
        s = s_next
        turn += 1
    if turn % D != 0:
        _cta_barrier()
        _gflush(ws, (turn // D) % 2, y_ptr, c_g, step, turn % D, N, stride_yn, D, R, W, LT)


_WS: dict = {}


def launch_gbatch(x, packed, scales, y, R=4, D=8, programs=None):
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    Q = max(32, triton.next_power_of_2(K // 32))
    NW = min(16, Q // 32)
    meta = dict(GROUP=G, R=R, D=D, PDL=True, num_warps=NW, launch_pdl=True, **_layouts(R, NW, Q // (32 * NW)))
    ws = _WS.get(x.device)
    if ws is None:
        ws = _WS[x.device] = torch.empty(4 << 20, device=x.device)
    args = (x, packed, scales, y, ws, N, K, x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1),
            y.stride(1))
    wave = _wave(gbatch_kernel, args, meta, ("gbatch", N, K, R, D))
    progs = min(programs or wave, triton.cdiv(N, R))
    assert progs * 2 * D * R * (Q // 32) <= ws.numel()
    gbatch_kernel[(progs,)](*args, **meta)
    return y


def lt3(R, D, NW, Q):
    """(2 D, R, Q // 32) partials: a row's partials of every warp in one thread, the (turn, row) pairs over lanes
    and warps."""
    tr = min(R, 32)
    td = 32 // tr
    return gl.BlockedLayout([1, 1, Q // 32], [td, tr, 1], [NW, 1, 1], [2, 1, 0])


def launch_batch(x, packed, scales, y, R=4, D=8, programs=None, maxnreg=None):
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    Q = max(32, triton.next_power_of_2(K // 32))
    NW = min(16, Q // 32)
    meta = dict(GROUP=G, R=R, D=D, PDL=True, num_warps=NW, launch_pdl=True, LT3=lt3(R, D, NW, Q),
                **_layouts(R, NW, Q // (32 * NW)))
    if maxnreg:
        meta["maxnreg"] = maxnreg
    args = (x, packed, scales, y, N, K, x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1),
            y.stride(1))
    wave = _wave(batch_kernel, args, meta, ("batch", N, K, R, D, maxnreg))
    batch_kernel[(min(programs or wave, triton.cdiv(N, R)),)](*args, **meta)
    return y


def launch_pf(x, packed, scales, y, R=4, PF=2, programs=None, maxnreg=None):
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    Q = max(32, triton.next_power_of_2(K // 32))
    NW = min(16, Q // 32)
    meta = dict(GROUP=G, R=R, PF=PF, PDL=True, num_warps=NW, launch_pdl=True, **_layouts(R, NW, Q // (32 * NW)))
    if maxnreg:
        meta["maxnreg"] = maxnreg
    args = (x, packed, scales, y, N, K, x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1),
            y.stride(1))
    wave = _wave(pf_kernel, args, meta, ("pf", N, K, R, PF, maxnreg))
    pf_kernel[(min(programs or wave, triton.cdiv(N, R)),)](*args, **meta)
    return y


def split_meta(K, G, P, R, NW, join, pdl=True):
    KP = K // P
    Q = max(32, triton.next_power_of_2(KP // 32))
    NW = NW or min(16, Q // 32)
    S = Q // (32 * NW)
    kw = {"launch_pdl": True} if pdl else {}
    return dict(GROUP=G, R=R, P=P, JOIN=join, PDL=pdl, num_warps=NW, NT=32 * NW,
                LP=gl.BlockedLayout([1], [32], [NW], [0]), **_layouts(R, NW, S), **kw)


_OCC: dict = {}


def _wave(kernel, args, meta, key) -> int:
    if key not in _OCC:
        k = kernel.warmup(*args, grid=(1,), **meta)
        k._init_handles()
        nw = meta["num_warps"]
        _OCC[key] = max(1, min(65536 // (max(k.n_regs, 1) * 32 * nw), 64 // nw)) * \
            torch.cuda.get_device_properties(0).multi_processor_count
        print(f"  compiled {key}: {k.n_regs} registers, {k.metadata.shared} B shared", flush=True)
    return _OCC[key]


def launch_split(x, packed, scales, y, ws, cnt, P=4, R=8, NW=None, join=1, programs=None, maxnreg=None):
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    meta = split_meta(K, G, P, R, NW, join)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    args = (x, packed, scales, y, ws, cnt, N, K, x.stride(1), packed.stride(0) // 4, scales.stride(0),
            scales.stride(1), y.stride(1))
    chunks = triton.cdiv(N, R)
    wave = _wave(split_kernel, args, meta, ("split", N, K, P, R, meta["num_warps"], join, maxnreg))
    programs = wave // 2 if programs == "half" else programs or wave
    per_part = min(chunks, programs // P)
    split_kernel[(P * max(1, per_part),)](*args, **meta)
    return y


def launch_diag16(x, packed, scales, y, ws, R=4):
    N, K = packed.shape[0], 2 * packed.shape[1]
    G = K // scales.shape[1]
    Q = max(32, triton.next_power_of_2(K // 32))
    NW = min(16, Q // 32)
    lay = _layouts(R, NW, Q // (32 * NW))
    del lay["LT"]
    meta = dict(GROUP=G, R=R, PDL=True, num_warps=NW, launch_pdl=True, **lay)
    args = (x, packed, scales, y, ws, N, K, x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1),
            y.stride(1))
    wave = _wave(diag16_kernel, args, meta, ("diag16", N, K, R))
    diag16_kernel[(min(wave, triton.cdiv(N, R)),)](*args, **meta)
    return y


def inspect_pf() -> None:
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    batch = os.environ.get("SWEEP") == "batch"
    fn = batch_kernel if batch else pf_kernel
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16"}
    cases = ((14336, 4, 8), (14336, 4, 4), (14336, 8, 8), (4096, 8, 8), (4096, 8, 4), (4096, 4, 8)) if batch else (
        (14336, 4, 1), (14336, 4, 2), (14336, 4, 3), (14336, 2, 4), (14336, 8, 2), (4096, 8, 1), (4096, 4, 2),
        (4096, 8, 2), (4096, 4, 3), (4096, 2, 4))
    for K, R, PF in cases:
        Q = max(32, triton.next_power_of_2(K // 32))
        nw = min(16, Q // 32)
        constexprs = {"GROUP": 128, "R": R, ("D" if batch else "PF"): PF, "PDL": True, "stride_xk": 1, "stride_sg": 1, "stride_yn": 1,
                      "stride_wn": K // 8, "stride_sn": K // 128, **_layouts(R, nw, Q // (32 * nw)),
                      **({"LT3": lt3(R, PF, nw, Q)} if batch else {})}
        sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in types or a == "K"}
        k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
        cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([cuobj, "-res-usage", f.name], capture_output=True, text=True).stdout
        print(f"PF kernel K={K} R={R} PF={PF} NW={nw}:", " ".join(re.findall(r"REG:\d+|STACK:\d+|LOCAL:\d+", res)),
              flush=True)


def inspect() -> None:
    """Compile for sm_90a without a GPU; print registers and spills."""
    if os.environ.get("SWEEP") in ("pf", "batch"):
        return inspect_pf()
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = split_kernel
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32",
             "cnt_ptr": "*i32"}
    for K, P, R, join in ((14336, 4, 8, 0), (14336, 4, 8, 1), (14336, 4, 8, 2), (14336, 2, 4, 2), (4096, 2, 8, 2)):
        meta = split_meta(K, 128, P, R, None, join, pdl=False)
        nw = meta.pop("num_warps")
        constexprs = {**meta, "stride_xk": 1, "stride_sg": 1, "stride_yn": 1, "stride_wn": K // 8,
                      "stride_sn": K // 128, "Q": meta["Q"]}
        sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in types or a == "K"}
        try:
            k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
        except Exception as e:  # noqa: BLE001
            print(f"K={K} P={P} R={R} JOIN={join}: FAILED {str(e)[-2500:]}")
            continue
        cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([cuobj, "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([cuobj, "-sass", f.name], capture_output=True, text=True).stdout
        if os.environ.get("DUMP"):
            open(f"/tmp/split_{K}_{P}_{R}_{join}.ptx", "w").write(k.asm["ptx"])
        print(f"K={K} P={P} R={R} JOIN={join} NW={nw}:", " ".join(re.findall(r"REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+", res)),
              f"BAR {sass.count('BAR.SYNC')} ATOM {len(re.findall(r'ATOM|RED', sass))}", flush=True)


def main() -> None:
    from llmlab.kernels.bench_kernels import _copies, _graph_ms
    from llmlab.kernels.dequant_matmul import dequant_matmul_reference, dequantize_int4, int4_matmul, quantize_int4
    out_path = sys.argv[1]
    dev, G = "cuda", 128
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("LLMLAB_COMMIT", ""), "rows": [], "checks": []}
    torch.manual_seed(0)
    # correctness first, on odd shapes: every join, fp32 / bf16, twice (the counters must be back at 0)
    for N, K, P, R, dt in ((999, 14336, 4, 8, torch.float32), (17, 4096, 2, 8, torch.bfloat16),
                           (4095, 14336, 2, 4, torch.bfloat16), (1001, 8192, 4, 4, torch.float16)):
        w4, s4 = quantize_int4(torch.randn(N, K, device=dev), G)
        x = (torch.randn(1, K, device=dev) * 3).to(dt)
        ref = dequant_matmul_reference(x.float(), dequantize_int4(w4, s4))
        ws = torch.empty(P, N, device=dev)
        cnt = torch.zeros(triton.cdiv(N, R), device=dev, dtype=torch.int32)
        for join in (1, 2):
            for progs in (None, 2 * P, 7 * P):
                for rep in range(2):
                    y = torch.full((1, N), float("nan"), device=dev, dtype=dt)
                    launch_split(x, w4, s4, y, ws, cnt, P=P, R=R, join=join, programs=progs)
                    err = float((y.float() - ref).abs().max() / ref.abs().max())
                    left = int(cnt.abs().sum())
                    res["checks"].append(dict(N=N, K=K, P=P, R=R, join=join, programs=progs, dtype=str(dt), rep=rep,
                                              max_rel_err=err, counters_left=left))
                    print(f"check N={N} K={K} P={P} R={R} JOIN={join} programs={progs} {dt} rep {rep}: "
                          f"err {err:.1e}, counters left {left}", flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)

    for N, K in ((4096, 14336), (14336, 4096), (6144, 4096), (4096, 4096)):
        W = torch.randn(N, K, device=dev)
        w4, s4 = quantize_int4(W, G)
        del W
        wbytes = w4.numel() + s4.numel() * 4
        n = _copies(wbytes, dev)
        sets = [(torch.randn(1, K, device=dev, dtype=torch.bfloat16), w4.clone(), s4.clone(),
                 torch.empty(1, N, device=dev, dtype=torch.bfloat16)) for _ in range(n)]
        ws = torch.empty(4, N, device=dev)
        cnts = {R: torch.zeros(triton.cdiv(N, R), device=dev, dtype=torch.int32) for R in (2, 4, 8)}
        wsd = torch.empty(N * 16, device=dev)
        ref = dequant_matmul_reference(sets[0][0], dequantize_int4(w4, s4)).float().view(-1)
        dense = [(torch.randn(1, K, device=dev, dtype=torch.bfloat16),
                  torch.randn(N, K, device=dev, dtype=torch.bfloat16)) for _ in range(_copies(N * K * 2, dev))]
        t_dense = _graph_ms([lambda x=x, W=W: x @ W.T for x, W in dense])
        del dense
        torch.cuda.empty_cache()
        print(f"{N} x {K}: bf16 x @ W.T {t_dense * 1e3:6.2f} us", flush=True)

        def record(name, call, check=True, **extra):
            try:
                y = call(*sets[0]).float().view(-1)
                torch.cuda.synchronize()
                err = float((y - ref).abs().max() / ref.abs().max()) if check else None
                t = _graph_ms([lambda s=s: call(*s) for s in sets])
                if check:  # after hundreds of replays: still right (the counters went back to 0)
                    sets[0][3].fill_(float("nan"))
                    y = call(*sets[0]).float().view(-1)
                    torch.cuda.synchronize()
                    err = max(err, float((y - ref).abs().max() / ref.abs().max()))
            except Exception as e:  # noqa: BLE001
                print(f"{N} x {K} {name} {extra}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                return
            row = dict(N=N, K=K, variant=name, time_us=t * 1e3, dense_us=t_dense * 1e3, speedup_vs_bf16=t_dense / t,
                       GBps=wbytes / t / 1e6, max_rel_err=err, **extra)
            res["rows"].append(row)
            print(f"{N} x {K} {name:10s} {t * 1e3:6.2f} us {row['speedup_vs_bf16']:.2f}x bf16 err {err} {extra}",
                  flush=True)

        record("package", lambda x, w, s, y: int4_matmul(x, w, s))
        if K == 14336:
            record("diag16", lambda x, w, s, y: launch_diag16(x, w, s, y, wsd), check=False)
        Ps = (4, 2) if K == 14336 else (2,)
        for P in Ps:
            for R in (8, 4) if K // P <= 4096 else (4, 8):
                for join in (0, 1, 2):
                    progs_opts = (None,) if join == 0 else (None, "half")
                    for progs in progs_opts:
                        def call(x, w, s, y, P=P, R=R, join=join, progs=progs):
                            return launch_split(x, w, s, y, ws, cnts[R], P=P, R=R, join=join, programs=progs)
                        record("split", call, check=join > 0, P=P, R=R, join=join, programs=progs or "wave")
                    if K == 14336 and P == 4 and join > 0:  # the join costs registers (168 against 128): capped
                        record("split", lambda x, w, s, y, P=P, R=R, join=join: launch_split(
                            x, w, s, y, ws, cnts[R], P=P, R=R, join=join, maxnreg=128), P=P, R=R, join=join,
                            programs="wave", maxnreg=128)
        best = sorted((r for r in res["rows"] if (r["N"], r["K"]) == (N, K) and r["max_rel_err"] is not None
                       and r["max_rel_err"] < 1e-2), key=lambda r: r["time_us"])[:5]
        print(f"{N} x {K} best: " + "; ".join(f"{r['variant']} {r['time_us']:.2f} us {r['speedup_vs_bf16']:.2f}x "
                                                f"{ {k: r[k] for k in ('P', 'R', 'join', 'programs') if k in r} }"
                                                for r in best), flush=True)
        del sets
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

def main_pf() -> None:
    """Call CU: the package kernel with PF chunks in flight (SWEEP=pf); call CW: its cross-warp step once per D turns, through a global scratch (SWEEP=batch, PF = D); call CX: the same through shared memory (SWEEP=sbatch); against the package at each shape."""
    from llmlab.kernels.bench_kernels import _copies, _graph_ms
    from llmlab.kernels.dequant_matmul import dequant_matmul_reference, dequantize_int4, int4_matmul, quantize_int4
    out_path = sys.argv[1]
    dev, G = "cuda", 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("LLMLAB_COMMIT", ""), "rows": [], "checks": []}
    torch.manual_seed(0)
    batch = os.environ.get("SWEEP") in ("batch", "sbatch")
    launch_b = launch_batch if os.environ.get("SWEEP") == "sbatch" else launch_gbatch
    run = (lambda x, w, s, y, R, PF, programs=None, maxnreg=None: launch_b(x, w, s, y, R=R, D=PF,
                                                                             programs=programs)) if batch \
        else launch_pf
    for N, K, R, PF, dt in ((999, 14336, 4, 2, torch.float32), (17, 4096, 8, 2, torch.bfloat16),
                            (4095, 14336, 2, 4, torch.bfloat16), (1001, 4096, 4, 3, torch.float16),
                            (1001, 14336, 4, 3, torch.bfloat16), (4096, 4096, 8, 8, torch.float32)):
        w4, s4 = quantize_int4(torch.randn(N, K, device=dev), G)
        x = (torch.randn(1, K, device=dev) * 3).to(dt)
        ref = dequant_matmul_reference(x.float(), dequantize_int4(w4, s4))
        for progs in (None, 3, 100):
            y = torch.full((1, N), float("nan"), device=dev, dtype=dt)
            run(x, w4, s4, y, R=R, PF=PF, programs=progs)
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            res["checks"].append(dict(N=N, K=K, R=R, PF=PF, programs=progs, dtype=str(dt), max_rel_err=err))
            print(f"check N={N} K={K} R={R} PF={PF} programs={progs} {dt}: err {err:.1e}", flush=True)
    for N, K in ((4096, 14336), (14336, 4096), (6144, 4096), (4096, 4096)):
        W = torch.randn(N, K, device=dev)
        w4, s4 = quantize_int4(W, G)
        del W
        wbytes = w4.numel() + s4.numel() * 4
        sets = [(torch.randn(1, K, device=dev, dtype=torch.bfloat16), w4.clone(), s4.clone(),
                 torch.empty(1, N, device=dev, dtype=torch.bfloat16)) for _ in range(_copies(wbytes, dev))]
        ref = dequant_matmul_reference(sets[0][0], dequantize_int4(w4, s4)).float().view(-1)
        dense = [(torch.randn(1, K, device=dev, dtype=torch.bfloat16),
                  torch.randn(N, K, device=dev, dtype=torch.bfloat16)) for _ in range(_copies(N * K * 2, dev))]
        t_dense = _graph_ms([lambda x=x, W=W: x @ W.T for x, W in dense])
        del dense
        torch.cuda.empty_cache()
        print(f"{N} x {K}: bf16 x @ W.T {t_dense * 1e3:6.2f} us", flush=True)

        def record(name, call, **extra):
            try:
                y = call(*sets[0]).float().view(-1)
                torch.cuda.synchronize()
                err = float((y - ref).abs().max() / ref.abs().max())
                t = _graph_ms([lambda s=s: call(*s) for s in sets])
            except Exception as e:  # noqa: BLE001
                print(f"{N} x {K} {name} {extra}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                return
            row = dict(N=N, K=K, variant=name, time_us=t * 1e3, dense_us=t_dense * 1e3, speedup_vs_bf16=t_dense / t,
                       GBps=wbytes / t / 1e6, max_rel_err=err, **extra)
            res["rows"].append(row)
            print(f"{N} x {K} {name:8s} {t * 1e3:6.2f} us {row['speedup_vs_bf16']:.2f}x bf16 err {err:.1e} {extra}",
                  flush=True)

        record("package", lambda x, w, s, y: int4_matmul(x, w, s))
        cfgs = [(4, 1), (4, 2), (4, 3), (2, 2), (2, 4)] if K == 14336 else \
            [(8, 1), (4, 2), (8, 2), (4, 3), (2, 4)]
        if batch:
            cfgs = [(4, 2), (4, 4), (4, 8), (4, 16), (8, 8), (2, 8)] if K == 14336 else \
                [(8, 2), (8, 4), (8, 8), (8, 16), (4, 8)]
            if os.environ["SWEEP"] == "sbatch":
                cfgs = [(4, 2), (4, 4), (4, 8), (4, 16), (2, 8), (2, 16)] if K == 14336 else \
                    [(8, 2), (8, 4), (8, 8), (4, 8), (4, 16)]
        for R, PF in cfgs:
            for progs, mr in ((None, None),) if batch else ((None, None), (sms, None), (2 * sms, None), (None, 128)):
                if mr and K == 14336:
                    continue  # 16 warps: 128 registers is the most anyway
                record(os.environ["SWEEP"], lambda x, w, s, y, R=R, PF=PF, progs=progs, mr=mr: run(
                    x, w, s, y, R=R, PF=PF, programs=progs, maxnreg=mr), R=R, PF=PF,
                    programs=progs or "wave", maxnreg=mr)
        best = sorted((r for r in res["rows"] if (r["N"], r["K"]) == (N, K)), key=lambda r: r["time_us"])[:5]
        print(f"{N} x {K} best: " + "; ".join(f"{r['variant']} {r['time_us']:.2f} us {r['speedup_vs_bf16']:.2f}x "
                                                f"{ {k: r[k] for k in ('R', 'PF', 'programs', 'maxnreg') if k in r} }"
                                                for r in best), flush=True)
        del sets
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--inspect"]:
        inspect()
    elif os.environ.get("SWEEP") in ("pf", "batch", "sbatch"):
        main_pf()
    else:
        main()
