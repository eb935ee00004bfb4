"""The int4 GEMV in Gluon (llmlab/kernels/int4_gemv_gluon.py), int4_matmul's M = 1 path on CUDA GPUs.

CPU: the interpreter does not run Gluon, so here the kernel is compiled for Hopper (sm_90) without running it: its
layout conversions that must move no data are asserted at compile time (`assert_trivial`), so a wrong layout fails
to build. GPU: its outputs against x @ dequant(W)^T and against the Triton GEMV, the fallback when it cannot build,
and CUDA-graph replay.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

from llmlab.kernels import int4_gemv_gluon as gg  # noqa: E402
from llmlab.kernels import int4_matmul as int4_module  # noqa: E402
from llmlab.kernels.int4_matmul import int4_matmul  # noqa: E402
from llmlab.kernels.weight_quant import dequant_matmul_reference, dequantize_int4, quantize_int4  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=1e-1, rtol=2e-2)}


def test_status_says_why_the_gluon_gemv_is_not_used_off_the_gpu():
    assert "not a CUDA device (cpu)" in int4_module.gluon_gemv_status("cpu")
    ok, why = gg.available(torch.device("cpu"))
    assert not ok and "CUDA" in why
    if not torch.cuda.is_available():  # asked about "cuda" on a machine without one: not "gluon"
        assert int4_module.gluon_gemv_status("cuda") != "gluon"
        assert gg.available(torch.device("cuda")) == (False, "no CUDA GPU is available")


def _printed_by_fresh_process(code: str) -> list[list[str]]:
    """Run `code` in a fresh Python without Triton's interpreter (this process runs it, and an interpreted Triton
    cannot compile); its printed lines, split on whitespace. Fails the test with its stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [ln.split() for ln in out.stdout.splitlines() if ln.strip()]


def test_the_kernel_builds_for_hopper_with_its_layouts_lined_up():
    """Compiled (no GPU needed) at each config `config(K)` picks: one warp at K = 64 (Q = 32 slots, 30 masked), R = 8
    rows per chunk at K = 4096, R = 4 and 16 warps at K = 14336 (448 slots padded to 512). In a fresh process:
    this one runs Triton's interpreter, which cannot compile."""
    if gg.GLUON_ERROR:
        pytest.skip(f"this Triton has no Gluon: {gg.GLUON_ERROR}")
    code = (
        "from llmlab.kernels import int4_gemv_gluon as gg\n"
        "for K in (64, 4096, 14336):\n"
        "    R, NW, S = gg.config(K)\n"
        "    ptx = gg.build_offline(K, group=32).asm['ptx']\n"
        "    print(K, R, NW, S, ptx.count('fma.rn.f32'), ptx.count('fma.rn.ftz'), ptx.count('bar.sync'),\n"
        "          ptx.count('ld.global.v4.b32'))\n")
    lines = _printed_by_fresh_process(code)
    assert [ln[:4] for ln in lines] == [["64", "8", "1", "1"], ["4096", "8", "4", "1"], ["14336", "4", "16", "1"]]
    for K, R, NW, S, fma, ftz, bars, v4 in lines:
        assert int(fma) >= 8 * 4 * int(R)  # 8 codes x 4 words x R rows per chunk, at least
        assert int(ftz) == 0  # subnormal fields must survive the FMAs (see packed_fields `field_f32`)
        assert int(bars) >= 1  # the cross-warp step's barrier
        assert int(v4) >= 2 * int(R)  # each row's weights in one 16-byte load per thread (first chunk + loop)


def test_the_kernel_builds_with_the_small_ops_inside():
    """The fused variants `fused_quant_gemv` launches compile for Hopper: the RMSNorm prologue (a square root for
    rstd), the SwiGLU prologue (an exponential for the sigmoid) and the residual epilogue (a second bf16 load
    stream). In a fresh process, as above."""
    if gg.GLUON_ERROR:
        pytest.skip(f"this Triton has no Gluon: {gg.GLUON_ERROR}")
    code = (
        "from llmlab.kernels import int4_gemv_gluon as gg\n"
        "for K, pro, res in ((4096, 1, False), (4096, 0, True), (14336, 2, True), (4096, 0, False)):\n"
        "    ptx = gg.build_offline(K, group=128, prologue=pro, residual=res).asm['ptx']\n"
        "    print(pro, int(res), int('sqrt' in ptx), int('ex2' in ptx), ptx.count('ld.global'))\n")
    rows = [[int(v) for v in ln] for ln in _printed_by_fresh_process(code)]
    (_, _, norm_sqrt, norm_exp, _), (_, _, res_sqrt, res_exp, res_loads), (_, _, _, glu_exp, _), plain = rows
    assert norm_sqrt and not norm_exp and glu_exp and not res_sqrt and not res_exp
    assert not plain[2] and not plain[3] and res_loads > plain[4]


gpu = pytest.mark.gpu


def _poisoned(N, dtype, pad=5):
    """y (1, N) inside a NaN-filled buffer with `pad` columns after it: every y must be written, no pad touched."""
    buf = torch.full((1, N + pad), float("nan"), device="cuda", dtype=dtype)
    return buf, buf[:, :N]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 7, 17, 999, 1001, 4095])
@pytest.mark.parametrize("K, G", [(32, 32), (96, 32), (4096, 128), (8192, 64), (14336, 256)])
def test_gluon_gemv_equals_reference(N, K, G, dtype):
    torch.manual_seed(N + K)
    packed, s4 = quantize_int4(torch.randn(N, K, device="cuda"), G)
    x = torch.randn(1, K, device="cuda").to(dtype)
    buf, y = _poisoned(N, dtype)
    gg.int4_gemv(x, packed, s4, y, {"PDL": False})
    ref = dequant_matmul_reference(x.float(), dequantize_int4(packed, s4))
    assert torch.isnan(buf[:, N:]).all(), "wrote past the last row"
    # fp32: sums of K products in another order, and the codes' offset of 8 taken off as 8 x sum(x) (see
    # int4_gemv `_int4_word_sums`) cancels; measured on the H200 <= 4e-7 of the largest |y| at K = 14336, so the
    # bound is set against max |y|, not each y
    tol = dict(TOL[dtype], atol=1e-5 * float(ref.abs().max())) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(y.float(), ref, **tol)


@gpu
def test_int4_matmul_runs_the_gluon_gemv_at_batch_1_and_matches_the_triton_one(monkeypatch):
    assert int4_module.gluon_gemv_status("cuda") == "gluon"
    N, K = 4096, 4096
    packed, s4 = quantize_int4(torch.randn(N, K, device="cuda"), 128)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = gg.int4_gemv
    monkeypatch.setattr(gg, "int4_gemv", lambda *a: calls.append(1) or real(*a))
    y = int4_matmul(x, packed, s4)
    assert calls, "int4_matmul did not run the Gluon GEMV"
    monkeypatch.setattr(int4_module, "USE_GLUON", False)
    y_triton = int4_matmul(x, packed, s4)
    assert len(calls) == 1
    # the same sums in another order, each rounded to bf16 once
    torch.testing.assert_close(y.float(), y_triton.float(), atol=2e-2 * float(y_triton.abs().max()), rtol=1e-2)


@gpu
def test_a_gluon_gemv_that_cannot_build_warns_once_and_the_triton_gemv_answers(monkeypatch):
    packed, s4 = quantize_int4(torch.randn(64, 256, device="cuda"), 64)
    x = torch.randn(1, 256, device="cuda")
    ref = dequant_matmul_reference(x, dequantize_int4(packed, s4))

    def broken(*args):
        raise RuntimeError("gluon API moved")

    monkeypatch.setattr(gg, "int4_gemv", broken)
    monkeypatch.setattr(int4_module, "_GLUON_OFF", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1 = int4_matmul(x, packed, s4)
        y2 = int4_matmul(x, packed, s4)
    assert sum("gluon API moved" in str(c.message) and "64 x 256" in str(c.message) for c in caught) == 1
    for name in (x.device, "cuda"):  # the GPU however it is named ("cuda" is the current one)
        assert "failed to build or run" in int4_module.gluon_gemv_status(name)
    for y in (y1, y2):
        torch.testing.assert_close(y, ref, **TOL[torch.float32])


@gpu
def test_gluon_gemv_replays_in_a_cuda_graph():
    """Compiled at the first (warm-up) call, then captured: the replay reads the x it is given."""
    packed, s4 = quantize_int4(torch.randn(6144, 4096, device="cuda"), 128)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    int4_matmul(x, packed, s4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int4_matmul(x, packed, s4)
    x.copy_(torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(y.float(), dequant_matmul_reference(x.float(), dequantize_int4(packed, s4)),
                               **TOL[torch.bfloat16])


@gpu
def test_rows_longer_than_max_k_take_the_k_walking_gemv(monkeypatch):
    """Past MAX_K each thread would hold several slots (spills, never timed): int4_matmul keeps the Triton GEMV."""
    K = gg.MAX_K + 32
    packed, s4 = quantize_int4(torch.randn(40, K, device="cuda"), 32)
    x = torch.randn(1, K, device="cuda")

    def refuse(*args):
        raise AssertionError("the Gluon GEMV ran past MAX_K")

    monkeypatch.setattr(gg, "int4_gemv", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either: it was never tried
        y = int4_matmul(x, packed, s4)
    ref = dequant_matmul_reference(x, dequantize_int4(packed, s4))
    torch.testing.assert_close(y, ref, **dict(TOL[torch.float32], atol=1e-5 * float(ref.abs().max())))


@gpu
def test_gluon_gemv_reads_strided_x_sliced_weights_and_other_scale_layouts():
    """x a strided view with NaN between and after its values; packed a column slice of a wider buffer (4-byte but
    not 16-byte aligned rows); scales transposed in memory, then in bf16."""
    N, K, G = 300, 4096, 128
    packed, s4 = quantize_int4(torch.randn(N, K, device="cuda"), G)
    xbuf = torch.full((1, 2 * K + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = xbuf[:, : 2 * K : 2]
    x.copy_(torch.randn(1, K))
    wide = torch.zeros(N, K // 2 + 4, dtype=torch.uint8, device="cuda")
    wide[:, 4:] = packed
    for w, s in ((packed, s4), (wide[:, 4:], s4), (packed, s4.t().contiguous().t()),
                 (packed, s4.to(torch.bfloat16))):
        buf, y = _poisoned(N, torch.bfloat16)
        gg.int4_gemv(x, w, s, y, {"PDL": False})
        ref = dequant_matmul_reference(x.float(), dequantize_int4(packed, s.float()))
        assert torch.isnan(buf[:, N:]).all() and torch.isfinite(y).all()
        torch.testing.assert_close(y.float(), ref, **TOL[torch.bfloat16])


def test_a_config_is_r_and_depth_and_anything_else_is_refused_by_name():
    assert gg.check_config(triton.Config({"R": 4, "DEPTH": 2})) == (4, 2)
    assert gg.check_config(triton.Config({"R": 4, "DEPTH": 1}, maxnreg=88)) == (4, 1)
    for bad, match in [({"R": 4, "DEPTH": 2}, "triton.Config with R and DEPTH"),
                       (triton.Config({"R": 4, "PPS": 2}), "another weight format"),
                       (triton.Config({"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 1, "STAGES": 1}), "R and DEPTH"),
                       (triton.Config({"R": 3, "DEPTH": 1}), "power of 2"),
                       (triton.Config({"R": 64, "DEPTH": 1}), "1..32"),
                       (triton.Config({"R": 4, "DEPTH": gg.MAX_DEPTH + 1}), "DEPTH in"),
                       (triton.Config({"R": 4, "DEPTH": True}), "DEPTH"),
                       (triton.Config({"R": 4, "DEPTH": 1}, maxnreg=16), "maxnreg must be None or an int in 32"),
                       (triton.Config({"R": 4, "DEPTH": 1}, maxnreg=88.0), "maxnreg"),
                       (triton.Config({"R": 4, "DEPTH": 1, "SPLITS": 3}), "SPLITS must be a power of 2"),
                       (triton.Config({"R": 4, "DEPTH": 1, "SPLITS": 16}), "SPLITS must be a power of 2 in 1..8"),
                       (triton.Config({"R": 4, "DEPTH": 1, "SPLITS": True}), "SPLITS"),
                       (triton.Config({"R": 4, "DEPTH": 1, "SPLIT_K": 2}), "R and DEPTH")]:
        with pytest.raises(TypeError, match=match):
            gg.check_config(bad)
    split = triton.Config({"R": 8, "DEPTH": 1, "SPLITS": 4})
    assert gg.check_config(split) == (8, 1) and gg.splits_of(split) == 4
    assert gg.splits_of(triton.Config({"R": 8, "DEPTH": 1})) == 1


def test_a_split_tile_that_does_not_fit_the_layer_is_refused_before_any_launch():
    """SPLITS needs whole scale groups in each split and no RMSNorm prologue (its rstd is over the whole row). The
    check runs before the scratch or a launch, so it answers on a CPU."""
    N, K, G = 8, 1024, 128
    packed, s4 = quantize_int4(torch.randn(N, K), G)
    x, y = torch.randn(1, K), torch.empty(1, N)
    tile = triton.Config({"R": 4, "DEPTH": 1, "SPLITS": 8})  # 128 weights a split: whole groups, but the RMSNorm
    with pytest.raises(ValueError, match="SPLITS=8 does not fit.*RMSNorm"):
        gg.int4_gemv(x, packed, s4, y, {"PDL": False}, norm_weight=torch.ones(K), tile=tile)
    packed, s4 = quantize_int4(torch.randn(N, K), 256)  # 128 weights a split: half a group
    with pytest.raises(ValueError, match="whole groups of 256"):
        gg.int4_gemv(x, packed, s4, y, {"PDL": False}, tile=tile)


def test_candidate_configs_start_with_the_default_fit_the_register_budget_and_need_the_gluon_gemv(monkeypatch):
    assert gg.candidate_configs(4096, "cpu") == []  # no Gluon GEMV on a CPU: nothing to time
    monkeypatch.setattr(int4_module, "gluon_gemv_status", lambda device: "gluon")
    monkeypatch.delenv("LLMLAB_TRITON_AUTOTUNE", raising=False)
    from llmlab.kernels import _util
    monkeypatch.setattr(_util, "interpret_mode", lambda: False)
    for K in (4096, 14336):
        cands = gg.candidate_configs(K, "cpu")
        R, NW, S = gg.config(K)
        assert cands[0].kwargs == {"R": R, "DEPTH": 1} and len(cands) > 3
        assert len({str(c) for c in cands}) == len(cands)
        for c in cands:
            r, d = gg.check_config(c)
            _, nw, s = gg.config(K // gg.splits_of(c))  # a split's programs are sized for their share of the row
            assert (d + 1) * r * 4 * s <= gg.MAX_AHEAD_WORDS and c.num_warps == nw
        capped = [c for c in cands if c.maxnreg]
        split = [(c.kwargs["SPLITS"], c.kwargs["R"], c.num_warps) for c in cands if "SPLITS" in c.kwargs]
        if NW == 16:  # one program an SM: one capped default, leaving a 4-warp program of 144 registers its room
            assert [(c.kwargs, c.maxnreg) for c in capped] == [({"R": R, "DEPTH": 1}, 88)]
            assert 65536 - 88 * 32 * NW >= gg.NEXT_PROGRAM_REGS > 65536 - 96 * 32 * NW
            # and split-K: halves in 8-warp programs, quarters in 4-warp ones (several programs an SM)
            assert split == [(2, 4, 8), (4, 8, 4)]
        else:
            assert capped == [] and split == []
    assert gg.candidate_configs(gg.MAX_K + 32, "cpu") == [] and gg.candidate_configs(100, "cpu") == []
    monkeypatch.setattr(_util, "interpret_mode", lambda: True)  # autotuning off: the default alone
    assert [c.kwargs for c in gg.candidate_configs(4096, "cpu")] == [{"R": 8, "DEPTH": 1}]


def test_every_candidate_config_builds_for_hopper_with_more_loads_in_flight_as_depth_grows():
    """Each config step tuning may time compiles (in a fresh process, as above) with the fusions the step runs it
    with; a deeper config requests its extra chunks before the loop, so it has more 16-byte load sites."""
    if gg.GLUON_ERROR:
        pytest.skip(f"this Triton has no Gluon: {gg.GLUON_ERROR}")
    code = (
        "from llmlab.kernels import int4_gemv_gluon as gg, int4_matmul, _util\n"
        "int4_matmul.gluon_gemv_status = lambda d: 'gluon'\n"
        "_util.interpret_mode = lambda: False\n"
        "for K, pro, res in ((4096, 1, False), (14336, 2, True)):\n"
        "    for c in gg.candidate_configs(K, 'cpu'):\n"
        "        ptx = gg.build_offline(K, group=128, prologue=pro, residual=res, tile=c).asm['ptx']\n"
        "        print(K, c.kwargs['R'], c.kwargs['DEPTH'], ptx.count('ld.global.v4.b32'), c.maxnreg or 0,\n"
        "              ptx.count(f'.maxnreg {c.maxnreg}'), gg.splits_of(c), ptx.count('atom.global.gpu.acq_rel'),\n"
        "              ptx.count('ld.global.cg'))\n")
    rows = [[int(v) for v in ln] for ln in _printed_by_fresh_process(code)]
    assert {K for K, *_ in rows} == {4096, 14336} and len(rows) >= 8
    assert [(K, cap, n) for K, _, _, _, cap, n, *_ in rows if cap] == [(14336, 88, 1)]  # the cap reaches ptxas
    loads = {(K, R, D): n for K, R, D, n, cap, _, splits, _, _ in rows if not cap and splits == 1}
    for (K, R, D), n in loads.items():
        if (K, R, D + 1) in loads:
            assert loads[(K, R, D + 1)] > n, (K, R, D)
    # whole rows count nothing; a split program counts itself done on its chunks and zeroes their counters (two
    # acq_rel atomics), and reads every split's partial rows from L2
    for K, R, D, n, cap, _, splits, atomics, cg in rows:
        assert atomics == (0 if splits == 1 else 2) and (cg == 0 if splits == 1 else cg >= splits), (K, R, D, splits)
    assert sorted(splits for *_, splits, _, _ in rows if splits > 1) == [2, 4]


@gpu
@pytest.mark.parametrize("K, prologue", [(4096, "rmsnorm"), (14336, "swiglu")])
def test_every_candidate_config_computes_the_same_gemv(monkeypatch, K, prologue):
    """Each config step tuning may choose, with the fusion the decode step runs it with, against the unfused ops;
    N = 1001 leaves a partial last chunk for every R. (All of them, also where the GPU tests run with autotuning
    off.)"""
    monkeypatch.delenv("LLMLAB_TRITON_AUTOTUNE", raising=False)
    from llmlab.kernels.fused_quant_gemv import fused_quant_gemv, fused_quant_gemv_reference
    from tiny_models import one_token_inputs, quantized_layer

    N = 1001
    layer = quantized_layer("int4", N, K, 128, 3, False, device="cuda")
    x, nw, res = (t.to(torch.bfloat16) for t in one_token_inputs(N, K, prologue == "swiglu", 4, device="cuda"))
    args = dict(norm_weight=nw if prologue == "rmsnorm" else None, swiglu=prologue == "swiglu", residual=res)
    want = fused_quant_gemv_reference(x, layer, **args).float()
    cands = gg.candidate_configs(K, "cuda")
    assert len(cands) > 1
    for c in cands:
        got = fused_quant_gemv(x, layer, config=c, **args).float()
        torch.testing.assert_close(got, want, atol=2e-2 * float(want.abs().max()), rtol=2e-2, msg=str(c))


def test_a_failing_config_raises_and_leaves_the_gluon_gemv_on(monkeypatch):
    """A config being tried (step tuning) that fails to build raises, so the tuning records it as failed; the
    Gluon GEMV stays on for the other configs. Without a config the failure turns it off, with a warning, and the
    Triton GEMV answers. (Stand-ins for the GPU's Gluon GEMV: runs on a CPU.)"""
    from llmlab.kernels.fused_quant_gemv import fused_quant_gemv, fused_quant_gemv_reference
    from tiny_models import one_token_inputs, quantized_layer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = quantized_layer("int4", 24, 128, 32, 1, False, device=dev)
    x, _, _ = one_token_inputs(24, 128, False, 2, device=dev)

    def broken(*args, **kwargs):
        raise RuntimeError("out of registers")

    monkeypatch.setattr(int4_module, "_gluon_gemv", lambda device: True)
    monkeypatch.setattr(int4_module, "_GLUON_OFF", {})
    monkeypatch.setattr(gg, "int4_gemv", broken)
    with pytest.raises(RuntimeError, match="out of registers"):
        fused_quant_gemv(x, layer, config=triton.Config({"R": 2, "DEPTH": 3}))
    assert int4_module._GLUON_OFF == {}  # still on for the other configs
    if dev == "cpu":  # the Triton GEMV can answer in the interpreter
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fused_quant_gemv(x, layer)
        assert any("out of registers" in str(c.message) for c in caught) and int4_module._GLUON_OFF
        torch.testing.assert_close(got, fused_quant_gemv_reference(x, layer), atol=1e-4, rtol=1e-4)


@gpu
@pytest.mark.parametrize("splits, R", [(2, 4), (4, 8), (4, 4)])
def test_split_k_tiles_equal_whole_rows_every_launch_and_under_graph_replay(splits, R):
    """The split-K tiles (the down projection's shape, SwiGLU prologue and residual): every row written once, no
    pad touched, the same numbers as whole rows within the bf16 rounding of the output, the SAME bits on every
    launch (the last split adds the partials in split order, and zeroes the counters it used: a launch that left
    one behind would break the next), also when launched from a captured CUDA graph with new inputs. N = 1001
    leaves a partial last chunk."""
    from llmlab.kernels.fused_quant_gemv import fused_quant_gemv_reference
    from tiny_models import one_token_inputs, quantized_layer

    N, K = 1001, 14336
    layer = quantized_layer("int4", N, K, 128, 5, False, device="cuda")
    x, _, res = (t.to(torch.bfloat16).view(1, -1) for t in one_token_inputs(N, K, True, 6, device="cuda"))
    tile = triton.Config({"R": R, "DEPTH": 1, "SPLITS": splits})

    def run(x_in, out):
        gg.int4_gemv(x_in, layer.packed, layer.scales, out, {"PDL": False}, swiglu=True, residual=res, tile=tile)

    buf, y = _poisoned(N, torch.bfloat16)
    run(x, y)
    want = fused_quant_gemv_reference(x, layer, swiglu=True, residual=res).float()
    assert torch.isnan(buf[:, N:]).all() and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)
    whole = torch.empty_like(y)
    gg.int4_gemv(x, layer.packed, layer.scales, whole, {"PDL": False}, swiglu=True, residual=res)
    torch.testing.assert_close(y.float(), whole.float(), atol=1e-2 * float(whole.abs().max()), rtol=1e-2)
    first = y.clone()
    for _ in range(3):
        y.fill_(float("nan"))
        run(x, y)
        assert torch.equal(y, first)
    x2 = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(x2, y)
    for seed in (7, 8):
        x2.copy_(one_token_inputs(N, K, True, seed, device="cuda")[0].to(torch.bfloat16).view(1, -1))
        y.fill_(float("nan"))
        graph.replay()
        want = fused_quant_gemv_reference(x2, layer, swiglu=True, residual=res).float()
        torch.testing.assert_close(y.float(), want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)
