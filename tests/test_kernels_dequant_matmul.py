"""Weight-only int8 (per channel) and int4 (group-wise, two per byte) matmuls against x @ dequant(W)^T.

CPU: Triton's interpreter in fp32 (TRITON_INTERPRET=1 from conftest.py); fp16/bf16 activations on a GPU only.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import dequant_matmul as dq  # noqa: E402
from llmlab.kernels.dequant_matmul import (  # noqa: E402
    dequant_matmul_reference, dequantize_int4, dequantize_int8, int4_matmul, int8_matmul, quantize_int4,
    quantize_int8)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=1e-1, rtol=2e-2)}
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float16, torch.bfloat16)]


@pytest.fixture(autouse=True)
def _quiet_large_m():
    """M > 16 warns once per process; let each test see its own warning."""
    dq._warned_large_m = False
    yield


def _w(N, K, seed=0):
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)).to(DEV)


def test_quantizers_round_trip_and_pack_two_per_byte():
    w = _w(5, 64)
    w8, s8 = quantize_int8(w)
    assert w8.dtype == torch.int8 and s8.shape == (5,)
    assert (dequantize_int8(w8, s8) - w).abs().max() <= s8.max() / 2 + 1e-6
    packed, s4 = quantize_int4(w, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32) and s4.shape == (5, 2)
    assert (dequantize_int4(packed, s4) - w).abs().max() <= s4.max() / 2 + 1e-6
    # even k in the low nibble, odd k in the high nibble
    u = torch.round(w[:, :32] / s4[:, :1]).clamp(-8, 7).to(torch.int64) + 8
    assert torch.equal(packed[:, 0].long(), u[:, 0] | (u[:, 1] << 4))


@pytest.mark.parametrize("M", [1, 3])  # 1: the CUDA-core GEMV; 3: the tensor-core tile
@pytest.mark.parametrize("N", [1, 7, 17, 999, 1001, 4095])
def test_int8_over_output_sizes(N, M):
    w8, s8 = quantize_int8(_w(N, 96, seed=N))
    x = torch.randn(M, 96, device=DEV)
    torch.testing.assert_close(int8_matmul(x, w8, s8), dequant_matmul_reference(x, dequantize_int8(w8, s8)),
                               **TOL[torch.float32])


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("K", [1, 7, 17, 999, 1001, 4095])
def test_int8_over_reduction_sizes(K, M):
    w8, s8 = quantize_int8(_w(33, K, seed=K))
    x = torch.randn(M, K, device=DEV)
    torch.testing.assert_close(int8_matmul(x, w8, s8), dequant_matmul_reference(x, dequantize_int8(w8, s8)),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, *GPU_DTYPES])
@pytest.mark.parametrize("M", [1, 2, 16, 17])
def test_int8_batch_sizes(M, dtype):
    w8, s8 = quantize_int8(_w(70, 128, seed=M))
    x = torch.randn(M, 128, device=DEV).to(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = int8_matmul(x, w8, s8)
    assert any("M = 17" in str(c.message) for c in caught) == (M == 17)
    torch.testing.assert_close(y, dequant_matmul_reference(x, dequantize_int8(w8, s8)), **TOL[dtype])


@pytest.mark.gpu
def test_int8_fp16_activations_at_k_14336_stay_finite():
    w8, s8 = quantize_int8(_w(4096, 14336) * 3)
    x = (torch.randn(4, 14336, device=DEV) * 10).half()
    y = int8_matmul(x, w8, s8)
    assert torch.isfinite(y).all()
    ref = x.float() @ dequantize_int8(w8, s8).T
    torch.testing.assert_close(y.float(), ref, atol=1e-1, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, *GPU_DTYPES])
@pytest.mark.parametrize("G", [32, 64, 96, 128, 256])  # 96: not a power of 2 (the M = 1 GEMV's group view)
@pytest.mark.parametrize("M", [1, 2, 17])
def test_int4_matches_dequantized_matmul(M, G, dtype):
    packed, s4 = quantize_int4(_w(65, 768, seed=G + M), G)  # K = 768: a multiple of every G here
    x = torch.randn(M, 768, device=DEV).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # M = 17 warns about speed; the answer must still be right
        y = int4_matmul(x, packed, s4)
    torch.testing.assert_close(y, dequant_matmul_reference(x, dequantize_int4(packed, s4)), **TOL[dtype])


@pytest.mark.parametrize("N", [1, 7, 17, 999, 1001, 4095])
def test_int4_over_output_sizes(N):
    packed, s4 = quantize_int4(_w(N, 64, seed=N), 32)
    x = torch.randn(1, 64, device=DEV)
    torch.testing.assert_close(int4_matmul(x, packed, s4), dequant_matmul_reference(x, dequantize_int4(packed, s4)),
                               **TOL[torch.float32])


def test_int8_masked_reduction_lanes_do_not_leak():
    # x is a view into a wider buffer whose tail (past K = 70) is NaN: the last K tile must mask it out
    buf = torch.full((3, 128), float("nan"), device=DEV)
    x = buf[:, :70]
    x.copy_(torch.randn(3, 70))
    w8, s8 = quantize_int8(_w(9, 70))
    y1 = int8_matmul(x[:1], w8, s8)  # M = 1: the GEMV path
    assert torch.isfinite(y1).all()
    torch.testing.assert_close(y1, dequant_matmul_reference(x[:1], dequantize_int8(w8, s8)), **TOL[torch.float32])
    w8, s8 = quantize_int8(_w(9, 70))
    y = int8_matmul(x, w8, s8)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, dequant_matmul_reference(x, dequantize_int8(w8, s8)), **TOL[torch.float32])


def test_int4_masked_output_lanes_do_not_leak():
    # N = 70: the second 64-wide tile is mostly padding; y is preallocated by the wrapper, so compare whole rows
    packed, s4 = quantize_int4(_w(70, 64), 32)
    x = torch.randn(2, 64, device=DEV)
    y = int4_matmul(x, packed, s4)
    assert y.shape == (2, 70) and torch.isfinite(y).all()


def test_group_size_that_does_not_divide_k_is_a_clear_error():
    with pytest.raises(ValueError, match=r"group_size 128 does not divide K = 320.*64"):
        quantize_int4(_w(4, 320), 128)
    packed = torch.zeros(4, 160, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="do not divide K = 320"):
        int4_matmul(torch.randn(1, 320, device=DEV), packed, torch.ones(4, 3, device=DEV))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        int4_matmul(torch.randn(1, 320, device=DEV), packed, torch.ones(4, 20, device=DEV))  # G = 16


def test_wrong_shapes_and_dtypes_are_clear_errors():
    w8, s8 = quantize_int8(_w(8, 32))
    with pytest.raises(ValueError, match=r"x must be \(M, 32\)"):
        int8_matmul(torch.randn(1, 31, device=DEV), w8, s8)
    with pytest.raises(TypeError, match="int8"):
        int8_matmul(torch.randn(1, 32, device=DEV), w8.float(), s8)
    with pytest.raises(ValueError, match="M = 0"):
        int8_matmul(torch.randn(0, 32, device=DEV), w8, s8)
    with pytest.raises(TypeError, match="uint8"):
        int4_matmul(torch.randn(1, 32, device=DEV), w8[:, :16], torch.ones(8, 1, device=DEV))


@pytest.mark.parametrize("M", [1, 3])
def test_int8_strided_scales(M):
    """Scales that are a strided view (every other element of a buffer) must be read by their values, not memory."""
    w8, s8 = quantize_int8(_w(40, 64, seed=5))
    buf = torch.zeros(80, device=DEV)
    buf[::2] = s8
    strided = buf[::2]
    x = torch.randn(M, 64, device=DEV)
    torch.testing.assert_close(int8_matmul(x, w8, strided), dequant_matmul_reference(x, dequantize_int8(w8, s8)),
                               **TOL[torch.float32])


# -- the M = 1 GEMVs: 32-bit words, every config the GPU autotuner may pick ----------------------------------------
# The interpreter runs only the default config through the wrappers, so these call the kernels' jit functions
# (`.fn`) directly with other tile shapes: runs of 1, 2 or 4 words, K tiles smaller and larger than a group, K not
# a multiple of the K tile, N not a multiple of BLOCK_N. (The interpreter ignores num_warps.)

def _int4_gemv(x, packed, s4, BLOCK_N, WORDS, BLOCK_K, STAGES=1, num_warps=4):
    import triton
    N, K = packed.shape[0], 2 * packed.shape[1]
    words = dq._as_words(packed)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    dq._int4_gemv_kernel.fn[(triton.cdiv(N, BLOCK_N),)](
        x, words, s4, y, N, K, x.stride(1), s4.stride(1), y.stride(1), dq.MAGIC_BITS, 16,
        words.stride(0), s4.stride(0),
        GROUP=K // s4.shape[1], BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, WORDS=WORDS, STAGES=STAGES, num_warps=num_warps)
    return y


def _int8_gemv(x, w8, s8, BLOCK_N, WORDS, BLOCK_K, STAGES=1, num_warps=4):
    import triton
    N, K = w8.shape
    words = dq._as_words(w8)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    dq._int8_gemv_kernel.fn[(triton.cdiv(N, BLOCK_N),)](
        x, words, s8, y, N, K, x.stride(1), y.stride(1), dq.MAGIC_BITS | 0x80, 16, words.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, WORDS=WORDS, STAGES=STAGES, num_warps=num_warps)
    return y


_TILES = [(16, 2, 2048, 1),  # the int4 default: one K tile holds all of K here
          (8, 2, 256, 3),  # K tile 256: smaller than K; a multiple of the group, or inside one
          (4, 4, 128, 1),  # runs of 4 words (32 int4 weights), K tile 128 < a group of 256
          (32, 1, 64, 1),  # runs of 1 word, K tile 64: inside every group of 64..256
          (16, 4, 1024, 2)]  # runs of 4 words, K tile 1024 > most K here


@pytest.mark.parametrize("tile", _TILES)
@pytest.mark.parametrize("G", [32, 64, 96, 128, 256])
def test_int4_gemv_configs(G, tile):
    N, K = 37, 7 * G  # N: not a multiple of BLOCK_N; K: 7 groups, a multiple of no K tile larger than a group
    packed, s4 = quantize_int4(_w(N, K, seed=G), G)
    x = torch.randn(1, K, device=DEV)
    ref = dequant_matmul_reference(x, dequantize_int4(packed, s4))
    torch.testing.assert_close(_int4_gemv(x, packed, s4, *tile), ref, **TOL[torch.float32])


@pytest.mark.parametrize("tile", _TILES)
@pytest.mark.parametrize("K", [16, 112, 1008])  # multiples of 16 (the wrapper's rule), not of the K tile
def test_int8_gemv_configs(K, tile):
    w8, s8 = quantize_int8(_w(37, K, seed=K))
    x = torch.randn(1, K, device=DEV)
    torch.testing.assert_close(_int8_gemv(x, w8, s8, *tile), dequant_matmul_reference(x, dequantize_int8(w8, s8)),
                               **TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", dq._GEMV1_SHAPES)
def test_every_autotune_config_compiles_and_matches(shape):
    """Each (BLOCK_N, WORDS, num_warps, STAGES) of the autotune list, compiled for this GPU, in bf16 at a decode-like
    shape (N not a multiple of BLOCK_N, K = 6144 not a multiple of the widest K tiles)."""
    BLOCK_N, WORDS, warps, STAGES = shape
    N, K = 1000, 6144
    x = torch.randn(1, K, device=DEV).bfloat16()
    packed, s4 = quantize_int4(_w(N, K, seed=1), 128)
    y = _int4_gemv(x, packed, s4, BLOCK_N, WORDS, 8 * WORDS * 32 * warps, STAGES, num_warps=warps)
    torch.testing.assert_close(y, dequant_matmul_reference(x, dequantize_int4(packed, s4)), **TOL[torch.bfloat16])
    w8, s8 = quantize_int8(_w(N, K, seed=2))
    y = _int8_gemv(x, w8, s8, BLOCK_N, WORDS, 4 * WORDS * 32 * warps, STAGES, num_warps=warps)
    torch.testing.assert_close(y, dequant_matmul_reference(x, dequantize_int8(w8, s8)), **TOL[torch.bfloat16])


def test_gemv_unpacks_every_code_at_every_position():
    """All 16 nibble codes at all 8 places of a word, all 256 int8 values (-128 too, which quantize_int8 never makes)
    at all 4 places: a one-hot x picks out single weights, so y must equal them exactly."""
    K = 256
    codes = torch.arange(16 * K // 2, dtype=torch.int64).view(16, K // 2)
    packed = ((codes * 7) % 256).to(torch.uint8).to(DEV)  # every byte, hence every (low, high) nibble pair
    s4 = torch.ones(16, K // 32, device=DEV)
    w8 = (torch.arange(16 * K, dtype=torch.int64).view(16, K) % 256 - 128).to(torch.int8).to(DEV)
    s8 = torch.ones(16, device=DEV)
    for k in [0, 1, 2, 3, 4, 5, 6, 7, 8, 130, 255]:
        x = torch.zeros(1, K, device=DEV)
        x[0, k] = 1.0
        assert torch.equal(int4_matmul(x, packed, s4)[0], dequantize_int4(packed, s4)[:, k])
        assert torch.equal(int8_matmul(x, w8, s8)[0], w8[:, k].float())
        for tile in [(8, 4, 256), (16, 1, 64)]:
            assert torch.equal(_int4_gemv(x, packed, s4, *tile)[0], dequantize_int4(packed, s4)[:, k])
            assert torch.equal(_int8_gemv(x, w8, s8, *tile)[0], w8[:, k].float())


def test_gemv_masked_x_tail_and_strided_x():
    # x views into wider buffers: a NaN tail past K (the last K tile must not read it) and a stride of 2
    for K in (80, 96):
        buf = torch.full((1, 2 * K + 64), float("nan"), device=DEV)
        x = buf[:, :K]
        x.copy_(torch.randn(1, K))
        xs = buf[:, ::2][:, :K]
        xs.copy_(torch.randn(1, K))
        w8, s8 = quantize_int8(_w(9, K, seed=K))
        for xx in (x, xs):
            y = int8_matmul(xx, w8, s8)
            assert torch.isfinite(y).all()
            torch.testing.assert_close(y, dequant_matmul_reference(xx, dequantize_int8(w8, s8)), **TOL[torch.float32])
        if K % 32 == 0:
            packed, s4 = quantize_int4(_w(9, K, seed=K), 32)
            for xx in (x, xs):
                y = int4_matmul(xx, packed, s4)
                assert torch.isfinite(y).all()
                torch.testing.assert_close(y, dequant_matmul_reference(xx, dequantize_int4(packed, s4)),
                                           **TOL[torch.float32])


def test_weights_that_cannot_be_read_as_words_fall_back():
    """The GEMV reads W as int32 words; where a view cannot (a row start not 4-byte aligned, K not a multiple of 4)
    or int8's K is not a multiple of 16, M = 1 takes the M <= 16 kernel, with the same answer."""
    packed, s4 = quantize_int4(_w(10, 128, seed=3), 32)
    buf = torch.zeros(10, 64 + 1, dtype=torch.uint8, device=DEV)
    shifted = buf[:, 1:]  # storage offset 1, row stride 65: no int32 view
    shifted.copy_(packed)
    assert dq._as_words(shifted) is None and dq._as_words(packed) is not None
    x = torch.randn(1, 128, device=DEV)
    torch.testing.assert_close(int4_matmul(x, shifted, s4), int4_matmul(x, packed, s4), **TOL[torch.float32])
    for K in (126, 120):  # 126: no int32 view; 120: a view, but not a multiple of 16
        w8, s8 = quantize_int8(_w(10, K, seed=4))
        assert (dq._as_words(w8) is None) == (K == 126)
        x = torch.randn(1, K, device=DEV)
        torch.testing.assert_close(int8_matmul(x, w8, s8), dequant_matmul_reference(x, dequantize_int8(w8, s8)),
                                   **TOL[torch.float32])


def test_gemv1_prune_keeps_runs_inside_groups_and_tiles_within_k():
    import triton
    cfg = lambda bk, words: triton.Config({"BLOCK_N": 16, "BLOCK_K": bk, "WORDS": words, "STAGES": 1})  # noqa: E731
    configs = [cfg(4096, 4), cfg(2048, 2), cfg(1024, 4), cfg(256, 1)]
    kept = dq._gemv1_prune(configs, {"K": 2048}, GROUP=128)
    assert [c.kwargs["BLOCK_K"] for c in kept] == [2048, 1024, 256]
    kept = dq._gemv1_prune(configs, {"K": 4096}, GROUP=16)  # runs of 4 words (32 weights) straddle groups of 16
    assert [c.kwargs["WORDS"] for c in kept] == [2, 1]
    assert dq._gemv1_prune(configs, {"K": 128}) == [configs[0]]  # int8 (no GROUP); all too wide: keep one
