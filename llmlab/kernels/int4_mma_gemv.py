"""int4 GEMV on the tensor cores (M = 1, fp16/bf16 activations): weights stored in the mma fragment order.

The CUDA-core GEMVs of `int4_gemv` spend ~3.5 instructions on every int4 weight (unpack, convert, FMA) — at
batch 1 the SM cannot issue them as fast as the memory delivers 4-bit weights. Marlin (Frantar et al. 2024,
https://arxiv.org/abs/2408.11743, https://github.com/IST-DASLab/marlin) hands the multiply-adds to the tensor cores
and makes the unpacking nearly free by storing the weights, once, in the order the mma instruction wants them:

  * `mma.sync.m16n8k16` (PTX ISA, "Matrix fragments for mma.m16n8k16",
    https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float) multiplies a
    16 x 16 tile of A by a 16 x 8 tile of B; lane l = 4g + t of the warp holds eight A values: rows g and g + 8,
    columns 2t, 2t + 1, 2t + 8, 2t + 9, in four 32-bit registers of two 16-bit values each;
  * eight int4 codes are one 32-bit word, so `repack_int4_mma` stores, for every 16 x 16 tile of W, lane l's eight
    codes in lane l's word, each code in the nibble that lands in the right register half: code i of the word
    (bits 4i..4i+3) is register i % 4, half i // 4. Register r is then ONE `lop3` of the word shifted by 4r
    (nibbles r and r + 4 masked into the mantissas of two 16-bit floats of 128 (bf16) or 1024 (fp16)) and ONE
    packed `fma`/`sub` that removes 128 + 8 (1024 + 8): the codes - 8, exact — 11 instructions per word of 8
    weights with the three shifts (~2.5 per weight for the whole loop, loads and addresses included);
  * x (M = 1) is B with all eight columns equal to x, so every column of the 16 x 8 result is W x; lane l keeps
    rows g and g + 8 of it.

The mma is written in inline PTX (`tl.inline_asm_elementwise`, pack = 4: one asm instance gets one lane's four
consecutive words — four k-steps of one 16-row block — and chains four mmas). That relies on the lane that holds
word c of a (.., 128)-word tile being lane c // 4, which is the blocked layout Triton gives a contiguous int32 load
of 128 words per warp (16 bytes per lane), and the GPU tests check the results against x @ dequant(W)^T. There is
no CPU path: the Triton interpreter does not run inline assembly, so `int4_mma_gemv` needs a CUDA GPU (sm_80 or
later), and the CPU tests check the repacking.

Status: EXPERIMENTAL and not wired into `int4_matmul` — it is correct (GPU tests; relative error 1.6e-3 against
x @ dequant(W)^T in fp32, bf16's rounding) but SLOWER than the CUDA-core GEMV at every Llama-3.1-8B shape, though
faster than cuBLAS bf16 (docs/results.md). Under Nsight Compute it keeps few warps on an SM (16 KB of pipeline
buffers per program limit the occupancy), issues an instruction on a small share of a scheduler's cycles, and
stalls most on shared memory (the x fragments and the accumulator's layout change pass through it). Fewer
instructions do not help a kernel whose one warp per scheduler waits on latency. Next: keep x in registers (a
lane's 16 x values per chunk are one 32-byte load: no shared memory), scales in the same lane order so the
accumulator needs no layout change, and more, shallower programs per SM.

Format (`repack_int4_mma`): w_mma (N // 16, K // 64, 32, 4) int32 — [row block, 64-wide k chunk, lane, k-step of
the chunk]; scales as `quantize_int4`'s (N, K // G), G a multiple of 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import autotune_configs, check_tensors, tune_bench, zero_on_error
from .split_k import scratch as _scratch
from .split_k import split_k_range as _split_k_range
from .split_k import split_k_store as _split_k_store

TILE = 16  # the mma's M and K
CHUNK_K = 64  # four k-steps: one lane's 16-byte load


def _lane_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, mma column) inside a 16 x 16 tile of code i (0..7) of lane l's word, as two (32, 8) int64 tensors."""
    lane = torch.arange(32)[:, None]
    i = torch.arange(8)[None, :]
    g, t = lane // 4, lane % 4
    reg, half = i % 4, i // 4
    return g + 8 * (reg % 2), 2 * t + half + 8 * (reg // 2)


def _chunk_k() -> torch.Tensor:
    """(4, 16) int64: the k (0..63, within a 64-wide chunk) that k-step j's mma column kappa multiplies.

    The sum over k does not care about k's order, so W's columns (here) and x (in the kernel) are taken in an order
    that makes lane t's B fragments of all four steps ONE contiguous run of x: kappa = 2t + h (register b0) is
    k = 16t + 4j + h, kappa = 2t + 8 + h (b1) is k = 16t + 4j + 2 + h — lane t reads x[16t .. 16t + 16) of the
    chunk, one 8-byte (b0, b1) pair per step."""
    kappa = torch.arange(16)
    t, b, h = (kappa % 8) // 2, kappa // 8, kappa % 2
    return 16 * t[None, :] + 4 * torch.arange(4)[:, None] + 2 * b[None, :] + h[None, :]


def repack_int4_mma(packed: torch.Tensor) -> torch.Tensor:
    """`quantize_int4`'s (N, K // 2) uint8 codes -> (N // 16, K // 64, 32, 4) int32 in the mma fragment order.

    Raises:
        ValueError: packed is not a 2-D uint8 tensor, or N is not a multiple of 16 or K of 64."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"repack_int4_mma: packed must be (N, K // 2) uint8, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    N, K = packed.shape[0], 2 * packed.shape[1]
    if N % TILE or K % CHUNK_K or N == 0 or K == 0:
        raise ValueError(f"repack_int4_mma: needs N a multiple of {TILE} and K of {CHUNK_K}, got N = {N}, K = {K}; "
                         f"use int4_matmul (the CUDA-core GEMV) for other shapes")
    dev = packed.device
    u = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(N, K).to(torch.int64)  # codes 0..15 in k order
    chunks = u.view(N // TILE, TILE, K // CHUNK_K, CHUNK_K).permute(0, 2, 1, 3)  # (row block, chunk, 16, 64)
    steps = chunks[..., _chunk_k().to(dev)].permute(0, 1, 3, 2, 4)  # (row block, chunk, step, 16, 16): A tiles
    rows, cols = (m.to(dev) for m in _lane_map())
    words = (steps[..., rows, cols] << (4 * torch.arange(8, device=dev))).sum(-1)  # (RB, KC, 4, 32) in 0..2^32
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.transpose(2, 3).contiguous()  # (RB, KC, 32 lanes, 4 steps): a lane's four words are adjacent


def unpack_int4_mma(w_mma: torch.Tensor) -> torch.Tensor:
    """The inverse of `repack_int4_mma`: (N // 16, K // 64, 32, 4) int32 -> (N, K // 2) uint8 (for tests).

    Raises:
        ValueError: w_mma is not an int32 tensor shaped (N // 16, K // 64, 32, 4)."""
    if w_mma.dtype != torch.int32 or w_mma.dim() != 4 or tuple(w_mma.shape[2:]) != (32, 4):
        raise ValueError(f"unpack_int4_mma: expects repack_int4_mma's (N/16, K/64, 32, 4) int32, got {w_mma.dtype} "
                         f"{tuple(w_mma.shape)}")
    RB, KC, dev = w_mma.shape[0], w_mma.shape[1], w_mma.device
    words = w_mma.transpose(2, 3).to(torch.int64) & 0xFFFFFFFF  # (RB, KC, 4, 32)
    nib = (words[..., None] >> (4 * torch.arange(8, device=dev))) & 0xF  # (RB, KC, 4, 32, 8)
    steps = torch.zeros(RB, KC, 4, TILE, TILE, dtype=torch.int64, device=dev)
    rows, cols = (m.to(dev) for m in _lane_map())
    steps[..., rows, cols] = nib
    chunks = torch.zeros(RB, KC, TILE, CHUNK_K, dtype=torch.int64, device=dev)
    chunks[..., _chunk_k().to(dev)] = steps.permute(0, 1, 3, 2, 4)
    u = chunks.permute(0, 2, 1, 3).reshape(RB * TILE, KC * CHUNK_K)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)


def _mma_asm(bf16: bool) -> str:
    """PTX for one lane's four words (operands $4..$7), the x fragments b0 ($8..$11) and b1 ($12..$15) of their
    k-steps: four chained mma.m16n8k16 with fp32 accumulators; out $0 = row g, $1 = row g + 8, $2 = $3 = 0."""
    if bf16:  # 0x4300 = 128: a nibble in the low mantissa bits is 128 + code; fma(v, 1, -136) = code - 8
        magic, fix = "0x43004300", ["fma.rn.bf16x2 %a{r}, %a{r}, %one, %neg;"]
        consts, typ = "mov.b32 %one, 0x3F803F80; mov.b32 %neg, 0xC308C308;", "bf16"
    else:  # 0x6400 = 1024: 1024 + code; minus 1032 = code - 8
        magic, fix = "0x64006400", ["sub.f16x2 %a{r}, %a{r}, %neg;"]
        consts, typ = "mov.b32 %one, 0x3C003C00; mov.b32 %neg, 0x64086408;", "f16"
    lines = ["{", ".reg .b32 %s<4>, %a<4>, %one, %neg;", ".reg .f32 %d<4>;", consts,
             "mov.f32 %d0, 0f00000000; mov.f32 %d1, 0f00000000; mov.f32 %d2, 0f00000000; mov.f32 %d3, 0f00000000;"]
    for j in range(4):
        w = f"${4 + j}"
        lines.append(f"mov.b32 %s0, {w}; shr.u32 %s1, {w}, 4; shr.u32 %s2, {w}, 8; shr.u32 %s3, {w}, 12;")
        for r in range(4):  # register r: nibbles r (low half) and r + 4 (high half), i.e. bits 4r and 4r + 16
            lines.append(f"lop3.b32 %a{r}, %s{r}, 0x000F000F, {magic}, 0xEA;")  # (s & mask) | magic
            lines.append(fix[0].format(r=r))
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{typ}.{typ}.f32 {{%d0, %d1, %d2, %d3}}, "
                     f"{{%a0, %a1, %a2, %a3}}, {{${8 + j}, ${12 + j}}}, {{%d0, %d1, %d2, %d3}};")
    lines += ["mov.b32 $0, %d0; mov.b32 $1, %d2; mov.b32 $2, 0; mov.b32 $3, 0;", "}"]
    return "\n".join(lines)


_ASM_BF16, _ASM_F16 = tl.constexpr(_mma_asm(True)), tl.constexpr(_mma_asm(False))  # globals a kernel reads

_SHAPES = [  # (RB row blocks of 16, KQ chunks of 64 per step, SPLIT_K, num_warps, STAGES)
    (1, 2, 1, 1, 4), (2, 2, 1, 1, 4), (1, 2, 2, 1, 4), (2, 2, 2, 1, 4), (1, 1, 2, 1, 6), (2, 1, 1, 1, 6),
    (4, 2, 1, 2, 4), (4, 2, 2, 2, 4), (2, 2, 4, 2, 4), (1, 2, 4, 1, 4), (4, 1, 1, 4, 4), (8, 2, 1, 4, 3)]
MMA_CONFIGS = autotune_configs([triton.Config({"RB": rb, "KQ": kq, "SPLIT_K": sk, "STAGES": st}, num_warps=w)
                                for rb, kq, sk, w, st in _SHAPES],
                               default=triton.Config({"RB": 2, "KQ": 1, "SPLIT_K": 1, "STAGES": 4}, num_warps=1))
# (with one config Triton's autotuner never calls the prune, so the default must fit every group size: KQ = 1)


def _prune(configs, named_args, **kwargs):
    """A step's k range (64 KQ) must lie in one group; splits need a step each."""
    G = kwargs.get("GROUP", named_args.get("GROUP"))
    K = named_args["K"]
    kept = [c for c in configs if G % (CHUNK_K * c.kwargs["KQ"]) == 0
            and c.kwargs["SPLIT_K"] <= K // (CHUNK_K * c.kwargs["KQ"])]
    return kept or [triton.Config({"RB": 1, "KQ": 1, "SPLIT_K": 1, "STAGES": 4}, num_warps=1)]


@triton.autotune(configs=MMA_CONFIGS, key=["N", "K", "GROUP"], prune_configs_by={"early_config_prune": _prune},
                 do_bench=tune_bench)
@triton.jit
def _int4_mma_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_sn, stride_sg, stride_ws,
    GROUP: tl.constexpr, BF16: tl.constexpr,
    RB: tl.constexpr, KQ: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
):
    BLOCK_K: tl.constexpr = 64 * KQ
    rb = tl.program_id(0) * RB + tl.arange(0, RB)  # this program's 16-row blocks
    kq = tl.arange(0, KQ)
    c = tl.arange(0, 128)  # word c of a chunk: lane c // 4, k-step c % 4
    rb_mask = rb < N // 16
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    x_pairs = x_ptr.to(tl.pointer_type(tl.int64))  # x as runs of four 16-bit values: (b0, b1) of one k-step
    w_off = (rb[:, None, None] * (K // 64) + kq[None, :, None]) * 128 + c[None, None, :]  # (RB, KQ, 128)
    # word c (lane l = c // 4, t = l % 4, step j = c % 4) multiplies x[16t + 4j .. 16t + 4j + 4) of its chunk
    # (`_chunk_k`): one 8-byte load, b0 its low half and b1 its high half
    x_off = kq[:, None] * 16 + 4 * ((c[None, :] // 4) % 4) + c[None, :] % 4  # (KQ, 128) in 8-byte units
    g, t, j = c // 16, (c // 4) % 4, c % 4
    row = rb[:, None] * 16 + g[None, :] + 8 * (j[None, :] == 1)  # (RB, 128): the row of out j = 0 / 1
    valid = rb_mask[:, None] & (j < 2)[None, :]
    k_start, k_end = _split_k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([RB, 128], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_words + w_off + (k0 // 64) * 128, mask=rb_mask[:, None, None], other=0)
        xb = tl.load(x_pairs + k0 // 4 + x_off)  # (KQ, 128) int64
        b0 = tl.broadcast_to(xb.to(tl.int32)[None, :, :], (RB, KQ, 128))
        b1 = tl.broadcast_to((xb >> 32).to(tl.int32)[None, :, :], (RB, KQ, 128))
        d = tl.inline_asm_elementwise(_ASM_BF16 if BF16 else _ASM_F16, "=r,=r,=r,=r" + ",r" * 12, [w, b0, b1],
                                      dtype=tl.int32, is_pure=True, pack=4)
        part = tl.sum(d.to(tl.float32, bitcast=True), axis=1)  # (RB, 128)
        s = tl.load(s_ptr + row * stride_sn + (k0 // GROUP) * stride_sg, mask=valid, other=0.0).to(tl.float32)
        acc += part * s
    _split_k_store(acc, y_ptr, 1, row, valid & (t == 0)[None, :], ws_ptr, stride_ws, cnt_ptr, SPLIT_K)



def int4_mma_gemv(x: torch.Tensor, w_mma: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ dequant(W)^T for ONE row of x, on the tensor cores, from `repack_int4_mma`'s weights.

    Args:
        x: (1, K) fp16 or bf16 on a CUDA GPU. w_mma: (N // 16, K // 64, 32, 4) int32. scales: (N, K // G) float,
            G a multiple of 64.

    Returns:
        (1, N) in x's dtype, accumulated in fp32 (the mma's accumulators).

    Raises:
        ValueError: shapes that do not fit, a group size that is not a multiple of 64, a CPU tensor (no inline
            assembly in the interpreter). TypeError: dtypes.
    """
    if x.device.type != "cuda":  # first: the generic checks would suggest the interpreter, which cannot run it
        raise ValueError("int4_mma_gemv: needs a CUDA GPU (inline PTX mma; the Triton interpreter cannot run it); "
                         "use int4_matmul on a CPU")
    check_tensors("int4_mma_gemv", (torch.float16, torch.bfloat16), x=x)
    if w_mma.dtype != torch.int32 or w_mma.dim() != 4 or w_mma.shape[2:] != (32, 4):
        raise ValueError(f"int4_mma_gemv: w_mma must be repack_int4_mma's (N/16, K/64, 32, 4) int32, got "
                         f"{w_mma.dtype} {tuple(w_mma.shape)}")
    N, K = w_mma.shape[0] * TILE, w_mma.shape[1] * CHUNK_K
    if x.dim() != 2 or x.shape != (1, K):
        raise ValueError(f"int4_mma_gemv: x must be (1, {K}), got {tuple(x.shape)}")
    if scales.dim() != 2 or scales.shape[0] != N or K % scales.shape[1] or (K // scales.shape[1]) % CHUNK_K:
        raise ValueError(f"int4_mma_gemv: scales must be (N = {N}, K / G) with G a multiple of {CHUNK_K}, got "
                         f"{tuple(scales.shape)}")
    G = K // scales.shape[1]
    x = x.contiguous()
    w_mma = w_mma.contiguous()
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    ws, cnt = _scratch(x.device, N)
    with zero_on_error(cnt):
        _int4_mma_gemv_kernel[lambda meta: (triton.cdiv(N // TILE, meta["RB"]), meta["SPLIT_K"])](
            x, w_mma, scales, y, ws, cnt,
            N, K,
            scales.stride(0), scales.stride(1), ws.stride(0),
            GROUP=G, BF16=x.dtype == torch.bfloat16,
        )
    return y
