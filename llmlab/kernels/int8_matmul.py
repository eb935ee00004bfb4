"""int8 weight-only matmul for decode: y = x @ (w_q * scales[:, None])^T, the int8 weights converted in registers.

The format (per output channel) and the reference are in `llmlab.kernels.weight_quant`. Two kernels:

  * M = 1 (batch-1 decode), rows that start on 4-byte boundaries: `_int8_gemv_kernel`, a GEMV on the CUDA cores
    (a (16 x K) tensor-core tile would be 15/16 padding). Each program owns BLOCK_N rows and walks K, 32 bits (4
    weights) at a time; x is loaded once per K tile as a (J, 4) tile and split into the x of each byte position, so
    a word's four products are one FMA chain in one thread, and the bytes become floats in one instruction each
    (`packed_fields.field_f32`). SPLIT_K programs may share a row block's K range (`split_k.py`). A config with R
    and PPS runs the input-stationary GEMV instead (`int8_gemv.py`: x in registers, whole rows streaming past),
    which a decode step's tuning may pick for its small GEMVs (`candidate_configs`).
  * anything else: `_int8_matmul_kernel`, one tl.dot per K tile over 16-row blocks of x, any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import int8_gemv, split_k
from ._util import check_tensors, demo_needs_cuda, pdl_kwargs, tune_bench, zero_on_error
from .packed_fields import X_EXP, field_f32, lift, split4
from .quant_tiles import GEMV1_CONFIGS, GEMV_CONFIGS, gemv1_prune
from .split_k import split_k_range, split_k_store
from .weight_quant import ACT_DTYPES, BLOCK_M, check_are_tensors, check_x, word_rows


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


def _gemv1_fused_prune(configs, named_args, **kwargs):
    """`gemv1_prune`, and with the RMSNorm prologue one split only: rstd needs the sum of x^2 over the whole row,
    which a program has only when it walks all of K."""
    configs = gemv1_prune(configs, named_args, **kwargs)
    if kwargs.get("PROLOGUE", named_args.get("PROLOGUE", 0)) == 1:
        configs = [c for c in configs if c.kwargs["SPLIT_K"] == 1] or [
            triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "STAGES": 1})]
    return configs


@triton.jit
def _int8_x_tile(x_ptr, nw_ptr, kk, K, stride_xk, PROLOGUE: tl.constexpr):
    """x at positions kk (a (J, 4) tile; 0 past K) in fp32 after the prologue (1: times the RMSNorm weight; 2: x
    is [gate | up] and the input is silu(gate) * up, rounded where the unfused ops round), and x^2 there (the
    RMSNorm's sum, before the weight)."""
    k_mask = kk < K
    x = tl.load(x_ptr + kk * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
    sq = x * x
    if PROLOGUE == 1:
        x = x * tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    if PROLOGUE == 2:
        dt = x_ptr.dtype.element_ty
        u = tl.load(x_ptr + (K + kk) * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        x = ((x * tl.sigmoid(x)).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
    return x, sq


@triton.jit
def _int8_word_sums(w, x):
    """(BLOCK_N, J) int32 words of int8 weights (byte i = weight 4j + i) and their x as a (J, 4) fp32 tile ->
    sum_i w_i x_i * 2^-X_EXP per (row, word), one FMA chain per (row, word): XOR 0x80 turns each signed byte into
    w + 128 in 0..255, read by `field_f32`, and 128 x the word's x sum comes off."""
    u = w ^ -0x7F7F7F80  # = 0x80808080 as int32
    top = u >> 16
    x0, x1, x2, x3 = split4(x)
    sx = (x0 + x1 + x2 + x3) * (128.0 * 2.0 ** -X_EXP)  # (J,): the bytes' offset of 128
    part = field_f32(u, 0, 8) * lift(x0, 0)[None, :] - sx[None, :]
    part += field_f32(u, 8, 8) * lift(x1, 8)[None, :]
    part += field_f32(top, 0, 8) * lift(x2, 0)[None, :]
    part += field_f32(top, 8, 8) * lift(x3, 8)[None, :]
    return part


@triton.autotune(configs=GEMV1_CONFIGS, key=["N", "K", "PROLOGUE", "HAS_RES", "PDL"],
                 prune_configs_by={"early_config_prune": _gemv1_fused_prune}, do_bench=tune_bench)
@triton.jit
def _int8_gemv_kernel(
    # pointers (ws, cnt: the split-K scratch, see `split_k_store`; nw: the RMSNorm weight, res: the residual)
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, nw_ptr, res_ptr,
    # sizes; RMSNorm's eps
    N, K, eps,
    # strides (elements; stride_wn in 32-bit words: the rows are read 4 weights at a time)
    stride_xk, stride_wn, stride_yn, stride_ws,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
    # the small ops inside (`fused_quant_gemv`): prologue 0 none, 1 RMSNorm, 2 SwiGLU; the residual add; PDL
    PROLOGUE: tl.constexpr = 0, HAS_RES: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """M = 1: the int4 GEMV's scheme for int8 weights (`_int8_word_sums`); one scale per output row, applied to
    each split's sums. With PDL the first weight tile is requested before the wait for the kernel that writes x."""
    J: tl.constexpr = BLOCK_K // 4  # int32 words per row in a K tile (K is a multiple of 4)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    ri = tl.arange(0, 4)
    n_mask = rn < N
    w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * stride_wn
    k_start, k_end = split_k_range(K, BLOCK_K, SPLIT_K)
    if PDL:  # let the next kernel's programs start arriving (see `pdl_enabled` in _util.py)
        tl.extra.cuda.gdc_launch_dependents()
    jw = k_start // 4 + rj
    w = tl.load(w_rows + jw[None, :], mask=n_mask[:, None] & (jw < K // 4)[None, :], other=0)  # (BLOCK_N, J)
    if PDL:  # the first tile depends on no earlier kernel: requested before waiting for the one that writes x
        tl.extra.cuda.gdc_wait()
    x, sq = _int8_x_tile(x_ptr, nw_ptr, k_start + 4 * rj[:, None] + ri[None, :], K, stride_xk, PROLOGUE)
    acc = _int8_word_sums(w, x)
    for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=STAGES):
        jw = k0 // 4 + rj
        w = tl.load(w_rows + jw[None, :], mask=n_mask[:, None] & (jw < K // 4)[None, :], other=0)
        x, sq_k = _int8_x_tile(x_ptr, nw_ptr, k0 + 4 * rj[:, None] + ri[None, :], K, stride_xk, PROLOGUE)
        sq += sq_k
        acc += _int8_word_sums(w, x)
    s = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    y = tl.sum(acc, axis=1) * 2.0 ** X_EXP * s  # back from the sums' scale first: s * 2^64 could overflow
    if PROLOGUE == 1:  # one split (`_gemv1_fused_prune`): this program summed x^2 over the whole row
        y = y / tl.sqrt(tl.sum(tl.sum(sq, axis=1), axis=0) / K + eps)
    split_k_store(y, y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K, res_ptr, HAS_RES)


def check_gemv_tile(config) -> None:
    """A `config=` for the M = 1 GEMV, of either kind: the K-walking GEMV's, a triton.Config whose kwargs are exactly
    BLOCK_N and BLOCK_K (powers of 2, BLOCK_K >= 4: whole 32-bit words), SPLIT_K (1..split_k.MAX_SPLIT_K) and STAGES
    (>= 1); or the input-stationary GEMV's (`int8_gemv`), exactly R (rows per chunk, a power of 2 up to
    MAX_R) and PPS (programs per SM, >= 1), or R and GLUON=True for its Gluon build (`int8_gemv_gluon`). TypeError
    otherwise, naming what is wrong."""
    if input_stationary(config):
        r, p = config.kwargs["R"], config.kwargs.get("PPS", 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (r, p)) or not 1 <= r <= MAX_R \
                or r & (r - 1) or p < 1 or config.kwargs.get("GLUON", True) is not True:
            raise TypeError(f"int8 GEMV: an input-stationary config's R must be a power of 2 in 1..{MAX_R}, PPS >= 1 "
                            f"and GLUON True, got {config.kwargs}")
        return
    keys = {"BLOCK_N", "BLOCK_K", "SPLIT_K", "STAGES"}
    if not isinstance(config, triton.Config) or set(config.kwargs) != keys:
        got = f"{type(config).__name__} {config}" if isinstance(config, triton.Config) else repr(config)
        raise TypeError(f"int8 GEMV: config must be a triton.Config with BLOCK_N, BLOCK_K, SPLIT_K and STAGES and "
                        f"nothing else, or with R and PPS, or R and GLUON (see candidate_configs), got {got}; a "
                        f"tile chosen for another weight format (a float or int4 model's) does not fit: clear the "
                        f"step's tiles or tune again")
    bn, bk, sk, st = (config.kwargs[k] for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "STAGES"))
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (bn, bk, sk, st))
    if not ints or bn < 1 or bk < 4 or bn & (bn - 1) or bk & (bk - 1) or not 1 <= sk <= split_k.MAX_SPLIT_K \
            or st < 1:
        raise TypeError(f"int8 GEMV: config's BLOCK_N and BLOCK_K must be powers of 2 (BLOCK_K >= 4), SPLIT_K in "
                        f"1..{split_k.MAX_SPLIT_K} and STAGES >= 1, got BLOCK_N={bn!r}, BLOCK_K={bk!r}, "
                        f"SPLIT_K={sk!r}, STAGES={st!r}")


# The most rows an input-stationary chunk holds: the Gluon build puts a chunk's rows on the 32 lanes of a warp for
# its cross-thread sums (`int4_gemv_gluon`), so more than 32 cannot be laid out.
MAX_R = 32


def input_stationary(config) -> bool:
    """Is `config` one of the input-stationary GEMV's: R and PPS (`int8_gemv`), or R and GLUON
    (`int8_gemv_gluon`)?"""
    return isinstance(config, triton.Config) and set(config.kwargs) in ({"R", "PPS"}, {"R", "GLUON"})


def check_gemv_config(config, rmsnorm: bool = False) -> None:
    """`check_gemv_tile`, and with the RMSNorm prologue (`rmsnorm`) one split only: rstd sums x^2 over the whole
    row, which one program walks (ValueError otherwise). The launcher, `fused_quant_gemv` and step tuning all
    check a given config with this."""
    check_gemv_tile(config)
    if rmsnorm and not input_stationary(config) and config.kwargs["SPLIT_K"] != 1:
        raise ValueError(f"int8 GEMV: the RMSNorm prologue needs SPLIT_K = 1 (rstd sums x^2 over the whole row, "
                         f"which one program walks), got the config {config}")


def candidate_configs(N: int, K: int, rmsnorm: bool = False, device: torch.device | str | None = None) -> list:
    """The configs a decode step's tuning (`step_tuning`) times for the M = 1 GEMV of an N x K int8 weight: the
    K-walking GEMV's tiles the autotuner would time (`GEMV1_CONFIGS` after `_gemv1_fused_prune`; with the RMSNorm
    prologue one split only), then the input-stationary GEMV's (`int8_gemv.candidate_configs`, where it takes K),
    in Triton and, where it runs on `device` (None: the current CUDA device), in Gluon
    (`int8_gemv_gluon.candidate_configs`). One config where autotuning is off (the interpreter,
    LLMLAB_TRITON_AUTOTUNE=0)."""
    from . import int8_gemv_gluon

    tiles = _gemv1_fused_prune(list(GEMV1_CONFIGS), {"N": N, "K": K}, PROLOGUE=1 if rmsnorm else 0)
    if len(GEMV1_CONFIGS) == 1:
        return tiles
    return tiles + int8_gemv.candidate_configs(K) + int8_gemv_gluon.candidate_configs(K, device)


def launch_gemv(x, w_q, scales, y, norm_weight=None, eps: float = 1e-5, swiglu: bool = False, residual=None,
                config: triton.Config | None = None) -> None:
    """Launch `_int8_gemv_kernel` for one row of x: y = [residual +] x' @ (w_q * scales)^T with x' = x, its
    RMSNorm (`norm_weight`) or silu(gate) * up (`swiglu`: x is [gate | up]), over cdiv(N, BLOCK_N) row blocks x
    SPLIT_K splits (the autotuned config's, or `config`'s) with the split-K scratch of this N. The callers check
    the arguments (`int8_matmul`, `fused_quant_gemv`). An input-stationary `config` runs that GEMV instead: R and
    PPS `int8_gemv`'s, R and GLUON `int8_gemv_gluon`'s where it can run (else `int8_gemv`'s with R, which computes
    the same sums); ValueError where it cannot take K (`int8_gemv.takes`)."""
    N, K = w_q.shape
    if input_stationary(config):
        check_gemv_tile(config)
        if not int8_gemv.takes(K):
            raise ValueError(f"int8 GEMV: the input-stationary config {config} takes rows of a multiple of 16 "
                             f"weights up to {int8_gemv.MAX_K}, not {K}; use a K-walking config (BLOCK_N, BLOCK_K, "
                             f"SPLIT_K, STAGES) or config=None")
        fused = dict(norm_weight=norm_weight, eps=eps, swiglu=swiglu, residual=residual)
        if "GLUON" in config.kwargs and _launch_gluon(x, w_q, scales, y, config.kwargs["R"], fused):
            return
        int8_gemv.launch(x, w_q, scales, y, config.kwargs["R"], config.kwargs.get("PPS", int8_gemv.DEFAULT[1]),
                         **fused)
        return
    ws, cnt = split_k.scratch(x.device, N)
    kernel, meta = _int8_gemv_kernel, {}
    if config is None and norm_weight is not None and len(_int8_gemv_kernel.configs) == 1:
        # autotuning off (the interpreter): the one config, unsplit (the autotuner prunes only among several)
        only = _int8_gemv_kernel.configs[0]
        config = triton.Config({**only.kwargs, "SPLIT_K": 1}, num_warps=only.num_warps)
    if config is not None:
        check_gemv_config(config, rmsnorm=norm_weight is not None)
        kernel, meta = _int8_gemv_kernel.fn, config.all_kwargs()
    with zero_on_error(cnt):
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
            x, w_q, scales, y, ws, cnt, x if norm_weight is None else norm_weight, x if residual is None else residual,
            N, K, float(eps),
            x.stride(-1), w_q.stride(0) // 4, y.stride(-1), ws.stride(0),
            PROLOGUE=2 if swiglu else 1 if norm_weight is not None else 0, HAS_RES=residual is not None,
            **pdl_kwargs(x.device), **meta,
        )


def _launch_gluon(x, w_q, scales, y, R: int, fused: dict) -> bool:
    """Run the Gluon GEMV (`int8_gemv_gluon`) into y; False where it does not run on x's device
    (`int8_gemv_gluon.usable`), or after it failed to build there (said once; the Triton build from then on)."""
    from . import int8_gemv_gluon

    if not int8_gemv_gluon.usable(x.device):
        return False
    try:
        int8_gemv_gluon.int8_gemv(x, w_q, scales, y, R, pdl_kwargs(x.device), **fused)
        return True
    except Exception as e:  # noqa: BLE001 - a Triton whose Gluon cannot build it: the Triton GEMV
        int8_gemv_gluon.failed(x.device, tuple(w_q.shape), e)
        return False


def int8_matmul(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ (w_q * scales[:, None])^T with int8 weights dequantized in registers.

    Args:
        x: (M, K) fp32 / fp16 / bf16 activations (fp32 in the CPU interpreter); M = 1..16 is the target.
        w_q: (N, K) int8 (`quantize_int8`). scales: (N,) float (any float dtype; used in fp32).

    Returns:
        (M, N) in x's dtype, accumulated in fp32.

    M = 1 with rows that start on 4-byte boundaries (K a multiple of 4, a contiguous w_q) runs the CUDA-core GEMV,
    which reads 32-bit words; anything else runs the tl.dot kernel, which reads any strides.

    Numerics of the M = 1 GEMV (see `field_f32`): exact products, fp32 sums, for 2^-62 <= |x| < 2^43 (about 2e-19 to
    9e12; all of fp16's range). A bf16/fp32 element of x at or above 2^43 can make every output inf or NaN (where
    it meets the field lifted most); elements far below 2^-62 lose precision and, below ~1e-26, count as 0. The
    offset of the stored codes (128 here, 8 for int4) comes off as that times the sum of x per word, so an x with a
    large mean loses a few bits to cancellation.

    Raises:
        ValueError: shape mismatches, M = 0. TypeError: wrong dtypes. Warns once for M > 16 (correct, slow).
    """
    check_tensors("int8_matmul", ACT_DTYPES, x=x)
    check_are_tensors("int8_matmul", w_q=w_q, scales=scales)
    if w_q.dtype != torch.int8 or not scales.is_floating_point():
        raise TypeError(f"int8_matmul: w_q must be int8 and scales float, got {w_q.dtype} and {scales.dtype}")
    if w_q.dim() != 2 or scales.shape != (w_q.shape[0],):
        raise ValueError(f"int8_matmul: w_q must be (N, K) and scales (N,), got {tuple(w_q.shape)} and "
                         f"{tuple(scales.shape)}")
    if w_q.device != x.device or scales.device != x.device:
        raise ValueError(f"int8_matmul: x, w_q, scales must be on one device ({x.device}, {w_q.device}, "
                         f"{scales.device})")
    N, K = w_q.shape
    check_x("int8_matmul", x, K)
    scales = scales.contiguous()  # the kernels read scales[n] at offset n
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 1 and word_rows(w_q, K, 4):  # batch-1 decode: the CUDA-core GEMV
        launch_gemv(x, w_q, scales, y)
        return y
    grid = lambda meta: (triton.cdiv(M, BLOCK_M), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _int8_matmul_kernel[grid](
        x, w_q, scales, y,
        M, N, K,
        x.stride(0), x.stride(1), w_q.stride(0), w_q.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, IEEE=x.dtype == torch.float32,
    )
    return y


if __name__ == "__main__":
    demo_needs_cuda("int8_matmul")
    from triton.testing import do_bench

    from .weight_quant import quantize_int8

    torch.manual_seed(0)
    for N, K in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        w8, s8 = quantize_int8(w)
        for M in (1, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ms_bf16, ms8 = do_bench(lambda: x @ w.T), do_bench(lambda: int8_matmul(x, w8, s8))
            print(f"N={N} K={K} M={M:2d}: bf16 {ms_bf16 * 1e3:6.1f} us  int8 {ms8 * 1e3:6.1f} us "
                  f"(x{ms_bf16 / ms8:.2f})")
