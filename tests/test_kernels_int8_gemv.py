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


@pytest.mark.parametrize("config", [{"R": 4, "PPS": 1}, {"R": 8, "GLUON": True}], ids=str)
def test_bytes_at_both_ends_of_the_int8_range(config):
    """-128 (0x80, which XOR 0x80 makes 0) and 127 (0x7F -> 255): a file's codes may hold -128 though the
    quantizer writes -127..127."""
    from llmlab.quant import Int8Linear

    g = torch.Generator().manual_seed(13)
    w_q = torch.randint(-128, 128, (11, 48), generator=g, dtype=torch.int8)
    w_q[0], w_q[1, ::2], w_q[2] = -128, 127, -128
    layer = Int8Linear(w_q, torch.rand(11, generator=g) * 0.01 + 1e-3).to(DEV)
    x, _, res = _inputs(11, 48, False, seed=13)
    got = fused_quant_gemv(x, layer, config=triton.Config(config), residual=res)
    want = res + x @ (w_q.float() * layer.scales.cpu()[:, None]).to(DEV).T
    torch.testing.assert_close(got, want, **TOL)


def test_rows_it_cannot_take_are_refused_with_the_fix_and_the_gemv_stays_usable():
    layer = _layer(8, 84)  # K = 84: whole words, not whole 16-byte quads
    x, _, _ = _inputs(8, 84, False)
    assert not int8_gemv.takes(84) and int8_gemv.takes(96) and not int8_gemv.takes(int8_gemv.MAX_K + 16)
    assert int8_gemv.candidate_configs(84) == []
    with pytest.raises(ValueError, match="multiple of 16.*K-walking config"):
        fused_quant_gemv(x, layer, config=_is())
    torch.testing.assert_close(fused_quant_gemv(x, layer), fused_quant_gemv_reference(x, layer), **TOL)


@pytest.mark.parametrize("bad,match", [({"R": 3, "PPS": 1}, "power of 2"), ({"R": 8, "PPS": 0}, "PPS >= 1"),
                                       ({"R": 8, "PPS": 1.5}, "PPS >= 1"), ({"R": 8}, "R and PPS"),
                                       ({"R": 64, "GLUON": True}, r"power of 2 in 1\.\.32"),
                                       ({"R": 8, "PPS": 1, "GLUON": True}, "R and GLUON")])
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
    stationary = [c for c in cands if int8_module.input_stationary(c) and "PPS" in c.kwargs]
    assert len(stationary) == len(int8_gemv.SHAPES) and len(cands) > len(stationary)
    assert all(c.num_warps == 8 for c in stationary)  # as the kernel launches: 256 slots of 16 at K = 4096
    for c in cands:
        int8_module.check_gemv_config(c, rmsnorm=True)  # each one the launcher takes
    # rows of 14348 weights: the K-walking tiles only
    assert not any(int8_module.input_stationary(c) for c in int8_module.candidate_configs(4096, 14348))


@torch.no_grad()
def test_a_quantized_decode_step_with_the_input_stationary_gemv_in_every_role_matches_the_model(monkeypatch):
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
    monkeypatch.setattr(int8_gemv, "launch", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    got = greedy_on_static_cache(step, model, ids, steps=3)
    assert len(calls) == 3 * 4 * model.config.n_layers  # every GEMV of the 3 decode steps ran it
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert [o[:, -1].argmax(-1).item() for o in got] == [o[:, -1].argmax(-1).item() for o in want]


# -- the Gluon build (llmlab/kernels/int8_gemv_gluon.py) -----------------------------------------------------------

def test_a_gluon_config_runs_the_triton_build_where_gluon_cannot_run():
    """In the interpreter (or on a GPU whose Triton has no Gluon) R and GLUON run `int8_gemv`'s kernel with that
    R: the same sums."""
    from llmlab.kernels import int8_gemv_gluon

    layer = _layer(21, 96, seed=11)
    x, nw, res = _inputs(21, 96, False, seed=11)
    cfg = triton.Config({"R": 4, "GLUON": True})
    assert int8_module.input_stationary(cfg)
    got = fused_quant_gemv(x, layer, config=cfg, norm_weight=nw, residual=res)
    torch.testing.assert_close(got, fused_quant_gemv_reference(x, layer, norm_weight=nw, residual=res), **TOL)
    if not torch.cuda.is_available():
        assert int8_gemv_gluon.candidate_configs(4096) == []  # nothing to time where it cannot run
    with pytest.raises(TypeError, match="GLUON True"):
        fused_quant_gemv(x, layer, config=triton.Config({"R": 4, "GLUON": False}))


def test_the_gluon_build_compiles_for_hopper_with_each_fusion():
    """Compiled for sm_90 without a GPU, in a fresh process (this one may run Triton's interpreter, which cannot
    compile): layout conversions asserted to move no data would fail here. Each row's quad is one 16-byte load a
    thread; the subnormal fields need FMAs that keep them (no .ftz); the RMSNorm adds a square root, SwiGLU an
    exponential."""
    import os
    import subprocess
    import sys

    from llmlab.kernels import int4_gemv_gluon

    if int4_gemv_gluon.GLUON_ERROR:
        pytest.skip(f"this Triton has no Gluon: {int4_gemv_gluon.GLUON_ERROR}")
    code = (
        "from llmlab.kernels import int8_gemv_gluon as g\n"
        "for K, R, pro, res in ((4096, 8, 1, False), (4096, 16, 0, True), (14336, 4, 2, True), (80, 8, 0, False)):\n"
        "    ptx = g.build_offline(K, R=R, prologue=pro, residual=res).asm['ptx']\n"
        "    print(K, R, pro, ptx.count('ld.global.v4.b32') + ptx.count('ld.global.nc.v4.b32'),\n"
        "          ptx.count('fma.rn.f32'), ptx.count('fma.rn.ftz'), int('sqrt' in ptx), int('ex2' in ptx))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[int(v) for v in ln.split()] for ln in out.stdout.splitlines() if ln.strip()]
    assert [r[:3] for r in rows] == [[4096, 8, 1], [4096, 16, 0], [14336, 4, 2], [80, 8, 0]]
    for K, R, pro, v4, fma, ftz, sqrt, ex2 in rows:
        assert v4 >= 2 * R  # the first chunk and the loop's next one: a 16-byte load per row and thread
        assert fma >= 4 * 4 * R and ftz == 0
        assert sqrt == (pro == 1) and ex2 == (pro == 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, K, prologue, R", [(6144, 4096, "rmsnorm", 8), (4096, 4096, "none", 16),
                                               (4096, 14336, "swiglu", 4), (28672, 4096, "rmsnorm", 8),
                                               (1001, 96, "swiglu", 8), (7, 16, "none", 4)])
def test_the_gluon_build_equals_the_unfused_ops(monkeypatch, N, K, prologue, R, dtype):
    from llmlab.kernels import int8_gemv_gluon
    from llmlab.kernels.int4_matmul import gluon_gemv_status

    assert gluon_gemv_status("cuda") == "gluon"
    calls = []
    real = int8_gemv_gluon.int8_gemv
    monkeypatch.setattr(int8_gemv_gluon, "int8_gemv",
                        lambda *a, **k: (real(*a, **k), calls.append(1))[0])  # counted once it returned
    layer = _layer(N, K, seed=N % 97)
    x, nw, res = (t.to(dtype) for t in _inputs(N, K, prologue == "swiglu", seed=K % 89))
    args = dict(norm_weight=nw if prologue == "rmsnorm" else None, swiglu=prologue == "swiglu",
                residual=None if prologue == "rmsnorm" else res)
    got = fused_quant_gemv(x, layer, config=triton.Config({"R": R, "GLUON": True}), **args).float()
    assert calls == [1] and int8_gemv_gluon.usable(x.device)  # the Gluon kernel ran, not the Triton fallback
    want = fused_quant_gemv_reference(x.float(), layer, **{k: v if not torch.is_tensor(v) else v.float()
                                                           for k, v in args.items()}).float()
    scale = float(want.abs().max())
    tol = dict(rtol=1e-4, atol=1e-4 * scale) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(got, want, **tol)
