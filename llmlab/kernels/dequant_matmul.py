"""Weight-only int8 and int4 matmul for decode (M = 1..16 tokens): y = x @ dequant(W)^T, dequantized on the fly.

At decode time a Linear layer is a GEMV: every weight is read once per step and used for M multiply-adds, so the
step time is the weight bytes over the memory bandwidth. Storing weights in 8 or 4 bits halves or quarters those
bytes; the kernel reads the small integers, converts them to the activation dtype in registers, and multiplies.
(gpt-fast, https://github.com/pytorch-labs/gpt-fast; Frantar et al., GPTQ https://arxiv.org/abs/2210.17323 for
group-wise scales; Marlin https://github.com/IST-DASLab/marlin for the fp16 x int4 kernel this imitates, simply.)

Formats (`quantize_int8`, `quantize_int4` make them; `dequantize_*` undo them, the references):

  int8, per output channel:  w_q (N, K) int8 in [-127, 127], scales (N,):  W[n, k] ~= w_q[n, k] * scales[n]
  int4, group-wise:          packed (N, K // 2) uint8, scales (N, K // G):   W[n, k] ~= (u[n, k] - 8) * scales[n, k // G]
      where u[n, k] in 0..15 is the 4-bit code of weight k: TWO PER BYTE, the even k in the LOW nibble and the odd
      k in the HIGH nibble:  packed[n, j] = u[n, 2j] | (u[n, 2j + 1] << 4).  Codes are symmetric (-8..7 + 8).

M: the kernels tile M in blocks of 16 rows (tl.dot's minimum), so M = 1..16 is one tile and reads W once. A larger
M still gives the right answer but re-reads W once per 16 rows, and a warning says so: use a dense (dequantized)
matmul for prefill.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from ._util import autotune_configs, check_tensors, demo_needs_cuda, num_sms, pdl_kwargs, tune_bench, zero_on_error
from .split_k import scratch as _scratch
from .split_k import split_k_range as _split_k_range
from .split_k import split_k_store as _split_k_store

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 16

# Autotuning (https://triton-lang.org/main/python-api/generated/triton.autotune.html): the first call for a new
# (N, K) times each config and keeps the fastest. A GEMV's speed is how many bytes are in flight: more, smaller
# column tiles (BLOCK_N) give more programs to spread over the SMs; longer K tiles and more pipeline stages
# (num_stages) keep more loads outstanding per program. See `autotune_configs` for when only one runs.
_GEMV_SHAPES = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
                (128, 128, 8, 3), (64, 64, 4, 5), (128, 64, 4, 4)]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMV_CONFIGS = autotune_configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                                 for n, k, w, st in _GEMV_SHAPES],
                                default=triton.Config({"BLOCK_N": 64, "BLOCK_K": 32}))  # 32 divides any group


def _int4_prune(configs, named_args, **kwargs):
    """int4 configs need BLOCK_K to divide the group size (one scale per column per K tile); 32 always does."""
    G = named_args["GROUP"]
    kept = [c for c in configs if G % c.kwargs["BLOCK_K"] == 0]
    return kept or [triton.Config({"BLOCK_N": 64, "BLOCK_K": 32})]


# -- the PyTorch references: quantize, dequantize, matmul ----------------------------------------------------------

def _check_weight(op: str, w: torch.Tensor, name: str | None = None) -> None:
    """A weight that can be quantized: a non-empty 2-D float tensor of finite values (one NaN or inf makes its row's
    or group's scale NaN or inf, and every output that reads it NaN)."""
    what = "the weight" if name is None else f"the weight {name!r}"
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: {what} is a {type(w).__name__}, not a tensor; give a 2-D float (N, K) tensor, e.g. "
                        f"torch.tensor(w) or a layer's .weight")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{op}: {what} must be a 2-D float (N, K) tensor (out_features x in_features, as "
                         f"nn.Linear.weight), got {w.dtype} of shape {tuple(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{op}: {what} has shape {tuple(w.shape)}, no values to quantize: give at least one row "
                         f"and one column")
    bad = ~torch.isfinite(w)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        n = int(bad.sum())
        raise ValueError(f"{op}: {what} is not finite: {n} of its {w.numel()} values {'is' if n == 1 else 'are'} "
                         f"NaN or inf (the first, {w[row, col].item()}, at row {row}, column {col}), so its scales "
                         f"would be too. Quantize finite weights: reload the checkpoint, or fix the layer that "
                         f"produced them")


def quantize_int8(w: torch.Tensor, *, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (w_q (N, K) int8, scales (N,) fp32), symmetric per output channel (row).

    name: the weight's name (e.g. "layers.0.mlp.down_proj.weight"), for error messages.

    Raises:
        ValueError: w is not a 2-D float tensor, or holds NaN or inf (the message names `name` and the first one)."""
    _check_weight("quantize_int8", w, name)
    w32 = w.float()
    scales = w32.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    w_q = torch.clamp(torch.round(w32 / scales[:, None]), -127, 127).to(torch.int8)
    return w_q, scales


def dequantize_int8(w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w_q (N, K) int8, scales (N,) fp32 (one per output row, from `quantize_int8`) -> W (N, K) fp32: w_q * scale.

    Raises ValueError when scales does not hold one value per row of w_q."""
    if w_q.dim() != 2 or scales.shape != (w_q.shape[0],):
        raise ValueError(f"dequantize_int8: w_q {tuple(w_q.shape)} and scales {tuple(scales.shape)} do not match: "
                         f"give the (N, K) int8 weight and its (N,) scales from quantize_int8")
    return w_q.float() * scales.float()[:, None]


SCALE_LIMIT = 2.0 ** 96  # int4 scales must stay below: the M = 1 GEMVs multiply them by 2^32 (see `X_EXP`)


def _check_k(K: int) -> None:
    """K (the input dimension) a multiple of 32, the kernels' smallest K tile: else no group size fits it."""
    if K % 32:
        raise ValueError(f"int4: K = {K} (the input dimension) is not a multiple of 32, so no group size the kernels "
                         f"can use fits it; pad the input dimension to a multiple of 32 or keep this layer in "
                         f"bf16 or int8")


def _check_group(K: int, group_size: int) -> None:
    """A group size the kernels can use: a positive multiple of 32 (their smallest K tile) that divides K."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"int4: group_size must be an int (e.g. 128), got {group_size!r}")
    _check_k(K)
    fits = [g for g in (256, 128, 64, 32) if K % g == 0]
    hint = f"e.g. {fits[1] if len(fits) > 1 and fits[0] > 128 else fits[0]}"
    if group_size <= 0 or group_size % 32:
        raise ValueError(f"int4: group_size must be a positive multiple of 32 (the kernels' smallest K tile), got "
                         f"{group_size}; use one that divides K = {K} ({hint})")
    if group_size > K:
        raise ValueError(f"int4: group_size {group_size} is larger than K = {K} (a row's length); use a group size "
                         f"that divides K ({hint})")
    if K % group_size:
        raise ValueError(f"int4: group_size {group_size} does not divide K = {K}; use a group size that divides K "
                         f"({hint}) or pad K to a multiple of {group_size}")


def quantize_int4(w: torch.Tensor, group_size: int = 128, *, name: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (packed (N, K // 2) uint8, scales (N, K // group_size) fp32): symmetric, group-wise.

    name: the weight's name (e.g. "layers.0.mlp.down_proj.weight"), for error messages.

    Raises:
        ValueError: w is not a 2-D float tensor, or holds NaN or inf (the message names `name` and the first one);
            group_size not a positive multiple of 32 (the kernels' smallest K tile), larger than K, or not dividing
            K; K not a multiple of 32 (the messages name the fix); a scale of 2^96 or more (|w| above ~5.5e29),
            beyond the M = 1 kernels' range (they lift scales by 2^32 to keep small products from underflowing).
        TypeError: group_size not an int.
    """
    _check_weight("quantize_int4", w, name)
    N, K = w.shape
    _check_group(K, group_size)
    w32 = w.float().view(N, K // group_size, group_size)
    scales = w32.abs().amax(dim=2).clamp(min=1e-12) / 7.0  # (N, K // G); -8 is never used: symmetric
    if scales.max() >= SCALE_LIMIT:
        where = f" in {name}" if name else ""
        raise ValueError(f"quantize_int4: weights{where} up to {w32.abs().max().item():.3g} need scales of 2^96 or "
                         f"more, beyond int4_matmul's range at M = 1; rescale the layer (such weights are usually "
                         f"a bug upstream) or keep it in bf16")
    u = (torch.clamp(torch.round(w32 / scales[..., None]), -8, 7) + 8).to(torch.uint8).view(N, K)
    packed = u[:, 0::2] | (u[:, 1::2] << 4)  # even k: low nibble, odd k: high nibble
    return packed, scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed (N, K // 2) uint8 (two 4-bit values per byte, low nibble first, stored as value + 8) and scales
    (N, K // G) fp32 (one per group of G consecutive inputs, from `quantize_int4`) -> W (N, K) fp32:
    (nibble - 8) * its group's scale.

    Raises ValueError when scales does not hold one row per row of packed and a whole number of groups per row."""
    if packed.dim() != 2 or scales.dim() != 2 or scales.shape[0] != packed.shape[0] or not scales.shape[1] \
            or (2 * packed.shape[1]) % scales.shape[1]:
        raise ValueError(f"dequantize_int4: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not "
                         f"match: give the (N, K // 2) uint8 weight and its (N, K // group_size) scales from "
                         f"quantize_int4")
    N, half = packed.shape
    u = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(N, 2 * half)  # (N, K): low nibble first
    G = 2 * half // scales.shape[1]  # the group size
    return (u.float() - 8) * scales.float().repeat_interleave(G, dim=1)


def dequant_matmul_reference(x: torch.Tensor, w_dequant: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w_dequant (N, K)^T in fp32, cast to x's dtype.

    Bytes: eager PyTorch first materializes dequant(W) in the activation dtype (read N x K x 1 or 0.5 bytes, write
    N x K x 2), then reads it again for the matmul; the fused kernel reads only the packed weights and scales.
    """
    return (x.float() @ w_dequant.float().T).to(x.dtype)


# -- the kernels ---------------------------------------------------------------------------------------------------

@triton.autotune(configs=GEMV_CONFIGS, key=["N", "K"])
@triton.jit
def _int8_matmul_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, y_ptr,
    # sizes
    M, N, K,
    # strides (elements)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # (BLOCK_M, BLOCK_K)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)  # (BLOCK_K, BLOCK_N) int8
        if IEEE:
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))  # |w| <= 127 is exact in fp16 and bf16
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = acc * s[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.autotune(configs=GEMV_CONFIGS, key=["N", "K", "GROUP"], prune_configs_by={"early_config_prune": _int4_prune})
@triton.jit
def _int4_matmul_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, y_ptr,
    # sizes
    M, N, K, GROUP,
    # strides (elements)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_ym, stride_yn,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    # BLOCK_K (unpacked) divides GROUP, so each K tile has one scale per output channel
    HALF: tl.constexpr = BLOCK_K // 2
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, HALF)
    m_mask = rm[:, None] < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + rj  # byte index: holds weights 2j (low nibble) and 2j + 1 (high nibble)
        p = tl.load(w_ptr + rn[None, :] * stride_wn + j[:, None] * stride_wk,
                    mask=n_mask[None, :] & (j[:, None] < K // 2), other=0)  # (HALF, BLOCK_N) uint8
        lo = (p & 0xF).to(tl.int32) - 8
        hi = ((p >> 4) & 0xF).to(tl.int32) - 8
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + (2 * j)[None, :] * stride_xk,
                         mask=m_mask & (2 * j[None, :] < K), other=0.0)  # (BLOCK_M, HALF)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + (2 * j + 1)[None, :] * stride_xk,
                        mask=m_mask & (2 * j[None, :] + 1 < K), other=0.0)
        if IEEE:
            part = tl.dot(x_even, lo.to(x_even.dtype), input_precision="ieee")
            part += tl.dot(x_odd, hi.to(x_odd.dtype), input_precision="ieee")
        else:
            part = tl.dot(x_even, lo.to(x_even.dtype)) + tl.dot(x_odd, hi.to(x_odd.dtype))
        s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * s[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_mask & n_mask[None, :])


# M = 1 (batch-1 decode): no tensor cores. A (16 x K) tile for tl.dot would be 15/16 padding. Here each program
# owns BLOCK_N rows of W and reads them along K, 32 bits at a time (8 int4 or 4 int8 weights per word): a classic
# GEMV on the CUDA cores. At batch 1 the memory system delivers a weight faster than a handful of warps per SM get
# through the few instructions it needs, so the instructions per weight count, and so does their latency:
#  * a field becomes a float with ONE instruction and no int -> float conversion (those run at a quarter of the
#    FMA rate): `_field` masks it in place and reads the word as an fp32 SUBNORMAL, exactly field * 2^(SHIFT - 149);
#    x is multiplied once per K tile by the matching power of two (`_lift`), so the FMA that multiplies the field
#    by x yields field * x * 2^-64 — no FADD per weight to remove an offset, as `_code` needs (the
#    int4 codes' offset of 8 and the int8 bytes' 128 come off as 8 (128) times each word's x sum, one FMA per word);
#  * x is loaded once per K tile as a (J, 8) tile and split into the x of each field position, so each word's
#    eight products are one FMA chain in one thread — no cross-thread reduction inside the loop;
#  * the group scale multiplies a word tile's sum, not every weight: a K tile lies in one group (BLOCK_K divides
#    GROUP), one scale per row for the tile.
# Counted offline (`triton.compile` for sm_90, cuobjdump -sass; the loop body over the weights one thread handles):
# 9.6 instructions per int4 weight for the first byte-wise kernel, 4.2 with `_code`, 3.1-3.7 with `_field`.
# Two more habits, both autotuned, for the bytes in flight (a row of the 8B model's up projection is only 2 KB of
# int4, so a program that walks K alone makes a handful of dependent trips to memory):
#  * the loop is software-pipelined (`tl.range(num_stages=STAGES)`: later tiles' loads are issued before this
#    one is summed — a config's num_stages alone does not pipeline a loop without tl.dot). The pipeline syncs a
#    program's warps every step; with ONE warp per program that is free, and the sweeps (calls W, X) found 1-2 warps
#    per program 1.5-2x faster than 4;
#  * split-K: SPLIT_K programs share a row block's K range (grid N/BLOCK_N x SPLIT_K), each writes its partial
#    sums to a scratch buffer and counts itself done on an atomic counter; the LAST one to finish adds the partials
#    in split order (so the result does not depend on timing) and writes y — one launch, no second "reduce"
#    kernel. This is the "serial split-K" of CUTLASS's GEMMs and the fixup step of Stream-K (Osama et al. 2023,
#    https://arxiv.org/abs/2301.03598). It pays where N is small for the SMs (4096 x 14336: SPLIT_K 4).
# Measured on the H200 (M = 1, bf16, against cuBLAS bf16, CUDA-graph replay): with `_code` (calls Y, AA, AC) int4
# 1.71-1.95x (the byte-wise kernel: 1.32-1.44x), int8 1.63-1.79x. With `_field` (call AE's sweep of every config)
# int4 gained ~10% at 14336 x 4096 (14.6 us, 2.11x), int8 nothing: int8 already streams at 3.4 TB/s (80% of copy)
# at the large shapes. A quarter fewer instructions bought int4 ~10%, not 25%: Nsight Compute (call AG, 14336 x
# 4096) shows 6.0 warps per SM (1.7 per scheduler) with an instruction issued on 58% of cycles — each warp's chain
# (shared-memory loads, then LOP3 -> FMA) waits on LATENCY, with too few warps to hide it, more than on the issue
# rate. What paid was the shape of the work (calls AE, AI): one-warp programs of 32 rows with K split 4-8 ways for
# int4 (more warps in flight, each with a short K range), 4-8 rows x 512-wide K tiles for int8. Call AJ (the
# autotuned package, `..._kernels_micro_20261130T184948Z.json`): int4 2.14x / 2.35x / 1.92x / 1.93x and int8 1.80x /
# 1.91x / 1.89x / 1.97x at 14336 x 4096, 4096 x 14336, 6144 x 4096, 4096 x 4096 (int8 was 1.64-1.66x at 6144 x 4096
# with every earlier config). The tensor-core try (`int4_mma_gemv.py`: weights in the mma fragment order, ~2.5
# instructions per weight) was slower, 25 us: one warp per scheduler stalled on shared memory (call AG). So was a
# persistent form (call AP, `tools/exp_int4_persistent.py`): programs walking 2-8 (row block, split) items in one
# pipelined loop ran 1.1-2x slower, worse with more items each — what this kernel needs is warps in flight.
# Nor did fewer instructions pay by themselves (session 11, `data/runs/2026-12-01_h200_session11.md`): codes stored
# so that x loads straight into the weight tile's layout (no shared memory or barrier in the loop; call BH,
# `tools/exp_int4_xlayout.py`) ran 20.7 vs 14.8 us — every thread of a warp then redoes the same x work, or holds
# so many rows that too few warps run; x's lift and word sums moved before the conversion (call BI,
# `tools/exp_int4_xlift.py`, 10% fewer instructions when compiled offline) ran 15.7 vs 14.8 us.
# The configs: the ones that won somewhere in the sweeps of calls W, X, AE and AI (every config timed by CUDA-graph
# replay at the 8B shapes, `tools/exp_quant_gemv.py`).
_GEMV1_SHAPES = [  # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, STAGES)
    (32, 128, 1, 1, 4), (16, 128, 1, 1, 4), (32, 128, 4, 2, 4), (16, 256, 1, 1, 4), (16, 128, 1, 1, 6),
    (8, 256, 1, 1, 4), (32, 256, 4, 2, 3), (8, 256, 2, 1, 4), (16, 128, 2, 1, 4),
    (32, 128, 2, 1, 4), (64, 128, 4, 2, 4),  # call AE's sweep (int4 14336 x 4096: 14.6 vs 16.5 us)
    (32, 128, 8, 1, 4), (32, 128, 4, 1, 4), (4, 512, 1, 1, 4), (8, 512, 1, 1, 3), (4, 256, 1, 1, 4)]  # call AI's
GEMV1_CONFIGS = autotune_configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st},
                                                num_warps=w) for n, k, sk, w, st in _GEMV1_SHAPES],
                                 # the interpreter's one config splits K, so the CPU tests run the split path
                                 default=triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "STAGES": 1}))
MAGIC = 0x4B000000  # the bits of 2^23 in fp32; the int4 tile kernel takes it as an argument (see `_code`)

def _gemv1_prune(configs, named_args, **kwargs):
    """int4: keep tiles that lie inside one group (BLOCK_K divides the group size; 32 always does).
    Both: drop splits that would get no K tile (more splits than tiles), unless that drops every config."""
    G = kwargs.get("GROUP", named_args.get("GROUP"))  # a constexpr arrives as a keyword; int8 has none
    K = named_args["K"]
    kept = [c for c in configs if G is None or G % c.kwargs["BLOCK_K"] == 0]
    kept = kept or [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "STAGES": 1})]
    return [c for c in kept if c.kwargs["SPLIT_K"] <= triton.cdiv(K, c.kwargs["BLOCK_K"])] or kept[:1]


@triton.jit
def _code(w, SHIFT: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, magic):
    """(the BITS-bit field at bits SHIFT.. of int32 words w) - OFFSET as exact fp32, with no int -> float
    conversion instruction: one LOP3 masks the field in place and ORs in `magic`, the bits of 2^(23 - SHIFT) —
    whose mantissa's last place is worth 2^-SHIFT, so the field's lowest bit (bit SHIFT) is worth 1 and the float
    is 2^(23 - SHIFT) + the field's value; one FADD removes 2^(23 - SHIFT) + OFFSET. Needs SHIFT + BITS <= 23.
    `magic` comes from a kernel argument (`_magic`), not a constant: as a constant, the compiler re-creates the
    mask in a register for every LOP3 (a MOV per weight)."""
    field = w & (((1 << BITS) - 1) << SHIFT)
    return (field | magic).to(tl.float32, bitcast=True) - ((1 << (23 - SHIFT)) + OFFSET)


X_EXP = tl.constexpr(64)  # the GEMVs' sums are kept times 2^-X_EXP (see `_field`)


@triton.jit
def _field(w, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """The BITS-bit field at bits SHIFT.. of int32 words w, read in place as an fp32 SUBNORMAL: one LOP3 (a mask),
    no conversion instruction. With the exponent bits zero the float is exactly field * 2^(SHIFT - 149), so a
    product with `_lift(x, SHIFT)` = x * 2^(149 - SHIFT - X_EXP) is field * x * 2^-X_EXP, exact up to the FMA's
    rounding. Needs SHIFT + BITS <= 23 (the field inside the mantissa) and FMAs that keep subnormal inputs (the
    default: Triton emits fma.rn.f32, not .ftz; on a CPU, `torch.set_flush_denormal(True)` breaks the interpreter's
    runs). The range this leaves x: |x| < 2^(X_EXP - 21 + SHIFT) — 2^43 for SHIFT 0 — before the lifted x
    overflows (inf, then NaN in every sum), and products stay normal (full precision) for
    |field * x| > 2^(X_EXP - 126); smaller ones lose bits and, below 2^-149 * 2^X_EXP, vanish."""
    return (w & (((1 << BITS) - 1) << SHIFT)).to(tl.float32, bitcast=True)


@triton.jit
def _lift(x, SHIFT: tl.constexpr):
    """x (fp32) * 2^(149 - SHIFT - X_EXP), the partner of `_field(w, SHIFT, ...)` (a power of two: exact)."""
    return x * (2.0 ** (149 - SHIFT - X_EXP))


@triton.jit
def _magic(two23, SHIFT: tl.constexpr):
    """The bits of 2^(23 - SHIFT) from those of 2^23 (`two23` = MAGIC, passed as an argument): lower the exponent."""
    return two23 - (SHIFT << 23)


@triton.jit
def _int4_codes(w, m0, m4, m8, m12, m16):
    """int32 words w (8 int4 codes each, code i at bits 4i) -> eight fp32 tensors shaped like w: code i - 8.
    m0..m16: `_magic(magic, SHIFT)` for SHIFT 0, 4, 8, 12, 16, made once before the K loop. Codes 5, 6, 7
    (bits 20..31) are shifted down to bits 8..19 first, to sit inside the fp32 mantissa."""
    top = w >> 12
    return (_code(w, 0, 4, 8, m0), _code(w, 4, 4, 8, m4), _code(w, 8, 4, 8, m8), _code(w, 12, 4, 8, m12),
            _code(w, 16, 4, 8, m16), _code(top, 8, 4, 8, m8), _code(top, 12, 4, 8, m12), _code(top, 16, 4, 8, m16))


@triton.jit
def _split8(x):
    """(J, 8) -> eight (J,) tensors x[:, 0] .. x[:, 7] (three splits of trailing size-2 dimensions)."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 2, 2, 2)))  # a: i = 0, 2, 4, 6; b: i = 1, 3, 5, 7
    a0, a1 = tl.split(a)  # a0: i = 0, 4; a1: i = 2, 6
    b0, b1 = tl.split(b)  # b0: i = 1, 5; b1: i = 3, 7
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _split4(x):
    """(J, 4) -> four (J,) tensors x[:, 0] .. x[:, 3]."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # a: i = 0, 2; b: i = 1, 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _int4_word_sums(w, top, x):
    """(BLOCK_N, J) int32 words w (code i at bits 4i; top = w >> 12) and their x as a (J, 8) fp32 tile ->
    sum_i (code_i - 8) x_i * 2^-X_EXP per (row, word): one FMA chain per (row, word), in one thread, the codes'
    offset of 8 taken off as 8 x the word's x sum (see `_field`, `_lift`)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x)  # x_i: the x of code i of each word
    sx = (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7) * (8.0 * 2.0 ** -X_EXP)  # (J,): the codes' offset of 8
    part = _field(w, 0, 4) * _lift(x0, 0)[None, :] - sx[None, :]
    part += _field(w, 4, 4) * _lift(x1, 4)[None, :]
    part += _field(w, 8, 4) * _lift(x2, 8)[None, :]
    part += _field(w, 12, 4) * _lift(x3, 12)[None, :]
    part += _field(w, 16, 4) * _lift(x4, 16)[None, :]
    part += _field(top, 8, 4) * _lift(x5, 8)[None, :]
    part += _field(top, 12, 4) * _lift(x6, 12)[None, :]
    part += _field(top, 16, 4) * _lift(x7, 16)[None, :]
    return part


@triton.autotune(configs=GEMV1_CONFIGS, key=["N", "K", "GROUP"], prune_configs_by={"early_config_prune": _gemv1_prune},
                 do_bench=tune_bench)
@triton.jit
def _int4_gemv_kernel(
    # pointers (ws, cnt: the split-K scratch, see `_split_k_store`)
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
    k_start, k_end = _split_k_range(K, BLOCK_K, SPLIT_K)
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
    _split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)


@triton.autotune(configs=GEMV1_CONFIGS, key=["N", "K"], prune_configs_by={"early_config_prune": _gemv1_prune},
                 do_bench=tune_bench)
@triton.jit
def _int8_gemv_kernel(
    # pointers (ws, cnt: the split-K scratch, see `_split_k_store`)
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    # sizes
    N, K,
    # strides (elements; stride_wn in 32-bit words: the rows are read 4 weights at a time)
    stride_xk, stride_wn, stride_yn, stride_ws,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
):
    """M = 1: the int4 GEMV's scheme for int8 weights: XOR 0x80 turns each signed byte w into w + 128 in 0..255,
    read by `_field`; 128 times each word's x sum comes off; one scale per output row, applied to each split's
    sums."""
    J: tl.constexpr = BLOCK_K // 4  # int32 words per row in a K tile (K is a multiple of 4)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    ri = tl.arange(0, 4)
    n_mask = rn < N
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    k_start, k_end = _split_k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_N, J], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        jw = k0 // 4 + rj
        w = tl.load(w_words + rn[:, None] * stride_wn + jw[None, :],
                    mask=n_mask[:, None] & (jw < K // 4)[None, :], other=0)  # (BLOCK_N, J): byte i = weight 4j + i
        u = w ^ -0x7F7F7F80  # = 0x80808080 as int32: each byte w becomes w + 128 in 0..255
        top = u >> 16
        kk = k0 + 4 * rj[:, None] + ri[None, :]
        x = tl.load(x_ptr + kk * stride_xk, mask=kk < K, other=0.0).to(tl.float32)  # (J, 4); 0 past K
        x0, x1, x2, x3 = _split4(x)
        sx = (x0 + x1 + x2 + x3) * (128.0 * 2.0 ** -X_EXP)  # (J,): the bytes' offset of 128
        part = _field(u, 0, 8) * _lift(x0, 0)[None, :] - sx[None, :]
        part += _field(u, 8, 8) * _lift(x1, 8)[None, :]
        part += _field(top, 0, 8) * _lift(x2, 0)[None, :]
        part += _field(top, 8, 8) * _lift(x3, 8)[None, :]
        acc += part
    s = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    y = tl.sum(acc, axis=1) * 2.0 ** X_EXP * s  # back from the sums' scale first: s * 2^64 could overflow
    _split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)


# M = 1, int4, in the interpreter and wherever the Gluon form (below) cannot run: an INPUT-STATIONARY GEMV (the
# dataflow names of SCALE-Sim, https://arxiv.org/abs/1811.02883: what stays put in a processing element — here x in
# a thread's registers). The GEMV above walks a few rows along K, so every K step reloads and re-lifts x and each
# row is read in short pieces at different times. This one turns it around: a program spans whole rows, thread-slot
# q owns k in [32q, 32q + 32) (one 16-byte word quad of each packed row) for its whole life, so its 32 x values are
# loaded and lifted ONCE, and rows stream past R at a time — a program's load is R whole rows, contiguous. Per row a
# thread does 32 masks, 32 FMAs in one chain (words split in registers: no multiply to start a word, no sum over
# words), one scale; then the program sums each row across its threads. Programs are persistent (a few per SM,
# walking chunks p, p + P, ...): the next chunk's weights are requested before this chunk's math, the first chunk's
# before the PDL wait. Measured in call CF (tools/exp_int4_xstat.cu, the same design in CUDA C++; Llama-3.1-8B
# shapes, H200): 10.5 us at 14336 x 4096 (3.09x cuBLAS bf16; the K-walking GEMV 14.8 us) and 4.4 us at 4096 x 4096.
# Q (threads per row) is the power of two >= K / 32, num_warps = Q / 32 (one slot per thread).
# One config, not autotuned: over R {2, 4, 8} x programs per SM {0 (one chunk each), 1..6} the times under CUDA-graph
# replay were uneven (call CJ, 14336 x 4096: 12.5 to 36 us; 13.2, 16.2 and 16.6 us for R = 4 at 3, 2 and 4 per
# SM) and the autotuner, timing one launch at a time, chose a config 33% slower than the sweep's best. R = 8 at 2
# programs per SM was best or within 7% of it at every shape of the sweep: 13.3 us at 14336 x 4096 (2.36x cuBLAS
# bf16), 6.9 at 6144 x 4096, 5.4 at 4096 x 4096, 5.8 at 2048 x 8192 (110 registers a thread, Triton 3.6); within
# 8% again in call CK, where int4_matmul made 2.28-2.50x and the CUDA build (call CF's) 2.7-3.0x in the same calls:
# Triton 3.6 sums each chunk's rows with a butterfly per warp and two trips through shared memory (3 barriers), the
# CUDA kernel with one transposed shuffle over all R rows and 1 barrier. See data/runs/2026-12-02_h200_session17-18.md.
IS_R, IS_PPS = 8, 2  # rows per chunk, persistent programs per SM
# At K = 14336 (Q = 512: 16 warps, one program per SM) it took 19.6 us against the K-walking GEMV's 14.0: longer
# rows take that one.
IS_MAX_K = 8192


def _is_launch(x, packed, scales, y, N: int, K: int, G: int, R: int = IS_R, programs: int | None = None,
               pdl: bool | None = None) -> None:
    """Launch `_int4_gemv_is_kernel`: R rows per chunk on `programs` persistent programs (default IS_PPS per SM,
    at most one per chunk), PDL as `pdl_kwargs` says unless `pdl` is given."""
    Q = triton.next_power_of_2(K // 32)
    if programs is None:
        programs = min(triton.cdiv(N, R), IS_PPS * num_sms(x.device))
    launch = pdl_kwargs(x.device) if pdl is None else {"PDL": pdl, **({"launch_pdl": True} if pdl else {})}
    _int4_gemv_is_kernel[(programs,)](
        x, packed, scales, y,
        N, K,
        x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1), y.stride(1),
        GROUP=G, Q=Q, R=R, num_warps=max(1, min(16, Q // 32)), **launch,
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
    acc += _field(w, 0, 4) * a0[None, :]
    acc += _field(w, 4, 4) * a1[None, :]
    acc += _field(w, 8, 4) * a2[None, :]
    acc += _field(w, 12, 4) * a3[None, :]
    acc += _field(w, 16, 4) * a4[None, :]
    acc += _field(top, 8, 4) * a5[None, :]
    acc += _field(top, 12, 4) * a6[None, :]
    acc += _field(top, 16, 4) * a7[None, :]
    return acc


@triton.jit
def _quad_words(w):
    """(R, 4Q) -> words 4q + 0, 1, 2, 3 as four (R, Q) tensors (all four in one thread: no data moves)."""
    a, b = tl.split(tl.reshape(w, (w.shape[0], w.shape[1] // 4, 2, 2)))  # a: words 0, 2; b: words 1, 3
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _int4_gemv_is_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, y_ptr,
    # sizes
    N, K,
    # strides (elements; stride_wn in 32-bit words)
    stride_xk, stride_wn, stride_sn, stride_sg, stride_yn,
    # meta-parameters: Q thread-slots (power of 2 >= K / 32), R rows per chunk
    GROUP: tl.constexpr, Q: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr,
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
    # x once per program: each slot's 32 values in one (Q, 32) load (call CG: 32 two-byte loads per thread made a
    # program's start cost more than its rows at 4+ programs per SM), then split in registers into the 32 lifted
    # partners aJi of code i of word J: x[32q + 8J + i] * 2^(149 - shift_i - X_EXP) (see `_field`, `_int4_codes`)
    xt = tl.load(x_ptr + (32 * rq[:, None] + tl.arange(0, 32)[None, :]) * stride_xk, mask=q_mask[:, None],
                 other=0.0).to(tl.float32)  # (Q, 32)
    off = tl.sum(xt, axis=1) * (8.0 * 2.0 ** -X_EXP)  # (Q,): the codes' offset of 8, taken off once per row
    c0, c1, c2, c3, c4, c5, c6, c7 = _split8(tl.reshape(xt, (Q * 4, 8)))  # c_i[4q + J] = x[32q + 8J + i]
    a00, a10, a20, a30 = _split4(tl.reshape(_lift(c0, 0), (Q, 4)))
    a01, a11, a21, a31 = _split4(tl.reshape(_lift(c1, 4), (Q, 4)))
    a02, a12, a22, a32 = _split4(tl.reshape(_lift(c2, 8), (Q, 4)))
    a03, a13, a23, a33 = _split4(tl.reshape(_lift(c3, 12), (Q, 4)))
    a04, a14, a24, a34 = _split4(tl.reshape(_lift(c4, 16), (Q, 4)))
    a05, a15, a25, a35 = _split4(tl.reshape(_lift(c5, 8), (Q, 4)))  # codes 5..7 are read from w >> 12
    a06, a16, a26, a36 = _split4(tl.reshape(_lift(c6, 12), (Q, 4)))
    a07, a17, a27, a37 = _split4(tl.reshape(_lift(c7, 16), (Q, 4)))
    for c in tl.range(c, n_chunks, step, num_stages=1):
        w_next, s_next = _is_chunk(w_ptr, s_ptr, c + step, N, K, stride_wn, stride_sn, stride_sg, rw, w_mask, rf_row,
                                   rf_q, grp, R, Q)
        w0, w1, w2, w3 = _quad_words(w)
        acc = tl.zeros([R, Q], tl.float32) - off[None, :]
        acc = _word_fma(w0, a00, a01, a02, a03, a04, a05, a06, a07, acc)
        acc = _word_fma(w1, a10, a11, a12, a13, a14, a15, a16, a17, acc)
        acc = _word_fma(w2, a20, a21, a22, a23, a24, a25, a26, a27, acc)
        acc = _word_fma(w3, a30, a31, a32, a33, a34, a35, a36, a37, acc)
        # lifted by half of 2^X_EXP before the sum so that small parts times small scales do not underflow
        y = tl.sum(acc * (s * 2.0 ** (X_EXP // 2)), axis=1) * 2.0 ** (X_EXP - X_EXP // 2)  # (R,), in every thread
        # stored by slot 0 from the flat layout: an (R,) store would first move the sums through shared memory
        y_flat = tl.reshape(tl.broadcast_to(y[:, None], (R, Q)), (R * Q,))
        rn = c * R + rf_row
        tl.store(y_ptr + rn * stride_yn, y_flat.to(y_ptr.dtype.element_ty), mask=(rf_q == 0) & (rn < N))
        w = w_next
        s = s_next


# M = 2..16 (a few decode rows at once): the tensor cores, one (16 x BLOCK_K) x (BLOCK_K x BLOCK_N) tl.dot per K
# tile. The weights are read as the GEMV reads them (32-bit words; each field made its exact value by `_code`, as
# the dot needs the codes themselves), put back in K order by joins that stay
# in each thread, and cast to x's dtype (codes -8..7 are exact in fp16 and bf16), so x is ONE contiguous load and
# there is one dot per tile. Measured (call AC, 14336 x 4096): 32.0 us at M = 4 and 31.2 us at M = 16, 0.97-1.00x
# cuBLAS bf16, where the byte-wise `_int4_matmul_kernel` above (two dots over the even and odd k, strided x loads)
# took 65 and 89 us (0.47x, 0.35x); that one stays for weights whose rows are not word-aligned. Still no faster than
# bf16: Triton converts the dequantized tile to the dot's operand layout through shared memory (see the GEMV notes).
# One scale per row per tile, as in the GEMV: BLOCK_K divides GROUP.
_TILE_SHAPES = [(32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 4, 3), (32, 64, 2, 4), (64, 128, 8, 3),
                (16, 128, 2, 4)]  # (BLOCK_N, BLOCK_K, num_warps, STAGES)
TILE_CONFIGS = autotune_configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k, "STAGES": st}, num_warps=w)
                                 for n, k, w, st in _TILE_SHAPES],
                                default=triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "STAGES": 1}))


def _tile_prune(configs, named_args, **kwargs):
    """BLOCK_K must divide the group size (one scale per row per tile); 32 always does."""
    G = kwargs.get("GROUP", named_args.get("GROUP"))
    return [c for c in configs if G % c.kwargs["BLOCK_K"] == 0] or [
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 32, "STAGES": 3}, num_warps=4)]


@triton.jit
def _k_order8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight (BLOCK_N, J) tensors, field i of each word -> (BLOCK_N, 8 J) in K order (weight 8j + i at column
    8j + i): three joins, each adding a trailing size-2 dimension held in one thread (no data moves)."""
    lo = tl.join(tl.join(c0, c4), tl.join(c2, c6))  # fields 0, 2, 4, 6 of each word
    hi = tl.join(tl.join(c1, c5), tl.join(c3, c7))  # fields 1, 3, 5, 7
    return tl.reshape(tl.join(lo, hi), (c0.shape[0], c0.shape[1] * 8))


@triton.autotune(configs=TILE_CONFIGS, key=["N", "K", "GROUP"], prune_configs_by={"early_config_prune": _tile_prune},
                 do_bench=tune_bench)
@triton.jit
def _int4_tile_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, y_ptr,
    # sizes
    M, N, K,
    # strides (elements; stride_wn in 32-bit words)
    stride_xm, stride_xk, stride_wn, stride_sn, stride_sg, stride_ym, stride_yn, magic,
    # meta-parameters
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, IEEE: tl.constexpr,
):
    J: tl.constexpr = BLOCK_K // 8
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    m0, m4, m8, m12, m16 = magic, _magic(magic, 4), _magic(magic, 8), _magic(magic, 12), _magic(magic, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :], mask=n_mask[:, None], other=0)
        wk = _k_order8(*_int4_codes(w, m0, m4, m8, m12, m16))  # (BLOCK_N, BLOCK_K) fp32, the codes - 8
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk, mask=m_mask[:, None],
                    other=0.0)  # (BLOCK_M, BLOCK_K)
        if IEEE:
            part = tl.dot(x, tl.trans(wk), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(wk.to(x.dtype)))
        s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * s[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# -- the wrappers --------------------------------------------------------------------------------------------------

_warned_large_m = False
def _word_rows(w: torch.Tensor, row_bytes: int, word: int) -> bool:
    """Can the GEMV read w's rows as `word`-byte words? Contiguous rows, each starting on a word boundary. Other
    layouts (a strided view) take the tl.dot kernel, which reads any strides."""
    return (w.stride(1) == 1 and w.stride(0) % word == 0 and row_bytes % word == 0
            and w.data_ptr() % word == 0)


def _check_x(op: str, x: torch.Tensor, K: int, how: str = "") -> None:
    """x is (M, K) with 1 <= M; `how` says how K was read from the weights, for the error message."""
    global _warned_large_m
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{op}: x must be (M, {K}) to match the weights{how}, got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{op}: x has no rows (M = 0)")
    if x.shape[0] > BLOCK_M and not _warned_large_m:
        _warned_large_m = True
        warnings.warn(f"{op}: M = {x.shape[0]} > {BLOCK_M}: the kernel is built for decode (M = 1..{BLOCK_M}); it "
                      f"stays correct but re-reads the weights once per {BLOCK_M} rows — for prefill, dequantize "
                      f"once and use a dense matmul", stacklevel=3)


def _check_are_tensors(op: str, **args) -> None:
    """TypeError naming an argument that is not a tensor (a list of weights would fail later on `.dtype`)."""
    for name, t in args.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}; quantize the weights with "
                            f"quantize_int8 / quantize_int4, which return tensors")


def int8_matmul(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ (w_q * scales[:, None])^T with int8 weights dequantized in registers.

    Args:
        x: (M, K) fp32 / fp16 / bf16 activations (fp32 in the CPU interpreter); M = 1..16 is the target.
        w_q: (N, K) int8 (`quantize_int8`). scales: (N,) float (any float dtype; used in fp32).

    Returns:
        (M, N) in x's dtype, accumulated in fp32.

    M = 1 with rows that start on 4-byte boundaries (K a multiple of 4, a contiguous w_q) runs the CUDA-core GEMV,
    which reads 32-bit words; anything else runs the tl.dot kernel, which reads any strides.

    Numerics of the M = 1 GEMV (see `_field`): exact products, fp32 sums, for 2^-62 <= |x| < 2^43 (about 2e-19 to
    9e12; all of fp16's range). A bf16/fp32 element of x at or above 2^43 can make every output inf or NaN (where
    it meets the field lifted most); elements far below 2^-62 lose precision and, below ~1e-26, count as 0. The
    offset of the stored codes (128 here, 8 for int4) comes off as that times the sum of x per word, so an x with a
    large mean loses a few bits to cancellation.

    Raises:
        ValueError: shape mismatches, M = 0. TypeError: wrong dtypes. Warns once for M > 16 (correct, slow).
    """
    check_tensors("int8_matmul", ACT_DTYPES, x=x)
    _check_are_tensors("int8_matmul", w_q=w_q, scales=scales)
    if w_q.dtype != torch.int8 or not scales.is_floating_point():
        raise TypeError(f"int8_matmul: w_q must be int8 and scales float, got {w_q.dtype} and {scales.dtype}")
    if w_q.dim() != 2 or scales.shape != (w_q.shape[0],):
        raise ValueError(f"int8_matmul: w_q must be (N, K) and scales (N,), got {tuple(w_q.shape)} and "
                         f"{tuple(scales.shape)}")
    if w_q.device != x.device or scales.device != x.device:
        raise ValueError(f"int8_matmul: x, w_q, scales must be on one device ({x.device}, {w_q.device}, "
                         f"{scales.device})")
    N, K = w_q.shape
    _check_x("int8_matmul", x, K)
    scales = scales.contiguous()  # the kernels read scales[n] at offset n
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 1 and _word_rows(w_q, K, 4):  # batch-1 decode: the CUDA-core GEMV
        ws, cnt = _scratch(x.device, N)
        with zero_on_error(cnt):
            _int8_gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
                x, w_q, scales, y, ws, cnt,
                N, K,
                x.stride(1), w_q.stride(0) // 4, y.stride(1), ws.stride(0),
            )
        return y
    grid = lambda meta: (triton.cdiv(M, BLOCK_M), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _int8_matmul_kernel[grid](
        x, w_q, scales, y,
        M, N, K,
        x.stride(0), x.stride(1), w_q.stride(0), w_q.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, IEEE=x.dtype == torch.float32,
    )
    return y


# M = 1 on a CUDA GPU: the same input-stationary GEMV written in Gluon (llmlab/kernels/int4_gemv_gluon.py), whose per-chunk
# row sums cost 2 barriers and no per-row butterflies (Triton's reduction above: 3 barriers and 5 shuffle steps per
# row). Measured on the H200 (calls CN-CS): 9.9 us at 14336 x 4096 against this file's 12.6 us, and 13.1 us at 4096
# x 14336 against the K-walking GEMV's 14.0 us. It takes rows of up to `int4_gemv_gluon.MAX_K` weights (longer rows
# put two or more slots in each thread, which spills registers and was never timed: they keep the K-walking GEMV).
# The Triton kernels above stay for the CPU interpreter (which does not run Gluon), for Tritons without Gluon, and
# as its reference in the tests. USE_GLUON = False turns it off.
USE_GLUON = True
_GLUON_OFF: dict = {}  # cuda:i -> None where the Gluon GEMV is used, else the reason it is not


def _gluon():
    """llmlab/kernels/int4_gemv_gluon.py, imported at first use on a GPU: importing Gluon takes ~0.1 s, which runs on a CPU
    (the interpreter, Binder) never need."""
    from . import int4_gemv_gluon
    return int4_gemv_gluon


def _cuda_index(device: torch.device) -> torch.device:
    """"cuda" -> "cuda:i" for the current device, so that one GPU has one entry in `_GLUON_OFF` however it is
    named (a tensor's .device always carries its index)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _gluon_gemv(device: torch.device) -> bool:
    """Whether int4_matmul's M = 1 path runs the Gluon GEMV on `device` (the reason it does not is kept, see
    `gluon_gemv_status`)."""
    if not USE_GLUON or device.type != "cuda":
        return False
    device = _cuda_index(device)
    if device not in _GLUON_OFF:
        ok, why = _gluon().available(device)
        _GLUON_OFF[device] = None if ok else why
    return _GLUON_OFF[device] is None


def _gluon_failed(device: torch.device, shape: tuple, e: Exception) -> None:
    """The Gluon GEMV raised (e.g. a Triton whose Gluon API moved): say so once, naming the weight's shape, and use
    the Triton kernels on this device from now on (`gluon_gemv_status` keeps the reason)."""
    device = _cuda_index(device)
    _GLUON_OFF[device] = (f"the Gluon GEMV failed to build or run for a {shape[0]} x {shape[1]} weight "
                          f"({type(e).__name__}: {str(e)[:200]})")
    warnings.warn(f"int4_matmul: {_GLUON_OFF[device]}; using the Triton GEMV on {device} from now on (correct, "
                  f"slower)", stacklevel=3)


def gluon_gemv_status(device: torch.device | str = "cuda") -> str:
    """"gluon" when int4_matmul's M = 1 path runs the Gluon GEMV on `device` ("cuda" means the current GPU), else
    the reason it runs Triton's: switched off, not a CUDA device, the interpreter, no Gluon in this Triton, no GPU,
    or an earlier failure to build or run."""
    device = torch.device(device)
    if not USE_GLUON:
        return "switched off (dequant_matmul.USE_GLUON = False)"
    if _gluon_gemv(device):
        return "gluon"
    return _GLUON_OFF.get(_cuda_index(device)) or f"not a CUDA device ({device.type})"


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ dequantize_int4(packed, scales)^T, the 4-bit weights unpacked and scaled in registers.

    Args:
        x: (M, K) fp32 / fp16 / bf16 (fp32 in the CPU interpreter); M = 1..16 is the target.
        packed: (N, K // 2) uint8, two weights per byte (even k low nibble, odd k high; see the module docstring).
        scales: (N, K // G) float: one scale per group of G consecutive weights of a row; G = K / scales.shape[1].

    Returns:
        (M, N) in x's dtype, accumulated in fp32.

    Contiguous packed rows (4-byte aligned): M = 1 runs the input-stationary GEMV, in Gluon on a CUDA GPU
    (llmlab/kernels/int4_gemv_gluon.py; `gluon_gemv_status()` says whether it is used), else in Triton
    (`_int4_gemv_is_kernel`; the K-walking `_int4_gemv_kernel` for K > IS_MAX_K); M > 1 the word-reading
    tensor-core tile kernel; other layouts the byte-wise tl.dot kernel, which reads any strides.

    Numerics of the M = 1 GEMV: as `int8_matmul`'s (exact for 2^-62 <= |x| < 2^43; inf/NaN above, lost below);
    scales must stay below 2^96 (`quantize_int4` refuses larger ones).

    Raises:
        ValueError: shape mismatches, K not a multiple of 32, a group size that does not divide K or is odd.
        TypeError: wrong dtypes.
        Warns once for M > 16 (correct, slow), and once per GPU if the Gluon GEMV fails to build or run there (the
        Triton GEMV answers instead; `gluon_gemv_status()` keeps the reason).
    """
    check_tensors("int4_matmul", ACT_DTYPES, x=x)
    _check_are_tensors("int4_matmul", packed=packed, scales=scales)
    if packed.dtype != torch.uint8 or not scales.is_floating_point():
        raise TypeError(f"int4_matmul: packed must be uint8 (two 4-bit weights per byte) and scales float, got "
                        f"{packed.dtype} and {scales.dtype}")
    if packed.dim() != 2 or scales.dim() != 2 or scales.shape[0] != packed.shape[0] or scales.shape[1] == 0:
        raise ValueError(f"int4_matmul: packed must be (N, K/2) and scales (N, K/G), got {tuple(packed.shape)} "
                         f"and {tuple(scales.shape)}")
    if packed.device != x.device or scales.device != x.device:
        raise ValueError(f"int4_matmul: x, packed, scales must be on one device ({x.device}, {packed.device}, "
                         f"{scales.device}); move them with .to(x.device)")
    N, K = packed.shape[0], 2 * packed.shape[1]
    if K == 0:
        raise ValueError(f"int4_matmul: packed {tuple(packed.shape)} holds no weights per row (K = 0)")
    if K % scales.shape[1]:
        raise ValueError(f"int4_matmul: {scales.shape[1]} scales per row do not divide K = {K} into equal groups; "
                         f"scales must be (N, K / G) for a group size G that divides K, as quantize_int4(w, "
                         f"group_size=G) returns them")
    G = K // scales.shape[1]
    _check_k(K)  # before the group-size advice below, which no group size could follow
    if G % 2:
        raise ValueError(f"int4_matmul: {scales.shape[1]} scales per row over K = {K} make groups of {G} weights, "
                         f"an odd size; quantize with quantize_int4(w, group_size=...) using 32, 64, 128 or 256")
    if G % 32:
        raise ValueError(f"int4_matmul: group size {G} is not a multiple of 32, the kernel's smallest K tile; "
                         f"requantize with quantize_int4(w, group_size=...) using 32, 64, 128 or 256")
    _check_group(K, G)
    _check_x("int4_matmul", x, K, f" (K = 2 x packed.shape[1] = 2 x {K // 2}: two 4-bit weights per byte)")
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    words = _word_rows(packed, K // 2, 4)  # contiguous, 4-byte aligned rows: the word-reading kernels
    if M == 1 and words and _gluon_gemv(x.device) and K <= _gluon().MAX_K:  # batch 1 on a GPU: the Gluon GEMV
        try:
            _gluon().int4_gemv(x, packed, scales, y, pdl_kwargs(x.device))
            return y
        except Exception as e:  # noqa: BLE001 - a Triton whose Gluon cannot build it: the Triton kernels below
            _gluon_failed(x.device, (N, K), e)
    if M == 1 and words and K <= IS_MAX_K:  # batch-1 decode: the input-stationary GEMV
        _is_launch(x, packed, scales, y, N, K, G)
        return y
    if M == 1 and words:  # batch-1 decode, rows longer than IS_MAX_K: the K-walking GEMV
        ws, cnt = _scratch(x.device, N)
        with zero_on_error(cnt):
            _int4_gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
                x, packed, scales, y, ws, cnt,
                N, K,
                x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1), y.stride(1), ws.stride(0),
                GROUP=G,
            )
        return y
    grid = lambda meta: (triton.cdiv(M, BLOCK_M), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    if words:  # M = 2..16 (and beyond, a tile of 16 rows at a time): the tensor cores
        _int4_tile_kernel[grid](
            x, packed, scales, y,
            M, N, K,
            x.stride(0), x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1), y.stride(0),
            y.stride(1), MAGIC,
            GROUP=G, BLOCK_M=BLOCK_M, IEEE=x.dtype == torch.float32,
        )
        return y
    _int4_matmul_kernel[grid](
        x, packed, scales, y,
        M, N, K, G,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, IEEE=x.dtype == torch.float32,
    )
    return y


if __name__ == "__main__":
    demo_needs_cuda("dequant_matmul")
    from triton.testing import do_bench

    torch.manual_seed(0)
    for N, K in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        w8, s8 = quantize_int8(w)
        w4, s4 = quantize_int4(w, 128)
        for M in (1, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ms_bf16 = do_bench(lambda: x @ w.T)
            ms8, ms4 = do_bench(lambda: int8_matmul(x, w8, s8)), do_bench(lambda: int4_matmul(x, w4, s4))
            print(f"N={N} K={K} M={M:2d}: bf16 {ms_bf16 * 1e3:6.1f} us  int8 {ms8 * 1e3:6.1f} us "
                  f"(x{ms_bf16 / ms8:.2f})  int4 {ms4 * 1e3:6.1f} us (x{ms_bf16 / ms4:.2f}); "
                  f"int4 weight GB/s {w4.numel() / ms4 / 1e6:7.1f}")
