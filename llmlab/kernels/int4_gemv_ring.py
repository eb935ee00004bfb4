"""The int4 Gluon GEMV with its chunks in flight in shared memory: a ring filled by cp.async.

int4_gemv_gluon.py's kernel keeps DEPTH chunks of weights requested ahead in registers and passes them down one
turn per chunk (w = w1; w1 = w_new). In its SASS the loads of the chunk after next come after all the FMAs of the
current chunk: the copy w = w_new would wait for the load, so ptxas loads straight into the registers being summed,
once they are summed, and only one chunk is in flight while the math runs (docs/results.md). Keeping each chunk in
its own registers fixes that order but costs ~30 registers a thread and was slower.

Here the chunks in flight live in shared memory instead, in a ring of DEPTH + 1 slots. Each turn:
1. the program asks for chunk c + DEPTH * step with `cp.async` (Ampere's asynchronous global-to-shared copy, 16
   bytes a thread and row, no registers held) into the slot read the turn before, and closes the request as one
   group (`commit_group`);
2. it waits until at most DEPTH groups are still in flight (`wait_group(DEPTH)`): chunk c has arrived;
3. it reads chunk c from its slot into registers and sums it as int4_gemv_gluon does (`_chunk_sums`,
   `_store_rows`: the same math, the same order, so the same bits).
The loads are issued before the math by construction, whatever ptxas schedules, and the registers hold one chunk,
not DEPTH + 1: ~70 registers a thread against ~100-140, so more programs fit an SM, as far as their shared memory
(`int4_gemv_tiles.ring_bytes`) lets them. Each thread reads back only the words it copied (the same layouts in and
out); Triton's barrier analysis cannot know that and adds a barrier after the wait and one before the next copy.

The scales travel in the ring too (4 bytes a row and slot): cp.async copies 4, 8 or 16 bytes, so the ring takes
fp32 scales only (what `quantize_int4` gives). Whole rows only (no split-K). The tile says which kernel runs: a
step's tuning offers ring configs (`RING` in `int4_gemv_tiles.candidate_configs`) beside the register ones and keeps
whichever is fastest inside the captured step.

Source of the idea: the multi-stage shared-memory pipelines of CUTLASS's Ampere GEMMs and Triton's `num_stages`
(cp.async groups), applied to a GEMV whose tiles are one thread's 16 bytes.
"""

from __future__ import annotations

from . import int4_gemv_gluon as g4

if g4.GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from .int4_gemv_gluon import _chunk_sums, _pdl, _slots, _store_rows, _x_once

    @gluon.jit
    def _request(w_words, s_ptr, w_slot, s_slot, c, N, stride_wn, stride_sn, stride_sg, rw, q_ok, grp,
                 R: gl.constexpr, LW: gl.constexpr, LA: gl.constexpr):
        """Ask for chunk c's weights ((R, 4Q) int32 in LW) and scales ((R, Q) fp32 in LA) to be copied into one
        ring slot, as one cp.async group. Rows past N copy zeros (never stored)."""
        rn_w = c * R + gl.arange(0, R, layout=gl.SliceLayout(1, LW))
        cp.async_copy_global_to_shared(w_slot, w_words + rn_w[:, None] * stride_wn + rw[None, :],
                                       mask=(rn_w < N)[:, None] & q_ok[None, :])
        rn_s = c * R + gl.arange(0, R, layout=gl.SliceLayout(1, LA))
        cp.async_copy_global_to_shared(s_slot, s_ptr + rn_s[:, None] * stride_sn + grp[None, :] * stride_sg,
                                       mask=(rn_s < N)[:, None])
        cp.commit_group()

    @gluon.jit
    def _int4_gemv_ring_kernel(
        # the arguments of int4_gemv_gluon's kernel, so that a launch picks either; split-K's (ws_ptr, cnt_ptr,
        # stride_ws, MAXC, LF) are unused: SPLITS must be 1
        x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, res_ptr, ws_ptr, cnt_ptr, stride_ws, N, K, eps,
        stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_sg, stride_yn,
        GROUP: gl.constexpr, R: gl.constexpr, Q: gl.constexpr, PDL: gl.constexpr,
        PROLOGUE: gl.constexpr, HAS_RES: gl.constexpr,
        # chunks in flight ahead of the one being summed: the ring has DEPTH + 1 slots
        DEPTH: gl.constexpr, SPLITS: gl.constexpr, MAXC: gl.constexpr,
        LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr,
        LT: gl.constexpr, LF: gl.constexpr,
    ):
        gl.static_assert(SPLITS == 1, "the ring GEMV sums whole rows")
        LQ: gl.constexpr = gl.SliceLayout(0, LA)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # row-major, 16-byte words stay whole
        buf = gl.allocate_shared_memory(gl.float32, [2, R, Q // 32], plain)
        w_ring = gl.allocate_shared_memory(gl.int32, [DEPTH + 1, R, 4 * Q], plain)
        s_ring = gl.allocate_shared_memory(gl.float32, [DEPTH + 1, R, Q], plain)
        rw, q_ok, grp = _slots(K, GROUP, Q, LW, LQ)
        w_words = w_ptr.to(gl.pointer_type(gl.int32))
        n_chunks = (N + R - 1) // R
        c = gl.program_id(0)
        step = gl.num_programs(0)
        if PDL:
            _pdl(False)
        # the first DEPTH chunks depend on no earlier kernel: requested before waiting for x
        for i in gl.static_range(DEPTH):
            _request(w_words, s_ptr, w_ring.index(i), s_ring.index(i), c + i * step, N, stride_wn, stride_sn,
                     stride_sg, rw, q_ok, grp, R, LW, LA)
        if PDL:
            _pdl(True)
        rstd, off, a0, a1, a2, a3 = _x_once(x_ptr, nw_ptr, K, K, eps, stride_xk, Q, LX, LQ, PROLOGUE)
        turn = 0
        for c in range(c, n_chunks, step):
            ahead = (turn + DEPTH) % (DEPTH + 1)  # the slot summed last turn
            _request(w_words, s_ptr, w_ring.index(ahead), s_ring.index(ahead), c + DEPTH * step, N, stride_wn,
                     stride_sn, stride_sg, rw, q_ok, grp, R, LW, LA)
            cp.wait_group(DEPTH)  # chunk c has landed
            slot = turn % (DEPTH + 1)
            w = w_ring.index(slot).load(LW)
            s = s_ring.index(slot).load(LA)
            p = _chunk_sums(w, s, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            _store_rows(p, buf.index(turn % 2), y_ptr, res_ptr, rstd, c, N, stride_yn, LT, R, PROLOGUE == 1,
                        HAS_RES)
            turn += 1
        cp.wait_group(0)  # the requests past the last chunk (zeros) land before the program's memory is freed
