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

from ._util import autotune_configs, check_tensors

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

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (w_q (N, K) int8, scales (N,) fp32), symmetric per output channel (row)."""
    w32 = w.float()
    scales = w32.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    w_q = torch.clamp(torch.round(w32 / scales[:, None]), -127, 127).to(torch.int8)
    return w_q, scales


def dequantize_int8(w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, K) int8, (N,) -> (N, K) fp32."""
    return w_q.float() * scales.float()[:, None]


def _check_group(K: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"int4: group_size must be a positive even number, got {group_size}")
    if K % group_size:
        fits = [g for g in (256, 128, 64, 32) if K % g == 0]
        hint = f"a group size that divides K (e.g. {fits[0]})" if fits else "a group size that divides K"
        raise ValueError(f"int4: group_size {group_size} does not divide K = {K}; use {hint} or pad K to a "
                         f"multiple of {group_size}")


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (packed (N, K // 2) uint8, scales (N, K // group_size) fp32): symmetric, group-wise.

    Raises:
        ValueError: group_size does not divide K (the message names both and the fix), or is odd.
    """
    N, K = w.shape
    _check_group(K, group_size)
    w32 = w.float().view(N, K // group_size, group_size)
    scales = w32.abs().amax(dim=2).clamp(min=1e-12) / 7.0  # (N, K // G); -8 is never used: symmetric
    u = (torch.clamp(torch.round(w32 / scales[..., None]), -8, 7) + 8).to(torch.uint8).view(N, K)
    packed = u[:, 0::2] | (u[:, 1::2] << 4)  # even k: low nibble, odd k: high nibble
    return packed, scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, K // 2) uint8, (N, K // G) -> (N, K) fp32."""
    N, half = packed.shape
    u = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(N, 2 * half)  # (N, K): low nibble first
    G = 2 * half // scales.shape[1]
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
# owns BLOCK_N rows of W and walks along K: a classic GEMV on the CUDA cores. The weights are the only large read, so
# the kernel keeps up with HBM only if it spends few instructions per weight: an H200 issues about 3.6 thread-
# instructions (132 SMs x 128 lanes x ~1.8 GHz) in the time HBM (~4.2 TB/s) delivers one int4 weight. Counted in the
# compiled loop (SASS, sm_90, bf16 x), these habits take int4 from about 7 instructions per weight to 3.7-4.2 and
# int8 from about 7 to 3.6-4.1, depending on the config:
#  * Words, not bytes: W is read through a free int32 view of its bytes (8 nibbles or 4 int8 per word). Each thread
#    owns a run of WORDS consecutive words of every one of the tile's BLOCK_N rows (one 8- or 16-byte load per row,
#    all rows at fixed offsets from one address), and the threads of a program lie side by side along K: a K tile is
#    BLOCK_K = (weights per word) x WORDS x 32 x num_warps. A thread's x values serve all its BLOCK_N rows.
#  * A float from a nibble in one logic instruction, no shifts: the 2^23 trick (OR an integer into the mantissa of
#    2^23, bits 0x4B000000, and the float reads exactly 2^23 + integer) also works in place, for a nibble 4J bits up
#    the word: the word's bit 4J, worth 16^J as an integer, is worth exactly 1 in the mantissa of 2^(23 - 4J). So
#    (w & (0xF << 4J)) | bits-of-2^(23 - 4J) reads 2^(23 - 4J) + nibble (one AND-OR: one LOP3 instruction), and one
#    subtraction gives nibble - 8. Only the upper half-word needs a shift, one per word. int8 bytes: the same with
#    8J, the sign handled by an XOR with 0x80 inside the same instruction.
#  * No reduction inside the loop: a thread's products go into running sums by fused multiply-adds, one instruction
#    per weight (tl.fma, explicit: Triton 3.10 stops fusing a * b + c by default). int4 adds up its WORDS words of a
#    row and scales that sum once (a run lies in one group: its 8 x WORDS <= 32 weights divide the group size); int8
#    scales each row once at the end. The one sum across threads comes after the K loop.
#  * x is read as contiguous 16-byte vectors (the 8 or 4 values under a word) and split into the nibble or byte
#    positions in registers (tl.split), instead of one strided load per position.
# The 2^23 bits and the shift 16 reach the kernels as run-time arguments, not constexprs: as constants the compiler
# re-creates 0x4B000000 before each use and turns `w >> 16` into one shift per nibble (both seen in the SASS).
MAGIC_BITS = 0x4B000000  # the bits of 2^23 in fp32
_GEMV1_SHAPES = [  # (BLOCK_N, WORDS, num_warps, STAGES); BLOCK_K = weights per word x WORDS x 32 x num_warps
    (4, 4, 4, 1), (8, 2, 4, 1), (8, 4, 4, 1), (16, 2, 4, 1), (16, 4, 4, 1), (32, 2, 4, 1), (8, 2, 8, 1),
    (16, 2, 8, 1), (8, 4, 2, 1), (16, 2, 2, 1), (32, 2, 2, 1), (16, 4, 1, 1),
    (8, 2, 4, 3), (16, 2, 4, 3), (16, 2, 2, 3), (8, 4, 4, 3)]  # STAGES 3: later K tiles in flight (cp.async)


def _gemv1_configs(per_word: int) -> list:
    """The M = 1 configs for weights packed `per_word` to an int32 word (8: int4, 4: int8)."""
    def config(n, words, warps, stages):
        return triton.Config({"BLOCK_N": n, "BLOCK_K": per_word * words * 32 * warps, "WORDS": words, "STAGES": stages},
                             num_warps=warps)
    return autotune_configs([config(*shape) for shape in _GEMV1_SHAPES], default=config(16, 2, 4, 1))


GEMV1_INT4_CONFIGS = _gemv1_configs(8)
GEMV1_INT8_CONFIGS = _gemv1_configs(4)


def _gemv1_prune(configs, named_args, **kwargs):
    """int4: a thread's run of 8 x WORDS weights must lie in one group (one scale per run), i.e. divide the group size
    (any config here does for a multiple of 32, which the wrapper requires: the prune is not called when only one
    config is listed, so correctness must not rely on it). Both: drop K tiles wider than K (their extra warps would
    idle) unless that drops every config."""
    G = kwargs["GROUP"] if "GROUP" in kwargs else named_args.get("GROUP")  # a constexpr arrives as a keyword
    kept = [c for c in configs if G is None or G % (8 * c.kwargs["WORDS"]) == 0]
    kept = kept or [triton.Config({"BLOCK_N": 16, "BLOCK_K": 1024, "WORDS": 1, "STAGES": 1})]  # runs of 8 weights
    return [c for c in kept if c.kwargs["BLOCK_K"] <= named_args["K"]] or kept[:1]


@triton.jit
def _nibble(w, J: tl.constexpr, magic):
    """Nibble J (bits 4J .. 4J + 3, J = 0..3) of each int32 word of w, as the float nibble - 8: exact.

    `magic` is the bits of 2^23; lowering its exponent field by 4J gives 2^(23 - 4J), whose mantissa bit 4J is worth
    2^(4J - 23) x 2^(23 - 4J) = 1: OR-ed in place, the nibble reads as 2^(23 - 4J) + nibble."""
    bits = (w & (0xF << (4 * J))) | (magic - J * (4 << 23))
    return bits.to(tl.float32, bitcast=True) - (8388608.0 / 16 ** J + 8.0)


@triton.jit
def _byte(w, J: tl.constexpr, magic):
    """Byte J (bits 8J .. 8J + 7, J = 0..1) of each int32 word of w, read as an int8, as a float: exact.

    As `_nibble`, in the mantissa of 2^(23 - 8J), with the byte's top bit flipped on the way (an int8 v is stored as
    the byte v mod 256, and that ^ 0x80 = v + 128 in 0..255): `magic` is the bits of 2^23 with 0x80 in the low byte;
    for byte J its exponent drops by 8J and the 0x80 moves up 8J bits. One XOR both flips and sets the exponent."""
    flip = magic - J * (8 << 23) + (0x80 << (8 * J)) - 0x80
    bits = (w & (0xFF << (8 * J))) ^ flip
    return bits.to(tl.float32, bitcast=True) - (8388608.0 / 256 ** J + 128.0)


@triton.jit
def _unzip8(x):
    """x (..., 2, 2, 2) -> x[..., 0, 0, 0], x[..., 0, 0, 1], ..., x[..., 1, 1, 1]: 8 tensors (...), in the order of
    t = 4i + 2j + k for x[..., i, j, k], i.e. of x's last dim before a reshape (..., 8) -> (..., 2, 2, 2)."""
    even, odd = tl.split(x)  # tl.split: the last dim (size 2) into two tensors; here t % 2 = 0 and 1
    t04, t26 = tl.split(even)  # t % 4 = 0 and 2
    t15, t37 = tl.split(odd)  # t % 4 = 1 and 3
    t0, t4 = tl.split(t04)
    t2, t6 = tl.split(t26)
    t1, t5 = tl.split(t15)
    t3, t7 = tl.split(t37)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _unzip4(x):
    """x (..., 2, 2) -> its 4 slices (...) in the order t = 2j + k of x[..., j, k] (see `_unzip8`)."""
    even, odd = tl.split(x)
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.autotune(configs=GEMV1_INT4_CONFIGS, key=["N", "K", "GROUP"],
                 prune_configs_by={"early_config_prune": _gemv1_prune})
@triton.jit
def _int4_gemv_kernel(
    # pointers: x (K,), w (N, K / 8) int32 (the packed bytes, 8 nibbles per word), scales (N, K / GROUP), y (N,)
    x_ptr, w_ptr, s_ptr, y_ptr,
    # sizes
    N, K,
    # strides (elements)
    stride_xk, stride_sg, stride_yn,
    # MAGIC_BITS and 16, at run time (see above)
    magic, shift,
    # meta-parameters; the row strides are constexprs so that the BLOCK_N rows' loads share one address
    stride_wn: tl.constexpr, stride_sn: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr,
):
    """y[n] = sum_k (u[n, k] - 8) * scales[n, k // GROUP] * x[k] for BLOCK_N rows; x, y in x's dtype (fp32 in the
    interpreter), scales any float, sums in fp32. K is a multiple of GROUP, itself a multiple of 8 x WORDS.

    Register tile: (BLOCK_N rows, WORDS, RUNS) words, word [n, a, b] = word a of run b of row n; a thread holds all
    BLOCK_N rows and WORDS words of one run (the compiler takes the layout from x's (WORDS, RUNS, 8) load)."""
    RUNS: tl.constexpr = BLOCK_K // (8 * WORDS)  # runs of WORDS words in a K tile (one per thread, as configured)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    ra = tl.arange(0, WORDS)
    rb = tl.arange(0, RUNS)
    last = (K // (8 * WORDS) - 1) * WORDS  # the first word of a row's last run
    acc = tl.zeros([BLOCK_N, RUNS], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):  # STAGES > 1: later tiles' loads in flight (cp.async)
        first = k0 // 8 + rb * WORDS  # (RUNS,) each run's first word
        # a run past K loads the last run again (valid memory, no masks) and x = 0 there cancels it
        first_w = tl.minimum(first, last)
        w = tl.load(w_ptr + rn[:, None, None] * stride_wn + (first_w[None, :] + ra[:, None])[None, :, :],
                    mask=n_mask[:, None, None])  # (BLOCK_N, WORDS, RUNS) int32
        w_hi = w >> shift  # nibbles 4..7 into bits 0..15 (the bits above are never read)
        kk = (first[None, :] + ra[:, None])[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # (WORDS, RUNS, 8)
        xv = tl.load(x_ptr + kk * stride_xk, mask=kk < K, other=0.0).to(tl.float32)  # contiguous per word
        x0, x1, x2, x3, x4, x5, x6, x7 = _unzip8(tl.reshape(xv, (WORDS, RUNS, 2, 2, 2)))  # x under nibble t
        part = _nibble(w, 0, magic) * x0  # (BLOCK_N, WORDS, RUNS): each word's 8 products, summed by FMAs
        part = tl.fma(_nibble(w, 1, magic), x1, part)
        part = tl.fma(_nibble(w, 2, magic), x2, part)
        part = tl.fma(_nibble(w, 3, magic), x3, part)
        part = tl.fma(_nibble(w_hi, 0, magic), x4, part)
        part = tl.fma(_nibble(w_hi, 1, magic), x5, part)
        part = tl.fma(_nibble(w_hi, 2, magic), x6, part)
        part = tl.fma(_nibble(w_hi, 3, magic), x7, part)
        g = first_w // (GROUP // 8)  # (RUNS,) the group of each run
        s = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :] * stride_sg, mask=n_mask[:, None])
        acc = tl.fma(tl.sum(part, axis=1), s.to(tl.float32), acc)  # sum within the thread, scale once per run
    tl.store(y_ptr + rn * stride_yn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.autotune(configs=GEMV1_INT8_CONFIGS, key=["N", "K"], prune_configs_by={"early_config_prune": _gemv1_prune})
@triton.jit
def _int8_gemv_kernel(
    # pointers: x (K,), w (N, K / 4) int32 (the int8 weights, 4 per word), scales (N,), y (N,)
    x_ptr, w_ptr, s_ptr, y_ptr,
    # sizes
    N, K,
    # strides (elements)
    stride_xk, stride_yn,
    # MAGIC_BITS | 0x80 (see `_byte`) and 16, at run time (see above)
    magic, shift,
    # meta-parameters
    stride_wn: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
    STAGES: tl.constexpr,
):
    """y[n] = scales[n] * sum_k w[n, k] * x[k] for BLOCK_N rows: the int4 GEMV's scheme with 4 bytes per word and
    one scale per row, so each thread's products sum elementwise across the whole K loop, scaled at the end. K is a
    multiple of 4 x WORDS (the wrapper sends only K % 16 == 0 here)."""
    RUNS: tl.constexpr = BLOCK_K // (4 * WORDS)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    ra = tl.arange(0, WORDS)
    rb = tl.arange(0, RUNS)
    last = (K // (4 * WORDS) - 1) * WORDS
    acc = tl.zeros([BLOCK_N, WORDS, RUNS], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        first = k0 // 4 + rb * WORDS
        first_w = tl.minimum(first, last)  # past K: reload the last run, x = 0 cancels it
        w = tl.load(w_ptr + rn[:, None, None] * stride_wn + (first_w[None, :] + ra[:, None])[None, :, :],
                    mask=n_mask[:, None, None])  # (BLOCK_N, WORDS, RUNS) int32
        w_hi = w >> shift  # bytes 2, 3 into bits 0..15
        kk = (first[None, :] + ra[:, None])[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # (WORDS, RUNS, 4)
        xv = tl.load(x_ptr + kk * stride_xk, mask=kk < K, other=0.0).to(tl.float32)
        x0, x1, x2, x3 = _unzip4(tl.reshape(xv, (WORDS, RUNS, 2, 2)))
        acc = tl.fma(_byte(w, 0, magic), x0, acc)
        acc = tl.fma(_byte(w, 1, magic), x1, acc)
        acc = tl.fma(_byte(w_hi, 0, magic), x2, acc)
        acc = tl.fma(_byte(w_hi, 1, magic), x3, acc)
    s = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * s
    tl.store(y_ptr + rn * stride_yn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


# -- the wrappers --------------------------------------------------------------------------------------------------

_warned_large_m = False


def _check_x(op: str, x: torch.Tensor, K: int) -> None:
    global _warned_large_m
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{op}: x must be (M, {K}) to match the weights, got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{op}: x has no rows (M = 0)")
    if x.shape[0] > BLOCK_M and not _warned_large_m:
        _warned_large_m = True
        warnings.warn(f"{op}: M = {x.shape[0]} > {BLOCK_M}: the kernel is built for decode (M = 1..{BLOCK_M}); it "
                      f"stays correct but re-reads the weights once per {BLOCK_M} rows — for prefill, dequantize "
                      f"once and use a dense matmul", stacklevel=3)


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """The (rows, cols) one-byte tensor t seen as (rows, cols / 4) int32 words: a view, no copy (bytes 4j..4j+3 of a
    row are word j, the first byte in its low bits: little-endian, as on GPUs and x86/ARM CPUs). None where t's layout
    does not allow it: cols not a multiple of 4, a row not contiguous, or a row start that is not 4-byte aligned."""
    if t.shape[1] % 4 or t.stride(1) != 1 or t.stride(0) % 4 or t.storage_offset() % 4:
        return None
    return t.view(torch.int32)


def int8_matmul(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ (w_q * scales[:, None])^T with int8 weights dequantized in registers.

    Args:
        x: (M, K) fp32 / fp16 / bf16 activations (fp32 in the CPU interpreter); M = 1..16 is the target.
        w_q: (N, K) int8 (`quantize_int8`). scales: (N,) float (any float dtype; used in fp32).

    Returns:
        (M, N) in x's dtype, accumulated in fp32.

    Raises:
        ValueError: shape mismatches, M = 0. TypeError: wrong dtypes. Warns once for M > 16 (correct, slow).
    """
    check_tensors("int8_matmul", ACT_DTYPES, x=x)
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
    # batch-1 decode: the CUDA-core GEMV, on 32-bit words; its threads' runs (up to 16 weights) must tile K
    words = _as_words(w_q) if M == 1 and K % 16 == 0 else None
    if words is not None:  # (else the M <= 16 kernel below: same answer, slower)
        _int8_gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, words, scales, y,
            N, K,
            x.stride(1), y.stride(1),
            MAGIC_BITS | 0x80, 16,
            words.stride(0),
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


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ dequantize_int4(packed, scales)^T, the 4-bit weights unpacked and scaled in registers.

    Args:
        x: (M, K) fp32 / fp16 / bf16 (fp32 in the CPU interpreter); M = 1..16 is the target.
        packed: (N, K // 2) uint8, two weights per byte (even k low nibble, odd k high; see the module docstring).
        scales: (N, K // G) float: one scale per group of G consecutive weights of a row; G = K / scales.shape[1].

    Returns:
        (M, N) in x's dtype, accumulated in fp32.

    Raises:
        ValueError: shape mismatches, a group size that does not divide K or is odd. TypeError: wrong dtypes.
        Warns once for M > 16 (correct, slow).
    """
    check_tensors("int4_matmul", ACT_DTYPES, x=x)
    if packed.dtype != torch.uint8 or not scales.is_floating_point():
        raise TypeError(f"int4_matmul: packed must be uint8 (two 4-bit weights per byte) and scales float, got "
                        f"{packed.dtype} and {scales.dtype}")
    if packed.dim() != 2 or scales.dim() != 2 or scales.shape[0] != packed.shape[0] or scales.shape[1] == 0:
        raise ValueError(f"int4_matmul: packed must be (N, K/2) and scales (N, K/G), got {tuple(packed.shape)} "
                         f"and {tuple(scales.shape)}")
    if packed.device != x.device or scales.device != x.device:
        raise ValueError(f"int4_matmul: x, packed, scales must be on one device")
    N, K = packed.shape[0], 2 * packed.shape[1]
    if K % scales.shape[1]:
        raise ValueError(f"int4_matmul: {scales.shape[1]} groups do not divide K = {K}")
    G = K // scales.shape[1]
    _check_group(K, G)
    _check_x("int4_matmul", x, K)
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if G % 32:
        raise ValueError(f"int4_matmul: group size {G} is not a multiple of 32, the kernel's smallest K tile; "
                         f"requantize with quantize_int4(w, group_size=...) using 32, 64, 128 or 256")
    # batch-1 decode: the CUDA-core GEMV, on 32-bit words (a thread's run of up to 32 weights lies in one group)
    words = _as_words(packed) if M == 1 else None
    if words is not None:  # (else the M <= 16 kernel below: same answer, slower)
        _int4_gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, words, scales, y,
            N, K,
            x.stride(1), scales.stride(1), y.stride(1),
            MAGIC_BITS, 16,
            words.stride(0), scales.stride(0),
            GROUP=G,
        )
        return y
    grid = lambda meta: (triton.cdiv(M, BLOCK_M), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _int4_matmul_kernel[grid](
        x, packed, scales, y,
        M, N, K, G,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, IEEE=x.dtype == torch.float32,
    )
    return y


if __name__ == "__main__":
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
