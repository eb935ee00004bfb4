"""The input-stationary int8 GEMV (`llmlab.kernels.int8_gemv`) against the unfused ops in PyTorch, how a config
selects it, and a quantized decode step that runs it for every GEMV role.

On a CPU these run in Triton's interpreter (fp32, and fp16 where stated); a GPU runs them compiled.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from llmlab.quant import quantize_model
from tiny_models import greedy_on_static_cache, one_token_inputs, quantized_layer, tiny_model

triton = pytest.importorskip("triton")

from llmlab.kernels._util import interpret_mode  # noqa: E402

if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import int8_gemv  # noqa: E402
from llmlab.kernels import int8_matmul as int8_module  # noqa: E402
from llmlab.kernels.fused_quant_gemv import fused_quant_gemv, fused_quant_gemv_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=1e-4, atol=1e-4)


def _is(R=8, pps=2):
    return triton.Config({"R": R, "PPS": pps})


def _layer(N, K, seed=0):
    return quantized_layer("int8", N, K, seed=seed, device=DEV)


def _inputs(N, K, swiglu, seed=1, dtype=torch.float32):
    return one_token_inputs(N, K, swiglu, seed, dtype, device=DEV)


# K = 80: 5 slots of 16, Q = 8 (three slots past the row); K = 16: one slot; N not a multiple of R
@pytest.mark.parametrize("N,K", [(37, 128), (19, 80), (9, 16)])
@pytest.mark.parametrize("R,pps", [(8, 2), (4, 1), (16, 1)])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
def test_the_input_stationary_gemv_equals_the_unfused_ops(N, K, R, pps, prologue):
    layer = _layer(N, K, seed=N + K)
    x, nw, res = _inputs(N, K, prologue == "swiglu", seed=K)
    for residual in (None, res):
        args = dict(norm_weight=nw if prologue == "rmsnorm" else None, swiglu=prologue == "swiglu",
                    residual=residual)
        got = fused_quant_gemv(x, layer, config=_is(R, pps), **args)
        torch.testing.assert_close(got, fused_quant_gemv_reference(x, layer, **args), **TOL)
    # the check can fail: the K-walking GEMV's answer without the prologue differs
    if prologue != "none":
        assert (got - fused_quant_gemv_reference(x[..., :K], layer, residual=res)).abs().max() > 1e-2


def test_every_row_is_written_with_fewer_programs_than_chunks():
    """pps x SMs programs (4 SMs in the interpreter) walk 64 / 4 = 16 chunks: each program several."""
    N, K = 64, 32
    layer = _layer(N, K, seed=3)
    x, _, _ = _inputs(N, K, False, seed=3)
    y = torch.full((1, N), float("nan"), device=DEV)
    int8_module.launch_gemv(x.view(1, K), layer.w_q, layer.scales, y, config=_is(4, 1))
    torch.testing.assert_close(y, fused_quant_gemv_reference(x, layer).view(1, N), **TOL)


def test_fp16_activations_with_long_rows_stay_finite_and_match_an_fp32_reference():
    """K = 14336 (the 8B model's down projection) with fp16 x: the fp32 sums do not overflow fp16's range."""
    N, K = 8, 14336
    layer = _layer(N, K, seed=7)
    x, _, _ = _inputs(N, K, False, seed=7, dtype=torch.float16)
    y = torch.empty(1, N, device=DEV, dtype=torch.float16)
    int8_module.launch_gemv(x.view(1, K), layer.w_q, layer.scales, y, config=_is(8, 1))
    want = x.view(1, K).float() @ layer.dequantize(torch.float32).T
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), want, rtol=2e-3, atol=2e-3)


def test_rows_it_cannot_take_are_refused_with_the_fix_and_the_gemv_stays_usable():
    layer = _layer(8, 84)  # K = 84: whole words, not whole 16-byte quads
    x, _, _ = _inputs(8, 84, False)
    assert not int8_gemv.takes(84) and int8_gemv.takes(96) and not int8_gemv.takes(int8_gemv.MAX_K + 16)
    assert int8_gemv.candidate_configs(84) == []
    with pytest.raises(ValueError, match="multiple of 16.*K-walking config"):
        fused_quant_gemv(x, layer, config=_is())
    torch.testing.assert_close(fused_quant_gemv(x, layer), fused_quant_gemv_reference(x, layer), **TOL)


@pytest.mark.parametrize("bad,match", [({"R": 3, "PPS": 1}, "power of 2"), ({"R": 8, "PPS": 0}, "PPS >= 1"),
                                       ({"R": 8, "PPS": 1.5}, "PPS >= 1"), ({"R": 8}, "R and PPS")])
def test_a_malformed_input_stationary_config_is_refused(bad, match):
    layer = _layer(16, 64)
    x, _, _ = _inputs(16, 64, False)
    with pytest.raises(TypeError, match=match):
        fused_quant_gemv(x, layer, config=triton.Config(bad))


def test_the_candidates_hold_both_gemvs_where_autotuning_is_on(monkeypatch):
    from llmlab.kernels import quant_tiles

    full = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st}, num_warps=w)
            for n, k, sk, w, st in quant_tiles._GEMV1_SHAPES]
    monkeypatch.setattr(int8_module, "GEMV1_CONFIGS", full)
    cands = int8_module.candidate_configs(6144, 4096, rmsnorm=True)
    stationary = [c for c in cands if int8_module.input_stationary(c)]
    assert len(stationary) == len(int8_gemv.SHAPES) and len(cands) > len(stationary)
    for c in cands:
        int8_module.check_gemv_config(c, rmsnorm=True)  # each one the launcher takes
    # rows of 14348 weights: the K-walking tiles only
    assert not any(int8_module.input_stationary(c) for c in int8_module.candidate_configs(4096, 14348))


@torch.no_grad()
def test_a_quantized_decode_step_with_the_input_stationary_gemv_in_every_role_matches_the_model():
    from llmlab.kernels.decode_step import GEMV_ROLES, KernelDecodeStep
    from llmlab.kernels.modules import swap_in

    model = quantize_model(tiny_model(seed=9), "int8").to(DEV)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(9)).to(DEV)
    want = greedy_on_static_cache(model, model, ids, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = KernelDecodeStep(swap_in(model), tiles={role: _is(4, 1) for role in GEMV_ROLES})
    calls = []
    real = int8_gemv.launch
    try:
        int8_gemv.launch = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        got = greedy_on_static_cache(step, model, ids, steps=3)
    finally:
        int8_gemv.launch = real
    assert len(calls) == 3 * 4 * model.config.n_layers  # every GEMV of the 3 decode steps ran it
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert [o[:, -1].argmax(-1).item() for o in got] == [o[:, -1].argmax(-1).item() for o in want]
