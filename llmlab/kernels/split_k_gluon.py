"""Split-K's fixup for the Gluon GEMVs (int4_gemv_gluon.py): split_k.py's serial split-K, with one atomic round trip
per program instead of one per chunk.

A split program sums a share of K of the rows of several chunks. After each chunk it stores its partial row sums
into its split's row of `split_k.scratch` (`store_partial`), without waiting on anything. After its last chunk it
counts itself done on all of its chunks' counters at once, and for each chunk where it was the last of the SPLITS
it adds the partial rows and writes y (`finish_splits`). A count after every chunk would wait for an atomic's
round trip to L2 each time, which made the split GEMV slower than whole rows (docs/results.md).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # `thread_barrier` in 3.6, `barrier` later


@gluon.jit
def store_partial(p, buf, ws_ptr, c, N, LT: gl.constexpr, R: gl.constexpr):
    """Step 3 for one split of chunk c's rows: the warps' partial sums through shared memory `buf` into this
    split's row of the scratch (`ws_ptr`, already offset to it); `finish_splits` adds them up."""
    buf.store(p)
    _cta_barrier()
    v = buf.load(LT)
    rn = c * R + gl.arange(0, R, layout=gl.SliceLayout(1, LT))
    gl.store(ws_ptr + rn, gl.sum(v, axis=1) * 2.0 ** 32, mask=rn < N)


@gluon.jit
def finish_splits(ws_ptr, cnt_ptr, y_ptr, res_ptr, c0, step, n_chunks, N, stride_ws, stride_yn, R: gl.constexpr,
                  SPLITS: gl.constexpr, MAXC: gl.constexpr, HAS_RES: gl.constexpr, LF: gl.constexpr):
    """After a split program's last chunk: it counts itself done on each of its chunks' counters at once (one
    atomic round trip, not one a chunk), and for the chunks where it was the last of the SPLITS adds the scratch
    rows in split order (the result does not depend on which finished first), adds the residual as the int4
    GEMV's `_store_rows` does, writes y and zeroes the counters for the next launch. Memory order as in
    split_k.py: the first barrier puts every thread's partial stores before the acq_rel counts, the second the
    counts before any thread reads the other splits' rows, which it reads from L2 (.cg loads), not from a stale
    L1. Its chunks: c0, c0 + step, ... below n_chunks, at most MAXC of them (a power of 2; LF lays out (MAXC, R)
    with one chunk's rows in a thread)."""
    _cta_barrier()
    LC: gl.constexpr = gl.SliceLayout(1, LF)
    cc = c0 + gl.arange(0, MAXC, layout=LC) * step
    mine = cc < n_chunks
    one = gl.full([MAXC], 1, gl.int32, LC)
    done = gl.atomic_add(cnt_ptr + cc, one, mask=mine, sem="acq_rel")  # splits of each chunk done before it
    last = mine & (done == SPLITS - 1)
    _cta_barrier()
    rn = cc[:, None] * R + gl.arange(0, R, layout=gl.SliceLayout(0, LF))[None, :]
    m = last[:, None] & (rn < N)
    y = gl.load(ws_ptr + rn, mask=m, other=0.0, cache_modifier=".cg")
    for i in gl.static_range(1, SPLITS):
        y += gl.load(ws_ptr + i * stride_ws + rn, mask=m, other=0.0, cache_modifier=".cg")
    if HAS_RES:
        r = gl.load(res_ptr + rn, mask=m, other=0.0).to(gl.float32)
        y = y.to(y_ptr.dtype.element_ty).to(gl.float32) + r
    gl.store(y_ptr + rn * stride_yn, y.to(y_ptr.dtype.element_ty), mask=m)
    gl.atomic_xchg(cnt_ptr + cc, one - 1, mask=last)
