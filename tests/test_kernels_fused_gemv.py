"""The one-token GEMV with a fused RMSNorm / SwiGLU prologue and residual epilogue (llmlab/kernels/fused_gemv.py) against
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

from llmlab.kernels.fused_gemv import _fused_gemv_kernel, fused_gemv, fused_gemv_reference  # noqa: E402

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("size", SIZES)
def test_swiglu_epilogue_matches_the_unfused_ops(size, norm, dtype):
    """swiglu_out: a [gate; up] weight (2I rows) -> silu(gate) * up (I outputs), with or without the RMSNorm
    prologue; the size in the output tiling (I), then in the K tiling."""
    for n_out, K in ((size, 64), (24, size)):
        x, w, kw = _case(2 * n_out, K, "norm" if norm else "plain", dtype, seed=size)
        got = fused_gemv(x, w, swiglu_out=True, **kw)
        assert got.shape == (1, n_out) and got.dtype == dtype
        torch.testing.assert_close(got, fused_gemv_reference(x, w, swiglu_out=True, **kw), **TOL[dtype])


@pytest.mark.parametrize("block_n, block_k, stages", [(1, 1024, 1), (8, 128, 2), (4, 256, 3)])
def test_swiglu_epilogue_over_other_tile_shapes(block_n, block_k, stages):
    """The GPU autotuner's other tiles for the SwiGLU epilogue: one output (two weight rows) per program, the
    whole row in one tile, a pipelined loop."""
    x, w, kw = _case(2 * 37, 999, "norm", torch.float32, seed=block_n)
    torch.testing.assert_close(_launch(x, w, kw, "norm", block_n, block_k, stages, glu=True),
                               fused_gemv_reference(x, w, swiglu_out=True, **kw), **TOL[torch.float32])


def _launch(x, w, kw, fusion, block_n, block_k, stages, glu=False):
    """The kernel run directly with one config (the interpreter's autotuner has only its default)."""
    import triton

    from llmlab.kernels.fused_gemv import NONE, RMSNORM, SWIGLU

    N, K = w.shape
    n_out = N // 2 if glu else N
    y = torch.full((1, n_out), float("nan"), device=DEV)
    prologue = SWIGLU if kw["swiglu"] else RMSNORM if "norm_weight" in kw else NONE
    _fused_gemv_kernel.fn[(triton.cdiv(n_out, block_n),)](
        x, w, kw.get("norm_weight", x), kw.get("residual", x), y, n_out, K, 1e-5, w.stride(0),
        PROLOGUE=prologue, HAS_RES="residual" in kw, PDL=False, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        GLU=glu)
    return y


@pytest.mark.parametrize("block_n, block_k, stages", [(2, 1024, 3), (4, 512, 1), (32, 128, 2)])
def test_other_tile_shapes_the_gpu_autotuner_may_pick(block_n, block_k, stages):
    """The interpreter runs one config; the GPU may choose any: run some others through the kernel directly."""
    x, w, kw = _case(37, 999, "norm+residual", torch.float32, seed=3)
    torch.testing.assert_close(_launch(x, w, kw, "norm+residual", block_n, block_k, stages),
                               fused_gemv_reference(x, w, **kw), **TOL[torch.float32])


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("block_n", [1, 8])
def test_whole_row_configs_load_the_row_in_one_tile(fusion, block_n):
    """BLOCK_K >= K (the whole-row configs small GEMVs are tuned over): the loop after the first tile runs zero
    times, and the masked lanes past K (999 of 1024) read nothing."""
    x, w, kw = _case(37, 999, fusion, torch.float32, seed=block_n)
    torch.testing.assert_close(_launch(x, w, kw, fusion, block_n, 1024, 1), fused_gemv_reference(x, w, **kw),
                               **TOL[torch.float32])


def test_small_weights_are_tuned_over_whole_row_configs_only():
    """`_prune`: a weight up to WHOLE_ROW_MAX_BYTES gets the configs whose BLOCK_K is the shortest that covers K;
    a larger one every config but the whole-row additions, as before."""
    from llmlab.kernels import fused_gemv as fg

    configs = fg._STREAM_CONFIGS + fg.WHOLE_ROW_CONFIGS  # what the GPU autotuner gets
    bf16 = torch.empty(1, dtype=torch.bfloat16)

    def prune(N, K, w=bf16, **meta):
        return fg._prune(configs, {"N": N, "K": K, "w_ptr": w}, **{"PDL": True, **meta})

    small = prune(3072, 2048)  # the 1B model's q/k/v: 12.6 MB
    assert small and {c.kwargs["BLOCK_K"] for c in small} == {2048}
    assert {c.kwargs["BLOCK_K"] for c in prune(96, 300)} == {512}
    large = prune(2048, 8192)  # the down projection: 33.5 MB
    assert len(large) == len(fg._SHAPES) and not [c for c in large if c in fg.WHOLE_ROW_CONFIGS]
    assert len(prune(3072, 2048, PDL=False)) == len(fg._SHAPES)  # without PDL there is nothing to overlap
    assert len(prune(64, 8192 + 1)) == len(fg._SHAPES)  # a row longer than any whole-row tile streams
    n_rows = fg.WHOLE_ROW_MAX_BYTES // (2 * 2048)  # exactly the limit in bf16; twice it in fp32
    assert {c.kwargs["BLOCK_K"] for c in prune(n_rows, 2048)} == {2048}
    assert len(prune(n_rows, 2048, w=torch.empty(1, dtype=torch.float32))) == len(fg._SHAPES)
    # the SwiGLU epilogue reads 2N weight rows: n_rows / 2 outputs are at the limit, n_rows outputs beyond it
    glu = prune(n_rows // 2, 2048, GLU=True)
    assert glu and all(2 * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 128 * 32 * c.num_warps for c in glu)
    assert len(prune(n_rows, 2048, GLU=True)) == len(fg._SHAPES)


def test_fp16_norm_prologue_with_large_inputs_stays_finite():
    """x around +-1000: x^2 overflows fp16 (max 65504) unless the sum of squares is done in fp32."""
    x, w, kw = _case(64, 4095, "norm", torch.float16, seed=5)
    x = (x.float() * 1000).to(torch.float16)
    got = fused_gemv(x, w, **kw)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, fused_gemv_reference(x, w, **kw), **TOL[torch.float16])


@pytest.mark.parametrize("bad, message", [
    (lambda x, w: dict(x=torch.zeros(2, 64, device=DEV), weight=w), "one row"),
    (lambda x, w: dict(x=x[:, :0], weight=w[:, :0], norm_weight=torch.ones(0, device=DEV)), "is empty"),
    (lambda x, w: dict(x=x[:, :32], weight=w), "one row of 64"),
    (lambda x, w: dict(x=torch.randn(64, 2, device=DEV)[:, 0][None], weight=w), "not contiguous"),
    (lambda x, w: dict(x=torch.tensor(1.0, device=DEV), weight=w), "one row of 64"),
    (lambda x, w: dict(x=x, weight=w, swiglu=True), "2K"),
    (lambda x, w: dict(x=x, weight=w, norm_weight=torch.ones(63, device=DEV)), "norm_weight must be (64,)"),
    (lambda x, w: dict(x=x, weight=w, residual=torch.zeros(1, 5, device=DEV)), "residual must be one row"),
    (lambda x, w: dict(x=torch.zeros(1, 128, device=DEV), weight=w, swiglu=True,
                       norm_weight=torch.ones(64, device=DEV)), "choose one prologue"),
    (lambda x, w: dict(x=x, weight=w.t()), "contiguous rows"),
    (lambda x, w: dict(x=x, weight=w[:63], swiglu_out=True), "even number of rows"),
    (lambda x, w: dict(x=x, weight=w, swiglu_out=True, residual=torch.zeros(1, 64, device=DEV)), "no residual"),
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


def test_flags_must_be_bools_and_non_tensors_are_named():
    """A string like "no" is truthy: the switches take True or False only; a list or a numpy array is named as
    what it is, not as a device mismatch."""
    x, w = torch.randn(1, 64, device=DEV), torch.randn(64, 64, device=DEV)
    for flag in ("swiglu_out", "swiglu"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False"):
            fused_gemv(x, w, **{flag: "no"})
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        fused_gemv(x.tolist(), w)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor, got ndarray"):
        fused_gemv(x, w.cpu().numpy())
    with pytest.raises(ValueError, match="meta tensor"):
        fused_gemv(x, torch.empty(64, 64, device="meta"))
    with pytest.raises(TypeError, match="swiglu_out must be True or False"):
        fused_gemv_reference(x, w, swiglu_out="no")
    np = pytest.importorskip("numpy")
    torch.testing.assert_close(fused_gemv(x, w, swiglu_out=np.bool_(True)),  # numpy's bools are bools
                               fused_gemv_reference(x, w, swiglu_out=True), **TOL[torch.float32])


def test_swiglu_out_errors_name_the_one_problem():
    x, w = torch.randn(1, 64, device=DEV), torch.randn(10, 64, device=DEV)
    with pytest.raises(ValueError, match="takes no residual"):
        fused_gemv(x, w, swiglu_out=True, residual=torch.randn(1, 10, device=DEV))
    with pytest.raises(ValueError, match="even number of rows, got 9"):
        fused_gemv(x, w[:9], swiglu_out=True)
    with pytest.raises(ValueError, match="even number of rows, got 9"):
        fused_gemv_reference(x, w[:9], swiglu_out=True)


def test_a_one_column_weight_with_any_column_stride():
    """K = 1: a (N, 1) weight is contiguous whatever its column stride says (PyTorch's view, e.g. a transposed
    (1, N) row)."""
    x, w = torch.randn(1, 1, device=DEV), torch.randn(1, 10, device=DEV).t()
    assert w.stride() == (1, 10)
    torch.testing.assert_close(fused_gemv(x, w), fused_gemv_reference(x, w), **TOL[torch.float32])
