"""The tensor-core int4 GEMV (`llmlab/kernels/int4_mma_gemv.py`): the mma-order repacking on CPU, the kernel on a GPU.

The CPU tests check the repacking two ways: it round-trips, and a plain emulation of what the PTX does with each
lane's registers — written from the PTX ISA's fragment table for mma.m16n8k16, not from the repacking's own index
maps — gives x @ dequant(W)^T. The kernel itself (inline PTX) runs only on a GPU: the interpreter has no inline asm.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels.weight_quant import dequant_matmul_reference, dequantize_int4, quantize_int4
from llmlab.kernels.int4_mma_gemv import repack_int4_mma, unpack_int4_mma


def _packed(N, K, G=128, seed=0):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    return quantize_int4(w, G)


@pytest.mark.parametrize("N,K", [(16, 64), (48, 192), (32, 512)])
def test_repack_round_trip(N, K):
    packed, _ = _packed(N, K, G=64)
    w_mma = repack_int4_mma(packed)
    assert w_mma.shape == (N // 16, K // 64, 32, 4) and w_mma.dtype == torch.int32
    assert torch.equal(unpack_int4_mma(w_mma), packed)


def _emulate(x: torch.Tensor, w_mma: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y (N,) the way the kernel computes it, lane by lane, from the PTX ISA's m16n8k16 fragment table:
    a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9] (low half first);
    b0 = B[2t, 2t+1][n], b1 = B[2t+8, 2t+9][n]; register r of the kernel holds nibbles r (low) and r + 4 (high);
    lane t's (b0, b1) of step j are x[16t + 4j .. 16t + 4j + 4) of the chunk (low pair b0)."""
    RB, KC = w_mma.shape[:2]
    N, K = 16 * RB, 64 * KC
    G = K // scales.shape[1]
    y = torch.zeros(N, dtype=torch.float64)
    for rb in range(RB):
        for kc in range(KC):
            for j in range(4):
                A = torch.full((16, 16), float("nan"), dtype=torch.float64)
                B = torch.full((16,), float("nan"), dtype=torch.float64)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    word = int(w_mma[rb, kc, lane, j]) & 0xFFFFFFFF
                    code = [((word >> (4 * i)) & 0xF) - 8 for i in range(8)]
                    regs = [(code[r], code[r + 4]) for r in range(4)]  # (low, high) halves
                    for (row, col), (lo, hi) in zip([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)],
                                                    regs):
                        A[row, col], A[row, col + 1] = lo, hi
                    base = 64 * kc + 16 * t + 4 * j
                    B[2 * t], B[2 * t + 1], B[2 * t + 8], B[2 * t + 9] = (float(v) for v in x[base:base + 4])
                assert not A.isnan().any() and not B.isnan().any(), "every fragment slot filled exactly once"
                rows = slice(16 * rb, 16 * rb + 16)
                y[rows] += (A @ B) * scales[rows, (64 * kc) // G].double()
    return y


@pytest.mark.parametrize("N,K,G", [(16, 128, 64), (32, 256, 128)])
def test_fragment_emulation_matches_reference(N, K, G):
    packed, scales = _packed(N, K, G)
    x = torch.randn(K, generator=torch.Generator().manual_seed(1))
    y = _emulate(x, repack_int4_mma(packed), scales)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(N, K).double() - 8
    ref = (codes * scales.double().repeat_interleave(G, dim=1)) @ x.double()  # all in fp64: exact up to rounding
    torch.testing.assert_close(y, ref, atol=1e-9, rtol=1e-9)


def test_repack_rejects_bad_shapes():
    packed, _ = _packed(16, 64, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        repack_int4_mma(packed[:8])
    with pytest.raises(ValueError, match="K of 64"):
        repack_int4_mma(packed[:, :16])
    with pytest.raises(ValueError, match="uint8"):
        repack_int4_mma(packed.to(torch.int16))
    with pytest.raises(ValueError, match="int32"):
        unpack_int4_mma(packed)  # the row-major codes, not the mma order


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_refuses_cpu(dtype):
    from llmlab.kernels.int4_mma_gemv import int4_mma_gemv
    packed, scales = _packed(16, 64, 64)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):  # whatever the dtype, and not "use the interpreter"
        int4_mma_gemv(torch.randn(1, 64).to(dtype), repack_int4_mma(packed), scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel is inline PTX: it needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K,G", [(16, 64, 64), (48, 192, 64), (1008, 4096, 128), (4096, 1024, 256),
                                   (256, 14336, 128)])
def test_kernel_matches_reference(N, K, G, dtype):
    from llmlab.kernels.int4_mma_gemv import int4_mma_gemv
    packed, scales = _packed(N, K, G)
    packed, scales = packed.cuda(), scales.cuda()
    x = torch.randn(1, K, device="cuda", dtype=dtype)
    y = int4_mma_gemv(x, repack_int4_mma(packed), scales)
    ref = dequant_matmul_reference(x.float(), dequantize_int4(packed, scales))
    assert y.dtype == dtype and y.shape == (1, N)
    torch.testing.assert_close(y.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
