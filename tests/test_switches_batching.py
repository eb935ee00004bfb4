"""The batching switch with the others: `apply_switches` refuses, up front and in switch names, the combinations
`LLM.generate` cannot run (`llmlab.switches.BATCHING_REFUSES`), and that table agrees with `LLM.generate`."""

from __future__ import annotations

import types

import pytest
import torch

from llmlab import engine, switches
from llmlab.engine import BATCHING, LLM
from llmlab.switches import BATCHING_REFUSES, RAGGED_REFUSES, SWITCHES, apply_switches, check_batching
from tiny_models import tiny_model

PROMPT = [5, 6, 7, 8, 9]
RAGGED = [[5, 6, 7, 8, 9], [5, 6, 7]]


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model(seed=3), None, name="tiny")


class _Ran(Exception):
    """Raised by the stand-ins of generate's decode loops: the call passed every check."""


@pytest.fixture
def checks_only(monkeypatch):
    """LLM.generate with its decode loops replaced: a call raises ValueError if refused, else _Ran."""
    def ran(*args, **kwargs):
        raise _Ran

    for name in ("generate", "generate_fast", "generate_static", "generate_continuous"):
        monkeypatch.setattr(engine, name, ran)


def _single_switch_settings(llm) -> list[dict]:
    """Every switch away from its default, alone, that `apply_switches` takes on this model (and the paged cache
    with the KV cache off, which sets no cache_factory)."""
    out = [{"kv_cache": False, "paged_kv": True}]
    for key, sw in SWITCHES.items():
        if key == "batching":
            continue
        for value in ((not sw.default,) if sw.choices is None else sw.choices):
            if value == sw.default:
                continue
            try:
                apply_switches(llm, {key: value})
            except ValueError:  # not available here (a CUDA GPU, triton), or needs another switch
                continue
            out.append({key: value})
    return out


def _refused(call, runs: bool = True) -> bool:
    """Whether `call` raises ValueError; runs=True: a call not refused reaches a decode loop (raises _Ran)."""
    try:
        call()
    except _Ran:
        return False
    except ValueError:
        return True
    assert not runs, "generate neither ran nor refused"
    return False


def test_the_table_agrees_with_generate_switch_by_switch(llm, checks_only):
    """For every mode and every switch apply_switches takes alone: apply_switches refuses the pair exactly where
    LLM.generate (one prompt, as the dashboard runs) refuses the generate arguments the switch sets."""
    tried = []
    for settings in _single_switch_settings(llm):
        run_llm, kwargs = apply_switches(llm, settings)
        for mode in BATCHING:
            by_generate = _refused(lambda: run_llm.generate(PROMPT, max_new_tokens=2, batching=mode, **kwargs))
            by_switches = _refused(lambda: apply_switches(llm, {**settings, "batching": mode}), runs=False)
            assert by_switches == by_generate, (settings, mode)
            tried.append((tuple(settings), mode, by_switches))
        # prompts of different lengths: RAGGED_REFUSES is what the left-padded static batch refuses
        ragged = _refused(lambda: run_llm.generate(RAGGED, max_new_tokens=2, **kwargs))
        assert ragged == any(settings.get(k) == v for k, v in RAGGED_REFUSES.items()), settings
    refused = {s for s, mode, r in tried if r and mode == "continuous"}
    assert {("kv_cache",), ("paged_kv",), ("gpu_sampling",)} <= refused  # the CPU's share of the table, at least
    assert not any(r for s, mode, r in tried if mode != "continuous")


def test_each_refusal_names_the_switches_and_the_fix(llm, monkeypatch):
    before = llm.generate(PROMPT, max_new_tokens=8, stop_at_eos=False).token_ids
    applied = []
    for key, switch in SWITCHES.items():  # record every switch that would change the model or set an argument
        monkeypatch.setattr(switch, "apply", lambda m, v, kw, key=key: applied.append(key) or m)
    why = "batching='continuous' runs its own engine on a paged KV pool (llmlab.batching.engine), which cannot run with"
    cases = {
        (("kv_cache", False),): f"{why} kv_cache=False: turn kv_cache on, or set batching to 'one_at_a_time'",
        (("paged_kv", True),): f"{why} paged_kv=True: turn paged_kv off, or set batching to 'one_at_a_time'",
        (("gpu_sampling", True),): f"{why} gpu_sampling=True: turn gpu_sampling off, or set batching to "
                                   f"'one_at_a_time' or 'static'",
        (("kv_cache", False), ("paged_kv", True)): f"{why} kv_cache=False and paged_kv=True: turn kv_cache on and "
                                                   f"paged_kv off, or set batching to 'one_at_a_time'",
        (("kv_cache", False), ("dtype", "bf16")): f"{why} kv_cache=False: turn kv_cache on, or set batching to "
                                                  f"'one_at_a_time'",
    }
    if SWITCHES["torch_compile"].available(llm)[0]:
        cases[(("torch_compile", True),)] = (f"{why} torch_compile=True: turn torch_compile off, or set batching to "
                                             f"'one_at_a_time' or 'static'")
    for pairs, message in cases.items():
        with pytest.raises(ValueError) as e:
            apply_switches(llm, {**dict(pairs), "batching": "continuous"})
        assert str(e.value) == message
        assert "use_cache" not in message and "cache_factory" not in message  # arguments the student never typed
    assert applied == []  # refused before any switch changed the model
    monkeypatch.undo()
    run_llm, kwargs = apply_switches(llm, {"batching": "one_at_a_time", "kv_cache": False, "paged_kv": True})
    assert run_llm is llm and kwargs == {"use_cache": False, "batching": "one_at_a_time"}
    assert llm.generate(PROMPT, max_new_tokens=8, stop_at_eos=False).token_ids == before
    assert llm.generate([PROMPT, PROMPT], max_new_tokens=8, stop_at_eos=False,
                        **apply_switches(llm, {"batching": "continuous"})[1]).token_ids == before * 2


def test_continuous_batching_with_cuda_graphs_needs_the_triton_kernels():
    """The engine captures its decode step only on the Triton paged kernel (`paged_step_reason`); on a CUDA model
    apply_switches says so before the engine is built. A stand-in with a CUDA device: no GPU needed to check."""
    cuda = types.SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(ValueError, match=r"^batching='continuous' with cuda_graphs=True captures its engine's decode "
                                         r"step on the Triton kernels' paged attention: turn triton_kernels on too, "
                                         r"or cuda_graphs off$"):
        apply_switches(cuda, {"batching": "continuous", "cuda_graphs": True})
    check_batching({**switches.defaults(), "batching": "continuous", "cuda_graphs": True, "triton_kernels": True})
    check_batching({**switches.defaults(), "batching": "static", "cuda_graphs": True})


def test_the_table_names_real_switches_and_modes():
    for mode, refused in BATCHING_REFUSES.items():
        assert mode in BATCHING and mode in SWITCHES["batching"].choices
        for key, value in {**refused, **RAGGED_REFUSES}.items():
            assert key in SWITCHES and value != SWITCHES[key].default


@pytest.mark.parametrize("settings, named", [({"kv_cache": False}, "the kv_cache switch off"),
                                             ({"paged_kv": True}, "the paged_kv switch")])
def test_ragged_prompts_name_the_switch_and_one_at_a_time_runs_them(llm, settings, named):
    # prompts of different lengths with a switch the left-padded batch cannot take: the message names the switch a
    # student set (not only generate's argument) and offers one_at_a_time, which then runs them
    run_llm, kwargs = apply_switches(llm, settings)
    with pytest.raises(ValueError, match=rf"\({named}\).*or use batching='one_at_a_time'"):
        run_llm.generate(RAGGED, max_new_tokens=2, **kwargs)
    run_llm, kwargs = apply_switches(llm, {**settings, "batching": "one_at_a_time"})
    assert [len(r) for r in run_llm.generate(RAGGED, max_new_tokens=2, **kwargs).token_ids] == [2, 2]
