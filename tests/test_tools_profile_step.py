"""tools/profile_step.py's bookkeeping on hand-made kernel records: steps split at the greedy pick, marginal times
under overlap (programmatic dependent launch), and each layer's kernels given their roles."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("profile_step", Path(__file__).parents[1] / "tools" / "profile_step.py")
ps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ps)


def _layer(t: float, swiglu: bool, rope: bool = True) -> tuple[list[dict], float]:
    """One layer's kernels from time t: each starts 1 us before the previous one ends (overlap) and ends 10 us
    after it, except the down GEMV, which ends 20 us after. rope=False: RoPE inside the attention's split kernel."""
    names = ["_int8_gemv_kernel"] + (["_rope_cache_kernel"] if rope else []) + ["_decode_split_kernel", "_merge_kernel",
             "_int8_gemv_kernel", "_int8_gemv_kernel"] + (["_swiglu_kernel"] if swiglu else []) + ["_int8_gemv_kernel"]
    out = []
    for i, n in enumerate(names):
        adds = 20.0 if i == len(names) - 1 else 10.0
        out.append({"name": n, "ts": t - 1.0, "dur": adds + 1.0})
        t += adds
    return out, t


def _step(t: float, layers: int, swiglu: bool, rope: bool = True) -> tuple[list[dict], float]:
    ks = [{"name": "indexSelectSmallIndex", "ts": t, "dur": 2.0}]
    t += 2.0
    for _ in range(layers):
        lk, t = _layer(t, swiglu, rope)
        ks += lk
    ks += [{"name": "nvjet_lm_head", "ts": t, "dur": 30.0}, {"name": "_argmax_kernel", "ts": t + 30.0, "dur": 4.0}]
    return ks, t + 34.0


@pytest.mark.parametrize("rope", [True, False], ids=["rope-launch", "rope-in-attention"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_roles_and_marginal_times(swiglu, rope):
    kernels, t = [], 0.0
    for _ in range(5):
        ks, t = _step(t + 5.0, 3, swiglu, rope)  # 5 us of host gap between steps
        kernels += ks
    steps = ps.split_steps(kernels)
    assert len(steps) == 2  # five greedy picks: four steps between them, the first and last dropped
    marg = ps.marginal_us(steps[0])
    assert marg[0] == pytest.approx(2.0)  # the first kernel's own time (the host's gap before it is not the step's)
    per = ps.roles_of_step(steps[0], 3)
    assert per["qkv"] == pytest.approx(30.0) and per["rope"] == pytest.approx(30.0 if rope else 0.0)
    assert per["attention"] == pytest.approx(60.0) and per["down"] == pytest.approx(60.0)
    assert per["swiglu"] == pytest.approx(30.0 if swiglu else 0.0)
    assert per["head+tail"] == pytest.approx(2.0 + 34.0)
    assert sum(per.values()) == pytest.approx(sum(marg))  # every kernel counted once


def test_a_step_without_the_fused_layers_is_refused():
    ks, _ = _step(0.0, 2, False)
    with pytest.raises(ValueError, match="attention split kernels"):
        ps.roles_of_step(ks, 3)
    broken = [k for k in ks if not (k["name"] == "_int8_gemv_kernel" and k is ks[5])]
    with pytest.raises(ValueError, match="GEMVs after the attention"):
        ps.roles_of_step(broken, 2)
