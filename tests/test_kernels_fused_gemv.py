"""The one-token GEMV with a fused RMSNorm / SwiGLU prologue and residual epilogue (kernels/fused_gemv.py) against
the unfused PyTorch ops.

On a CPU the kernel runs in Triton's interpreter in fp32 (fp16 too: numpy has it); bf16 is `gpu`-marked. Sizes
{1, 7, 17, 999, 1001, 4095} run in both dimensions it tiles (N: output rows per program, K: inputs per step); the
weight rows are views into a wider buffer full of huge values, so a masked lane that read past K would show.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import fused_gemv as fg  # noqa: E402
from llmlab.kernels.fused_gemv import (  # noqa: E402
    RopeCacheWrite, _fused_gemv_kernel, fused_gemv, fused_gemv_reference)
from llmlab.kernels.rope_cache import rope_and_cache_  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 7, 17, 999, 1001, 4095]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=1e-1, rtol=2e-2)}
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
FUSIONS = ["plain", "norm", "residual", "norm+residual", "swiglu+residual"]


def _case(N, K, fusion, dtype, seed=0):
    """(x, weight, kwargs): the weight a (N, K) view of a (N, K + 37) buffer whose extra columns are 1e4."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((N, K + 37), 1e4)
    buf[:, :K] = torch.randn(N, K, generator=g) / K ** 0.5
    w = buf.to(DEV, dtype)[:, :K]
    x = torch.randn(1, 2 * K if "swiglu" in fusion else K, generator=g).to(DEV, dtype)
    kw = {}
    if "norm" in fusion:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, dtype)
    if "residual" in fusion:
        kw["residual"] = torch.randn(1, N, generator=g).to(DEV, dtype)
    kw["swiglu"] = "swiglu" in fusion
    return x, w, kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("size", SIZES)
def test_fused_gemv_matches_the_unfused_ops(size, fusion, dtype):
    for N, K in ((size, 64), (48, size)):  # the size in the N tiling, then in the K tiling
        x, w, kw = _case(N, K, fusion, dtype, seed=size)
        got = fused_gemv(x, w, **kw)
        assert got.shape == (1, N) and got.dtype == dtype
        torch.testing.assert_close(got, fused_gemv_reference(x, w, **kw), **TOL[dtype])


@pytest.mark.parametrize("block_n, block_k, stages", [(2, 1024, 3), (4, 512, 1), (32, 128, 2)])
def test_other_tile_shapes_the_gpu_autotuner_may_pick(block_n, block_k, stages):
    """The interpreter runs one config; the GPU may choose any: run some others through the kernel directly."""
    import triton

    N, K = 37, 999
    x, w, kw = _case(N, K, "norm+residual", torch.float32, seed=3)
    y = torch.full((1, N), float("nan"), device=DEV)
    _fused_gemv_kernel.fn[(triton.cdiv(N, block_n),)](
        x, w, kw["norm_weight"], kw["residual"], y, x, x, x, x, x, N, K, 1e-5, 0, 1, 1, w.stride(0), 0, 0, 0, 0,
        PROLOGUE=1, HAS_RES=True, PDL=False, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages)
    torch.testing.assert_close(y, fused_gemv_reference(x, w, **kw), **TOL[torch.float32])


def test_fp16_norm_prologue_with_large_inputs_stays_finite():
    """x around +-1000: x^2 overflows fp16 (max 65504) unless the sum of squares is done in fp32."""
    x, w, kw = _case(64, 4095, "norm", torch.float16, seed=5)
    x = (x.float() * 1000).to(torch.float16)
    got = fused_gemv(x, w, **kw)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, fused_gemv_reference(x, w, **kw), **TOL[torch.float16])


@pytest.mark.parametrize("bad, message", [
    (lambda x, w: dict(x=torch.zeros(2, 64, device=DEV), weight=w), "one row"),
    (lambda x, w: dict(x=x[:, :32], weight=w), "one row of 64"),
    (lambda x, w: dict(x=torch.randn(64, 2, device=DEV)[:, 0][None], weight=w), "not contiguous"),
    (lambda x, w: dict(x=torch.tensor(1.0, device=DEV), weight=w), "one row of 64"),
    (lambda x, w: dict(x=x, weight=w, swiglu=True), "2K"),
    (lambda x, w: dict(x=x, weight=w, norm_weight=torch.ones(63, device=DEV)), "norm_weight must be (64,)"),
    (lambda x, w: dict(x=x, weight=w, residual=torch.zeros(1, 5, device=DEV)), "residual must be one row"),
    (lambda x, w: dict(x=torch.zeros(1, 128, device=DEV), weight=w, swiglu=True,
                       norm_weight=torch.ones(64, device=DEV)), "choose one prologue"),
    (lambda x, w: dict(x=x, weight=w.t()), "contiguous rows"),
])
def test_bad_input_names_the_problem(bad, message):
    x, w = torch.randn(1, 64, device=DEV), torch.randn(64, 64, device=DEV)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fused_gemv(**bad(x, w))


def test_mixed_dtypes_are_refused():
    x, w = torch.randn(1, 64, device=DEV), torch.randn(16, 64, device=DEV, dtype=torch.float16)
    with pytest.raises(TypeError, match="share one dtype"):
        fused_gemv(x, w)


def test_a_strided_norm_weight_is_read_correctly():
    x, w, kw = _case(40, 30, "norm", torch.float32, seed=9)
    nw = torch.randn(60, device=DEV)[::2]  # a view with stride 2
    torch.testing.assert_close(fused_gemv(x, w, norm_weight=nw), fused_gemv_reference(x, w, norm_weight=nw),
                               **TOL[torch.float32])


# -- the RoPE + KV-cache epilogue of the q/k/v projection ---------------------------------------------------------

def _rope_case(H, Hkv, hd, S, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = (H + 2 * Hkv) * hd
    x, w, kw = _case(N, K, "norm", dtype, seed=seed)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))).to(DEV)
    kc = torch.randn(Hkv, S, hd, generator=g).to(DEV, dtype)
    return x, w, kw, inv_freq, kc, torch.randn(Hkv, S, hd, generator=g).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, Hkv, hd, pos", [(4, 2, 16, 7), (4, 1, 8, 5), (2, 2, 32, 9), (3, 1, 6, 2)])
def test_rope_epilogue_equals_the_gemv_then_the_rope_and_cache_kernel(H, Hkv, hd, pos, dtype):
    """The fused launch does what `fused_gemv` followed by `rope_and_cache_` (itself checked against the PyTorch
    ops in test_kernels_rope_cache.py) does: the same q, the same cache, every other slot untouched."""
    S, K = 12, 40
    x, w, kw, inv_freq, kc, vc = _rope_case(H, Hkv, hd, S, K, dtype, seed=H * hd + pos)
    positions = torch.tensor([pos], device=DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    got = fused_gemv(x, w, **kw, rope_cache=RopeCacheWrite(positions, inv_freq, kc, vc, H))
    want = fused_gemv(x, w, **kw).view(1, H + 2 * Hkv, hd)
    rope_and_cache_(want, None, None, positions, kc2[None], vc2[None], n_heads=H, inv_freq=inv_freq)
    torch.testing.assert_close(got.view(1, -1, hd)[:, :H], want[:, :H], **TOL[dtype])
    torch.testing.assert_close(kc, kc2, **TOL[dtype])
    torch.testing.assert_close(vc, vc2, **TOL[dtype])
    assert int(fg._head_counters(x.device, H + 2 * Hkv).abs().sum()) == 0  # ready for the next launch
    # and again: the counters the first launch left must not make the second merge early
    kc3 = kc.clone()
    got2 = fused_gemv(x, w, **kw, rope_cache=RopeCacheWrite(positions, inv_freq, kc3, vc.clone(), H))
    torch.testing.assert_close(got2, got, rtol=0, atol=0)
    torch.testing.assert_close(kc3, kc, rtol=0, atol=0)


@pytest.mark.parametrize("block_n", [1, 2, 8, 16])  # 8 = head_dim: one program per head; 16: two heads
def test_rope_epilogue_with_the_tiles_the_gpu_autotuner_may_pick(block_n):
    import triton

    H, Hkv, hd, S, K = 2, 1, 8, 6, 33
    x, w, kw, inv_freq, kc, vc = _rope_case(H, Hkv, hd, S, K, torch.float32, seed=block_n)
    positions = torch.tensor([3], device=DEV)
    N = (H + 2 * Hkv) * hd
    y = torch.full((1, N), float("nan"), device=DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    cnt = fg._head_counters(x.device, N // hd)
    _fused_gemv_kernel.fn[(triton.cdiv(N, block_n),)](
        x, w, kw["norm_weight"], x, y, positions, inv_freq, kc, vc, cnt, N, K, 1e-5, H, Hkv, S, w.stride(0),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        PROLOGUE=1, HAS_RES=False, PDL=False, BLOCK_N=block_n, BLOCK_K=16, STAGES=1, ROPE_HALF=hd // 2,
        BLOCK_HALF=hd // 2)
    want = fused_gemv(x, w, **kw).view(1, -1, hd)
    rope_and_cache_(want, None, None, positions, kc2[None], vc2[None], n_heads=H, inv_freq=inv_freq)
    torch.testing.assert_close(y.view(1, -1, hd)[:, :H], want[:, :H], **TOL[torch.float32])
    torch.testing.assert_close(kc, kc2, **TOL[torch.float32])
    torch.testing.assert_close(vc, vc2, **TOL[torch.float32])
    assert int(cnt.abs().sum()) == 0


def test_rope_epilogue_bad_input_names_the_problem():
    H, Hkv, hd, S, K = 2, 1, 8, 6, 16
    x, w, kw, inv_freq, kc, vc = _rope_case(H, Hkv, hd, S, K, torch.float32)
    pos = torch.tensor([1], device=DEV)
    with pytest.raises(ValueError, match="q heads"):
        fused_gemv(x, w[:-8], **kw, rope_cache=RopeCacheWrite(pos, inv_freq, kc, vc, H))
    with pytest.raises(ValueError, match="residual"):
        fused_gemv(x, w, residual=torch.zeros(1, w.shape[0], device=DEV),
                   rope_cache=RopeCacheWrite(pos, inv_freq, kc, vc, H))
    with pytest.raises(ValueError, match="inv_freq"):
        fused_gemv(x, w, **kw, rope_cache=RopeCacheWrite(pos, inv_freq[:-1], kc, vc, H))
    with pytest.raises(ValueError, match="positions"):
        fused_gemv(x, w, **kw, rope_cache=RopeCacheWrite(pos.float(), inv_freq, kc, vc, H))
