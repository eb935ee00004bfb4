"""The optimization ladder: registration, accumulation of settings, skipping with reasons, and the tour reading it."""

from __future__ import annotations

import re

import pytest

from llmlab import ladder, switches
from llmlab.engine import LLM
from llmlab.ladder import LadderStep, available_steps, get_step, register_step, step_names
from llmlab.switches import Switch
from llmlab.tour import run_tour, tour_settings
from tiny_models import tiny_model

# the rungs a CPU runs: the GPU-only ones (CUDA graphs, kernels, ...) are skipped with their reason
CPU_RUNGS = ["no_kv_cache", "eager", "+int8", "+int4", "+one_at_a_time", "+static_batching", "+continuous_batching"]


@pytest.fixture
def registry():
    """Restore the ladder and the switches after a test that registers its own."""
    saved_ladder, saved_switches = list(ladder.LADDER), dict(switches.SWITCHES)
    yield
    ladder.LADDER[:] = saved_ladder
    switches.SWITCHES.clear()
    switches.SWITCHES.update(saved_switches)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model(seed=0), name="tiny")


def _flag(key: str, available=lambda llm: (True, "")) -> Switch:
    return Switch(key, key.title(), False, "a test switch", lambda llm, v, kw: kw.update({key: v}) or llm,
                  available=available)


def test_the_ladder_starts_without_then_with_the_cache():
    names = step_names()
    assert names[:2] == ["no_kv_cache", "eager"]
    for n in ("+cuda_graphs", "+torch_compile"):
        assert n in names
    assert get_step("no_kv_cache").settings == {"kv_cache": False}
    assert get_step("eager").label == "KV cache"
    with pytest.raises(ValueError, match="unknown ladder step 'nope'.*eager"):
        get_step("nope")


def test_the_prefill_graph_rung_sits_above_the_decode_graphs_and_keeps_them(llm):
    names = step_names()
    assert names.index("+prefill_graphs") > names.index("+cuda_graphs")
    step = get_step("+prefill_graphs")
    assert step.settings == {"prefill_graphs": True} and step.cumulative and step.gpu_only
    assert switches.SWITCHES["prefill_graphs"].default is False
    with pytest.raises(ValueError, match="cannot be set to True here: needs a CUDA GPU"):
        switches.apply_switches(llm, {"prefill_graphs": True})
    # on a GPU: without the decode graphs it is refused when the switches are applied, not later in generate
    with pytest.raises(ValueError, match="turn the cuda_graphs switch on too"):
        switches.SWITCHES["prefill_graphs"].apply(llm, True, {"gpu_sampling": True})
    kwargs = {"cuda_graphs": True}
    assert switches.SWITCHES["prefill_graphs"].apply(llm, True, kwargs) is llm
    assert kwargs == {"cuda_graphs": True, "prefill_graphs": True}
    assert switches.SWITCHES["prefill_graphs"].apply(llm, False, {}) is llm


def test_cpu_runs_the_bottom_rungs_and_says_why_it_skips_the_rest(llm):
    runnable, skipped = available_steps(llm)
    # the weight-only quantized rungs and the batching rungs run on a CPU too, on top of eager
    assert [r.name for r in runnable] == CPU_RUNGS
    assert runnable[1].settings == {"kv_cache": True}
    assert runnable[3].settings == {"kv_cache": True, "weights": "int4"}
    assert runnable[6].settings["batching"] == "continuous" and not runnable[6].settings.get("cuda_graphs")
    assert {s.name for s, _ in skipped} == set(step_names()) - set(CPU_RUNGS)
    for step, why in skipped:
        assert why, f"{step.name} is skipped without a reason"
    reasons = dict((s.name, why) for s, why in skipped)
    assert "GPU" in reasons["+cuda_graphs"] or "CUDA" in reasons["+cuda_graphs"] or "not registered" in \
        reasons["+cuda_graphs"]


def test_settings_accumulate_and_a_skipped_rung_adds_nothing(llm, registry):
    switches.register(_flag("fast_a"))
    switches.register(_flag("fast_b", available=lambda llm: (False, "needs a unicorn")))
    switches.register(_flag("fast_c"))
    register_step(LadderStep("+a", {"fast_a": True}, "a"))
    register_step(LadderStep("+b", {"fast_b": True}, "b"))
    register_step(LadderStep("+c", {"fast_c": True}, "c"))
    runnable, skipped = available_steps(llm)
    by_name = {r.name: r.settings for r in runnable}
    assert by_name["+a"] == {"kv_cache": True, "fast_a": True}
    assert by_name["+c"] == {"kv_cache": True, "fast_a": True, "fast_c": True}  # +b was skipped: not carried
    assert ("+b", "Fast_B: needs a unicorn") in [(s.name, why) for s, why in skipped]
    # asking for one rung still accumulates the rungs below it
    only, _ = available_steps(llm, ["+c"])
    assert [r.name for r in only] == ["+c"] and only[0].settings == by_name["+c"]


def test_a_rung_whose_switch_is_not_registered_is_skipped(llm, registry):
    register_step(LadderStep("+int3", {"int3_weights": True}, "three-bit weights", weights="int3",
                             weight_bytes_per_param=0.375))
    _, skipped = available_steps(llm)
    why = dict((s.name, w) for s, w in skipped)["+int3"]
    assert "'int3_weights' is not registered" in why


def test_register_step_places_and_replaces(registry):
    register_step(LadderStep("+x", {}, "x"), after="eager")
    assert step_names()[2] == "+x"
    register_step(LadderStep("+y", {}, "y"), before="no_kv_cache")
    assert step_names()[0] == "+y"
    register_step(LadderStep("+x", {"kv_cache": True}, "x again"))  # replaces in place
    assert step_names()[3] == "+x" and get_step("+x").note == "x again"
    with pytest.raises(ValueError, match="no ladder step named 'nope'"):
        register_step(LadderStep("+z", {}), after="nope")
    with pytest.raises(ValueError, match="not both"):
        register_step(LadderStep("+z", {}), after="eager", before="eager")


def test_unknown_step_names_are_an_error(llm):
    with pytest.raises(ValueError, match="unknown ladder step 'fast'"):
        available_steps(llm, ["eager", "fast"])
    assert [r.name for r in available_steps(llm, ["all"])[0]] == CPU_RUNGS


@pytest.mark.parametrize("name, guess", [("cuda_graphs", "+cuda_graphs"), ("prefill_graphs", "+prefill_graphs"),
                                         ("kv_cache", "eager"), ("eagre", "eager"), ("+eager", "eager")])
def test_an_unknown_step_name_gets_a_suggestion(name, guess):
    """The rungs above "eager" are named with a leading "+"; a name without it, a switch's name or a typo is
    answered with the rung meant."""
    with pytest.raises(ValueError, match=re.escape(f"unknown ladder step {name!r} (did you mean {guess!r}?); steps: "
                                                   f"no_kv_cache, eager")):
        get_step(name)
    with pytest.raises(ValueError) as e:
        get_step("warp")
    assert "did you mean" not in str(e.value) and str(e.value).startswith("unknown ladder step 'warp'; steps: ")


def test_weights_label_and_bytes():
    import torch

    eager = get_step("eager")
    assert ladder.weights_label(eager, torch.bfloat16) == "bf16"
    assert ladder.weights_label(eager, torch.float32) == "fp32"
    assert ladder.weight_bytes_per_param(eager, torch.bfloat16) == 2
    q = LadderStep("+int4", {}, weights="int4")
    assert ladder.weight_bytes_per_param(q, torch.bfloat16) == 0.5
    assert ladder.weight_bytes_per_param(LadderStep("+g", {}, weights="int4", weight_bytes_per_param=0.5625),
                                         torch.bfloat16) == 0.5625


def test_tour_climbs_the_ladder(llm, tmp_path):
    from tiny_models import model_folder

    cpu_rungs = ["no KV cache", "KV cache", "int8 weights", "int4 weights (g128)", "one at a time (bs=1)", "static batching",
                 "continuous batching"]  # the GPU-only rungs are skipped
    assert [t.name for t in tour_settings(llm)] == cpu_rungs
    folder = model_folder(tmp_path, seed=0)[0]
    lines = []
    rows = run_tour(str(folder), device="cpu", max_new_tokens=4, repeats=1, print_fn=lines.append)
    assert [r["setting"] for r in rows] == cpu_rungs
    skipped_lines = [line for line in lines if "skipped:" in line]
    assert len(skipped_lines) == len(step_names()) - len(cpu_rungs)


def test_one_rung_may_be_named_by_a_string(llm):
    """available_steps(llm, "eager") is ["eager"], not the letters e, a, g, ..."""
    runnable, skipped = available_steps(llm, "eager")
    assert [r.name for r in runnable] == ["eager"] and not skipped
    assert available_steps(llm, "all") == available_steps(llm)
    with pytest.raises(ValueError, match="unknown ladder step 'eagre'"):
        available_steps(llm, "eagre")
