"""Weight-only int8 (per channel) and int4 (group-wise, two per byte) matmuls against x @ dequant(W)^T.

CPU: Triton's interpreter in fp32 (TRITON_INTERPRET=1 from conftest.py); fp16/bf16 activations on a GPU only.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from llmlab.kernels._util import interpret_mode, tune_bench

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import int4_gemv, weight_quant  # noqa: E402
from llmlab.kernels import int4_matmul as int4_module  # noqa: E402
from llmlab.kernels import int8_matmul as int8_module  # noqa: E402
from llmlab.kernels.int4_matmul import int4_matmul  # noqa: E402
from llmlab.kernels.int8_matmul import int8_matmul  # noqa: E402
from llmlab.kernels.split_k import scratch  # noqa: E402
from llmlab.kernels.weight_quant import (  # noqa: E402
    dequant_matmul_reference, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=1e-1, rtol=2e-2)}
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float16, torch.bfloat16)]


@pytest.fixture(autouse=True)
def _quiet_large_m():
    """M > 16 warns once per process; let each test see its own warning."""
    weight_quant._warned_large_m = False
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


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantizers_refuse_weights_that_are_not_finite(bad):
    """One NaN or inf made its row's (int8) or group's (int4) scale NaN and every output reading it NaN, silently."""
    w = _w(4, 128)
    w[1, 3] = bad
    kept = w.clone()
    for quantize in (lambda **kw: quantize_int8(w, **kw), lambda **kw: quantize_int4(w, 32, **kw)):
        with pytest.raises(ValueError) as e:
            quantize(name="layers.0.mlp.down_proj.weight")
        msg = str(e.value)
        assert "the weight 'layers.0.mlp.down_proj.weight' is not finite: 1 of its 512 values is NaN or inf" in msg
        assert f"the first, {bad}, at row 1, column 3" in msg and "reload the checkpoint" in msg
        with pytest.raises(ValueError, match=r"^quantize_int[48]: the weight is not finite"):  # no name given
            quantize()
    assert torch.equal(w.isnan(), kept.isnan()) and torch.equal(w.nan_to_num(), kept.nan_to_num())  # untouched
    w[1, 3] = 0.0  # the same tensor, made finite, quantizes
    assert quantize_int8(w)[1].isfinite().all() and quantize_int4(w, 32)[1].isfinite().all()


@pytest.mark.parametrize("M", [1, 3])  # 1: the CUDA-core GEMV; 3: the tensor-core tile
@pytest.mark.parametrize("N", [1, 7, 17, 999, 1001, 4095])
def test_int8_over_output_sizes(N, M):
    w8, s8 = quantize_int8(_w(N, 96, seed=N))
    x = torch.randn(M, 96, device=DEV)
    torch.testing.assert_close(int8_matmul(x, w8, s8), dequant_matmul_reference(x, dequantize_int8(w8, s8)),
                               **TOL[torch.float32])


@pytest.mark.parametrize("M", [1, 2])
# K not a multiple of 4: the M = 1 GEMV cannot read rows as 32-bit words and the tl.dot kernel runs; 12 and 1004:
# the GEMV, with a last K tile that is part mask
@pytest.mark.parametrize("K", [1, 7, 17, 999, 1001, 4095, 12, 1004])
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


@pytest.mark.parametrize("K, group, match", [
    (128, 8, r"positive multiple of 32.*got 8; use one that divides K = 128 \(e.g. 128\)"),
    (128, 0, "positive multiple of 32"),
    (64, 128, r"group_size 128 is larger than K = 64.*e.g. 64"),
    (200, 32, r"K = 200 .* not a multiple of 32.*pad the input dimension"),
])
def test_group_sizes_the_kernels_cannot_use_are_refused_when_quantizing(K, group, match):
    """quantize_int4 refuses what int4_matmul would refuse later, with a hint that fits K."""
    with pytest.raises(ValueError, match=match):
        quantize_int4(_w(4, K), group)


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
    with pytest.raises(TypeError, match="int8_matmul: w_q must be a torch.Tensor, got list"):
        int8_matmul(torch.randn(1, 32, device=DEV), w8.tolist(), s8)
    packed, s4 = quantize_int4(_w(8, 32), 32)
    with pytest.raises(TypeError, match="int4_matmul: packed must be a torch.Tensor, got list"):
        int4_matmul(torch.randn(1, 32, device=DEV), packed.tolist(), s4)


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


# -- the M = 1 GEMVs' split-K path: every split count gives the same answer, and the counters are reset ---------

def _gemv_raw(kernel, N, K, x, w, s, **meta):
    """Launch the un-autotuned M = 1 kernel with one explicit config (the autotuner keeps one config on a CPU)."""
    import triton
    y = torch.full((1, N), float("nan"), device=DEV)  # poisoned: every element must be written
    ws, cnt = scratch(x.device, N)
    grid = (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])
    if kernel is int4_gemv._int4_gemv_kernel:  # the rows are read as 32-bit words: strides in words
        kernel.fn[grid](x, w, s, y, ws, cnt, N, K, x.stride(1), w.stride(0) // 4, s.stride(0), s.stride(1),
                        y.stride(1), ws.stride(0), GROUP=K // s.shape[1], **meta)
    else:
        kernel.fn[grid](x, w, s, y, ws, cnt, x, x, N, K, 1e-5, x.stride(1), w.stride(0) // 4, y.stride(1),
                        ws.stride(0), **meta)
    assert int(cnt.abs().sum()) == 0, "the last split of each row block must zero its counter"
    return y


@pytest.mark.parametrize("split_k", [1, 2, 3, 8])  # 3 over 4 K tiles: uneven; 8 over 4: empty splits
@pytest.mark.parametrize("N", [7, 33])
def test_gemv_split_k_equals_reference(split_k, N):
    K = 128
    x = torch.randn(1, K, device=DEV)
    w8, s8 = quantize_int8(_w(N, K, seed=N + split_k))
    packed, s4 = quantize_int4(_w(N, K, seed=N), 32)
    meta = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split_k, STAGES=1)
    for _ in range(2):  # twice: the second launch finds the counters the first one left
        y8 = _gemv_raw(int8_module._int8_gemv_kernel, N, K, x, w8, s8, **meta)
        torch.testing.assert_close(y8, dequant_matmul_reference(x, dequantize_int8(w8, s8)), **TOL[torch.float32])
        y4 = _gemv_raw(int4_gemv._int4_gemv_kernel, N, K, x, packed, s4, **meta)
        torch.testing.assert_close(y4, dequant_matmul_reference(x, dequantize_int4(packed, s4)),
                                   **TOL[torch.float32])


def test_gemv_split_k_is_deterministic_and_groups_spanning_tiles_work():
    # BLOCK_K = 32 in groups of 64: two K tiles per group, each scaled by its group's scale; the partials are added
    # in split order, so repeated launches give identical bits
    N, K = 20, 256
    x = torch.randn(1, K, device=DEV)
    packed, s4 = quantize_int4(_w(N, K, seed=5), 64)
    meta = dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=4, STAGES=1)
    y = _gemv_raw(int4_gemv._int4_gemv_kernel, N, K, x, packed, s4, **meta)
    torch.testing.assert_close(y, dequant_matmul_reference(x, dequantize_int4(packed, s4)), **TOL[torch.float32])
    assert torch.equal(y, _gemv_raw(int4_gemv._int4_gemv_kernel, N, K, x, packed, s4, **meta))


def test_split_k_only_the_last_split_stores():
    """Which split stores y is decided by the counter, not by launch order (on a GPU the splits finish in any order,
    so the test must not assume the interpreter's). Both halves are deterministic:
    1. every split's count lands far below SPLIT_K - 1 (the counter preset to -100): no split is the last, so none
       may write y — it stays NaN;
    2. only split 0 launched (grid (., 1)) with the counter preset to SPLIT_K - 1: split 0 is the last, and writes
       its own partial plus the zeroed scratch rows of the others."""
    import triton

    N, K, split_k, block_k = 37, 992, 3, 32
    x = torch.randn(1, K, device=DEV)
    w8, s8 = quantize_int8(_w(N, K, seed=9))
    ws, cnt = scratch(x.device, N)

    def launch(splits_in_grid, preset):
        y = torch.full((1, N), float("nan"), device=DEV)
        ws.zero_()
        cnt.fill_(preset)
        try:
            int8_module._int8_gemv_kernel.fn[(triton.cdiv(N, 16), splits_in_grid)](
                x, w8, s8, y, ws, cnt, x, x, N, K, 1e-5, x.stride(1), w8.stride(0) // 4, y.stride(1), ws.stride(0),
                BLOCK_N=16, BLOCK_K=block_k, SPLIT_K=split_k, STAGES=1)
        finally:
            cnt.zero_()
        return y

    assert torch.isnan(launch(split_k, -100)).all()
    k0 = triton.cdiv(triton.cdiv(K, block_k), split_k) * block_k  # split 0's K range: [0, k0)
    torch.testing.assert_close(launch(1, split_k - 1),
                               dequant_matmul_reference(x[:, :k0], dequantize_int8(w8, s8)[:, :k0]),
                               **TOL[torch.float32])


@pytest.mark.gpu
def test_tuning_bench_times_a_launch_after_a_cache_flush():
    calls = []
    out = torch.empty(1 << 20, device="cuda")
    times = tune_bench(lambda: calls.append(out.fill_(1.0)), quantiles=(0.5, 0.2, 0.8), reps=5)
    assert len(calls) == 6  # one warm-up, then one per timed rep
    assert len(times) == 3 and 0 < times[1] <= times[0] <= times[2]


def test_a_launch_stopped_part_way_leaves_no_counts_behind(monkeypatch):
    # in the interpreter the programs run one by one: stop the launch inside it (as a notebook interrupt would)
    # after some splits counted themselves; the next call must still be right
    N, K = 9, 128
    x = torch.randn(1, K, device=DEV)
    w8, s8 = quantize_int8(_w(N, K, seed=1))
    ws, cnt = scratch(x.device, N)
    real = int8_module._int8_gemv_kernel

    class Stop:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                cnt[0] += 1  # a split counted itself, then the launch stopped
                raise KeyboardInterrupt
            return launch
    monkeypatch.setattr(int8_module, "_int8_gemv_kernel", Stop())
    with pytest.raises(KeyboardInterrupt):
        int8_matmul(x, w8, s8)
    assert int(cnt.abs().sum()) == 0
    monkeypatch.setattr(int8_module, "_int8_gemv_kernel", real)
    torch.testing.assert_close(int8_matmul(x, w8, s8), dequant_matmul_reference(x, dequantize_int8(w8, s8)),
                               **TOL[torch.float32])


class _Refuse:
    """Stands in for a kernel that must not run."""
    def __getitem__(self, grid):
        raise AssertionError("this kernel should not have been launched")


@pytest.mark.parametrize("op, M", [("int8", 1), ("int4", 1), ("int4", 3)])
def test_word_aligned_rows_take_the_word_kernels_and_other_layouts_the_byte_kernel(op, M, monkeypatch):
    # int8 M = 1 and int4 M = 1: the GEMVs; int4 M = 3: the word-reading tile kernel; unaligned rows: the byte-wise
    # tl.dot kernels, which read any strides
    N, K = 24, 256
    w = _w(N, K, seed=3)
    x = torch.randn(M, K, device=DEV)
    if op == "int8":
        wq, s = quantize_int8(w)
        matmul, ref = int8_matmul, dequant_matmul_reference(x, dequantize_int8(wq, s))
        gemv, tile = (int8_module, "_int8_gemv_kernel"), (int8_module, "_int8_matmul_kernel")
    else:
        wq, s = quantize_int4(w, 64)
        matmul, ref = int4_matmul, dequant_matmul_reference(x, dequantize_int4(wq, s))
        gemv = (int4_gemv, "_int4_gemv_is_kernel") if M == 1 else (int4_module, "_int4_tile_kernel")
        tile = (int4_module, "_int4_matmul_kernel")
    with monkeypatch.context() as m:  # contiguous rows: the GEMV, never the tile kernel
        m.setattr(*tile, _Refuse())
        torch.testing.assert_close(matmul(x, wq, s), ref, **TOL[torch.float32])
    # the same weights inside a wider buffer, one byte in: rows no longer start on a 4-byte boundary
    buf = torch.zeros(N, wq.shape[1] + 1, dtype=wq.dtype, device=DEV)
    buf[:, 1:] = wq
    with monkeypatch.context() as m:
        m.setattr(*gemv, _Refuse())
        m.setattr(int4_gemv, "_int4_gemv_kernel", _Refuse())  # int4 M = 1 has two GEMVs (see the next tests)
        torch.testing.assert_close(matmul(x, buf[:, 1:], s), ref, **TOL[torch.float32])


# -- int4 at M = 1: the input-stationary GEMV (whole rows streamed past x held in registers) -------------------------

def _is_raw(N, K, x, packed, s4, R, programs):
    """Launch `_int4_gemv_is_kernel` with R rows per chunk on `programs` programs (int4_matmul: IS_R, IS_PPS of
    int4_gemv)."""
    y = torch.full((1, N), float("nan"), device=DEV)  # poisoned: every element must be written
    int4_gemv.launch_input_stationary(x, packed, s4, y, N, K, K // s4.shape[1], R=R, programs=programs, pdl=False)
    return y


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("N, programs", [(1, 1), (7, 2), (17, 3), (33, 40)])  # 40 programs: most have no chunk
def test_int4_input_stationary_gemv_every_chunking_equals_reference(R, N, programs):
    """Programs walk chunks p, p + P, ... of R rows: uneven last chunks, programs with several chunks or none."""
    K = 96  # three 32-k slots, rounded up to Q = 4: the fourth slot is masked
    packed, s4 = quantize_int4(_w(N, K, seed=N + R), 32)
    x = torch.randn(1, K, device=DEV)
    y = _is_raw(N, K, x, packed, s4, R, programs)
    torch.testing.assert_close(y, dequant_matmul_reference(x, dequantize_int4(packed, s4)), **TOL[torch.float32])


def test_int4_input_stationary_gemv_masked_slots_and_strided_x_do_not_leak():
    """x past K is NaN (the padded slot must not read it), and x may be a strided view."""
    N, K = 9, 160  # five slots, Q = 8: three masked
    packed, s4 = quantize_int4(_w(N, K, seed=11), 32)
    buf = torch.full((1, 2 * 256), float("nan"), device=DEV)
    x = buf[:, : 2 * K : 2]  # stride 2, NaN between and after
    x.copy_(torch.randn(1, K))
    y = _is_raw(N, K, x, packed, s4, R=4, programs=2)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, dequant_matmul_reference(x, dequantize_int4(packed, s4)), **TOL[torch.float32])


def test_int4_rows_longer_than_the_input_stationary_limit_take_the_k_walking_gemv(monkeypatch):
    K = int4_gemv.IS_MAX_K + 32
    packed, s4 = quantize_int4(_w(3, K, seed=2), 32)
    x = torch.randn(1, K, device=DEV)
    # on a GPU the Gluon GEMV takes every K (test_kernels_int4_gluon.py)
    monkeypatch.setattr(int4_module, "USE_GLUON", False)
    monkeypatch.setattr(int4_gemv, "_int4_gemv_is_kernel", _Refuse())
    torch.testing.assert_close(int4_matmul(x, packed, s4), dequant_matmul_reference(x, dequantize_int4(packed, s4)),
                               **TOL[torch.float32])


def test_weights_that_are_not_a_matrix_or_hold_no_k_say_so():
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.randn(32))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int4(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="K = 0"):
        int4_matmul(torch.randn(1, 0, device=DEV), torch.zeros(4, 0, dtype=torch.uint8, device=DEV),
                    torch.ones(4, 1, device=DEV))


def test_scales_that_imply_an_odd_group_size_say_so():
    packed = torch.zeros(4, 48, dtype=torch.uint8, device=DEV)  # K = 96
    with pytest.raises(ValueError, match="make groups of 3 weights, an odd size"):
        int4_matmul(torch.randn(1, 96, device=DEV), packed, torch.ones(4, 32, device=DEV))


def test_int4_rows_whose_length_is_not_a_multiple_of_32_say_pad():
    """K = 48 with one scale per row: the message is about K (pad it), not about group sizes that cannot fit."""
    packed = torch.zeros(4, 24, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match=r"K = 48 .* not a multiple of 32.*pad the input dimension"):
        int4_matmul(torch.randn(1, 48, device=DEV), packed, torch.ones(4, 1, device=DEV))


def test_unpacked_codes_passed_as_packed_name_the_two_per_byte_layout():
    codes = torch.zeros(4, 128, dtype=torch.uint8, device=DEV)  # one code per byte: K read as 256
    with pytest.raises(ValueError, match=r"\(M, 256\).*two 4-bit weights per byte"):
        int4_matmul(torch.randn(1, 128, device=DEV), codes, torch.ones(4, 4, device=DEV))


def test_weights_too_large_for_the_gemv_scales_are_refused_when_quantizing():
    """The M = 1 GEMVs lift scales by 2^32: a scale of 2^96 would overflow there (inf/NaN), so quantize refuses."""
    w = _w(4, 64)
    w[2, 5] = 7.0 * 2.0 ** 96
    with pytest.raises(ValueError, match=r"w3 up to .* scales of 2\^96"):
        quantize_int4(w, 32, name="w3")
    w[2, 5] = 7.0 * 2.0 ** 95  # below the limit: accepted, and the GEMV stays finite and right
    packed, s4 = quantize_int4(w, 32)
    for seed in range(8):
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed)).to(DEV)
        y = int4_matmul(x, packed, s4)
        deq = dequantize_int4(packed, s4)
        ref = dequant_matmul_reference(x, deq)
        assert torch.isfinite(y).all()
        # the GEMVs sum the stored codes q + 8 times x and take 8 * sum(x) away once per row: their fp32 rounding
        # is relative to sum |x| (|q| + 8) s, not to |y| (a row with one large weight among zeros cancels)
        terms = x.abs() @ (deq.abs() + 8 * s4.repeat_interleave(32, dim=1)).T
        assert bool(((y - ref).abs() <= 1e-6 * terms).all()), f"seed {seed}: {(y - ref).abs() / terms}"


@pytest.mark.parametrize("magnitude", [2.0 ** 40, 2.0 ** -55, 1.0])
def test_gemv_exact_over_the_documented_range_of_x(magnitude):
    """The M = 1 GEMVs read each field as a subnormal float and scale x by a power of two (`_field`, `_lift`):
    exact for 2^-62 <= |x| < 2^43 (the wrappers' docstrings); checked near both ends, with an x that has a mean
    (the codes' offset comes off as a multiple of x's sum), and for int4 with tiny scales too (the per-tile
    part * scale must not underflow)."""
    K = 256
    x = ((torch.randn(1, K) + 3) * magnitude).to(DEV)
    w = _w(24, K, seed=5)
    for w_scale in ([1.0, 1e-12] if magnitude != 2.0 ** 40 else [1.0]):
        w8, s8 = quantize_int8(w * w_scale)
        ref8 = dequant_matmul_reference(x.double(), dequantize_int8(w8, s8).double())
        torch.testing.assert_close(int8_matmul(x, w8, s8).double(), ref8, rtol=1e-4, atol=1e-4 * ref8.abs().max())
        packed, s4 = quantize_int4(w * w_scale, 64)
        ref4 = dequant_matmul_reference(x.double(), dequantize_int4(packed, s4).double())
        torch.testing.assert_close(int4_matmul(x, packed, s4).double(), ref4, rtol=1e-4, atol=1e-4 * ref4.abs().max())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter: expected
def test_gemv_x_past_the_range_gives_non_finite_not_a_wrong_number():
    """Past the documented range (|x| >= 2^43, bf16/fp32 only) the lifted x can overflow (it does for the field at
    bit 0, lifted the most): every output is then inf or NaN, as the docstrings say, not a plausible wrong number."""
    w8, s8 = quantize_int8(_w(8, 64))
    x = torch.randn(1, 64, device=DEV)
    x[0, 4] = 2.0 ** 44  # k = 4: byte 0 of its word
    assert not int8_matmul(x, w8, s8).isfinite().any()
