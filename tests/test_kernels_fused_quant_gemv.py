"""The quantized GEMVs with the small ops inside (`llmlab.kernels.fused_quant_gemv`) against the unfused ops, and
the quantized model's batch-1 decode step that runs them (`KernelDecodeStep.one_token`).

On a CPU these run in Triton's interpreter (fp32): the int8 GEMV and the Triton int4 GEMV. The Gluon int4 GEMV,
which a GPU runs, is compiled for Hopper here (`test_the_gluon_gemv_builds_with_each_fusion`) and run by the GPU
tests (marked).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from llmlab.kernels.weight_quant import quantize_int4, quantize_int8
from llmlab.quant import Int4Linear, Int8Linear, quantize_model
from tiny_models import greedy_on_static_cache, one_token_inputs, quantized_layer, tiny_model

triton = pytest.importorskip("triton")

from llmlab.kernels._util import interpret_mode  # noqa: E402

if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import int4_gemv  # noqa: E402
from llmlab.kernels import int8_matmul as int8_module  # noqa: E402
from llmlab.kernels.fused_quant_gemv import fused_quant_gemv, fused_quant_gemv_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=1e-4, atol=1e-4)


def _layer(scheme, N, K, group=32, seed=0, bias=False):
    return quantized_layer(scheme, N, K, group, seed, bias, device=DEV)


def _inputs(N, K, swiglu, seed=1):
    return one_token_inputs(N, K, swiglu, seed, device=DEV)


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize("residual", [False, True])
def test_the_fused_gemv_equals_the_unfused_ops(scheme, group, prologue, residual):
    N, K = 37, 128  # N not a multiple of any tile: the masks matter
    layer = _layer(scheme, N, K, group or 32)
    x, nw, res = _inputs(N, K, prologue == "swiglu")
    args = dict(norm_weight=nw if prologue == "rmsnorm" else None, swiglu=prologue == "swiglu",
                residual=res if residual else None)
    got = fused_quant_gemv(x, layer, **args)
    want = fused_quant_gemv_reference(x, layer, **args)
    assert got.shape == (1, 1, N)
    torch.testing.assert_close(got, want, **TOL)
    # and the fusion changed the answer: without the prologue / residual it would differ (the check can fail)
    if prologue != "none" or residual:
        plain = fused_quant_gemv_reference(x[..., :K], layer)
        assert (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize("split_k", [2, 3])
def test_the_int8_gemv_adds_the_residual_once_when_k_is_split(split_k):
    N, K = 21, 256
    layer = _layer("int8", N, K, seed=2)
    x, _, res = _inputs(N, K, True, seed=3)
    y = torch.empty(1, N, device=DEV)
    cfg = triton.Config({"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": split_k, "STAGES": 1})
    for _ in range(2):  # twice: the second launch finds the counters the first one left
        int8_module.launch_gemv(x.view(1, -1), layer.w_q, layer.scales, y, swiglu=True, residual=res.view(1, N),
                                config=cfg)
        want = fused_quant_gemv_reference(x, layer, swiglu=True, residual=res).view(1, N)
        torch.testing.assert_close(y, want, **TOL)


def test_the_int8_gemv_refuses_a_split_k_with_the_rmsnorm_prologue():
    layer = _layer("int8", 8, 128)
    x, nw, _ = _inputs(8, 128, False)
    cfg = triton.Config({"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 2, "STAGES": 1})
    with pytest.raises(ValueError, match="SPLIT_K"):
        int8_module.launch_gemv(x.view(1, -1), layer.w_q, layer.scales, torch.empty(1, 8, device=DEV),
                                norm_weight=nw, config=cfg)


def test_rows_no_kernel_takes_run_the_unfused_ops(monkeypatch):
    monkeypatch.setattr(int4_gemv, "IS_MAX_K", 64)  # K = 128 is then too long for the input-stationary GEMV
    layer = _layer("int4", 24, 128, 64)
    x, nw, res = _inputs(24, 128, False)
    got = fused_quant_gemv(x, layer, norm_weight=nw, residual=res)
    torch.testing.assert_close(got, fused_quant_gemv_reference(x, layer, norm_weight=nw, residual=res), **TOL)


def test_bad_arguments_name_the_problem():
    layer = _layer("int4", 16, 128)
    x, nw, res = _inputs(16, 128, False)
    with pytest.raises(ValueError, match="one prologue"):
        fused_quant_gemv(torch.randn(1, 256, device=DEV), layer, norm_weight=nw, swiglu=True)
    with pytest.raises(ValueError, match="one row of 128"):
        fused_quant_gemv(torch.randn(2, 128, device=DEV), layer)
    with pytest.raises(ValueError, match="norm_weight must be"):
        fused_quant_gemv(x, layer, norm_weight=nw[:64])
    with pytest.raises(ValueError, match="residual must be"):
        fused_quant_gemv(x, layer, residual=res[..., :8])
    with pytest.raises(ValueError, match="bias"):
        fused_quant_gemv(x, _layer("int8", 16, 128, bias=True))
    with pytest.raises(ValueError, match="padded"):
        fused_quant_gemv(torch.randn(1, 96, device=DEV), _layer("int4", 16, 96, 64))
    with pytest.raises(TypeError, match="Int8Linear or Int4Linear"):
        fused_quant_gemv(x, torch.nn.Linear(128, 16))
    with pytest.raises(ValueError, match="contiguous"):
        fused_quant_gemv(torch.randn(128, 2, device=DEV)[:, 0].view(1, 128), layer)
    # hand-built layers whose buffers the kernels cannot read: refused, as int4_matmul / int8_matmul refuse them
    packed, _ = quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        fused_quant_gemv(torch.randn(1, 64, device=DEV), Int4Linear(packed, torch.rand(8, 4) + 0.1).to(DEV))
    w8, s8 = quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="scales"):
        fused_quant_gemv(torch.randn(1, 64, device=DEV), Int8Linear(w8, s8[:1].clone()).to(DEV))
    with pytest.raises(TypeError, match="torch.int8"):
        fused_quant_gemv(torch.randn(1, 64, device=DEV), Int8Linear(w8.view(torch.uint8), s8).to(DEV))
    with pytest.raises(ValueError, match="bias"):  # the reference refuses it too (it would drop the bias)
        fused_quant_gemv_reference(x, _layer("int8", 16, 128, bias=True))
    # after the errors, a good call still answers
    torch.testing.assert_close(fused_quant_gemv(x, layer, residual=res),
                               fused_quant_gemv_reference(x, layer, residual=res), **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, K, prologue", [(6144, 4096, "rmsnorm"), (4096, 4096, "none"), (4096, 14336, "swiglu"),
                                            (28672, 4096, "rmsnorm"), (1001, 96, "swiglu")])
def test_the_gluon_gemv_with_the_small_ops_inside_equals_the_unfused_ops(N, K, prologue, dtype):
    from llmlab.kernels.int4_matmul import gluon_gemv_status

    assert gluon_gemv_status("cuda") == "gluon"
    layer = _layer("int4", N, K, 32 if K % 128 else 128).to(DEV)
    x, nw, res = (t.to(dtype) for t in _inputs(N, K, prologue == "swiglu"))
    args = dict(norm_weight=nw if prologue == "rmsnorm" else None, swiglu=prologue == "swiglu",
                residual=None if prologue == "rmsnorm" else res)
    got = fused_quant_gemv(x, layer, **args).float()
    want = fused_quant_gemv_reference(x.float(), layer, **{k: v if not torch.is_tensor(v) else v.float()
                                                            for k, v in args.items()}).float()
    # bf16: the inputs and outputs rounded to bf16, the normalized x not (module notes): within a few bf16 ulps
    scale = float(want.abs().max())
    tol = dict(rtol=1e-4, atol=1e-4 * scale) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(got, want, **tol)


# -- the quantized model's batch-1 decode step ---------------------------------------------------------------------

def _count_calls(monkeypatch, names):
    from llmlab.kernels import modules

    calls: dict[str, int] = {}
    real = modules.ops()
    for name in names:
        fn = getattr(real, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(real, name, counted)
    return calls


@torch.no_grad()
@pytest.mark.parametrize("scheme,group", [("int8", 32), ("int4", 64)])
def test_the_quantized_decode_step_runs_four_fused_gemvs_a_layer_and_matches_the_model(monkeypatch, scheme, group):
    from llmlab.kernels.decode_step import KernelDecodeStep, runs_fused
    from llmlab.kernels.modules import swap_in

    model = quantize_model(tiny_model(seed=5), scheme, group_size=group).to(DEV)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(5)).to(DEV)

    def run(fwd):
        return greedy_on_static_cache(fwd, model, ids, steps=3)

    want = run(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = KernelDecodeStep(swap_in(model))
    assert runs_fused(model, torch.float32)
    calls = _count_calls(monkeypatch, ("fused_quant_gemv", "fused_gemv", "rmsnorm", "swiglu"))
    got = run(step)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    L = model.config.n_layers
    # the prompt takes the per-module path; each of the 3 decode steps 4 fused GEMVs a layer and the final norm;
    # SwiGLU inside the int4 down GEMV, an int8 step's own launch
    swiglu = L + (3 * L if scheme == "int8" else 0)
    assert calls == {"fused_quant_gemv": 3 * 4 * L, "rmsnorm": (2 * L + 1) + 3, "swiglu": swiglu}


@torch.no_grad()
@pytest.mark.parametrize("down", [{"R": 8, "PPS": 2}, {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 1, "STAGES": 1}])
def test_an_int8_step_runs_swiglu_inside_an_input_stationary_down_gemv(monkeypatch, down):
    """With an input-stationary config for the down role, SwiGLU is that GEMV's prologue (no launch of its own);
    with a K-walking one it keeps its launch. The greedy tokens equal the model's either way."""
    from llmlab.kernels.decode_step import KernelDecodeStep
    from llmlab.kernels.modules import swap_in

    model = quantize_model(tiny_model(seed=7), "int8").to(DEV)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(7)).to(DEV)
    want = greedy_on_static_cache(model, model, ids, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = KernelDecodeStep(swap_in(model), tiles={"down": triton.Config(down)})
    calls = _count_calls(monkeypatch, ("fused_quant_gemv", "swiglu"))
    got = greedy_on_static_cache(step, model, ids, steps=3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    L = model.config.n_layers
    inside = "R" in down
    assert calls == {"fused_quant_gemv": 3 * 4 * L, "swiglu": L + (0 if inside else 3 * L)}


def test_a_model_with_padded_quantized_rows_keeps_the_per_module_step():
    from llmlab.kernels.decode_step import quantized_projections

    padded = quantize_model(tiny_model(seed=6), "int4", group_size=128)  # 192 inputs of the down projection: padded
    assert not quantized_projections(padded)
    assert quantized_projections(quantize_model(tiny_model(seed=6), "int4", group_size=64))
    assert not quantized_projections(tiny_model(seed=6))


@pytest.mark.parametrize("config", [(4, 32, 1, 1), (8, 64, 1, 2), (16, 32, 2, 1), (8, 32, 3, 2)], ids=str)
@pytest.mark.parametrize("prologue", ["none", "swiglu", "rmsnorm"])
def test_an_int8_gemv_tile_given_as_config_computes_the_same_result(config, prologue):
    """`config=` (as step tuning passes it) runs that tile; a split tile with the RMSNorm prologue is refused."""
    bn, bk, sk, st = config
    cfg = triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "STAGES": st})
    N, K = 19, 160
    layer = _layer("int8", N, K, seed=4)
    x, nw, res = _inputs(N, K, prologue == "swiglu", seed=5)
    args = dict(norm_weight=nw if prologue == "rmsnorm" else None, swiglu=prologue == "swiglu", residual=res)
    if prologue == "rmsnorm" and sk > 1:
        with pytest.raises(ValueError, match="SPLIT_K = 1"):
            fused_quant_gemv(x, layer, config=cfg, **args)
        return
    torch.testing.assert_close(fused_quant_gemv(x, layer, config=cfg, **args),
                               fused_quant_gemv_reference(x, layer, **args), **TOL)


def test_a_config_of_the_other_format_is_refused_and_each_format_takes_its_own():
    x, _, _ = _inputs(16, 128, False)
    good = triton.Config({"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 1, "STAGES": 1})
    int4_config = triton.Config({"R": 4, "DEPTH": 2})
    layer4 = _layer("int4", 16, 128)
    with pytest.raises(TypeError, match="R and DEPTH"):
        fused_quant_gemv(x, layer4, config=good)
    # the int4 Gluon GEMV's config (where the Triton int4 GEMV runs instead, the same sums with its own config)
    torch.testing.assert_close(fused_quant_gemv(x, layer4, config=int4_config), fused_quant_gemv_reference(x, layer4),
                               **TOL)
    layer = _layer("int8", 16, 128)
    with pytest.raises(TypeError, match="BLOCK_N, BLOCK_K, SPLIT_K and STAGES"):
        fused_quant_gemv(x, layer, config=int4_config)
    for bad, match in [({"BLOCK_N": 8}, "triton.Config"),
                       (triton.Config({"BLOCK_N": 8, "BLOCK_K": 32, "STAGES": 1}), "SPLIT_K"),
                       (triton.Config({"BLOCK_N": 6, "BLOCK_K": 32, "SPLIT_K": 1, "STAGES": 1}), "powers of 2"),
                       (triton.Config({"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 9, "STAGES": 1}), "SPLIT_K in"),
                       (triton.Config({"BLOCK_N": 8, "BLOCK_K": 2, "SPLIT_K": 1, "STAGES": 1}), "BLOCK_K >= 4")]:
        with pytest.raises(TypeError, match=match):
            fused_quant_gemv(x, layer, config=bad)
    torch.testing.assert_close(fused_quant_gemv(x, layer, config=good), fused_quant_gemv_reference(x, layer), **TOL)
