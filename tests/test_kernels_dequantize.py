"""The one-pass int8 / int4 dequantize kernels (a quantized layer's prefill) against `weight_quant`'s references.

CPU: Triton's interpreter (TRITON_INTERPRET=1 from conftest.py), fp32 and fp16 outputs; bf16 on a GPU only. The
kernels promise the reference's values EXACTLY (code x scale in fp32, rounded once), so the checks are equality.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels.dequantize import int4_dequantize, int8_dequantize  # noqa: E402
from llmlab.kernels.weight_quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,G", [(1, 32, 32), (5, 64, 32), (33, 256, 128), (70, 192, 64), (31, 288, 96)])
def test_int4_equals_the_reference(N, K, G, dtype):
    torch.manual_seed(N * K + G)
    w = torch.randn(N, K, device=DEV) * torch.rand(N, 1, device=DEV) * 4  # rows of different scales
    packed, scales = quantize_int4(w, G)
    out = int4_dequantize(packed, scales, dtype)
    assert out.dtype == dtype and out.shape == (N, K)
    assert torch.equal(out, dequantize_int4(packed, scales).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(1, 1), (7, 100), (33, 257), (64, 384)])
def test_int8_equals_the_reference(N, K, dtype):
    torch.manual_seed(N + K)
    w = torch.randn(N, K, device=DEV) * torch.rand(N, 1, device=DEV) * 4
    w_q, scales = quantize_int8(w)
    out = int8_dequantize(w_q, scales, dtype)
    assert out.dtype == dtype and out.shape == (N, K)
    assert torch.equal(out, dequantize_int8(w_q, scales).to(dtype))


def test_row_blocks_of_a_fused_weight_read_their_own_rows():
    """`llmlab.quant.fused` hands layers row views of one tensor (offset, contiguous rows): each dequantizes alone."""
    torch.manual_seed(0)
    packed, scales = quantize_int4(torch.randn(40, 64, device=DEV), 32)
    part_p, part_s = packed[16:40], scales[16:40]
    assert torch.equal(int4_dequantize(part_p, part_s, torch.float32), dequantize_int4(packed, scales)[16:40])
    w_q, s8 = quantize_int8(torch.randn(40, 64, device=DEV))
    assert torch.equal(int8_dequantize(w_q[8:], s8[8:], torch.float32), dequantize_int8(w_q, s8)[8:])


@pytest.mark.parametrize("layout", ["column-major", "every other column", "one scale broadcast"])
def test_int4_reads_scales_of_any_layout(layout):
    """Scales whose columns are not adjacent in memory (stride(1) != 1) give the reference's weights too."""
    torch.manual_seed(0)
    packed, scales = quantize_int4(torch.randn(8, 128, device=DEV), 32)  # 4 groups a row
    s = {"column-major": scales.t().contiguous().t(),
         "every other column": torch.stack([scales, torch.zeros_like(scales)], dim=-1)[..., 0],
         "one scale broadcast": scales[:, :1].expand(8, 4)}[layout]
    assert s.stride(1) != 1
    assert torch.equal(int4_dequantize(packed, s, torch.float32), dequantize_int4(packed, s))


def test_all_zero_rows_give_zeros_not_nan():
    packed, scales = quantize_int4(torch.zeros(3, 64, device=DEV), 32)
    assert torch.equal(int4_dequantize(packed, scales, torch.float32), torch.zeros(3, 64, device=DEV))
    w_q, s8 = quantize_int8(torch.zeros(3, 64, device=DEV))
    assert torch.equal(int8_dequantize(w_q, s8, torch.float32), torch.zeros(3, 64, device=DEV))


def test_bad_input_names_the_problem():
    packed, scales = quantize_int4(torch.randn(4, 64, device=DEV), 32)
    with pytest.raises(TypeError, match="packed must be torch.uint8"):
        int4_dequantize(packed.to(torch.int8), scales, torch.float32)
    with pytest.raises(TypeError, match="dtype must be one of"):
        int4_dequantize(packed, scales, torch.int32)
    with pytest.raises(ValueError, match="scales must be"):
        int4_dequantize(packed, scales[:, :1].repeat(1, 3), torch.float32)  # 3 groups do not divide K = 64
    with pytest.raises(ValueError, match="contiguous rows"):
        int4_dequantize(packed.t(), scales, torch.float32)
    w_q, s8 = quantize_int8(torch.randn(4, 64, device=DEV))
    with pytest.raises(ValueError, match=r"scales must be \(N,\)"):
        int8_dequantize(w_q, s8[:3], torch.float32)
    with pytest.raises(TypeError, match="w_q must be torch.int8"):
        int8_dequantize(w_q.to(torch.uint8), s8, torch.float32)
    if DEV == "cpu":
        with pytest.raises(TypeError, match="no bf16"):
            int8_dequantize(w_q, s8, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_layers_bf16_prefill_on_cuda_equals_its_pytorch_path(scheme):
    """64 rows on CUDA take the one-pass dequantize + F.linear; the same weight in the same dtype makes the same
    GEMM, so the output equals the PyTorch path's bit for bit."""
    from llmlab.quant.linear import Int4Linear, Int8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    q = Int8Linear.from_linear(lin) if scheme == "int8" else Int4Linear.from_linear(lin, group_size=128)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    fast = q(x)
    q.use_kernel = False
    assert torch.equal(fast, q(x))
