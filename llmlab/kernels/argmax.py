"""The greedy token: the index of each row's largest logit, over a vocabulary of 100K+ entries, in ONE launch.

At batch 1 the decode step ends with one row of V logits (128256 for Llama 3). `torch.argmax` reduces a row with a
single thread block, so one SM works while the rest idle; `llmlab.sampling.argmax_rows` cuts the row into slices
first, which takes about six small PyTorch kernels (pad, max per slice, argmax of the maxima, gather, multiply, add),
plus the gaps between them inside a decode step. Here it is one launch spread over the GPU (`python -m
llmlab.kernels.argmax` times the three; the figures are in docs/results.md):

    grid (B, cdiv(V, CHUNK)): program (b, c) finds the max of CHUNK logits of row b and its first position, stores
    the pair as a partial, counts itself done on row b's counter; the LAST program of the row to finish reads the
    row's partials and writes the answer (the "last block does the final reduction" pattern of the CUDA samples'
    threadFenceReduction, and of `split_k.py`), then zeroes the counter for the next launch.

Ties go to the lowest index, as in `torch.argmax`: within a chunk `tl.argmax` keeps the first, and across chunks the
first chunk holding the maximum wins. A NaN counts as larger than every number (torch.argmax returns a NaN's
index); a row holding both +inf and NaN gets the first of them, where torch would pick the NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_tensors, demo_needs_cuda, zero_on_error

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHUNK = 1024  # logits per program: 126 programs for a 128256-entry vocabulary, one per SM of an H200
MAX_CHUNKS = 65535  # CUDA's limit on a grid's second dimension
MAX_V = MAX_CHUNKS * CHUNK


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) int64: `torch.argmax` over the last dimension (reads B x V elements once)."""
    return x.argmax(dim=-1)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, part_val_ptr, part_idx_ptr, cnt_ptr, V, stride_xb,
                   CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (b, c): logits [c * CHUNK, (c + 1) * CHUNK) of row b. With one chunk it writes out[b] itself;
    otherwise partial (max, position) -> part_*[b, c], and the row's last program reduces the partials.

    Memory order as in `split_k.split_k_store`: the barrier puts every thread's partial store before the counter's
    acq_rel update; the last program reads the partials with .cg loads (from L2, where the others' stores are)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    row = x_ptr + b.to(tl.int64) * stride_xb  # 64-bit: a logits[:, -1] view of (B, T, V) strides T x V per row
    x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN: larger than any number
    best = tl.max(x, axis=0)
    where = c * CHUNK + tl.argmax(x, axis=0, tie_break_left=True)  # the first position holding `best`
    if n_chunks == 1:
        tl.store(out_ptr + b, where.to(tl.int64))
    else:
        tl.store(part_val_ptr + b * BLOCK_C + c, best)
        tl.store(part_idx_ptr + b * BLOCK_C + c, where)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel")  # chunks of row b finished before this one
        if done == n_chunks - 1:
            cs = tl.arange(0, BLOCK_C)
            vals = tl.load(part_val_ptr + b * BLOCK_C + cs, mask=cs < n_chunks, other=float("-inf"),
                           cache_modifier=".cg")
            first = tl.argmax(vals, axis=0, tie_break_left=True)  # the first chunk holding the row's max
            idx = tl.load(part_idx_ptr + b * BLOCK_C + first, cache_modifier=".cg")
            tl.store(out_ptr + b, idx.to(tl.int64))
            tl.atomic_xchg(cnt_ptr + b, 0)  # ready for the next launch


_scratch_buffers: dict = {}


def _scratch(device: torch.device, B: int, block_c: int):
    """Partial maxima (B, block_c) fp32, their positions (B, block_c) int32 and one counter per row (zero between
    launches), kept for the life of the process per (device, B, block_c): a CUDA graph that captured a launch keeps
    using these addresses. Launches on one stream are safe; two streams at once with the same key are not.
    Raises RuntimeError when a new key is first met during a CUDA-graph capture (see `argmax`)."""
    key = (device, B, block_c)
    if key not in _scratch_buffers:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"argmax: first call for {B} rows of this vocabulary size during a CUDA-graph "
                               f"capture; its scratch counters would be zeroed only when the graph replays. Call "
                               f"argmax once before capturing (a warm-up)")
        _scratch_buffers[key] = (torch.empty(B, block_c, dtype=torch.float32, device=device),
                                 torch.empty(B, block_c, dtype=torch.int32, device=device),
                                 torch.zeros(B, dtype=torch.int32, device=device))
    return _scratch_buffers[key]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum, as `x.argmax(dim=-1)`, in one launch.

    Args:
        x: (B, V) logits, fp32 / fp16 / bf16 (fp32 or fp16 in the CPU interpreter), last dimension contiguous
            (a row-slice view such as `logits[:, -1]` of a (B, T, V) tensor is fine). V <= MAX_V (65535 chunks:
            CUDA's limit on the grid's second dimension).

    Returns:
        (B,) int64 on x's device: the first position of each row's maximum. NaN counts as the maximum; a row
        holding +inf before a NaN gets the +inf's position (torch.argmax: the NaN's).

    Raises:
        ValueError: x not 2-D, B or V zero, a non-contiguous last dimension, V > MAX_V. TypeError: not a tensor,
            an unsupported dtype (see `check_tensors`). RuntimeError: the first call for a (device, B, V size)
            made during a CUDA-graph capture (its scratch would only be zeroed when the graph replays): call once
            before capturing, as a warm-up.
    """
    check_tensors("argmax", DTYPES, x=x)
    if x.dim() != 2:
        raise ValueError(f"argmax: x must be (B, V) logits, got shape {tuple(x.shape)}; for the last position "
                         f"of (B, T, V) logits pass logits[:, -1], for one row of V pass x[None]")
    B, V = x.shape
    if B == 0 or V == 0:
        raise ValueError(f"argmax: x {tuple(x.shape)} is empty; need at least one row of at least one logit")
    if V > MAX_V:
        raise ValueError(f"argmax: {V} logits per row, more than the {MAX_V} ({MAX_CHUNKS} programs of {CHUNK}) "
                         f"one launch covers; use torch.argmax(x, dim=-1)")
    if x.stride(1) != 1 and V > 1:
        raise ValueError(f"argmax: x's last dimension must be contiguous, strides {x.stride()}; pass "
                         f"x.contiguous()")
    n_chunks = triton.cdiv(V, CHUNK)
    block_c = triton.next_power_of_2(n_chunks)
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    part_val, part_idx, counters = _scratch(x.device, B, block_c)
    with zero_on_error(counters):
        _argmax_kernel[(B, n_chunks)](x, out, part_val, part_idx, counters, V, x.stride(0),
                                      CHUNK=CHUNK, BLOCK_C=block_c, num_warps=4)
    return out


if __name__ == "__main__":
    demo_needs_cuda("argmax")
    from triton.testing import do_bench_cudagraph

    from llmlab.sampling import argmax_rows

    for B, V in ((1, 128256), (8, 128256), (1, 32000)):
        x = torch.randn(B, V, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(argmax(x), argmax_reference(x))
        for name, fn in (("triton", argmax), ("argmax_rows", argmax_rows), ("torch.argmax", argmax_reference)):
            print(f"B={B} V={V} {name:12s} {do_bench_cudagraph(lambda: fn(x)) * 1e3:6.1f} us")
