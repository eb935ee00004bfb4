"""int4 weight-only matmul for decode: y = x @ dequantize_int4(packed, scales)^T, the 4-bit weights unpacked and
scaled in registers (the format and the reference: `llmlab.kernels.weight_quant`).

Which kernel runs (`int4_matmul`), for contiguous, 4-byte aligned packed rows:

    M = 1 on a CUDA GPU, K <= int4_gemv_gluon.MAX_K   the Gluon GEMV (`int4_gemv_gluon.py`)
    M = 1 otherwise                                   the Triton GEMVs (`int4_gemv.py`)
    M = 2..16 (and beyond, 16 rows at a time)         `_int4_tile_kernel`, on the tensor cores

and for any other layout (a strided view) the byte-wise `_int4_matmul_kernel`, which reads any strides.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from . import int4_gemv
from ._util import check_tensors, demo_needs_cuda, pdl_kwargs, tune_bench
from .packed_fields import MAGIC, int4_codes, magic_shift
from .quant_tiles import GEMV_CONFIGS, TILE_CONFIGS, int4_prune, tile_prune
from .weight_quant import ACT_DTYPES, BLOCK_M, check_are_tensors, check_group, check_k, check_x, word_rows

# -- M > 1 -----------------------------------------------------------------------------------------------------------
# M = 2..16 (a few decode rows at once): the tensor cores, one (16 x BLOCK_K) x (BLOCK_K x BLOCK_N) tl.dot per K
# tile. The weights are read as the GEMVs read them (32-bit words; each field made its exact value by `code_f32`,
# as the dot needs the codes themselves), put back in K order by joins that stay in each thread, and cast to x's
# dtype (codes -8..7 are exact in fp16 and bf16), so x is ONE contiguous load and there is one dot per tile. It
# runs at about cuBLAS bf16's speed, well ahead of the byte-wise `_int4_matmul_kernel` (two dots over the even and
# odd k, strided x loads; docs/results.md), which stays for weights whose rows are not word-aligned. No faster than
# bf16: Triton converts the dequantized tile to the dot's operand layout through shared memory. One scale per row
# per tile: BLOCK_K divides GROUP.


@triton.jit
def _k_order8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight (BLOCK_N, J) tensors, field i of each word -> (BLOCK_N, 8 J) in K order (weight 8j + i at column
    8j + i): three joins, each adding a trailing size-2 dimension held in one thread (no data moves)."""
    lo = tl.join(tl.join(c0, c4), tl.join(c2, c6))  # fields 0, 2, 4, 6 of each word
    hi = tl.join(tl.join(c1, c5), tl.join(c3, c7))  # fields 1, 3, 5, 7
    return tl.reshape(tl.join(lo, hi), (c0.shape[0], c0.shape[1] * 8))


@triton.autotune(configs=TILE_CONFIGS, key=["N", "K", "GROUP"], prune_configs_by={"early_config_prune": tile_prune},
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
    m0, m4, m8 = magic, magic_shift(magic, 4), magic_shift(magic, 8)
    m12, m16 = magic_shift(magic, 12), magic_shift(magic, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :], mask=n_mask[:, None], other=0)
        wk = _k_order8(*int4_codes(w, m0, m4, m8, m12, m16))  # (BLOCK_N, BLOCK_K) fp32, the codes - 8
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


@triton.autotune(configs=GEMV_CONFIGS, key=["N", "K", "GROUP"], prune_configs_by={"early_config_prune": int4_prune})
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


# -- M = 1: the Gluon GEMV where it runs -----------------------------------------------------------------------------
# On a CUDA GPU the input-stationary GEMV written in Gluon (int4_gemv_gluon.py) sums each chunk's rows with 2
# barriers and no per-row butterflies; Triton's reduction (`int4_gemv._int4_gemv_is_kernel`) takes a 5-step butterfly
# per warp and row, then two trips through shared memory (3 barriers). The Gluon GEMV is the faster, and at K = 14336
# faster than the K-walking GEMV too (docs/results.md). It takes rows of up to `int4_gemv_gluon.MAX_K` weights
# (longer rows would put two or more slots in each thread, which spills registers). The Triton kernels stay for the
# CPU interpreter (which does not run Gluon), for Tritons without Gluon, and as its reference in the tests.
# USE_GLUON = False turns it off.
USE_GLUON = True
_GLUON_OFF: dict = {}  # cuda:i -> None where the Gluon GEMV is used, else the reason it is not


def _gluon():
    """llmlab/kernels/int4_gemv_gluon.py, imported at first use on a GPU: importing Gluon takes ~0.1 s, which runs
    on a CPU (the interpreter, Binder) never need."""
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
        return "switched off (int4_matmul.USE_GLUON = False)"
    if _gluon_gemv(device):
        return "gluon"
    return _GLUON_OFF.get(_cuda_index(device)) or f"not a CUDA device ({device.type})"


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ dequantize_int4(packed, scales)^T, the 4-bit weights unpacked and scaled in registers.

    Args:
        x: (M, K) fp32 / fp16 / bf16 (fp32 in the CPU interpreter); M = 1..16 is the target.
        packed: (N, K // 2) uint8, two weights per byte (even k low nibble, odd k high; see `weight_quant`).
        scales: (N, K // G) float: one scale per group of G consecutive weights of a row; G = K / scales.shape[1].

    Returns:
        (M, N) in x's dtype, accumulated in fp32.

    Contiguous packed rows (4-byte aligned): M = 1 runs the input-stationary GEMV, in Gluon on a CUDA GPU
    (llmlab/kernels/int4_gemv_gluon.py; `gluon_gemv_status()` says whether it is used), else in Triton
    (`int4_gemv.py`: input-stationary; K-walking for K > IS_MAX_K); M > 1 the word-reading
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
    check_are_tensors("int4_matmul", packed=packed, scales=scales)
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
    check_k(K)  # before the group-size advice below, which no group size could follow
    if G % 2:
        raise ValueError(f"int4_matmul: {scales.shape[1]} scales per row over K = {K} make groups of {G} weights, "
                         f"an odd size; quantize with quantize_int4(w, group_size=...) using 32, 64, 128 or 256")
    if G % 32:
        raise ValueError(f"int4_matmul: group size {G} is not a multiple of 32, the kernel's smallest K tile; "
                         f"requantize with quantize_int4(w, group_size=...) using 32, 64, 128 or 256")
    check_group(K, G)
    check_x("int4_matmul", x, K, f" (K = 2 x packed.shape[1] = 2 x {K // 2}: two 4-bit weights per byte)")
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    words = word_rows(packed, K // 2, 4)  # contiguous, 4-byte aligned rows: the word-reading kernels
    if M == 1 and words and _gluon_gemv(x.device) and K <= _gluon().MAX_K:  # batch 1 on a GPU: the Gluon GEMV
        try:
            _gluon().int4_gemv(x, packed, scales, y, pdl_kwargs(x.device))
            return y
        except Exception as e:  # noqa: BLE001 - a Triton whose Gluon cannot build it: the Triton kernels below
            _gluon_failed(x.device, (N, K), e)
    if M == 1 and words and K <= int4_gemv.IS_MAX_K:  # batch-1 decode: the input-stationary GEMV
        int4_gemv.launch_input_stationary(x, packed, scales, y, N, K, G)
        return y
    if M == 1 and words:  # batch-1 decode, rows longer than IS_MAX_K: the K-walking GEMV
        int4_gemv.launch_k_walking(x, packed, scales, y, N, K, G)
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
    demo_needs_cuda("int4_matmul")
    from triton.testing import do_bench

    from .weight_quant import quantize_int4

    torch.manual_seed(0)
    for N, K in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        w4, s4 = quantize_int4(w, 128)
        for M in (1, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ms_bf16, ms4 = do_bench(lambda: x @ w.T), do_bench(lambda: int4_matmul(x, w4, s4))
            print(f"N={N} K={K} M={M:2d}: bf16 {ms_bf16 * 1e3:6.1f} us  int4 {ms4 * 1e3:6.1f} us "
                  f"(x{ms_bf16 / ms4:.2f}); int4 weight GB/s {w4.numel() / ms4 / 1e6:7.1f}")
