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
* residual epilogue: y = residual + W x, the residual stream's add done on the way out;
* SwiGLU epilogue (`swiglu_out`): W is the fused [gate; up] projection, and each program computes gate row n and
  up row n together and writes silu(gate) * up. Better than the SwiGLU prologue of the down projection that
  follows: there EVERY program re-reads the whole [gate | up] (2K numbers, half as many bytes from L2 as its own
  weights at 4 rows per program) and recomputes all K sigmoids; here each sigmoid is computed once.

A Llama layer's decode step then has four GEMVs (norm + qkv, o + add, norm + gate/up + swiglu, down + add) instead
of four GEMVs and five small kernels. The SwiGLU and residual roundings to the activation dtype are done where the
unfused ops do them; the normalized x is not rounded (the one-pass form above), so in bf16 the result differs from
the unfused ops' by about one bf16 rounding of x (relative 2^-8 per element, averaging out over K); in fp32 they
agree to the order of the additions.
(The fusion of pointwise ops into the adjacent matmul is what compilers like TorchInductor and TensorRT do;
"Flash-Decoding" and the Hazy Research "megakernel" post, https://hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles,
explain why a 1B model at batch 1 is dominated by such small kernels.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._util import autotune_configs, check_eps, check_flag, check_tensors, demo_needs_cuda, pdl_kwargs, tune_bench

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NONE, RMSNORM, SWIGLU = 0, 1, 2  # the prologues (PROLOGUE constexpr)


def prologue_reference(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
                       swiglu: bool = False) -> torch.Tensor:
    """The GEMV's input as the unfused ops make it: silu(gate) * up of x = [gate | up] with `swiglu`, RMSNorm(x)
    (as `llmlab.model.RMSNorm.forward`) with `norm_weight`, else x itself."""
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    if norm_weight is not None:
        x32 = x.float()
        return norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return x


def fused_gemv_reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-5, swiglu: bool = False, residual: torch.Tensor | None = None,
                         swiglu_out: bool = False) -> torch.Tensor:
    """The unfused ops, as `llmlab.model` runs them: [RMSNorm or SwiGLU] -> F.linear -> [SwiGLU] -> [+ residual].

    Bytes (bf16, 1B model's down projection, K = 8192): eager reads gate and up and writes the product (3 x 16 KB),
    the GEMV reads W (33.5 MB), the add reads two rows and writes one — four launches; fused: one launch, the same
    33.5 MB. The saving is launches and fill/drain time, not bytes.
    """
    swiglu = check_flag("fused_gemv_reference", "swiglu", swiglu)
    swiglu_out = check_flag("fused_gemv_reference", "swiglu_out", swiglu_out)
    if swiglu_out and weight.shape[0] % 2:
        raise ValueError(f"swiglu_out needs a [gate; up] weight with an even number of rows, got {weight.shape[0]}")
    y = F.linear(prologue_reference(x, norm_weight, eps, swiglu), weight)
    if swiglu_out:  # y is [gate | up]
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


# Autotuned per shape and fusion: (BLOCK_N output rows per program, BLOCK_K inputs per step, warps, STAGES). A GEMV
# runs at the speed of the bytes in flight: with the loop's loads issued one step at a time, each step waits a full
# memory latency and the GEMV stays well short of the copy bandwidth. STAGES > 1 pipelines the loop
# (`tl.range(num_stages=...)`: later steps' tiles are requested while this one is summed); small BLOCK_N gives more
# programs for the 132 SMs when N is only 2048. One-warp programs (the last row): the pipelined loop syncs a
# program's warps every step, which one warp does for free — as in the int4 / int8 GEMVs' tiles. Timed as the
# quantized GEMVs are (`tune_bench`: after a read of 256 MB, not Triton's write). One config in the interpreter
# (`autotune_configs`).
_SHAPES = [(2, 1024, 4, 3), (4, 512, 4, 3), (4, 1024, 4, 3), (8, 512, 4, 3), (8, 256, 4, 4), (16, 256, 4, 3),
           (2, 2048, 8, 2), (4, 2048, 8, 2), (8, 1024, 8, 2), (16, 512, 8, 2), (2, 1024, 4, 1), (4, 512, 4, 1),
           (8, 512, 4, 2), (4, 1024, 4, 4),
           (2, 512, 1, 4), (4, 512, 1, 4), (4, 256, 1, 6), (8, 256, 1, 4), (2, 1024, 1, 4), (8, 512, 2, 4)]
_STREAM_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "STAGES": st}, num_warps=w) for n, k, w, st in _SHAPES]
CONFIGS = autotune_configs(_STREAM_CONFIGS, default=triton.Config({"BLOCK_N": 16, "BLOCK_K": 256, "STAGES": 1}))

# Small GEMVs load their WHOLE weight rows before they wait for the kernel before them. The weights do not depend on
# that kernel, and with PDL a GEMV's programs launch while it still runs (`pdl_enabled` in _util.py; every kernel of
# the decode step lets the next one launch at its start): a program whose first tile is its whole row (BLOCK_K >= K)
# has all of its bytes in flight — or already in registers — when the wait ends, and then only reads x. For the 1B
# model's q/k/v (12.6 MB) and o (8.4 MB) projections this overlaps their weight reads with the previous layer's
# down projection (q/k/v) and with the attention (o), which shortens the decode step — more so with the attention's
# merge letting the o projection launch early (`decode_attention`'s trigger_next; docs/results.md).
# The autotuner alone does not find this (it times a GEMV after itself, with nothing to overlap, and picks narrower
# streaming tiles), so with PDL on, for weights up to WHOLE_ROW_MAX_BYTES — a fraction of the register file (H200:
# 132 SMs x 256 KB = 33 MB), since every program of the grid holds its rows at once — and K up to 4096 (the longest
# whole-row tile), only whole-row configs are offered (`_prune`; with the SwiGLU epilogue only those of at most
# WHOLE_ROW_MAX_PER_THREAD weights a thread, a program holding twice the rows). Larger GEMVs (gate/up 67 MB, down
# 33.5 MB), longer rows and launches without PDL (nothing to overlap) are tuned over the streaming configs.
WHOLE_ROW_MAX_BYTES = 16 << 20
WHOLE_ROW_MAX_PER_THREAD = 128  # weights one thread holds (registers) in a whole-row tile with the SwiGLU epilogue
WHOLE_ROW_CONFIGS = [c for c in (triton.Config({"BLOCK_N": n, "BLOCK_K": k, "STAGES": 1}, num_warps=w)
                                  for k in (256, 512, 1024, 2048, 4096)
                                  for n, w in [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8)])
                     if c not in _STREAM_CONFIGS]  # (two are in _SHAPES already, and stay there for large GEMVs)
if len(CONFIGS) > 1:  # autotuning (the interpreter, and LLMLAB_TRITON_AUTOTUNE=0, run the one default config)
    CONFIGS = CONFIGS + WHOLE_ROW_CONFIGS


def _prune(configs, named_args, **kwargs):
    """The autotuner's early_config_prune: with PDL, weights up to WHOLE_ROW_MAX_BYTES get only the whole-row
    configs with the shortest BLOCK_K >= K (see above), where there is one; otherwise the streaming configs."""
    def meta(name):  # a constexpr comes as a keyword
        return kwargs.get(name, named_args.get(name, False))

    N, K = named_args["N"], named_args["K"]  # N: outputs; the weight has 2N rows with GLU
    glu = meta("GLU")
    rows = 2 * N if glu else N
    small = meta("PDL") and rows * K * named_args["w_ptr"].element_size() <= WHOLE_ROW_MAX_BYTES
    whole = [c for c in configs if c.kwargs["BLOCK_K"] >= K]
    if glu:  # two weight rows per output: keep the tiles that fit a thread's registers (the smallest if none does)
        fits = [c for c in whole
                if 2 * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= WHOLE_ROW_MAX_PER_THREAD * 32 * c.num_warps]
        whole = fits or sorted(whole, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])[:1]
    if small and whole:
        shortest = min(c.kwargs["BLOCK_K"] for c in whole)
        configs = [c for c in whole if c.kwargs["BLOCK_K"] == shortest]
    else:
        configs = [c for c in configs if c not in WHOLE_ROW_CONFIGS] or configs
    return configs


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


@triton.autotune(configs=CONFIGS, key=["N", "K", "PROLOGUE", "HAS_RES", "GLU", "PDL"], do_bench=tune_bench,
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fused_gemv_kernel(
    # pointers
    x_ptr, w_ptr, nw_ptr, res_ptr, y_ptr,
    # sizes
    N, K, eps,
    # strides (elements)
    stride_wn,
    # meta-parameters
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GLU: tl.constexpr = False,
):
    """Program p: outputs rn = p * BLOCK_N + (0..BLOCK_N-1) over all of K. (Splitting K over several programs, with
    the last one adding the partials — `split_k.py`, as the int4/int8 GEMVs do — is not used for these GEMVs: no
    split config beat the unsplit ones at the 1B model's shapes; docs/results.md.)
    GLU: the weight is [gate; up] (2N rows): the program reads gate row n and up row N + n for each of its BLOCK_N
    outputs (side by side, lanes 2j and 2j + 1) and writes silu(gate) * up — the SwiGLU epilogue."""
    dt = x_ptr.dtype.element_ty
    if GLU:  # weight row of lane r: gate row n (r even) or up row N + n (r odd), n = the lane's output
        r = tl.arange(0, 2 * BLOCK_N)
        rn = tl.program_id(0) * BLOCK_N + r // 2
        rw = rn + (r % 2) * N
    else:
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rw = rn
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rw[:, None] * stride_wn

    if PDL:  # let the next kernel's programs start arriving (see `pdl_enabled` in _util.py)
        tl.extra.cuda.gdc_launch_dependents()
    # the first W tile depends on no earlier kernel: request it before waiting for the one that writes x
    kk = rk
    w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    xk, sq = _x_tile(x_ptr, nw_ptr, kk, kk < K, K, PROLOGUE)
    # acc keeps one partial product per (row, lane) and is summed once after the loop: no reduction per step
    acc = w.to(tl.float32) * xk[None, :]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + rk
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # what it moves
        xk, sq_k = _x_tile(x_ptr, nw_ptr, kk, k_mask, K, PROLOGUE)
        sq += sq_k
        acc += w.to(tl.float32) * xk[None, :]
    y = tl.sum(acc, axis=1)  # (BLOCK_N,) fp32 — (2 BLOCK_N,) with GLU
    ssq = tl.sum(sq, axis=0)  # sum(x^2) over K (RMSNorm)
    out_mask = n_mask
    if PROLOGUE == 1:  # one pass: x is not normalized (nor rounded) before the products, the row sum is scaled
        y = y / tl.sqrt(ssq / K + eps)
    if GLU:  # (gate, up) pairs -> silu(gate) * up, each rounded where the unfused ops round (GEMV output, F.silu,
        g, u = tl.split(tl.reshape(y, (BLOCK_N, 2)))  # the product)
        g = g.to(dt).to(tl.float32)
        y = (g * tl.sigmoid(g)).to(dt).to(tl.float32) * u.to(dt).to(tl.float32)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        out_mask = rn < N
    if HAS_RES:  # residual + linear(x): the linear's output rounded first, as the unfused add sees it
        r = tl.load(res_ptr + rn, mask=out_mask, other=0.0).to(tl.float32)
        y = y.to(dt).to(tl.float32) + r
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=out_mask)


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
               swiglu: bool = False, residual: torch.Tensor | None = None,
               swiglu_out: bool = False, config: triton.Config | None = None) -> torch.Tensor:
    """y = [residual +] epilogue(weight @ prologue(x)) for ONE token, in one launch.

    Args:
        x: (..., K_in) holding one row (numel == K_in), fp32 / fp16 / bf16 (fp32 in the CPU interpreter),
            contiguous. K_in = K, or 2K with `swiglu` ([gate | up], as the fused gate/up projection writes it).
        weight: (N, K) same dtype, last dimension contiguous (a row-slice view of a bigger weight is fine).
        norm_weight: (K,) RMSNorm weight: x is normalized first (`llmlab.model.RMSNorm`, eps `eps`).
        swiglu: x is [gate | up]: silu(gate) * up is the GEMV's input. Not together with norm_weight.
        residual: (..., N) one row, same dtype: added to the output.
        swiglu_out: weight is a fused [gate; up] projection (2I, K): the output is silu(gate) * up, (..., I) — the
            SwiGLU done on the way out, so the down projection after it reads I numbers with no prologue (instead
            of 2I with `swiglu`). Not together with residual.
        config: launch with this tile (a `triton.Config` with BLOCK_N, BLOCK_K and STAGES, e.g. one of
            `candidate_configs`) instead of the autotuner's pick — how `step_tuning` runs the configs it chose by
            timing the whole decode step. None: the autotuner's.

    Returns:
        (..., N): x's leading dimensions with the last one N (N / 2 with swiglu_out), in x's dtype.

    Raises:
        ValueError: more than one row, an empty weight, shapes that do not fit, both prologues, a non-contiguous x
            or weight rows; swiglu_out with an odd number of weight rows or with a residual.
        TypeError: unsupported or mismatched dtypes, an argument that is not a tensor (see `check_tensors`);
            swiglu or swiglu_out not True/False; config not a triton.Config with exactly BLOCK_N, BLOCK_K (powers
            of 2) and STAGES (>= 1).
    """
    tensors = {"x": x, "weight": weight}
    if norm_weight is not None:
        tensors["norm_weight"] = norm_weight
    if residual is not None:
        tensors["residual"] = residual
    check_tensors("fused_gemv", DTYPES, **tensors)
    eps = check_eps("fused_gemv", eps)
    if len({t.dtype for t in tensors.values()}) != 1:
        raise TypeError("fused_gemv: x, weight, norm_weight and residual must share one dtype, got " +
                        ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()))
    swiglu = check_flag("fused_gemv", "swiglu", swiglu)
    swiglu_out = check_flag("fused_gemv", "swiglu_out", swiglu_out)
    if weight.dim() != 2 or (weight.stride(1) != 1 and weight.shape[1] > 1):
        raise ValueError(f"fused_gemv: weight must be (N, K) with contiguous rows, got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    N, K = weight.shape
    if N == 0 or K == 0:
        raise ValueError(f"fused_gemv: weight {tuple(weight.shape)} is empty; N and K must be >= 1")
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
    if swiglu_out and N % 2:
        raise ValueError(f"fused_gemv: swiglu_out needs a [gate; up] weight with an even number of rows, got {N}")
    if swiglu_out and residual is not None:
        raise ValueError("fused_gemv: swiglu_out takes no residual (the output is silu(gate) * up); add the "
                         "residual in the next GEMV")
    if residual is not None and (residual.dim() == 0 or residual.shape[-1] != N or residual.numel() != N):
        raise ValueError(f"fused_gemv: residual must be one row of {N}, got {tuple(residual.shape)}")
    if residual is not None and not residual.is_contiguous():
        raise ValueError(f"fused_gemv: residual is not contiguous (strides {residual.stride()}); pass "
                         f"residual.contiguous()")
    n_out = N // 2 if swiglu_out else N
    y = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    prologue = SWIGLU if swiglu else RMSNORM if norm_weight is not None else NONE
    kernel, meta = _fused_gemv_kernel, {}
    if config is not None:  # this tile, not the autotuner's: the plain jit kernel with the config's parameters
        _check_tile(config)
        kernel, meta = _fused_gemv_kernel.fn, config.all_kwargs()
    kernel[lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]),)](
        x, weight, x if norm_weight is None else norm_weight, x if residual is None else residual, y,
        n_out, K, float(eps),
        weight.stride(0),
        PROLOGUE=prologue, HAS_RES=residual is not None, GLU=swiglu_out, **pdl_kwargs(x.device), **meta,
    )
    return y


def _check_tile(config) -> None:
    """A `config=` for fused_gemv: a triton.Config whose kwargs are exactly BLOCK_N and BLOCK_K (powers of 2) and
    STAGES (>= 1). TypeError otherwise, naming what is wrong."""
    keys = {"BLOCK_N", "BLOCK_K", "STAGES"}
    if not isinstance(config, triton.Config) or set(config.kwargs) != keys:
        raise TypeError(f"fused_gemv: config must be a triton.Config with BLOCK_N, BLOCK_K and STAGES and nothing "
                        f"else (see candidate_configs), got {config!r}")
    bn, bk, st = (config.kwargs[k] for k in ("BLOCK_N", "BLOCK_K", "STAGES"))
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (bn, bk, st))
    if not ints or bn < 1 or bk < 1 or bn & (bn - 1) or bk & (bk - 1) or st < 1:
        raise TypeError(f"fused_gemv: config's BLOCK_N and BLOCK_K must be powers of 2 and STAGES >= 1, got "
                        f"BLOCK_N={bn!r}, BLOCK_K={bk!r}, STAGES={st!r}")


def candidate_configs(weight: torch.Tensor, swiglu_out: bool = False) -> list:
    """The tiles the autotuner would time for a `fused_gemv` of this weight ((N, K); with swiglu_out a [gate; up]
    weight): `CONFIGS` after its pruning (`_prune`: with PDL, the whole-row tiles for small weights, else the
    streaming ones). One config where autotuning is off (the interpreter, LLMLAB_TRITON_AUTOTUNE=0).
    `step_tuning` times each of them inside the decode step."""
    N, K = weight.shape
    n_out = N // 2 if swiglu_out else N
    return _prune(list(CONFIGS), {"N": n_out, "K": K, "w_ptr": weight},
                  GLU=swiglu_out, PDL=pdl_kwargs(weight.device)["PDL"])


if __name__ == "__main__":
    demo_needs_cuda("fused_gemv")
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
