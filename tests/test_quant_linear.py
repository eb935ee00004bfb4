"""Int8Linear / Int4Linear (llmlab/quant/linear.py): the round trip, edge-case groups, fp16 at a long K, the forward
against x @ dequant(W)^T, and the Triton kernel path (in Triton's CPU interpreter, fp32, small sizes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab.quant import Int4Linear, Int8Linear
from llmlab.quant import linear as qlinear


def _linear(N: int, K: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.05)
        if bias:
            lin.bias.normal_(0.0, 0.1)
    return lin


def _assert_within_half_scale(w: torch.Tensor, deq: torch.Tensor, scale_per_weight: torch.Tensor) -> None:
    err = (deq - w).abs()
    limit = scale_per_weight / 2 * (1 + 1e-5) + 1e-12
    worst = (err / limit).max().item()
    assert (err <= limit).all(), f"a dequantized weight is {worst:.3f} x (scale / 2) from the original"


def test_int8_round_trip_within_half_a_scale():
    lin = _linear(48, 96)
    q = Int8Linear.from_linear(lin)
    assert q.w_q.dtype == torch.int8 and q.w_q.shape == (48, 96) and q.scales.shape == (48,)
    _assert_within_half_scale(lin.weight, q.dequantize(), q.scales[:, None].expand(48, 96))


@pytest.mark.parametrize("G", [32, 64, 128])
def test_int4_round_trip_within_half_a_scale(G):
    lin = _linear(24, 256)
    q = Int4Linear.from_linear(lin, group_size=G)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (24, 128) and q.scales.shape == (24, 256 // G)
    assert q.group_size == G
    _assert_within_half_scale(lin.weight, q.dequantize(), q.scales.repeat_interleave(G, dim=1))


@pytest.mark.parametrize("make", [Int8Linear.from_linear, lambda lin: Int4Linear.from_linear(lin, group_size=32)],
                         ids=["int8", "int4"])
def test_all_zero_and_single_sign_groups_stay_finite(make):
    lin = _linear(4, 64)
    with torch.no_grad():
        lin.weight[0] = 0.0  # an all-zero row (int8) / two all-zero groups (int4)
        lin.weight[1, :32] = 0.0  # one all-zero group in int4
        lin.weight[2] = lin.weight[2].abs() + 0.01  # a single-sign row / groups (positive)
        lin.weight[3] = -(lin.weight[3].abs() + 0.01)  # negative
    q = make(lin)
    deq = q.dequantize()
    assert torch.isfinite(q.scales).all() and (q.scales > 0).all()
    assert torch.isfinite(deq).all()
    assert (deq[0] == 0).all() and (deq[1, :32] == 0).all()
    assert (deq[2] >= 0).all() and (deq[3] <= 0).all()  # small values may round to 0, none flips sign
    assert deq[2].max() > 0 and deq[3].min() < 0
    y = q(torch.randn(3, 64))
    assert torch.isfinite(y).all()


def test_int8_fp16_activations_at_k_14336_match_an_fp32_reference():
    K, N = 14336, 4
    lin = _linear(N, K)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(1)).half()
    y = q(x)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    ref = x.float() @ q.dequantize(torch.float32).T  # fp32 accumulation
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_forward_is_x_at_dequantized_weight_plus_bias(scheme):
    lin = _linear(40, 128, bias=True)
    q = Int8Linear.from_linear(lin) if scheme == "int8" else Int4Linear.from_linear(lin, group_size=64)
    x = torch.randn(2, 5, 128)  # (B, T, K): leading dimensions are kept
    y = q(x)
    assert y.shape == (2, 5, 40)
    torch.testing.assert_close(y, F.linear(x, q.dequantize(), lin.bias), atol=0, rtol=0)
    exact = lin(x)  # and close to the unquantized layer, as a whole (int4 rounding is coarse per element)
    rel = ((y - exact).norm() / exact.norm()).item()
    assert rel < (0.02 if scheme == "int8" else 0.2), rel
    with pytest.raises(ValueError, match="in_features = 128"):
        q(torch.randn(2, 64))


def test_weight_bytes_and_buffers():
    lin = _linear(64, 256, bias=True)
    q8, q4 = Int8Linear.from_linear(lin), Int4Linear.from_linear(lin, group_size=128)
    assert q8.weight_bytes() == 64 * 256 + 4 * 64
    assert q4.weight_bytes() == 64 * 128 + 4 * 64 * 2
    assert set(dict(q8.named_buffers())) == {"w_q", "scales", "bias"}
    assert not list(q8.parameters())


def test_from_linear_refuses_other_modules_and_bad_groups():
    with pytest.raises(TypeError, match="nn.Linear"):
        Int8Linear.from_linear(nn.Embedding(4, 4))
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32.*got 48"):
        Int4Linear.from_linear(_linear(8, 96), group_size=48)


def test_importing_llmlab_quant_does_not_import_triton():
    code = "import sys, llmlab.quant; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.parametrize("scheme,M", [("int8", 1), ("int8", 3), ("int4", 1), ("int4", 3)])
def test_kernel_path_matches_the_pytorch_path(scheme, M, monkeypatch):
    """The CUDA branch, forced onto the CPU: Triton's interpreter runs the kernel (fp32, small sizes)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set")
    lin = _linear(32, 64, bias=True)
    q = Int8Linear.from_linear(lin) if scheme == "int8" else Int4Linear.from_linear(lin, group_size=32)
    x = torch.randn(1, M, 64)
    q.use_kernel = False
    ref = q(x)
    q.use_kernel = True
    monkeypatch.setattr(qlinear.QuantizedLinear, "_kernel_ok", lambda self, x2d: True)
    torch.testing.assert_close(q(x), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme,K", [("int8", 64), ("int4", 64), ("int4", 80)])
def test_prefill_path_dequantizes_in_one_pass_and_matches_the_pytorch_path(scheme, K, monkeypatch):
    """Rows beyond the decode kernel's 16 on CUDA: the one-pass Triton dequantize + F.linear (forced onto the CPU
    here, in Triton's interpreter), equal to the PyTorch dequantize + F.linear; K = 80 at group 32 is padded to 96."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set")
    lin = _linear(48, K, bias=True)
    q = Int8Linear.from_linear(lin) if scheme == "int8" else Int4Linear.from_linear(lin, group_size=32)
    x = torch.randn(2, 20, K)
    q.use_kernel = False
    ref = q(x)
    q.use_kernel = True
    calls = []
    kernel = type(q)._dequantize_kernel
    monkeypatch.setattr(qlinear.QuantizedLinear, "_on_gpu", lambda self, x2d: True)
    monkeypatch.setattr(type(q), "_dequantize_kernel", lambda self, dtype: calls.append(dtype) or kernel(self, dtype))
    monkeypatch.setattr(qlinear.QuantizedLinear, "dequantize", lambda self, dtype: pytest.fail("PyTorch path taken"))
    torch.testing.assert_close(q(x), ref, atol=1e-5, rtol=1e-5)
    assert calls == [torch.float32], "the prefill path did not run the one-pass dequantize"
