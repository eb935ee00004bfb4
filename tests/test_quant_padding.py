"""int4 with a group size that does not divide K (llmlab/quant/linear.py, "Padding"): the weight is stored padded
with zero columns to Kp, the next multiple of the group size. The round trip on the real columns, the padded
columns exactly zero, the forward against x @ dequant(W)^T (PyTorch path and the Triton kernel in the CPU
interpreter), quantize_model on a model with K = 192 and the default model's K = 704 at group size 128."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab.generate import generate
from llmlab.kernels.weight_quant import dequantize_int4, quantize_int4
from llmlab.quant import Int4Linear, dequantize_model, is_quantized, quantize_model, quantized_layers, weight_bytes
from llmlab.quant import linear as qlinear
from llmlab.quant.linear import padded_k
from tiny_models import prompt_ids, tiny_model

# (N, K, group size): K = 704 is the default model's MLP width; 40 and 200 are not even multiples of 32
PADDED = [(16, 704, 128), (8, 200, 64), (6, 40, 32), (5, 100, 128)]


def _linear(N: int, K: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.05)
        if bias:
            lin.bias.normal_(0.0, 0.1)
    return lin


def test_padded_k():
    assert padded_k(704, 128) == 768 and padded_k(704, 64) == 704 and padded_k(40, 32) == 64
    assert padded_k(100, 128) == 128 and padded_k(128, 128) == 128


@pytest.mark.parametrize("N,K,G", PADDED)
def test_round_trip_within_half_a_scale_on_the_real_columns(N, K, G):
    lin = _linear(N, K)
    q = Int4Linear.from_linear(lin, group_size=G)
    Kp = padded_k(K, G)
    assert Kp > K and q.in_features == K and q.padded_in_features == Kp and q.group_size == G
    assert q.packed.shape == (N, Kp // 2) and q.scales.shape == (N, Kp // G)
    deq = q.dequantize()
    assert deq.shape == (N, K)
    scale = q.scales.repeat_interleave(G, dim=1)[:, :K]
    err = (deq - lin.weight).abs()
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-12).all(), (err / scale).max().item()
    # the last group's scale comes from its real columns only: the zeros do not enlarge it
    last = lin.weight[:, (Kp // G - 1) * G:].abs().amax(dim=1) / 7
    torch.testing.assert_close(q.scales[:, -1], last, atol=0, rtol=1e-6)


@pytest.mark.parametrize("N,K,G", PADDED)
def test_padded_columns_are_code_8_and_exactly_zero(N, K, G):
    q = Int4Linear.from_linear(_linear(N, K), group_size=G)
    full = dequantize_int4(q.packed, q.scales)  # (N, Kp): what the kernels read
    assert (full[:, K:] == 0).all()
    codes = torch.stack([q.packed & 0xF, q.packed >> 4], dim=-1).view(N, -1)
    assert (codes[:, K:] == 8).all()
    torch.testing.assert_close(full[:, :K], q.dequantize(), atol=0, rtol=0)


def test_whole_groups_are_quantized_as_without_padding():
    N, K, G = 8, 704, 128
    lin = _linear(N, K)
    q = Int4Linear.from_linear(lin, group_size=G)
    whole = K // G * G  # 640: the five groups that hold no padding
    packed, scales = quantize_int4(lin.weight.detach()[:, :whole], G)
    assert torch.equal(q.packed[:, :whole // 2], packed) and torch.equal(q.scales[:, :whole // G], scales)


def test_weight_bytes_count_the_padding():
    q = Int4Linear.from_linear(_linear(16, 704), group_size=128)
    assert q.weight_bytes() == 16 * 768 // 2 + 4 * 16 * 768 // 128
    assert "padded_in_features=768" in repr(q)
    assert "padded" not in repr(Int4Linear.from_linear(_linear(16, 768), group_size=128))


@pytest.mark.parametrize("N,K,G", PADDED)
def test_forward_is_x_at_dequantized_weight(N, K, G):
    lin = _linear(N, K, bias=True)
    q = Int4Linear.from_linear(lin, group_size=G)
    x = torch.randn(2, 3, K)
    y = q(x)
    assert y.shape == (2, 3, N)
    torch.testing.assert_close(y, F.linear(x, q.dequantize(), lin.bias), atol=0, rtol=0)
    with pytest.raises(ValueError, match=f"in_features = {K}"):
        q(torch.randn(2, padded_k(K, G)))  # the padded width is not the layer's input


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("N,K,G", [(24, 200, 64), (8, 40, 32)])
def test_kernel_path_matches_the_pytorch_path_for_a_padded_layer(N, K, G, M, monkeypatch):
    """The CUDA branch forced onto the CPU: Triton's interpreter runs int4_matmul on x padded to Kp (fp32)."""
    pytest.importorskip("triton", reason="triton is not installed: the kernel path cannot run")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set")
    q = Int4Linear.from_linear(_linear(N, K, bias=True), group_size=G)
    x = torch.randn(M, K)
    q.use_kernel = False
    ref = q(x)
    q.use_kernel = True
    calls = []
    real_kernel = Int4Linear._kernel
    monkeypatch.setattr(qlinear.QuantizedLinear, "_kernel_ok", lambda self, x2d: True)
    monkeypatch.setattr(Int4Linear, "_kernel", lambda self, x2d: calls.append(1) or real_kernel(self, x2d))
    torch.testing.assert_close(q(x), ref, atol=1e-4, rtol=1e-4)
    assert calls and q.use_kernel  # the kernel ran (not the fallback after an import error)


def test_constructor_checks_in_features_against_the_padding():
    q = Int4Linear.from_linear(_linear(4, 200), group_size=64)
    Int4Linear(q.packed, q.scales, in_features=193)  # 256 - 64 < 193 <= 256
    for bad in (192, 257, 0):
        with pytest.raises(ValueError, match=f"in_features={bad} does not fit packed rows of Kp = 256"):
            Int4Linear(q.packed, q.scales, in_features=bad)
    with pytest.raises(ValueError, match="do not match"):
        Int4Linear(q.packed, q.scales[:, :3])  # 3 scales do not split 256 into equal groups


@pytest.mark.parametrize("G", [48, 0, -32, 100])
def test_group_sizes_the_kernels_cannot_read_are_still_refused(G):
    with pytest.raises(ValueError, match=f"group_size must be a positive multiple of 32.*got {G}"):
        Int4Linear.from_linear(_linear(4, 64), group_size=G)
    model = tiny_model()
    with pytest.raises(ValueError, match=rf"group_size={G} is not a positive multiple of 32.*use one of "
                                         rf"\(32, 64, 128\).*32, 64 divide every layer's K \[128, 192\]"):
        quantize_model(model, "int4", group_size=G)
    for bad in (128.0, True, "128"):
        with pytest.raises(TypeError, match="group_size must be an int"):
            quantize_model(model, "int4", group_size=bad)
        with pytest.raises(TypeError, match="group_size must be an int"):
            Int4Linear.from_linear(_linear(4, 64), group_size=bad)
    assert not is_quantized(model)


def _dequantized_reference(original: nn.Module, quantized: nn.Module) -> nn.Module:
    """A plain-PyTorch copy of `original` whose quantized layers hold nn.Parameter(dequant(W)) (N, K): the model
    computes x @ dequant(W).T with no padding anywhere."""
    ref = copy.deepcopy(original)
    for name, q in quantized_layers(quantized).items():
        ref.get_submodule(name).weight = nn.Parameter(q.dequantize(torch.float32), requires_grad=False)
    return ref


def test_tiny_model_at_group_128_pads_its_down_proj():
    original = tiny_model(seed=3)  # K = 128 (attention, gate/up) and 192 (down_proj)
    model = quantize_model(copy.deepcopy(original), "int4", group_size=128)
    layers = quantized_layers(model)
    padded = {n: (m.in_features, m.padded_in_features) for n, m in layers.items()
              if m.padded_in_features != m.in_features}
    assert padded == {f"layers.{i}.mlp.down_proj": (192, 256) for i in range(2)}
    ids = prompt_ids(batch=2, length=10)
    ref = _dequantized_reference(original, model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=1e-5, rtol=1e-5)
    dense = {n: original.get_submodule(n).weight.numel() for n in layers}
    bytes_ = sum(m.weight_bytes() for m in layers.values())
    stored = sum(m.out_features * m.padded_in_features for m in layers.values())
    assert bytes_ == stored // 2 + 4 * stored // 128 and stored > sum(dense.values())
    dequantize_model(model)  # back to (N, K) nn.Linear layers holding the rounded weights
    assert model.layers[0].mlp.down_proj.weight.shape == (128, 192)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def default_llm():
    import llmlab

    return llmlab.load(device="cpu", dtype="fp32")


def test_default_model_int4_g128_greedy_tokens_equal_the_dequantized_reference(default_llm):
    q = default_llm.quantize("int4", group_size=128)
    down = q.model.layers[0].mlp.down_proj
    assert (down.in_features, down.padded_in_features, down.group_size) == (704, 768, 128)
    assert q.name.endswith("int4 g128")
    ref = _dequantized_reference(default_llm.model, q.model)
    ids = torch.tensor([default_llm.encode("import os\nfor name in")])
    with torch.no_grad():
        torch.testing.assert_close(q.model(ids), ref(ids), atol=1e-4, rtol=1e-4)
    got = generate(q.model, ids, max_new_tokens=16).token_ids
    want = generate(ref, ids, max_new_tokens=16).token_ids
    assert got == want
    assert weight_bytes(q.model) < weight_bytes(default_llm.model)
