"""Device experiment (session 11): an M = 1 int4 GEMV whose x needs no layout conversion, against the package's
`_int4_gemv_kernel` at Llama-3.1-8B's shapes.

Why: every int4 GEMV tried so far (the package kernel, call AQ's register prefetch) loads x as a (J, 8) tile and
splits it into the x of each nibble position; the split x then has to be moved into the layout of the weight tile
before the products, which Triton does through shared memory with a barrier in every K step (LDS + BAR, checked
offline in session 8). That barrier is why programs of more than one warp lost, and the shared-memory loads are
what Nsight Compute showed the warps waiting on (call AG).

Change: store the codes of each 32-weight chunk (4 int32 words) "field-major": word q, nibble i holds weight
32 c + 4 i + q (the package's format: weight 8 w + i). Then the x of nibble i for the words of a K tile is x at
k0 + 32 (j // 4) + 4 i + j % 4 — runs of 4 contiguous elements, like the words themselves — and it is loaded as a
(1, J) tensor, which Triton gives the same blocked layout as the (BLOCK_N, J) word tile: the broadcast in the
products moves nothing. Same arithmetic otherwise (`_field`/`_lift`, the offset of 8 via the word's x sum, one
scale per row per tile, the split-K fixup). The repack is done once, at quantization time (as Marlin does its own
weight order, https://github.com/IST-DASLab/marlin).

Prediction: no LDS/BAR in the loop (checked offline: `--asm`), multi-warp programs no longer penalized, int4 at
14336 x 4096 from 14.6 us toward ~11 us (2.9x bf16).

    python tools/exp_int4_xlayout.py out.json       # on the GPU: the sweep, each config checked first
    TRITON_INTERPRET=1 python tools/exp_int4_xlayout.py --check     # on a CPU: correctness at small sizes
    python tools/exp_int4_xlayout.py --asm          # on a CPU: compile for sm_90, count the loop's instructions
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import int4_gemv_sweep  # noqa: E402
from llmlab.kernels.dequant_matmul import X_EXP, _field, _lift  # noqa: E402
from llmlab.kernels.split_k import split_k_range, split_k_store  # noqa: E402


def repack_chunk32(packed: torch.Tensor) -> torch.Tensor:
    """The package's int4 packing (N, K // 2) uint8 (weight 8 w + i at nibble i of word w) -> the chunk order: in
    each 32-weight chunk c, word q nibble i holds weight 32 c + 4 i + q. Same shape and bytes."""
    N, half = packed.shape
    u = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(N, 2 * half)  # codes in k order
    u = u.view(N, -1, 8, 4).transpose(-1, -2).reshape(N, 2 * half)  # position q * 8 + i <- weight 4 i + q
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


@triton.jit
def _chunk_sums(w, xp, stride_xk, part, FIRST: tl.constexpr):
    """One 32-weight chunk per row: w (BLOCK_N, 4) int32 words in the chunk order, xp (1, 4) pointers to x at the
    chunk's k + q -> part + sum_i (code - 8) x * 2^-X_EXP per (row, word), one FMA chain per (row, word)."""
    top = w >> 12  # nibbles 5, 6, 7 (bits 20..31) down to bits 8..19
    x0 = tl.load(xp).to(tl.float32)
    x1 = tl.load(xp + 4 * stride_xk).to(tl.float32)
    x2 = tl.load(xp + 8 * stride_xk).to(tl.float32)
    x3 = tl.load(xp + 12 * stride_xk).to(tl.float32)
    x4 = tl.load(xp + 16 * stride_xk).to(tl.float32)
    x5 = tl.load(xp + 20 * stride_xk).to(tl.float32)
    x6 = tl.load(xp + 24 * stride_xk).to(tl.float32)
    x7 = tl.load(xp + 28 * stride_xk).to(tl.float32)
    sx = (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7) * (8.0 * 2.0 ** -X_EXP)  # (1, 4): the codes' offset of 8
    if FIRST:
        part = _field(w, 0, 4) * _lift(x0, 0) - sx
    else:
        part += _field(w, 0, 4) * _lift(x0, 0) - sx
    part += _field(w, 4, 4) * _lift(x1, 4)
    part += _field(w, 8, 4) * _lift(x2, 8)
    part += _field(w, 12, 4) * _lift(x3, 12)
    part += _field(w, 16, 4) * _lift(x4, 16)
    part += _field(top, 8, 4) * _lift(x5, 8)
    part += _field(top, 12, 4) * _lift(x6, 12)
    part += _field(top, 16, 4) * _lift(x7, 16)
    return part


@triton.jit
def _int4_gemv_c32(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_xk, stride_wn, stride_sn, stride_sg, stride_yn, stride_ws,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
):
    """Program (row block, split): BLOCK_N rows over the split's groups; each group's 32-weight chunks summed in one
    FMA chain per (row, word), the group's scale applied once per group. Each thread holds 4 words (one chunk) of
    BLOCK_N / (32 num_warps) rows, so the x work of a chunk is shared by that many rows."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rq = tl.arange(0, 4)
    n_mask = rn < N
    w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * stride_wn + rq[None, :]  # (BLOCK_N, 4)
    x_cols = x_ptr + rq[None, :] * stride_xk  # (1, 4)
    k_start, k_end = split_k_range(K, GROUP, SPLIT_K)
    acc = tl.zeros([BLOCK_N, 4], tl.float32)
    for k0 in tl.range(k_start, k_end, GROUP, num_stages=STAGES):
        k0 = tl.multiple_of(k0, GROUP)
        part = acc  # (overwritten by the first chunk)
        for c in tl.static_range(GROUP // 32):
            w = tl.load(w_rows + (k0 + 32 * c) // 8, mask=n_mask[:, None], other=0)
            part = _chunk_sums(w, x_cols + (k0 + 32 * c) * stride_xk, stride_xk, part, c == 0)
        s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * (s * 2.0 ** (X_EXP // 2))[:, None]
    y = tl.sum(acc, axis=1) * 2.0 ** (X_EXP - X_EXP // 2)
    split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)


_scratches: dict = {}


def _scratch(device, N):
    """The split-K scratch for up to 32 splits (the package's holds 8): partial rows (32, N) fp32, counters (N,)."""
    if (device, N) not in _scratches:
        _scratches[(device, N)] = (torch.empty(32, N, dtype=torch.float32, device=device),
                                   torch.zeros(N, dtype=torch.int32, device=device))
    return _scratches[(device, N)]


# packed in the chunk order; cfg: BLOCK_N, SPLIT_K, STAGES, num_warps
launch = int4_gemv_sweep.launcher(_int4_gemv_c32, _scratch)


def check_small() -> None:
    """The CPU interpreter: one split, several, a short last split, N not a multiple of BLOCK_N."""
    int4_gemv_sweep.check_small(launch, [
        (37, 256, 64, dict(BLOCK_N=16, SPLIT_K=1, STAGES=1)),
        (37, 256, 64, dict(BLOCK_N=8, SPLIT_K=3, STAGES=2)),
        (64, 512, 128, dict(BLOCK_N=32, SPLIT_K=2, STAGES=1)),
        (5, 96, 32, dict(BLOCK_N=4, SPLIT_K=2, STAGES=1))], prepare=repack_chunk32)


def asm(cfg: dict | None = None) -> None:
    """Compile for sm_90 without a GPU; print the loop's conversions and SASS opcode counts (SASS_OUT: a path
    prefix to keep the TTGIR and SASS)."""
    cfg = cfg or dict(BLOCK_N=256, SPLIT_K=8, STAGES=1, num_warps=1)
    meta = {k: v for k, v in cfg.items() if k != "num_warps"}
    int4_gemv_sweep.loop_instructions(_int4_gemv_c32, dict(stride_xk=1, stride_sg=1, stride_yn=1, GROUP=128, **meta),
                                      cfg["num_warps"], cfg["BLOCK_N"] // (32 * cfg["num_warps"]) * 128,
                                      os.environ.get("SASS_OUT", ""))


SWEEP = [dict(BLOCK_N=32 * nw * r, SPLIT_K=sk, STAGES=st, num_warps=nw)
         for r in (2, 4, 8) for nw in (1, 2, 4) for sk in (1, 2, 4, 8, 16, 32) for st in (1, 2)
         if nw < 4 or (r == 4 and st == 1)]


def keep(N: int, K: int, cfg: dict) -> bool:
    """Grids of 2..32 warps per SM of an H200 (132 SMs), splits of at least one group."""
    warps = triton.cdiv(N, cfg["BLOCK_N"]) * cfg["SPLIT_K"] * cfg["num_warps"]
    return 2 * 132 <= warps <= 32 * 132 and cfg["SPLIT_K"] <= K // 128


def sweep(out_path: str) -> None:
    int4_gemv_sweep.sweep(out_path, "c32", launch, SWEEP, prepare=repack_chunk32, keep=keep)


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        check_small()
    elif sys.argv[1:2] == ["--asm"]:
        asm(eval(sys.argv[2]) if len(sys.argv) > 2 else None)
    else:
        sweep(sys.argv[1])
