"""The ring int4 GEMV (llmlab/kernels/int4_gemv_ring.py): the Gluon GEMV with its chunks in flight in a shared-memory
ring filled by cp.async, run by a tile with RING=1.

CPU: its tiles are checked, a tile that cannot run is refused before a launch, and the kernel builds for Hopper with
its copies, waits and shared memory as designed (in a fresh process: this one may run Triton's interpreter). GPU: the
same bits as the register GEMV with the same R (the same math in the same order), every row written and nothing
past them, CUDA-graph replay with new inputs, strided x and scales.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from llmlab.kernels import int4_gemv_gluon as gg  # noqa: E402
from llmlab.kernels.int4_gemv_tiles import MAX_RING_BYTES, ring_bytes  # noqa: E402
from llmlab.kernels.weight_quant import dequant_matmul_reference, dequantize_int4, quantize_int4  # noqa: E402
from test_kernels_int4_gluon import _poisoned, _printed_by_fresh_process  # noqa: E402

gpu = pytest.mark.gpu


def _ring(R: int, depth: int) -> triton.Config:
    return triton.Config({"R": R, "DEPTH": depth, "RING": 1})


def test_a_ring_tile_is_checked_by_name():
    assert gg.check_config(_ring(4, 2)) == (4, 2) and gg.ring_of(_ring(4, 2))
    assert not gg.ring_of(triton.Config({"R": 4, "DEPTH": 2})) and not gg.ring_of(None)
    assert not gg.ring_of(triton.Config({"R": 4, "DEPTH": 2, "RING": 0}))
    for bad, match in [(triton.Config({"R": 4, "DEPTH": 1, "RING": 2}), "RING must be 0 or 1"),
                       (triton.Config({"R": 4, "DEPTH": 1, "RING": True}), "RING must be 0 or 1"),
                       (triton.Config({"R": 4, "DEPTH": 1, "RING": 1, "SPLITS": 2}), "SPLITS or RING, not both"),
                       (triton.Config({"R": 4, "DEPTH": 0, "RING": 1}), "DEPTH in"),
                       (triton.Config({"R": 4, "RING": 1}), "R and DEPTH")]:
        with pytest.raises(TypeError, match=match):
            gg.check_config(bad)


def test_a_ring_tile_refuses_scales_that_cp_async_cannot_copy_before_any_launch():
    """cp.async copies 4, 8 or 16 bytes: bf16 scales are refused by name (the check runs before a launch, so it
    answers on a CPU)."""
    packed, s4 = quantize_int4(torch.randn(8, 256), 128)
    x, y = torch.randn(1, 256), torch.empty(1, 8)
    with pytest.raises(ValueError, match="RING tile copies fp32 scales, got torch.bfloat16"):
        gg.int4_gemv(x, packed, s4.to(torch.bfloat16), y, {"PDL": False}, tile=_ring(8, 1))


def test_ring_bytes_counts_the_slots_and_the_deepest_ring_offered_fits_an_sm():
    # K = 14336: 16 warps, Q = 512 slots, R = 4 rows: 40 KB a slot
    assert ring_bytes(4, 512, 1) == 2 * 4 * 512 * 20 + 2 * 4 * 16 * 4
    assert ring_bytes(4, 512, 3) <= MAX_RING_BYTES < 227 * 1024


def test_the_ring_kernel_builds_for_hopper_with_its_copies_waits_and_ring():
    """Compiled for sm_90 without a GPU, with the fusions the step runs it with: 16-byte cp.async copies of the
    weights (R a chunk and thread, DEPTH + 1 sites), 4-byte ones of the scales, one group a chunk, one wait per
    turn and one after the loop, and shared memory at least the ring's (`ring_bytes`; the x prologue's layout changes take some more)."""
    if gg.GLUON_ERROR:
        pytest.skip(f"this Triton has no Gluon: {gg.GLUON_ERROR}")
    code = (
        "import triton\n"
        "from llmlab.kernels import int4_gemv_gluon as gg\n"
        "for K, pro, res in ((4096, 1, False), (14336, 2, True), (64, 0, False)):\n"
        "    R, NW, S = gg.config(K)\n"
        "    for D in (1, 3):\n"
        "        k = gg.build_offline(K, group=32, prologue=pro, residual=res,\n"
        "                             tile=triton.Config({'R': R, 'DEPTH': D, 'RING': 1}))\n"
        "        ptx = k.asm['ptx']\n"
        "        print(K, R, D, 32 * NW * S, ptx.count('cp.async.cg.shared.global'), ptx.count('cp.async.ca'),\n"
        "              ptx.count('cp.async.wait_group'), ptx.count('cp.async.commit_group'), k.metadata.shared,\n"
        "              ptx.count('fma.rn.ftz'))\n")
    rows = [[int(v) for v in ln] for ln in _printed_by_fresh_process(code)]
    assert len(rows) == 6
    for K, R, D, Q, cg, ca, waits, commits, shared, ftz in rows:
        assert cg == R * (D + 1) and ca == R * (D + 1), (K, D)  # weights 16 bytes, scales 4 bytes a row
        assert waits == 2 and commits == D + 1, (K, D)  # the loop's and the final wait; a group a chunk
        assert ring_bytes(R, Q, D) <= shared <= ring_bytes(R, Q, D) + 16 * 1024, (K, D, shared)
        assert ftz == 0  # the subnormal fields survive, as in the register kernel


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 7, 1001, 4095])
@pytest.mark.parametrize("K, G", [(32, 32), (4096, 128), (14336, 128)])
def test_the_ring_gives_the_register_gemvs_bits(N, K, G, dtype):
    """The ring changes where chunks wait, not the sums: for each DEPTH the output equals, bit for bit, the
    register GEMV's with the same R; both are within the int4 GEMV's tolerance of x @ dequant(W)^T, every row
    written and none past them."""
    torch.manual_seed(N + K)
    packed, s4 = quantize_int4(torch.randn(N, K, device="cuda"), G)
    x = torch.randn(1, K, device="cuda").to(dtype)
    R = gg.config(K)[0]
    _, want = _poisoned(N, dtype)
    gg.int4_gemv(x, packed, s4, want, {"PDL": False}, tile=triton.Config({"R": R, "DEPTH": 1}))
    ref = dequant_matmul_reference(x.float(), dequantize_int4(packed, s4))
    torch.testing.assert_close(want.float(), ref, atol=2e-2 * float(ref.abs().max()), rtol=2e-2)
    for depth in range(1, gg.MAX_DEPTH + 1):
        buf, y = _poisoned(N, dtype)
        gg.int4_gemv(x, packed, s4, y, {"PDL": False}, tile=_ring(R, depth))
        assert torch.isnan(buf[:, N:]).all(), "wrote past the last row"
        assert torch.equal(y, want), (depth, (y.float() - want.float()).abs().max())


@gpu
def test_the_ring_replays_in_a_cuda_graph_with_new_inputs_and_reads_strided_ones():
    """Captured after a warm-up: the replay reads the x it is given. x strided with NaN between its values, the
    scales transposed in memory (stride_sg > 1), the RMSNorm prologue and the residual."""
    N, K = 6144, 4096
    packed, s4 = quantize_int4(torch.randn(N, K, device="cuda"), 128)
    s_t = s4.t().contiguous().t()
    xbuf = torch.full((1, 2 * K), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = xbuf[:, ::2]
    x.copy_(torch.randn(1, K))
    nw = torch.randn(K, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
    y_ring, y_regs = (torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    args = dict(norm_weight=nw, residual=res)
    for tile, y in ((_ring(8, 2), y_ring), (triton.Config({"R": 8, "DEPTH": 1}), y_regs)):
        gg.int4_gemv(x, packed, s_t, y, {"PDL": False}, tile=tile, **args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gg.int4_gemv(x, packed, s_t, y_ring, {"PDL": False}, tile=_ring(8, 2), **args)
    x.copy_(torch.randn(1, K))
    y_ring.zero_()
    graph.replay()
    gg.int4_gemv(x, packed, s4, y_regs, {"PDL": False}, tile=triton.Config({"R": 8, "DEPTH": 1}), **args)
    torch.cuda.synchronize()
    assert torch.isfinite(y_ring).all() and torch.equal(y_ring, y_regs)
