"""Step tuning (llmlab/kernels/step_tuning.py): the batch-1 decode GEMVs' tiles chosen by timing the whole step.

On a CPU the kernels run in Triton's interpreter (fp32) and the step's time comes from a stand-in `measure` that
reads which tiles the kernels' decode step holds; the GPU test times the real captured step.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode
from tiny_models import tiny_model

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import fused_gemv as fg  # noqa: E402
from llmlab.kernels import step_tuning  # noqa: E402
from llmlab.kernels.decode_step import GEMV_ROLES, KernelDecodeStep, attention_role  # noqa: E402
from llmlab.kernels.modules import ops, swap_in, swap_out  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TILES = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "STAGES": st}, num_warps=w)
         for n, k, st, w in [(1, 32, 1, 1), (2, 64, 2, 2), (4, 128, 1, 4), (8, 32, 3, 1)]]


@pytest.mark.parametrize("config", TILES, ids=str)
@pytest.mark.parametrize("fusion", ["norm", "residual", "swiglu_out", "swiglu"])
@pytest.mark.parametrize("K", [7, 96, 200])
def test_every_tile_computes_the_same_gemv(config, fusion, K):
    """A forced tile (as step tuning runs them) equals the unfused PyTorch ops, K not a multiple of the tile
    included (masked lanes must not leak)."""
    g = torch.Generator().manual_seed(K)
    N = 10 if fusion == "swiglu_out" else 9
    w = torch.randn(N, K, generator=g).to(DEV)
    x = torch.randn(1, 2 * K if fusion == "swiglu" else K, generator=g).to(DEV)
    kw = dict(norm_weight=torch.randn(K, generator=g).to(DEV) if fusion == "norm" else None,
              residual=torch.randn(1, N, generator=g).to(DEV) if fusion == "residual" else None,
              swiglu=fusion == "swiglu", swiglu_out=fusion == "swiglu_out")
    torch.testing.assert_close(fg.fused_gemv(x, w, config=config, **kw), fg.fused_gemv_reference(x, w, **kw),
                               atol=1e-4, rtol=1e-4)


def _tile(**kw):
    return triton.Config({"BLOCK_N": 4, "BLOCK_K": 32, "STAGES": 1, **kw})


@pytest.mark.parametrize("bad, match", [
    ({"BLOCK_N": 4}, "with BLOCK_N, BLOCK_K and STAGES"), ("BLOCK_N=4", "with BLOCK_N, BLOCK_K and STAGES"),
    (triton.Config({"BLOCK_K": 32, "STAGES": 1}), "with BLOCK_N, BLOCK_K and STAGES"),
    (_tile(PDL=True), "and nothing else"), (_tile(FOO=1), "and nothing else"),
    (_tile(BLOCK_N=3), "powers of 2"), (_tile(BLOCK_N=0), "powers of 2"), (_tile(BLOCK_K="32"), "powers of 2"),
    (_tile(STAGES=0), "STAGES >= 1"),
], ids=["dict", "str", "no-BLOCK_N", "reserved-key", "unknown-key", "BLOCK_N-3", "BLOCK_N-0", "str-BLOCK_K",
        "STAGES-0"])
def test_a_config_that_is_not_a_tile_is_refused_with_its_name(bad, match):
    x, w = torch.randn(1, 8, device=DEV), torch.randn(4, 8, device=DEV)
    with pytest.raises(TypeError, match=match):
        fg.fused_gemv(x, w, config=bad)
    assert fg.fused_gemv(x, w, config=_tile()).shape == (1, 4)  # and the next call works


def test_candidate_configs_follow_the_autotuners_pruning(monkeypatch):
    """With PDL a small weight gets only the whole-row tiles (the shortest BLOCK_K >= K), a large one only the
    streaming tiles; the swiglu_out weight counts its two rows per output. (The candidate list is the autotuner's
    full list, not the interpreter's one config.)"""
    full = fg._STREAM_CONFIGS + fg.WHOLE_ROW_CONFIGS
    monkeypatch.setattr(fg, "CONFIGS", full)
    monkeypatch.setattr(fg, "pdl_kwargs", lambda device: {"PDL": True, "launch_pdl": True})
    small = torch.empty(64, 2048, device=DEV, dtype=torch.float16)  # 256 KB: whole rows
    cands = fg.candidate_configs(small)
    assert cands and all(c in fg.WHOLE_ROW_CONFIGS or c.kwargs["BLOCK_K"] >= 2048 for c in cands)
    assert {c.kwargs["BLOCK_K"] for c in cands} == {2048}
    big = torch.empty(2048, 8192, device="meta", dtype=torch.float16)  # 32 MB: streaming tiles
    assert fg.candidate_configs(big) == fg._STREAM_CONFIGS
    monkeypatch.setattr(fg, "pdl_kwargs", lambda device: {"PDL": False})
    assert fg.candidate_configs(small) == fg._STREAM_CONFIGS  # without PDL nothing to overlap: streaming tiles


def _fake_clock(costs: dict, base: float = 1.0):
    """A stand-in for `measure_step_ms`: base + the cost of each (role, tile) the step holds now (the
    autotuner's pick, i.e. no tile, costs `costs[(role, None)]`, default 0). Records every call's tiles."""
    seen = []

    roles = set(GEMV_ROLES) | {role for role, _ in costs}

    def measure(step):
        tiles = step.tiles
        seen.append(dict(tiles))
        return base + sum(costs.get((role, str(tiles.get(role)) if role in tiles else None), 0.0) for role in roles)
    return measure, seen


@torch.no_grad()
def _greedy(step, ids, slots: int, steps: int) -> list[int]:
    """Prefill ids (1, T) into a static cache of `slots` slots, then `steps` greedy batch-1 decode steps (the fused
    path of the kernels' step, which runs its step-tuned configs): the tokens."""
    from llmlab.cache.static_cache import StaticKVCache

    cache = StaticKVCache(step.model.config, 1, slots, torch.float32, DEV)
    nxt, out, T = step(ids, kv_cache=cache)[:, -1:].argmax(-1), [], ids.shape[1]
    for s in range(steps):
        nxt = step(nxt, positions=torch.tensor([[T + s]], device=DEV), kv_cache=cache)[:, -1:].argmax(-1)
        out.append(int(nxt))
    return out


def test_the_fastest_tile_of_each_role_is_chosen_and_the_decode_is_unchanged():
    model = tiny_model(seed=6).to(DEV)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(6)).to(DEV)

    step = KernelDecodeStep(swap_in(model))

    def greedy():
        return _greedy(step, ids, 24, 6)

    try:
        before = greedy()
        cands = {role: TILES[:3] for role in GEMV_ROLES}
        cands[attention_role(step_tuning.runner_slots(model))] = []  # not this test's subject
        # each role's fastest tile is a different one; the autotuner's pick costs 0.05
        costs = {(role, None): 0.05 for role in GEMV_ROLES}
        costs.update({(role, str(t)): 0.1 for role in GEMV_ROLES for t in TILES[:3]})
        winners = {"qkv": TILES[0], "o": TILES[1], "gate_up": TILES[2], "down": TILES[0]}
        costs.update({(role, str(t)): 0.0 for role, t in winners.items()})
        measure, seen = _fake_clock(costs)
        report = step_tuning.tune_decode_step(step, measure=measure, candidates=cands, rounds=2)
        tiles = step.tiles
        assert {r: str(c) for r, c in tiles.items()} == {r: str(c) for r, c in winners.items()}
        assert {r: report[r]["chosen"] for r in report} == {r: str(c) for r, c in winners.items()}
        assert all(report[r]["current"] == "autotuner" for r in report)
        assert len(seen) == 4 * (3 + 2 * (1 + 3))  # per role: a first pass of 3, then 2 rounds of 4 finalists
        assert all(report[r]["failed"] == {} for r in report)
        assert greedy() == before  # every tile computes the same GEMV: the tokens do not move
        assert len(set(before)) >= 2
    finally:
        swap_out(model)
    assert not any("tiles" in vars(m) for m in model.modules())  # the tiles live on the step, not on the model


def test_the_autotuners_pick_stays_when_no_tile_beats_it_by_the_margin():
    model = tiny_model(seed=7).to(DEV)
    step = KernelDecodeStep(swap_in(model))
    try:
        cands = {"down": TILES[:2]}
        costs = {("down", None): 0.0, ("down", str(TILES[0])): -0.001, ("down", str(TILES[1])): 0.2}
        measure, _ = _fake_clock(costs)  # TILES[0] is 0.1% faster: under the 0.3% margin asked for
        report = step_tuning.tune_decode_step(step, measure=measure, candidates=cands, rounds=1,
                                              keep_margin=0.003)
        assert report["down"]["chosen"] == "autotuner"
        assert step.tiles == {}
        costs[("down", str(TILES[0]))] = -0.01  # now 1% faster: it is chosen
        report = step_tuning.tune_decode_step(step, measure=measure, candidates=cands, rounds=1)
        assert report["down"]["chosen"] == str(TILES[0])
    finally:
        swap_out(model)


def test_a_tile_that_fails_is_skipped_and_an_error_loses_no_state():
    model = tiny_model(seed=8).to(DEV)
    step = KernelDecodeStep(swap_in(model))
    try:
        bad = triton.Config({"BLOCK_N": 4, "BLOCK_K": 64, "STAGES": 1}, num_warps=4)

        def measure(m):
            tile = m.tiles.get("down")
            if tile is bad:
                raise RuntimeError("out of resources")  # as a launch this GPU cannot fit
            return 0.5 if tile is None else 1.0

        report = step_tuning.tune_decode_step(step, measure=measure, candidates={"down": [TILES[0], bad]})
        assert str(bad) in report["down"]["failed"] and str(bad) not in report["down"]["first_pass_ms"]
        assert report["down"]["chosen"] == "autotuner"
        step.tiles = {"o": TILES[1]}
        calls = []

        def broken(m):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt  # e.g. a notebook interrupt in the middle
            return 1.0

        with pytest.raises(KeyboardInterrupt):
            step_tuning.tune_decode_step(step, measure=broken, candidates={"down": TILES[:3]})
        assert step.tiles == {"o": TILES[1]}  # as before the call
        assert _decode_logits(step).shape == (1, 1, 256)  # still usable: a batch-1 step that reads the tiles
    finally:
        swap_out(model)


@torch.no_grad()
def _decode_logits(step):
    """One batch-1 decode step on a static cache (the fused path, which runs the chosen tiles)."""
    from llmlab.cache.static_cache import StaticKVCache

    cache = StaticKVCache(step.model.config, 1, 16, torch.float32, DEV)
    step(torch.tensor([[1, 2, 3]], device=DEV), kv_cache=cache)
    return step(torch.tensor([[4]], device=DEV), positions=torch.tensor([[3]], device=DEV), kv_cache=cache)


def test_a_failing_tile_is_never_chosen_even_when_it_was_the_current_one():
    model = tiny_model(seed=13).to(DEV)
    step = KernelDecodeStep(swap_in(model))
    try:
        def measure(m):  # TILES[1] cannot run; TILES[2] would be fastest if it could
            tile = m.tiles.get("down")
            if tile is TILES[1]:
                raise RuntimeError("out of resources")
            return {id(TILES[0]): 0.9, id(TILES[2]): 0.5}.get(id(tile), 1.0)

        report = step_tuning.tune_decode_step(step, measure=measure, candidates={"down": TILES[:3]})
        assert report["down"]["chosen"] == str(TILES[2]) and str(TILES[1]) in report["down"]["failed"]
        assert step.tiles["down"] is TILES[2]
        # tune again: TILES[2] is now the current tile and a candidate; it fails this time -> an error, no change
        def failing_current(m):
            tile = m.tiles.get("down")
            if tile is TILES[2]:
                raise RuntimeError("out of resources")
            return 1.0

        with pytest.raises(RuntimeError, match="out of resources"):
            step_tuning.tune_decode_step(step, measure=failing_current, candidates={"down": TILES[:3]})
        assert step.tiles == {"down": TILES[2]}
        assert all(isinstance(c, triton.Config) for c in step.tiles.values())
    finally:
        swap_out(model)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0, "1.0", None, True],
                         ids=["nan", "inf", "zero", "negative", "str", "None", "bool"])
def test_a_measure_that_returns_no_time_is_refused_and_nothing_changes(bad):
    model = tiny_model(seed=14).to(DEV)
    step = KernelDecodeStep(swap_in(model))
    try:
        step.tiles = {"o": TILES[1]}
        calls = []

        def measure(m):
            calls.append(1)
            return bad if len(calls) == 2 else 1.0

        with pytest.raises(ValueError, match="measure returned .* finite number > 0"):
            step_tuning.tune_decode_step(step, measure=measure, candidates={"down": TILES[:3]})
        assert step.tiles == {"o": TILES[1]}
    finally:
        swap_out(model)


@pytest.mark.parametrize("bad, err, match", [
    ({"gateup": TILES[:2]}, ValueError, "unknown role"),
    ({"attention@256": TILES[:2]}, TypeError, "must be a list of triton.Config with a split config"),
    ([TILES[0]], TypeError, "candidates must be a dict"),
    ({"down": ["junk", TILES[0]]}, TypeError, "must be a list of triton.Config"),
    ({"down": TILES[0]}, TypeError, "must be a list of triton.Config"),
], ids=["unknown-role", "gemv-tile-for-attention", "list", "junk-entry", "not-a-list"])
def test_bad_candidates_get_a_named_error(bad, err, match):
    model = tiny_model(seed=15).to(DEV)
    step = KernelDecodeStep(swap_in(model))
    try:
        with pytest.raises(err, match=match):
            step_tuning.tune_decode_step(step, measure=lambda m: 1.0, candidates=bad)
    finally:
        swap_out(model)


def _kernels_on(llm):
    """The triton_kernels switch's effect (the switch itself needs a GPU): kernel modules in, LLM.kernels set."""
    from llmlab import switches

    return switches.SWITCHES["triton_kernels"].apply(llm, True, {})


def _kernels_off(llm):
    from llmlab import switches

    return switches.SWITCHES["triton_kernels"].apply(llm, False, {})


def test_the_switch_tunes_once_restores_after_off_and_retunes_for_another_dtype(monkeypatch):
    from llmlab import switches
    from llmlab.engine import LLM

    runs = []

    def fake_tune(step, **kw):  # stands in for the GPU timing: picks TILES[0] for the down projection
        runs.append(next(step.model.parameters()).dtype)
        step.tiles = {"down": TILES[0]}
        return {"down": {"chosen": str(TILES[0])}}

    monkeypatch.setattr(step_tuning, "tune_decode_step", fake_tune)
    llm = LLM(tiny_model(seed=16).to(DEV), name="tiny")
    sw = switches.SWITCHES["step_tuning"]
    _kernels_on(llm)
    try:
        sw.apply(llm, True, {})
        assert llm.kernels.tiles == {"down": TILES[0]} and len(runs) == 1
        assert step_tuning.chosen_tiles(llm) == {"down": TILES[0]}
        assert step_tuning.tuning_report(llm)["seconds"] >= 0
        assert step_tuning.tuning_report(llm)["roles"] == {"down": {"chosen": str(TILES[0])}}
        sw.apply(llm, False, {})
        assert llm.kernels.tiles == {} and step_tuning.chosen_tiles(llm) == {}
        sw.apply(llm, True, {})
        assert llm.kernels.tiles == {"down": TILES[0]} and len(runs) == 1
        _kernels_off(llm)  # the kernels off and on again: a new step, without tiles until the switch gives them
        assert llm.kernels is None and step_tuning.chosen_tiles(llm) == {}
        _kernels_on(llm)
        assert llm.kernels.tiles == {}
        sw.apply(llm, True, {})
        assert llm.kernels.tiles == {"down": TILES[0]} and len(runs) == 1  # remembered for the model: no retune
        llm.model.half()  # other weights' dtype: the tiles were chosen for fp32 and are chosen again
        sw.apply(llm, True, {})
        assert runs == [torch.float32, torch.float16]
    finally:
        _kernels_off(llm)


def test_the_switch_keeps_the_steps_tiles_when_tuning_fails(monkeypatch):
    from llmlab import switches
    from llmlab.engine import LLM

    def interrupted(step, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(step_tuning, "tune_decode_step", interrupted)
    llm = LLM(tiny_model(seed=19).to(DEV), name="tiny")
    _kernels_on(llm)
    try:
        llm.kernels.tiles = {"o": TILES[1]}
        with pytest.raises(KeyboardInterrupt):
            switches.SWITCHES["step_tuning"].apply(llm, True, {})
        assert llm.kernels.tiles == {"o": TILES[1]}
        assert step_tuning.tuning_report(llm) is None
    finally:
        _kernels_off(llm)


def test_a_refused_switch_changes_nothing(monkeypatch):
    """Every switch's value and availability is checked before any is applied: a refusal of a later switch does
    not leave an earlier one (the Triton kernels) half-applied to the model."""
    from llmlab import switches
    from llmlab.engine import LLM
    from llmlab.kernels.modules import is_swapped

    llm = LLM(tiny_model(seed=20, attention_bias=True).to(DEV), name="tiny")
    monkeypatch.setattr(switches.SWITCHES["triton_kernels"], "available", lambda llm: (True, ""))
    with pytest.raises(ValueError, match="switch .step tuning. cannot be set to True here"):
        switches.apply_switches(llm, {"triton_kernels": True, "step_tuning": True})
    assert not is_swapped(llm.model) and llm.kernels is None


def test_models_the_fused_step_does_not_run_are_refused_by_the_switch_with_the_reason():
    ok, why = step_tuning.fusable(tiny_model(seed=17, attention_bias=True))
    assert not ok and "leave step tuning off" in why
    assert step_tuning.fusable(tiny_model(seed=17)) == (True, "")


def test_with_one_config_per_role_nothing_is_tuned_and_the_log_says_why():
    model = tiny_model(seed=21).to(DEV)
    step = KernelDecodeStep(swap_in(model))
    try:
        lines = []
        single = {role: TILES[:1] for role in GEMV_ROLES}
        single[attention_role(step_tuning.runner_slots(model))] = SPLITS[:1]
        assert step_tuning.tune_decode_step(step, measure=lambda m: 1.0, candidates=single, log=lines.append) == {}
        assert len(lines) == 1 and "nothing to choose" in lines[0]
        assert step.tiles == {}
    finally:
        swap_out(model)


def test_bad_use_gets_a_named_error():
    model = tiny_model(seed=9).to(DEV)
    with pytest.raises(ValueError, match="turn the Triton kernels on first"):
        step_tuning.tune_decode_step(model, measure=lambda m: 1.0)  # a model, not the kernels' decode step
    step = KernelDecodeStep(swap_in(model))
    try:
        if DEV == "cpu":
            with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
                step_tuning.tune_decode_step(step)
        for bad in ({"rounds": 0}, {"finalists": 0}, {"rounds": 1.5}, {"finalists": "3"}):
            with pytest.raises(ValueError, match="rounds and finalists must be whole numbers >= 1"):
                step_tuning.tune_decode_step(step, measure=lambda m: 1.0, **bad)
        for bad in ("x", float("nan"), 5, -0.1, True):
            with pytest.raises(ValueError, match=r"keep_margin must be a fraction in \[0, 1\)"):
                step_tuning.tune_decode_step(step, measure=lambda m: 1.0, keep_margin=bad)
        for bad in ({"steps": 0}, {"steps": -3}, {"context": -1}, {"steps": 2.5}):
            with pytest.raises(ValueError, match="steps must be a whole number >= 1 and context >= 0"):
                step_tuning.measure_step_ms(step, **bad)
    finally:
        swap_out(model)
    biased = tiny_model(seed=9, attention_bias=True).to(DEV)
    step = KernelDecodeStep(swap_in(biased))
    try:
        with pytest.raises(ValueError, match="does not run the fused batch-1 GEMVs.*leave step tuning off"):
            step_tuning.tune_decode_step(step, measure=lambda m: 1.0)
    finally:
        swap_out(biased)


@torch.no_grad()
def test_measuring_the_step_fits_a_short_context_and_refuses_one_too_short():
    model = tiny_model(seed=12, max_seq_len=64).to(DEV)  # shorter than the 1024-slot runner it would build
    step = KernelDecodeStep(swap_in(model))
    try:
        assert step_tuning.measure_step_ms(step, context=128, steps=4) > 0
        with pytest.raises(ValueError, match="need a context of at least 72 tokens"):
            step_tuning.measure_step_ms(step, steps=64)
    finally:
        swap_out(model)


def test_chosen_tiles_make_captured_runners_stale():
    from llmlab.runtime.cuda_graphs import RunnerCache, weights_fingerprint

    model = tiny_model(seed=10).to(DEV)
    step = KernelDecodeStep(swap_in(model))
    runners = RunnerCache()
    try:
        before = weights_fingerprint(model, step)
        runner = runners.runner_for(model, "static", 1, 32, kernels=step)
        assert runners.runner_for(model, "static", 1, 32, kernels=step) is runner
        step.tiles = {"down": TILES[0]}
        assert weights_fingerprint(model, step) != before
        assert runners.runner_for(model, "static", 1, 32, kernels=step) is not runner
    finally:
        swap_out(model)


def test_the_switch_and_rung_are_registered_and_gpu_only():
    from llmlab import ladder, switches
    from llmlab.engine import LLM

    sw = switches.SWITCHES["step_tuning"]
    assert sw.default is False and list(switches.SWITCHES).index("step_tuning") > list(switches.SWITCHES).index(
        "triton_kernels")  # applied after the kernels it tunes
    step = ladder.get_step("+step_tuning")
    assert step.settings == {"step_tuning": True} and step.gpu_only
    llm = LLM(tiny_model(seed=0), name="tiny")
    ok, why = sw.available(llm)
    if DEV == "cpu":
        assert not ok and "CUDA" in why
    with pytest.raises(ValueError, match="turn the triton_kernels switch on too"):
        sw.apply(llm, True, {})


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_tuning_the_real_step_keeps_the_greedy_tokens(weights):
    """On the GPU: the captured step timed for real (two rounds); the tiles chosen; fp32 greedy decode through the
    graphs equals the eager PyTorch decode (of the same quantized model), token for token."""
    from llmlab.quant import quantize_model
    from llmlab.runtime.fast_generate import generate_fast
    from llmlab.generate import generate

    model = tiny_model(seed=11)
    model = (quantize_model(model, weights, group_size=64) if weights else model).to("cuda")
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3)).tolist()
    ref = generate(model, prompt, max_new_tokens=40)
    step = KernelDecodeStep(swap_in(model))
    try:
        report = step_tuning.tune_decode_step(step, rounds=2)
        attention = attention_role(step_tuning.runner_slots(model))
        assert set(report) <= set(GEMV_ROLES) | {attention}
        for r in report.values():
            assert r["chosen"] in r["step_ms"] and all(t > 0 for t in r["step_ms"].values())
        got = generate_fast(model, prompt, max_new_tokens=40, mode="graphs", kernels=step)
    finally:
        swap_out(model)
    assert got.token_ids == ref.token_ids


SPLITS = [triton.Config({"BLOCK_N": n, "SPLIT_N": sn, "FUSED_MERGE": f}, num_warps=4, num_stages=2)
          for n, sn, f in [(16, 16, False), (16, 64, False), (32, 32, True)]]


@torch.no_grad()
def test_the_attention_split_config_is_chosen_for_its_cache_size_and_the_decode_is_unchanged():
    """The attention role is named by the static cache's size (`attention_role`): the tuned split config runs in
    steps on caches of that size only, and every split config computes the same attention."""
    model = tiny_model(seed=18).to(DEV)  # context 256: the timed runner has 256 slots
    role = attention_role(step_tuning.runner_slots(model))
    assert role == "attention@256"
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(18)).to(DEV)

    step = KernelDecodeStep(swap_in(model))

    def greedy(slots):
        return _greedy(step, ids, slots, 5)

    try:
        before = greedy(256)
        costs = {(role, None): 0.05, (role, str(SPLITS[0])): 0.1, (role, str(SPLITS[1])): 0.0,
                 (role, str(SPLITS[2])): 0.1}
        measure, _ = _fake_clock(costs)
        report = step_tuning.tune_decode_step(step, measure=measure, candidates={role: SPLITS}, rounds=1)
        assert report[role]["chosen"] == str(SPLITS[1])
        assert step.tiles == {role: SPLITS[1]}
        calls = []
        real = ops().rope_cache_attention  # the step's attention, RoPE inside

        def spy(*a, **kw):
            calls.append(kw.get("config"))
            return real(*a, **kw)

        ns = ops()
        ns.rope_cache_attention = spy
        try:
            assert greedy(256) == before  # the chosen split: the same tokens
            assert calls and all(c is SPLITS[1] for c in calls)
            calls.clear()
            greedy(64)  # a 64-slot cache is another size: the autotuner's pick
            assert calls and all(c is None for c in calls)
        finally:
            ns.rope_cache_attention = real
        for config in SPLITS:  # every candidate computes the same attention
            step.tiles = {role: config}
            assert greedy(256) == before
    finally:
        swap_out(model)


@pytest.mark.parametrize("bad, match", [
    (triton.Config({"BLOCK_N": 16, "SPLIT_N": 32}), "with BLOCK_N, SPLIT_N and FUSED_MERGE"),
    (triton.Config({"BLOCK_N": 16, "SPLIT_N": 32, "FUSED_MERGE": False, "PDL": True}), "and nothing else"),
    (triton.Config({"BLOCK_N": 8, "SPLIT_N": 32, "FUSED_MERGE": False}), "power of 2 >= 16"),
    (triton.Config({"BLOCK_N": 16, "SPLIT_N": 24, "FUSED_MERGE": False}), "multiple of it"),
    (triton.Config({"BLOCK_N": 16, "SPLIT_N": 32, "FUSED_MERGE": 1}), "FUSED_MERGE True or False"),
    ("BLOCK_N=16", "with BLOCK_N, SPLIT_N and FUSED_MERGE"),
], ids=["no-FUSED_MERGE", "extra-key", "BLOCK_N-8", "SPLIT_N-24", "FUSED_MERGE-int", "str"])
def test_decode_attention_refuses_a_config_that_is_not_a_split_config(bad, match):
    from llmlab.kernels.decode_attention import decode_attention

    q, k, v = torch.randn(1, 4, 16, device=DEV), torch.randn(1, 2, 50, 16, device=DEV), torch.randn(1, 2, 50, 16,
                                                                                                    device=DEV)
    with pytest.raises(TypeError, match=match):
        decode_attention(q, k, v, config=bad)
    with pytest.raises(TypeError, match="num_splits or config, not both"):
        decode_attention(q, k, v, config=SPLITS[0], num_splits=2)


@pytest.mark.parametrize("config", SPLITS, ids=str)
def test_decode_attention_with_a_given_split_config_equals_the_reference(config):
    from llmlab.kernels.decode_attention import decode_attention, decode_attention_reference

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*shape, generator=g).to(DEV) for shape in ((2, 4, 16), (2, 2, 70, 16), (2, 2, 70, 16)))
    lens = torch.tensor([70, 23], device=DEV)
    want = torch.stack([decode_attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])[0]
                        for b, n in enumerate([70, 23])])
    torch.testing.assert_close(decode_attention(q, k, v, seq_lens=lens, config=config), want, atol=1e-4, rtol=1e-4)


# -- a weight-only quantized model's step -----------------------------------------------------------------------

I8 = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st}, num_warps=w)
      for n, k, sk, st, w in [(4, 32, 1, 1, 1), (8, 64, 1, 2, 1), (16, 32, 2, 1, 2)]]


def _quantized(scheme, seed=21):
    from llmlab.quant import quantize_model

    return swap_in(quantize_model(tiny_model(seed=seed), scheme, group_size=64).to(DEV))


def test_an_int8_models_gemv_tiles_are_chosen_in_its_step_and_the_decode_is_unchanged():
    """The int8 step's GEMVs run their role's tile: the fastest of each role is chosen (a stand-in clock that
    first decodes a step with the tiles); a split tile where the RMSNorm is the prologue (q/k/v, gate/up) is
    refused before anything is timed; the greedy tokens do not move."""
    model = _quantized("int8")
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(21)).to(DEV)
    step = KernelDecodeStep(model)
    try:
        before = _greedy(step, ids, 24, 6)
        attention = attention_role(step_tuning.runner_slots(model))
        for role in ("qkv", "gate_up"):  # a split tile where the RMSNorm is the prologue: refused up front
            with pytest.raises(ValueError, match=f"candidates\\['{role}'\\] holds a split tile"):
                step_tuning.tune_decode_step(step, measure=lambda s: 1.0, candidates={role: I8})
            assert step.tiles == {}
        cands = {role: I8 if role in ("o", "down") else I8[:2] for role in GEMV_ROLES}
        cands[attention] = []
        costs = {(role, str(t)): 0.1 for role in GEMV_ROLES for t in I8}
        costs.update({(role, None): 0.05 for role in GEMV_ROLES})  # the autotuner's pick
        winners = {"qkv": I8[1], "o": I8[2], "gate_up": I8[0], "down": I8[2]}
        costs.update({(role, str(t)): 0.0 for role, t in winners.items()})
        measure, _ = _fake_clock(costs)
        # each tile really runs inside the step's GEMVs: decode one step with it before the clock reads it
        report = step_tuning.tune_decode_step(step, measure=lambda s: (_greedy(s, ids, 24, 1), measure(s))[1],
                                              candidates=cands, rounds=1)
        assert {r: str(c) for r, c in step.tiles.items()} == {r: str(c) for r, c in winners.items()}
        assert all(report[r]["failed"] == {} for r in GEMV_ROLES)
        assert _greedy(step, ids, 24, 6) == before
        # tiles of another format (a float model's) are refused by the int8 GEMVs with the fix named
        step.tiles = {"o": TILES[0]}
        with pytest.raises(TypeError, match="another weight format"):
            _greedy(step, ids, 24, 1)
    finally:
        swap_out(model)


I4 = [triton.Config({"R": r, "DEPTH": d}) for r, d in ((8, 1), (4, 2), (2, 3))]


def test_an_int4_models_gemv_configs_are_chosen_in_its_step_and_other_formats_tiles_are_refused():
    """On a CPU the int4 Gluon GEMV does not run, so no GEMV config is offered (only the attention's split is
    timed); given ones are checked (an int8 or float tile is refused by name, the tiles unchanged), and chosen
    by a stand-in clock while the greedy tokens stay the same (the Triton int4 GEMV runs the same sums)."""
    model = _quantized("int4")
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(22)).to(DEV)
    step = KernelDecodeStep(model)
    try:
        assert step_tuning.fusable(model) == (True, "")
        assert step_tuning.gemv_candidates(step) == {role: [] for role in GEMV_ROLES}
        for given in (I8[:2], TILES[:2]):  # int8- or float-shaped: refused, naming the int4 configs
            with pytest.raises(TypeError, match="R and DEPTH"):
                step_tuning.tune_decode_step(step, measure=lambda s: 1.0, candidates={"down": given})
        assert step.tiles == {}
        before = _greedy(step, ids, 24, 4)
        attention = attention_role(step_tuning.runner_slots(model))
        cands = {role: I4 for role in GEMV_ROLES}
        cands[attention] = []
        winners = {"qkv": I4[1], "o": I4[2], "gate_up": I4[0], "down": I4[2]}
        costs = {(role, str(t)): 0.1 for role in GEMV_ROLES for t in I4}
        costs.update({(role, None): 0.05 for role in GEMV_ROLES})
        costs.update({(role, str(t)): 0.0 for role, t in winners.items()})
        measure, _ = _fake_clock(costs)
        step_tuning.tune_decode_step(step, measure=lambda s: (_greedy(s, ids, 24, 1), measure(s))[1],
                                     candidates=cands, rounds=1)
        assert {r: str(c) for r, c in step.tiles.items()} == {r: str(c) for r, c in winners.items()}
        assert _greedy(step, ids, 24, 4) == before
    finally:
        swap_out(model)


def test_int8_candidates_follow_the_autotuners_pruning(monkeypatch):
    from llmlab.kernels import int8_matmul, quant_tiles

    full = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st}, num_warps=w)
            for n, k, sk, w, st in quant_tiles._GEMV1_SHAPES]
    monkeypatch.setattr(int8_matmul, "GEMV1_CONFIGS", full)
    plain = int8_matmul.candidate_configs(4096, 14336)
    normed = int8_matmul.candidate_configs(6144, 4096, rmsnorm=True)
    walking = [c for c in plain if not int8_matmul.input_stationary(c)]
    assert len(walking) == len(full) and any(c.kwargs["SPLIT_K"] > 1 for c in walking)
    assert len(plain) > len(walking)  # and the input-stationary GEMV's configs (int8_gemv.py)
    normed = [c for c in normed if not int8_matmul.input_stationary(c)]
    assert normed and all(c.kwargs["SPLIT_K"] == 1 for c in normed) and len(normed) < len(full)
    for c in plain:
        int8_matmul.check_gemv_tile(c)  # every candidate is a tile the GEMV takes
    assert not any("GLUON" in c.kwargs for c in plain)  # no Gluon GEMV here (a CPU): none of its configs
    from llmlab.kernels import int8_gemv_gluon
    monkeypatch.setattr(int8_gemv_gluon, "usable", lambda device: True)  # where it runs, its configs come too
    gluon = [c for c in int8_matmul.candidate_configs(4096, 14336, device="cuda") if "GLUON" in c.kwargs]
    assert [c.kwargs["R"] for c in gluon] == list(int8_gemv_gluon.SHAPES)


def test_the_tuning_key_names_the_weight_format():
    from llmlab.quant import quantize_model

    keys = []
    for m in (tiny_model(seed=22), quantize_model(tiny_model(seed=22), "int8"),
              quantize_model(tiny_model(seed=22), "int4", group_size=64)):
        step = KernelDecodeStep(swap_in(m.to(DEV)))
        keys.append(step_tuning.tuned_for(step))
        swap_out(m)
    assert len(set(keys)) == 3  # tiles chosen for one format are not reused for another
