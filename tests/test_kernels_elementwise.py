"""Triton RMSNorm (+ residual), SwiGLU and RoPE against their PyTorch references.

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) in fp32; the fp16/bf16
cases are `gpu`-marked. Sizes {1, 7, 17, 999, 1001, 4095} run in the dimension each kernel tiles; outputs are
poisoned (NaN) before a launch where the kernel writes into a buffer we own, so a masked lane that leaked would show.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels.rmsnorm import TritonRMSNorm, rmsnorm, rmsnorm_reference  # noqa: E402
from llmlab.kernels.rope import rope_, rope_one, rope_reference  # noqa: E402
from llmlab.kernels.swiglu import swiglu, swiglu_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 7, 17, 999, 1001, 4095]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=1e-1, rtol=2e-2)}
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float16, torch.bfloat16)]
DTYPES = [torch.float32, *GPU_DTYPES]


# -- RMSNorm -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", SIZES)
def test_rmsnorm_matches_reference(D, dtype):
    torch.manual_seed(D)
    x = torch.randn(3, D, device=DEV, dtype=dtype)
    w = torch.randn(D, device=DEV, dtype=dtype)
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 17, 1001])
def test_fused_residual_rmsnorm_returns_norm_and_sum(D, dtype):
    torch.manual_seed(D)
    x, r = torch.randn(2, 2, D, device=DEV, dtype=dtype), torch.randn(2, 2, D, device=DEV, dtype=dtype)
    w = torch.randn(D, device=DEV, dtype=dtype)
    y, h = rmsnorm(x, w, 1e-6, residual=r)
    y_ref, h_ref = rmsnorm_reference(x, w, 1e-6, residual=r)
    torch.testing.assert_close(h, h_ref, **TOL[dtype])
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


def test_rmsnorm_masked_lanes_do_not_leak():
    # rows are views into a wider buffer: the padded tail of each row (D=999 -> BLOCK 1024) holds huge values
    # that must neither enter the sum of squares nor be overwritten
    buf = torch.full((4, 1024), 1e30, device=DEV)
    x = buf[:, :999]
    x.copy_(torch.randn(4, 999))
    w = torch.ones(999, device=DEV)
    y = rmsnorm(x, w)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, rmsnorm_reference(x.contiguous(), w), atol=1e-5, rtol=1e-5)
    assert (buf[:, 999:] == 1e30).all()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.gpu)])
def test_rmsnorm_large_fp16_inputs_stay_finite(dtype):
    # x ~ +-1000: x^2 ~ 1e6 overflows fp16 (max 65504) unless the sum of squares is taken in fp32
    torch.manual_seed(0)
    x = (torch.rand(4, 4095, device=DEV) * 2 - 1).sign() * 1000 + torch.randn(4, 4095, device=DEV)
    x = x.to(dtype)
    w = torch.rand(4095, device=DEV, dtype=dtype) + 0.5
    y = rmsnorm(x, w)
    assert torch.isfinite(y).all()
    x32, w32 = x.float(), w.float()
    ref = (w32 * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5))).to(dtype)
    torch.testing.assert_close(y, ref, **TOL[dtype])


def test_triton_rmsnorm_module_matches_model_rmsnorm():
    from llmlab.model import RMSNorm

    ref = RMSNorm(33, eps=1e-6).to(DEV)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(33))
    mod = TritonRMSNorm(33, eps=1e-6).to(DEV)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 33, device=DEV)
    torch.testing.assert_close(mod(x), ref(x), atol=1e-5, rtol=1e-5)


def test_rmsnorm_rejects_bad_inputs():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        rmsnorm(x, torch.ones(7, device=DEV))
    with pytest.raises(ValueError, match="residual"):
        rmsnorm(x, torch.ones(8, device=DEV), residual=torch.randn(2, 7, device=DEV))
    with pytest.raises(TypeError, match="dtype"):
        rmsnorm(x.to(torch.int32), torch.ones(8, device=DEV, dtype=torch.int32))
    with pytest.raises(TypeError, match="share one dtype"):
        rmsnorm(x, torch.ones(8, device=DEV, dtype=torch.float64).to(torch.float16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's bf16 limit only applies on a CPU")
def test_interpreter_refuses_bf16_with_a_clear_error():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="no bf16"):
        rmsnorm(x, torch.ones(8, dtype=torch.bfloat16))


# -- SwiGLU --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", SIZES)
def test_swiglu_matches_reference(N, dtype):
    torch.manual_seed(N)
    g, u = torch.randn(2, N, device=DEV, dtype=dtype) * 4, torch.randn(2, N, device=DEV, dtype=dtype)
    torch.testing.assert_close(swiglu(g, u), swiglu_reference(g, u), **TOL[dtype])


def test_swiglu_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one"):
        swiglu(torch.randn(2, 8, device=DEV), torch.randn(2, 9, device=DEV))


# -- RoPE ----------------------------------------------------------------------------------------------------------

def _tables(T, hd, B=None, dtype=torch.float32):
    shape = (T, hd // 2) if B is None else (B, T, hd // 2)
    ang = torch.rand(shape, device=DEV) * 50
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", SIZES)
def test_rope_in_place_matches_apply_rope(T, dtype):
    torch.manual_seed(T)
    B, H, Hkv, hd = 1, 2, 1, 16
    # the model's layout: (B, T, H, hd) viewed as (B, H, T, hd) — not contiguous
    q = torch.randn(B, T, H, hd, device=DEV, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, T, Hkv, hd, device=DEV, dtype=dtype).transpose(1, 2)
    cos, sin = _tables(T, hd, dtype=dtype)
    q_ref, k_ref = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    q_out, k_out = rope_(q, k, cos, sin)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])


@pytest.mark.parametrize("hd", [2, 6, 64])
def test_rope_per_sequence_positions_and_odd_half_dims(hd):
    torch.manual_seed(hd)
    B, H, T = 3, 3, 5
    q = torch.randn(B, H, T, hd, device=DEV)
    k = torch.randn(B, 1, T, hd, device=DEV)
    cos, sin = _tables(T, hd, B=B)
    q_ref, k_ref = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    rope_(q, k, cos, sin)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)


def test_rope_does_not_touch_neighbouring_memory():
    # q is a slice of a wider buffer (padding heads on either side): only its own channels may change
    buf = torch.full((1, 4, 7, 8), float("nan"), device=DEV)
    q = buf[:, 1:3]
    q.copy_(torch.randn(1, 2, 7, 8))
    k = torch.randn(1, 1, 7, 8, device=DEV)
    cos, sin = _tables(7, 8)
    q_ref = rope_reference(q.clone(), cos, sin)
    rope_(q, k, cos, sin)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    assert buf[:, 0].isnan().all() and buf[:, 3].isnan().all()


def test_rope_rejects_bad_inputs():
    q, k = torch.randn(1, 2, 3, 8, device=DEV), torch.randn(1, 1, 3, 8, device=DEV)
    cos, sin = _tables(3, 8)
    with pytest.raises(ValueError, match="even"):
        rope_(torch.randn(1, 2, 3, 7, device=DEV), torch.randn(1, 1, 3, 7, device=DEV), cos[:, :7], sin[:, :7])
    with pytest.raises(ValueError, match="cos/sin"):
        rope_(q, k, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="match q"):
        rope_(q, torch.randn(1, 1, 4, 8, device=DEV), cos, sin)


# -- TRITON_INTERPRET set only after triton was imported -----------------------------------------------------------

def test_interpreter_turned_on_after_triton_was_imported_is_named(monkeypatch):
    """Simulated (the test process imported triton under the interpreter): the kernel call raises the restart
    advice instead of triton's "0 active drivers" RuntimeError; triton_status says the same."""
    from llmlab.kernels import _util

    if interpret_mode():
        assert not _util.triton_imported_without_interpreter()  # conftest.py set it before triton was imported
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_util, "triton_imported_without_interpreter", lambda: True)
    with pytest.raises(ValueError, match="rmsnorm: TRITON_INTERPRET must be set before triton is imported: .*restart"):
        rmsnorm(torch.ones(2, 8), torch.ones(8))
    if not torch.cuda.is_available():
        ok, why = _util.triton_status()
        assert not ok and why == _util.INTERPRET_TOO_LATE


def test_interpreter_turned_on_after_the_kernels_were_imported_in_a_real_process():
    """The notebook case, for real: import a kernel, then set TRITON_INTERPRET=1, then call it on CPU tensors."""
    import os
    import subprocess
    import sys

    code = ("import os, torch\n"
            "from llmlab.kernels.rmsnorm import rmsnorm\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "try:\n"
            "    rmsnorm(torch.ones(2, 8), torch.ones(8))\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "ValueError: rmsnorm: TRITON_INTERPRET must be set before triton is imported" in proc.stdout, proc.stderr


def test_bad_arguments_found_by_a_student_review():
    """rope_ with one tensor as q and k would rotate it twice; swiglu of empty rows; eps that is not a number."""
    x = torch.randn(1, 2, 3, 8, device=DEV)
    a = torch.randn(3, 4, device=DEV).repeat(1, 2)
    with pytest.raises(ValueError, match="q and k share memory.*rope_one"):
        rope_(x, x, a.cos(), a.sin())
    ref = rope_reference(x, a.cos(), a.sin())
    torch.testing.assert_close(rope_one(x.clone(), a.cos(), a.sin()), ref)
    for shape in ((3, 0), (0, 5)):
        out = swiglu(torch.randn(*shape, device=DEV), torch.randn(*shape, device=DEV))
        assert out.shape == shape
    w = torch.ones(8, device=DEV)
    for eps, err in (("1e-5", TypeError), (True, TypeError), (-1.0, ValueError), (float("nan"), ValueError)):
        with pytest.raises(err, match="rmsnorm: eps must be"):
            rmsnorm(torch.randn(2, 8, device=DEV), w, eps=eps)
