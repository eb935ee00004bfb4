"""One decode-step GEMV (y = W x, one token) that also does the small op before it and the add after it.

At batch 1 a decode step is ~10 kernels per layer, and on a 1B model most of them are tiny: an RMSNorm over 2048
numbers, SwiGLU over 8192, a residual add. Each costs a launch, a fill and a drain of the GPU (a few microseconds in a
CUDA graph) for almost no bytes. They can ride along with the GEMV that reads their output, because a GEMV reads
its whole input vector anyway (every output row needs all of x):

* RMSNorm prologue: norm(x) = x * rstd * nw with rstd = 1/sqrt(mean(x^2) + eps) one number per row, so
  W norm(x) = rstd * W (x * nw): each program multiplies x by the norm weight as it streams W, sums x^2 on the same
  pass (x is K numbers, read from L2 — nothing next to the N x K weights) and scales its outputs at the end;
* SwiGLU prologue: x is the gate/up projection's output [gate | up] (2K numbers), and the program computes
  silu(gate) * up as it reads them;
* residual epilogue: y = residual + W x, the residual stream's add done on the way out.

A Llama layer's decode step then has four GEMVs (norm + qkv, o + add, norm + gate/up, swiglu + down + add) instead
of four GEMVs and five small kernels. The SwiGLU and residual roundings to the activation dtype are done where the
unfused ops do them; the normalized x is not rounded (the one-pass form above), so in bf16 the result differs from
the unfused ops' by about one bf16 rounding of x (relative 2^-8 per element, averaging out over K); in fp32 they
agree to the order of the additions.
(The fusion of pointwise ops into the adjacent matmul is what compilers like TorchInductor and TensorRT do;
"Flash-Decoding" and the Hazy Research "megakernel" post, https://hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles,
explain why a 1B model at batch 1 is dominated by such small kernels.)
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._util import autotune_configs, check_tensors, pdl_kwargs, tune_bench, zero_on_error
from .rope_cache import _rope_cache_head

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NONE, RMSNORM, SWIGLU = 0, 1, 2  # the prologues (PROLOGUE constexpr)


def fused_gemv_reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-5, swiglu: bool = False,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused ops, as `llmlab.model` runs them: [RMSNorm or SwiGLU] -> F.linear -> [+ residual].

    Bytes (bf16, 1B model's down projection, K = 8192): eager reads gate and up and writes the product (3 x 16 KB),
    the GEMV reads W (33.5 MB), the add reads two rows and writes one — four launches; fused: one launch, the same
    33.5 MB. The saving is launches and fill/drain time, not bytes.
    """
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    elif norm_weight is not None:  # as llmlab.model.RMSNorm.forward
        x32 = x.float()
        x = norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = F.linear(x, weight)
    return y if residual is None else residual + y


# Autotuned per shape and fusion: (BLOCK_N output rows per program, BLOCK_K inputs per step, warps, STAGES). A GEMV
# runs at the speed of the bytes in flight. Measured on the H200 (call K): with the loop's loads issued one step
# at a time, each step waited a full memory latency, and the 1B model's GEMVs reached 51-74% of the copy
# bandwidth. STAGES > 1 pipelines the loop (`tl.range(num_stages=...)`: later steps' tiles are requested while
# this one is summed); small BLOCK_N gives more programs for the 132 SMs when N is only 2048. One-warp programs
# (the last row): the pipelined loop syncs a program's warps every step, which one warp does for free — the int4 /
# int8 GEMVs were fastest that way (calls W, X). Timed as the quantized GEMVs are (`tune_bench`: after a read of
# 256 MB, not Triton's write). One config in the interpreter (`autotune_configs`).
_SHAPES = [(2, 1024, 4, 3), (4, 512, 4, 3), (4, 1024, 4, 3), (8, 512, 4, 3), (8, 256, 4, 4), (16, 256, 4, 3),
           (2, 2048, 8, 2), (4, 2048, 8, 2), (8, 1024, 8, 2), (16, 512, 8, 2), (2, 1024, 4, 1), (4, 512, 4, 1),
           (8, 512, 4, 2), (4, 1024, 4, 4),
           (2, 512, 1, 4), (4, 512, 1, 4), (4, 256, 1, 6), (8, 256, 1, 4), (2, 1024, 1, 4), (8, 512, 2, 4)]
CONFIGS = autotune_configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k, "STAGES": st}, num_warps=w)
                            for n, k, w, st in _SHAPES],
                           default=triton.Config({"BLOCK_N": 16, "BLOCK_K": 256, "STAGES": 1}))


@triton.jit
def _x_tile(x_ptr, nw_ptr, kk, k_mask, K, PROLOGUE: tl.constexpr):
    """The GEMV's input at positions kk (BLOCK_K,), fp32, after the prologue; and x^2 there (RMSNorm's sum)."""
    dt = x_ptr.dtype.element_ty  # the activation dtype: where the unfused ops round, we round
    if PROLOGUE == 2:  # SwiGLU: x holds [gate | up]; silu rounded as F.silu, the product as the unfused op
        g = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + kk, mask=k_mask, other=0.0).to(tl.float32)
        xk = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        sq = tl.zeros_like(xk)
    else:
        xk = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        sq = xk * xk
        if PROLOGUE == 1:  # RMSNorm: W (x * nw), times rstd = 1/sqrt(mean(x^2) + eps) after the loop
            xk = xk * tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    return xk, sq


def _heads_fit(block_n: int, head_dim: int) -> bool:
    """The RoPE epilogue needs a program's rows to be part of one head or whole heads."""
    return head_dim % block_n == 0 or block_n % head_dim == 0


def _rope_prune(configs, named_args, **kwargs):
    """With the RoPE epilogue: the configs whose BLOCK_N fits the heads (`_heads_fit`)."""
    half = kwargs.get("ROPE_HALF", named_args.get("ROPE_HALF", 0))
    if not half:
        return configs
    return [c for c in configs if _heads_fit(c.kwargs["BLOCK_N"], 2 * half)] or [
        triton.Config({"BLOCK_N": 2, "BLOCK_K": 256, "STAGES": 1})]


@triton.jit
def _rope_one_head(y_ptr, freq_ptr, kc_ptr, vc_ptr, pos, head, H, HKV, S, stride_kh, stride_ks, stride_vh, stride_vs,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """`rope_cache`'s work for one head of the projection y (batch 1): q rotated in y, k and v into the cache."""
    kv = tl.minimum(tl.maximum(head - H, 0), HKV - 1)
    kvv = tl.minimum(tl.maximum(head - H - HKV, 0), HKV - 1)
    _rope_cache_head(y_ptr + head * 2 * HALF, freq_ptr, freq_ptr, pos, kc_ptr + kv * stride_kh,
                     vc_ptr + kvv * stride_vh, head, H, HKV, S, stride_ks, stride_vs, HALF, BLOCK_HALF, True, True)


@triton.autotune(configs=CONFIGS, key=["N", "K", "PROLOGUE", "HAS_RES", "ROPE_HALF"], do_bench=tune_bench,
                 prune_configs_by={"early_config_prune": _rope_prune})
@triton.jit
def _fused_gemv_kernel(
    # pointers (pos .. cnt: the RoPE epilogue's, see `RopeCacheWrite`; unused without it)
    x_ptr, w_ptr, nw_ptr, res_ptr, y_ptr, pos_ptr, freq_ptr, kc_ptr, vc_ptr, cnt_ptr,
    # sizes
    N, K, eps, H, HKV, S,
    # strides (elements)
    stride_wn, stride_kh, stride_ks, stride_vh, stride_vs,
    # meta-parameters
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ROPE_HALF: tl.constexpr = 0, BLOCK_HALF: tl.constexpr = 1,
):
    dt = x_ptr.dtype.element_ty
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None] * stride_wn

    if PDL:  # let the next kernel's programs start arriving (see `pdl_enabled` in _util.py)
        tl.extra.cuda.gdc_launch_dependents()
    # the first W tile depends on no earlier kernel: request it before waiting for the one that writes x
    w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    xk, sq = _x_tile(x_ptr, nw_ptr, rk, rk < K, K, PROLOGUE)
    # acc keeps one partial product per (row, lane) and is summed once after the loop: no reduction per step
    acc = w.to(tl.float32) * xk[None, :]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + rk
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # what it moves
        xk, sq_k = _x_tile(x_ptr, nw_ptr, kk, k_mask, K, PROLOGUE)
        sq += sq_k
        acc += w.to(tl.float32) * xk[None, :]
    y = tl.sum(acc, axis=1)  # (BLOCK_N,) fp32
    if PROLOGUE == 1:  # one pass: x is not normalized (nor rounded) before the products, the row sum is scaled
        y = y / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    if HAS_RES:  # residual + linear(x): the linear's output rounded first, as the unfused add sees it
        r = tl.load(res_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        y = y.to(dt).to(tl.float32) + r
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    if ROPE_HALF > 0:  # RoPE + cache write, per head, once its rows are all stored (memory order: as in
        HD: tl.constexpr = 2 * ROPE_HALF  # dequant_matmul's `_split_k_store`: barrier, then an acq_rel count)
        tl.debug_barrier()
        pos = tl.load(pos_ptr)
        if BLOCK_N >= HD:  # this program's rows are whole heads: it rotates them itself
            for j in tl.static_range(BLOCK_N // HD):
                head = tl.program_id(0) * (BLOCK_N // HD) + j
                if head < N // HD:
                    _rope_one_head(y_ptr, freq_ptr, kc_ptr, vc_ptr, pos, head, H, HKV, S, stride_kh, stride_ks,
                                   stride_vh, stride_vs, ROPE_HALF, BLOCK_HALF)
        else:  # a head's rows are spread over HD / BLOCK_N programs: the last of them to finish rotates it
            head = (tl.program_id(0) * BLOCK_N) // HD
            done = tl.atomic_add(cnt_ptr + head, 1, sem="acq_rel")
            if done == HD // BLOCK_N - 1:
                _rope_one_head(y_ptr, freq_ptr, kc_ptr, vc_ptr, pos, head, H, HKV, S, stride_kh, stride_ks,
                               stride_vh, stride_vs, ROPE_HALF, BLOCK_HALF)
                tl.atomic_xchg(cnt_ptr + head, 0)  # ready for the next launch


class RopeCacheWrite(NamedTuple):
    """The q/k/v projection's epilogue for one decode token (`fused_gemv(..., rope_cache=...)`): RoPE on q and k
    and the K/V cache write of `rope_cache.rope_and_cache_`, done by the GEMV's own programs — the last program to
    finish each head's rows rotates that head (angles from the position and inv_freq) and writes k and v into the
    cache at the position. One launch per layer fewer.

    positions: (1,) int32/int64 on the device, the cache slot of the token (checked on the host by the caller);
    inv_freq: (hd/2,) fp32; k_cache, v_cache: (Hkv, S, hd) one layer's cache of sequence 0, last dimension
    contiguous; n_heads: H, the query heads. The weight's rows are then [q heads | k heads | v heads], hd each."""
    positions: torch.Tensor
    inv_freq: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    n_heads: int


_rope_counters: dict = {}


def _head_counters(device: torch.device, heads: int) -> torch.Tensor:
    """(heads,) int32 zeros: one "programs done" counter per head for the RoPE epilogue, zeroed by each launch's
    last program of the head. Kept for the process's life per (device, heads): a captured CUDA graph keeps their
    address. Launches on one stream are ordered; two streams running this epilogue for one size at once are not."""
    key = (device, heads)
    if key not in _rope_counters:
        _rope_counters[key] = torch.zeros(heads, dtype=torch.int32, device=device)
    return _rope_counters[key]


def _check_rope(rc: RopeCacheWrite, x: torch.Tensor, N: int) -> int:
    """Check a RopeCacheWrite against the GEMV's output size N; returns head_dim."""
    if rc.k_cache.dim() != 3 or rc.k_cache.shape != rc.v_cache.shape:
        raise ValueError(f"fused_gemv: rope_cache's k_cache and v_cache must be (Hkv, S, hd) alike, got "
                         f"{tuple(rc.k_cache.shape)} and {tuple(rc.v_cache.shape)}")
    hkv, _, hd = rc.k_cache.shape
    if hd % 2 or N != (rc.n_heads + 2 * hkv) * hd:
        raise ValueError(f"fused_gemv: {N} outputs are not {rc.n_heads} q heads + 2 x {hkv} k/v heads of "
                         f"head_dim {hd} (even), as the cache {tuple(rc.k_cache.shape)} and n_heads say")
    if rc.positions.shape != (1,) or rc.positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_gemv: rope_cache.positions must be a (1,) int32/int64 tensor, got "
                         f"{tuple(rc.positions.shape)} {rc.positions.dtype}")
    if rc.inv_freq.shape != (hd // 2,) or rc.inv_freq.dtype != torch.float32:
        raise ValueError(f"fused_gemv: rope_cache.inv_freq must be ({hd // 2},) fp32, got "
                         f"{tuple(rc.inv_freq.shape)} {rc.inv_freq.dtype}")
    for name, t in (("positions", rc.positions), ("inv_freq", rc.inv_freq), ("k_cache", rc.k_cache),
                    ("v_cache", rc.v_cache)):
        if t.device != x.device:
            raise ValueError(f"fused_gemv: rope_cache.{name} is on {t.device}, x on {x.device}")
    for name, t in (("k_cache", rc.k_cache), ("v_cache", rc.v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_gemv: rope_cache.{name}'s last dimension must be contiguous, strides "
                             f"{t.stride()}")
    return hd


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
               swiglu: bool = False, residual: torch.Tensor | None = None,
               rope_cache: RopeCacheWrite | None = None) -> torch.Tensor:
    """y = [residual +] weight @ prologue(x) for ONE token, in one launch.

    Args:
        x: (..., K_in) holding one row (numel == K_in), fp32 / fp16 / bf16 (fp32 in the CPU interpreter),
            contiguous. K_in = K, or 2K with `swiglu` ([gate | up], as the fused gate/up projection writes it).
        weight: (N, K) same dtype, last dimension contiguous (a row-slice view of a bigger weight is fine).
        norm_weight: (K,) RMSNorm weight: x is normalized first (`llmlab.model.RMSNorm`, eps `eps`).
        swiglu: x is [gate | up]: silu(gate) * up is the GEMV's input. Not together with norm_weight.
        residual: (..., N) one row, same dtype: added to the output.
        rope_cache: the q/k/v projection's epilogue (`RopeCacheWrite`): q rotated in the output, k rotated and v
            written into the cache at the position. Not together with residual.

    Returns:
        (..., N): x's leading dimensions with the last one N, in x's dtype (with rope_cache: q rotated; the k and v
        parts as projected, before RoPE).

    Raises:
        ValueError: more than one row, shapes that do not fit, both prologues, a non-contiguous x or weight rows.
        TypeError: unsupported or mismatched dtypes (see `check_tensors`).
    """
    tensors = {"x": x, "weight": weight}
    if norm_weight is not None:
        tensors["norm_weight"] = norm_weight
    if residual is not None:
        tensors["residual"] = residual
    check_tensors("fused_gemv", DTYPES, **tensors)
    if len({t.dtype for t in tensors.values()}) != 1:
        raise TypeError("fused_gemv: x, weight, norm_weight and residual must share one dtype, got " +
                        ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()))
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"fused_gemv: weight must be (N, K) with contiguous rows, got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    N, K = weight.shape
    k_in = 2 * K if swiglu else K
    if x.dim() == 0 or x.shape[-1] != k_in or x.numel() != k_in:
        raise ValueError(f"fused_gemv: x must be one row of {k_in} numbers "
                         f"({'[gate | up], 2K' if swiglu else 'K'} for weight {tuple(weight.shape)}), got "
                         f"{tuple(x.shape)}; for several rows use F.linear")
    if not x.is_contiguous():
        raise ValueError(f"fused_gemv: x is not contiguous (strides {x.stride()}); pass x.contiguous()")
    if swiglu and norm_weight is not None:
        raise ValueError("fused_gemv: choose one prologue, RMSNorm (norm_weight) or swiglu")
    if norm_weight is not None:
        if norm_weight.shape != (K,):
            raise ValueError(f"fused_gemv: norm_weight must be ({K},), got {tuple(norm_weight.shape)}")
        norm_weight = norm_weight.contiguous()  # the kernel reads it at offsets 0..K-1
    if residual is not None and (residual.dim() == 0 or residual.shape[-1] != N or residual.numel() != N):
        raise ValueError(f"fused_gemv: residual must be one row of {N}, got {tuple(residual.shape)}")
    if residual is not None and not residual.is_contiguous():
        raise ValueError(f"fused_gemv: residual is not contiguous (strides {residual.stride()}); pass "
                         f"residual.contiguous()")
    rc = rope_cache
    if rc is not None:
        if residual is not None:
            raise ValueError("fused_gemv: rope_cache (the q/k/v projection's epilogue) and residual do not go "
                             "together")
        hd = _check_rope(rc, x, N)
        if rc.k_cache.dtype != x.dtype or rc.v_cache.dtype != x.dtype:
            raise TypeError(f"fused_gemv: the cache must have x's dtype {x.dtype}, got {rc.k_cache.dtype}")
        configs = _fused_gemv_kernel.configs
        if len(configs) == 1 and not _heads_fit(configs[0].kwargs["BLOCK_N"], hd):
            # one config (the interpreter, or autotuning off) that does not fit the heads: two launches instead
            from .rope_cache import rope_and_cache_
            y = fused_gemv(x, weight, norm_weight, eps, swiglu)
            rope_and_cache_(y.view(1, -1, hd), None, None, rc.positions, rc.k_cache[None], rc.v_cache[None],
                            n_heads=rc.n_heads, inv_freq=rc.inv_freq)
            return y
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    prologue = SWIGLU if swiglu else RMSNORM if norm_weight is not None else NONE
    if rc is None:
        rope_args = (x, x, x, x, x, 0, 1, 1, 0, 0, 0, 0)  # never read
        rope_meta = {}
        counters = None
    else:
        counters = _head_counters(x.device, N // hd)
        rope_args = (rc.positions, rc.inv_freq, rc.k_cache, rc.v_cache, counters,
                     rc.n_heads, rc.k_cache.shape[0], rc.k_cache.shape[1],
                     rc.k_cache.stride(0), rc.k_cache.stride(1), rc.v_cache.stride(0), rc.v_cache.stride(1))
        rope_meta = dict(ROPE_HALF=hd // 2, BLOCK_HALF=triton.next_power_of_2(hd // 2))
    pos, freq, kc, vc, cnt, H, Hkv, S, skh, sks, svh, svs = rope_args
    with zero_on_error(counters) if counters is not None else contextlib.nullcontext():
        _fused_gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, weight, x if norm_weight is None else norm_weight, x if residual is None else residual, y,
            pos, freq, kc, vc, cnt,
            N, K, float(eps), H, Hkv, S,
            weight.stride(0), skh, sks, svh, svs,
            PROLOGUE=prologue, HAS_RES=residual is not None, **pdl_kwargs(x.device), **rope_meta,
        )
    return y


if __name__ == "__main__":
    from triton.testing import do_bench

    torch.manual_seed(0)
    dt = torch.bfloat16
    for N, K, kind in [(3072, 2048, "norm"), (2048, 2048, "res"), (16384, 2048, "norm"), (2048, 8192, "swiglu")]:
        w = torch.randn(N, K, device="cuda", dtype=dt) * 0.02
        x = torch.randn(1, 2 * K if kind == "swiglu" else K, device="cuda", dtype=dt)
        nw = torch.ones(K, device="cuda", dtype=dt) if kind == "norm" else None
        res = torch.randn(1, N, device="cuda", dtype=dt) if kind in ("res", "swiglu") else None
        args = dict(norm_weight=nw, swiglu=kind == "swiglu", residual=res)
        ms_f = do_bench(lambda: fused_gemv(x, w, **args))
        ms_r = do_bench(lambda: fused_gemv_reference(x, w, **args))
        print(f"{N}x{K} {kind:6s}: fused {ms_f * 1e3:6.1f} us ({w.numel() * 2 / ms_f / 1e6:6.0f} GB/s)  "
              f"unfused {ms_r * 1e3:6.1f} us")
