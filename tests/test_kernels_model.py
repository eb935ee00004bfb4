"""The "Triton kernels" switch: a tiny model with the kernel modules swapped in (and the kernels' decode step)
gives the PyTorch path's logits.

On a CPU this runs in Triton's interpreter (fp32); the switch itself is GPU-only and says why on a CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from llmlab.kernels._util import interpret_mode
from llmlab.cache.kv_cache import KVCache
from tiny_models import greedy_on_static_cache, tiny_model

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import modules  # noqa: E402
from llmlab.kernels.decode_step import KernelDecodeStep  # noqa: E402
from llmlab.kernels.modules import TritonAttention, TritonMLP, TritonRMSNorm, swap_in, swap_out  # noqa: E402
from llmlab.model import MLP, Attention, RMSNorm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
VIA = ["modules", "step"]  # model(...) with the kernel modules in; the kernels' decode step (KernelDecodeStep)


def _forward(model, via: str):
    """What runs a forward pass: the model itself (its kernel modules) or its KernelDecodeStep."""
    return model if via == "modules" else KernelDecodeStep(model)


def _prefill_then_decode(fwd, config, ids, steps=3):
    """Logits of a prefill and of `steps` greedy decode steps through a KVCache."""
    cache = KVCache(config, ids.shape[0], 64, torch.float32, DEV)
    out = [fwd(ids, kv_cache=cache)]
    pos = ids.shape[1]
    nxt = out[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        out.append(fwd(nxt, positions=torch.tensor([pos], device=DEV), kv_cache=cache))
        nxt, pos = out[-1][:, -1:].argmax(-1), pos + 1
    return out


def _count_calls(monkeypatch, names) -> dict:
    """Count the calls of the kernel wrappers `names` (modules.ops()) into the returned dict."""
    calls = {}
    ns = modules.ops()
    for name in names:
        def counted(*a, _f=getattr(ns, name), _n=name, **kw):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **kw)
        monkeypatch.setattr(ns, name, counted)
    return calls


def _run_swapped(model, run, via: str = "modules"):
    """run(forward) with the kernel modules swapped in (forward: the model, or its KernelDecodeStep), then swapped
    out again."""
    swap_in(model)
    try:
        return run(_forward(model, via))
    finally:
        swap_out(model)


def _types(model) -> list:
    return [type(m) for m in model.modules()]


@torch.no_grad()
def test_swap_in_replaces_the_modules_keeping_parameters_and_state_dict_and_swap_out_restores_them():
    """swap_in: the kernel module types, no `forward` in any instance __dict__, the same Parameter objects, the
    same state_dict keys and values (after a forward too, whose fused q/k/v and gate/up make the weights views);
    swap_out: the PyTorch types again, no kernel state left, and bit-identical outputs."""
    model = tiny_model(seed=1).to(DEV)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0)).to(DEV)
    ref = model(ids)
    params = [(n, id(p)) for n, p in model.named_parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch_types = _types(model)
    L = model.config.n_layers
    assert swap_in(model) is model
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(TritonRMSNorm) == 2 * L + 1 and kinds.count(TritonMLP) == kinds.count(TritonAttention) == L
    assert not any(t in (RMSNorm, MLP, Attention) for t in kinds)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert modules.is_swapped(model)
    swap_in(model)  # again: nothing changes
    assert _types(model) == kinds
    torch.testing.assert_close(model(ids), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(KernelDecodeStep(model)(ids), ref, atol=1e-4, rtol=1e-4)
    assert model.layers[0].self_attn.fused is not None and model.layers[0].mlp.fused is not None
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert not any(k.startswith("_llmlab") for m in model.modules() for k in m.__dict__)
    assert swap_out(model) is model
    assert _types(model) == torch_types and not modules.is_swapped(model)
    assert not any(hasattr(m, "fused") for m in model.modules())
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert list(model.state_dict()) == list(state)
    torch.testing.assert_close(model(ids), ref, atol=0, rtol=0)


def test_the_decode_step_needs_the_kernel_modules():
    with pytest.raises(ValueError, match=r"swap the kernel modules in first"):
        KernelDecodeStep(tiny_model(seed=0))


@torch.no_grad()
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}], ids=["llama", "qkv-bias"])
def test_swapped_model_matches_pytorch_path_with_kv_cache(monkeypatch, overrides, via):
    model = tiny_model(seed=1, **overrides).to(DEV)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEV)
    ref = _prefill_then_decode(model, model.config, ids)
    calls = _count_calls(monkeypatch, ("rmsnorm", "swiglu", "rope_one", "decode_attention"))
    swap_in(model)
    assert modules.is_swapped(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: every op went through its kernel
        got = _prefill_then_decode(_forward(model, via), model.config, ids)
    n_layers = model.config.n_layers
    # per forward: 2 norms per layer (through the step, the second with the residual add) + the final one; q and
    # k rotated together
    assert calls == {"rmsnorm": 4 * (2 * n_layers + 1), "swiglu": 4 * n_layers, "rope_one": 4 * n_layers,
                     "decode_attention": 3 * n_layers}
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    swap_out(model)
    assert not modules.is_swapped(model)
    torch.testing.assert_close(_prefill_then_decode(model, model.config, ids)[-1], ref[-1], atol=0, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("via", VIA)
def test_swapped_model_matches_with_a_static_cache(monkeypatch, via):
    """Decode steps on a static cache with the rows at DIFFERENT positions: the fused RoPE + cache write and the
    per-row lengths must match the PyTorch path (scatter + mask)."""
    from llmlab.cache.static_cache import StaticKVCache

    model = tiny_model(seed=2).to(DEV)
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1)).to(DEV)

    def run(fwd):
        cache = StaticKVCache(model.config, 2, 16, torch.float32, DEV)
        outs = [fwd(ids, kv_cache=cache)]
        for step in range(3):
            pos = torch.tensor([[5 + step], [3 + step]], device=DEV)  # row 1 overwrites its slots 3, 4, 5
            outs.append(fwd(ids[:, step:step + 1], positions=pos, kv_cache=cache))
        return outs

    ref = run(model)
    calls = []
    ns = modules.ops()
    monkeypatch.setattr(ns, "rope_and_cache_", lambda *a, _f=ns.rope_and_cache_, **k: calls.append(1) or _f(*a, **k))
    for got, want in zip(_run_swapped(model, run, via), ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(calls) == 3 * model.config.n_layers  # every decode step of every layer took the fused path


@torch.no_grad()
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}], ids=["llama", "qkv-bias"])
def test_batch_one_decode_on_a_static_cache_fuses_the_small_ops_into_the_gemvs(monkeypatch, overrides):
    """Batch 1, one token, static cache (the CUDA-graph decode at batch 1) through the kernels' decode step: four
    fused GEMVs per layer and no separate RMSNorm/SwiGLU launches except the final norm — and the same logits as the
    PyTorch path. A model the fused step does not cover (biases) takes the per-module path and matches too; so does
    the swapped model run by itself (its modules, no fused GEMVs)."""
    model = tiny_model(seed=4, **overrides).to(DEV)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4)).to(DEV)

    def run(fwd):
        return greedy_on_static_cache(fwd, model, ids, steps=4)

    ref = run(model)
    calls = _count_calls(monkeypatch, ("fused_gemv", "rmsnorm", "swiglu"))
    got = _run_swapped(model, run, "step")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    L = model.config.n_layers
    prefill = {"rmsnorm": 2 * L + 1, "swiglu": L}  # the prompt takes the per-module path
    if overrides:  # not fusable: every decode step runs the per-module kernels too
        assert calls == {"rmsnorm": 5 * (2 * L + 1), "swiglu": 5 * L}
    else:
        assert calls == {"fused_gemv": 4 * 4 * L, "rmsnorm": prefill["rmsnorm"] + 4, "swiglu": prefill["swiglu"]}
    calls.clear()
    for a, b in zip(_run_swapped(model, run, "modules"), ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert "fused_gemv" not in calls and calls["rmsnorm"] == 5 * (2 * L + 1)


@torch.no_grad()
@pytest.mark.parametrize("inside", [True, False], ids=["rope-in-attention", "rope-launch"])
def test_batch_one_step_applies_rope_in_the_attention_launch_or_before_it(monkeypatch, inside):
    """The batch-1 step's RoPE and K/V write: inside the attention's launch (`rope_cache_attention`, the default)
    or in a launch of their own (`rope_and_cache_`, ROPE_IN_ATTENTION = False); the same greedy logits as the
    PyTorch path either way, over enough steps that the attention reads keys the kernel itself wrote."""
    model = tiny_model(seed=6).to(DEV)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(6)).to(DEV)

    def run(fwd):
        return greedy_on_static_cache(fwd, model, ids, steps=6)

    ref = run(model)
    monkeypatch.setattr(modules, "ROPE_IN_ATTENTION", inside)
    calls = _count_calls(monkeypatch, ("rope_cache_attention", "rope_and_cache_", "decode_attention"))
    for a, b in zip(_run_swapped(model, run, "step"), ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    decode_layers = 6 * model.config.n_layers
    want = ({"rope_cache_attention": decode_layers} if inside
            else {"rope_and_cache_": decode_layers, "decode_attention": decode_layers})
    assert calls == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for tensors the interpreter cannot take")
@torch.no_grad()
def test_unsupported_dtype_falls_back_to_pytorch_with_one_warning():
    model = tiny_model(seed=3).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 4))
    ref = model(ids)
    swap_in(model)
    modules._warned.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(ids)
            by_step = KernelDecodeStep(model)(ids)
        msgs = [str(c.message) for c in caught if "Triton kernels" in str(c.message)]
        assert len(msgs) == 1 and "bfloat16" in msgs[0]
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        torch.testing.assert_close(by_step, ref, atol=0, rtol=0)
    finally:
        swap_out(model)


def test_switch_is_registered_and_says_why_it_is_unavailable_on_a_cpu():
    from llmlab import ladder, switches
    from llmlab.engine import LLM

    sw = switches.SWITCHES["triton_kernels"]
    assert sw.label == "Triton kernels" and sw.default is False
    assert "+triton_kernels" in ladder.step_names()
    llm = LLM(tiny_model(seed=0), name="tiny")
    ok, why = sw.available(llm)
    if DEV == "cpu":
        assert not ok and "CUDA" in why
        with pytest.raises(ValueError, match="Triton kernels"):
            switches.apply_switches(llm, {"triton_kernels": True})
    llm2, _ = switches.apply_switches(llm, {"triton_kernels": False})
    assert not modules.is_swapped(llm2.model) and llm2.kernels is None


@torch.no_grad()
def test_the_switch_swaps_the_modules_in_and_out_and_the_llm_decodes_like_the_eager_model(monkeypatch):
    """The switch (made available on a CPU here: the interpreter runs the kernels) swaps the kernel modules in and
    gives the LLM the kernels' decode step; greedy fp32 tokens, eager and on the static-cache runner, equal the
    PyTorch model's token for token; off again, the PyTorch modules are back."""
    from llmlab import switches
    from llmlab.engine import LLM
    from llmlab.generate import generate

    monkeypatch.setattr(switches.SWITCHES["triton_kernels"], "available", lambda llm: (True, ""))
    llm = LLM(tiny_model(seed=5).to(DEV), name="tiny")
    prompts = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2)).tolist()
    ref = generate(llm.model, prompts, max_new_tokens=12)
    assert len(set(ref.token_ids[0])) >= 3  # not vacuous: the decode does not repeat one token
    torch_types = _types(llm.model)
    run, kwargs = switches.apply_switches(llm, {"triton_kernels": True, "gpu_sampling": True})
    assert run is llm and isinstance(llm.kernels, KernelDecodeStep) and llm.kernels.model is llm.model
    assert modules.is_swapped(llm.model)
    assert run.generate(prompts, max_new_tokens=12, **kwargs).token_ids == ref.token_ids
    mode = "static"
    assert llm.runners[mode].kernels is llm.kernels  # the runner runs the kernels' step, kept on the LLM
    run, kwargs = switches.apply_switches(llm, {"triton_kernels": True})
    assert run.generate(prompts, max_new_tokens=12, **kwargs).token_ids == ref.token_ids  # eager, with the step
    run, kwargs = switches.apply_switches(llm, {"triton_kernels": False})
    assert llm.kernels is None and _types(llm.model) == torch_types
    assert run.generate(prompts, max_new_tokens=12, **kwargs).token_ids == ref.token_ids


def test_kernel_micro_benchmark_writes_a_valid_bench_file(tmp_path):
    import json

    from llmlab.measure.bench import validate_bench
    from llmlab.kernels import bench_kernels

    bench_kernels.main(["--smoke", "--out", str(tmp_path), "--copy-gbps", "10"])
    (path,) = tmp_path.glob("*_kernels_micro_*.json")
    doc = json.loads(path.read_text())
    validate_bench(doc)
    ops = {r["workload"] for r in doc["results"]}
    assert {"rmsnorm", "swiglu", "rope", "decode_attention", "int8_matmul", "int4_matmul"} <= ops
    assert all(r["bw_fraction"] is not None for r in doc["results"])


def test_switching_the_kernels_rebuilds_the_cached_decode_runner():
    """A runner captured before the swap holds the old kernels: the runner cache must not hand it back, whether
    the modules change (their types are in the fingerprint, before any weight moves) or the step does."""
    from llmlab.runtime.cuda_graphs import RunnerCache

    model = tiny_model(seed=3).to(DEV)
    runners = RunnerCache()
    before = runners.runner_for(model, "static", 1, 32)
    assert runners.runner_for(model, "static", 1, 32) is before  # nothing changed: reused
    swap_in(model)
    try:
        swapped = runners.runner_for(model, "static", 1, 32)
        assert swapped is not before and swapped.kernels is None
        assert runners.runner_for(model, "static", 1, 32) is swapped
        step = KernelDecodeStep(model)
        stepped = runners.runner_for(model, "static", 1, 32, kernels=step)
        assert stepped is not swapped and stepped.kernels is step
        assert runners.runner_for(model, "static", 1, 32, kernels=step) is stepped and runners["static"] is stepped
    finally:
        swap_out(model)
    assert runners.runner_for(model, "static", 1, 32, kernels=step) is not stepped  # the modules changed back
    assert runners.runner_for(model, "static", 1, 32) is not stepped


def test_the_triton_rung_replaces_torch_compile_on_top_of_cuda_graphs():
    from llmlab import ladder

    step = ladder.get_step("+triton_kernels")
    assert step.settings == {"triton_kernels": True, "torch_compile": False}


@torch.no_grad()
def test_fused_projections_follow_weight_changes_and_are_dropped_by_swap_out():
    """The fused q/k/v and gate/up weights must never serve stale values, however a weight is changed."""
    import copy

    model = tiny_model(seed=4).to(DEV)
    twin = copy.deepcopy(model)  # stays on the PyTorch path; gets the same edits
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1)).to(DEV)

    def edit(m, how):
        attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
        if how == "data":  # in place through .data: neither the address nor the version changes
            attn.v_proj.weight.data.mul_(-1.0)
            mlp.gate_proj.weight.data.add_(0.1)
        elif how == "inplace":
            attn.k_proj.weight.mul_(3.0)
        else:  # replaced: a new tensor
            mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight * 0.5)

    swap_in(model)
    try:
        model(ids)
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        assert attn.fused is not None and mlp.fused is not None  # the modules' own state
        assert attn.fused.weight.shape[0] == sum(attn.fused.sizes) and mlp.fused.bias is None
        for how in ("data", "inplace", "replaced"):
            edit(model, how)
            edit(twin, how)
            torch.testing.assert_close(model(ids), twin(ids), atol=1e-4, rtol=1e-4, msg=f"after a {how} edit")
    finally:
        swap_out(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(attn) is Attention and type(mlp) is MLP and not hasattr(attn, "fused") and not hasattr(mlp, "fused")
    torch.testing.assert_close(model(ids), twin(ids), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_kernel_bucketed_prefill_equals_the_pytorch_prefill():
    """The prefill a prefill graph replays (prompt padded to 16 tokens, the pads first at later positions) through
    the Triton kernels' step: the same last-position logits and prompt K/V as the PyTorch path's unpadded prefill.
    (Captured on a GPU, eager in the interpreter.)"""
    from llmlab.runtime.cuda_graphs import GraphDecoder

    model = tiny_model(seed=4).to(DEV)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3)).to(DEV)
    ref_runner = GraphDecoder(model, max_batch=2, max_seq_len=32, cuda_graphs=False)
    ref = ref_runner.prefill(ids)
    swap_in(model)
    try:
        runner = GraphDecoder(model, max_batch=2, max_seq_len=32, kernels=KernelDecodeStep(model))  # captures on a GPU
        got = runner.prefill(ids, bucketed=True).clone()
    finally:
        swap_out(model)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    for a, b in zip(ref_runner.cache.k + ref_runner.cache.v, runner.cache.k + runner.cache.v):
        torch.testing.assert_close(b[:, :, :9], a[:, :, :9], atol=1e-4, rtol=1e-4)
    assert len(runner.prefill_graphs) == (1 if DEV == "cuda" else 0)


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("prefill_graph", [False, True], ids=["eager-prefill", "prefill-graph"])
@pytest.mark.parametrize("batch", [1, 3])
def test_graph_replayed_triton_decode_equals_eager_decode(batch, prefill_graph):
    """The +triton_kernels rung as it runs in the ladder: CUDA graphs over the kernels' step (fp32, so the greedy
    tokens must match the eager PyTorch decode exactly), 48 steps, rows padded up to the bucket; with
    prefill_graph the prefill (7 tokens padded to 16) is replayed from a graph too (the +prefill_graphs rung)."""
    from llmlab.runtime.fast_generate import generate_fast
    from llmlab.generate import generate

    model = tiny_model(seed=5).to("cuda")
    prompts = torch.randint(0, 256, (batch, 7), generator=torch.Generator().manual_seed(2)).tolist()
    ref = generate(model, prompts, max_new_tokens=48)
    swap_in(model)
    try:
        got = generate_fast(model, prompts, max_new_tokens=48, mode="graphs", prefill_graph=prefill_graph,
                            kernels=KernelDecodeStep(model))
    finally:
        swap_out(model)
    assert got.token_ids == ref.token_ids
    assert got.extra["prefill_length"] == (16 if prefill_graph else None)
    assert got.extra["n_prefill_graphs"] == (1 if prefill_graph else 0)
    assert len(set(ref.token_ids[0])) >= 3  # the check is not vacuous: the decode does not repeat one token


def test_kernel_bench_notes_say_what_was_measured_on_this_device():
    """On a CPU the file must not claim CUDA-graph GPU times, nor a bf16 dense baseline."""
    from llmlab.kernels.bench_kernels import notes_for

    cpu, gpu = " ".join(notes_for("cpu", smoke=True)), " ".join(notes_for("cuda", smoke=False))
    assert "wall-clock" in cpu and "interpreter" in cpu and "CUDA-graph" not in cpu
    assert "dense baseline of speedup_vs_bf16 is fp32" in cpu and "meaningless" in cpu
    assert "CUDA-graph replay" in gpu and "wall-clock" not in gpu and "meaningless" not in gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a CUDA GPU")
def test_kernel_bench_without_the_interpreter_says_what_to_set(tmp_path, monkeypatch, capsys):
    from llmlab.kernels import bench_kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert bench_kernels.main(["--smoke", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("bench_kernels: error: ") and "TRITON_INTERPRET=1" in err
    assert not list(tmp_path.iterdir())


@torch.no_grad()
@pytest.mark.parametrize("via", VIA)
def test_a_positions_tensor_updated_in_place_gives_fresh_lengths(via):
    """A decode loop may keep one positions tensor and add 1 to it each step: the per-step lengths must follow."""
    from llmlab.cache.static_cache import StaticKVCache

    model = tiny_model(seed=6).to(DEV)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3)).to(DEV)

    def run(fwd):
        cache = StaticKVCache(model.config, 2, 32, torch.float32, DEV)
        fwd(ids, kv_cache=cache)
        P = torch.tensor([[12], [12]], device=DEV)
        outs = []
        for step in range(3):
            outs.append(fwd(ids[:, step:step + 1], positions=P, kv_cache=cache))
            P += 1
        return outs

    ref = run(model)
    for a, b in zip(_run_swapped(model, run, via), ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_a_swapped_model_saves_and_loads_like_the_original(tmp_path):
    """The fused projections make q/k/v (gate/up) views of one tensor: saving must still write separate weights."""
    from llmlab.checkpoint import load_model, save_model

    model = tiny_model(seed=7).to(DEV)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4)).to(DEV)
    ref = model(ids)
    swap_in(model)
    try:
        model(ids)  # builds the fused tensors
        save_model(model, tmp_path)
    finally:
        swap_out(model)
    loaded = load_model(tmp_path, device=DEV, dtype=torch.float32)
    torch.testing.assert_close(loaded(ids), ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("batch", [1, 2])
def test_a_position_outside_the_static_cache_is_refused_before_anything_is_written(batch, via):
    """As the PyTorch path's indexing refuses it — and the cache is left as it was, still usable."""
    from llmlab.cache.static_cache import StaticKVCache

    model = tiny_model(seed=3).to(DEV)
    swap_in(model)
    try:
        fwd = _forward(model, via)
        cache = StaticKVCache(model.config, batch, 8, torch.float32, DEV)
        fwd(torch.randint(0, 256, (batch, 4), generator=torch.Generator().manual_seed(0)).to(DEV), kv_cache=cache)
        before = [t.clone() for t in cache.k + cache.v]
        tok = torch.full((batch, 1), 5, device=DEV)
        for bad in (8, -1):
            with pytest.raises(ValueError, match="outside the static KV cache's 8 slots"):
                fwd(tok, positions=torch.full((batch, 1), bad, device=DEV), kv_cache=cache)
            assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))
        out = fwd(tok, positions=torch.full((batch, 1), 4, device=DEV), kv_cache=cache)  # still usable
        assert torch.isfinite(out).all()
    finally:
        swap_out(model)


def test_kernel_demos_exit_cleanly_without_a_gpu(monkeypatch):
    """`python -m llmlab.kernels.<op>` times the kernel on a GPU; without one it says so and how to run on a CPU."""
    from llmlab.kernels import _util

    monkeypatch.setattr(_util.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="fused_gemv: .*no.*bench_kernels --smoke"):
        _util.demo_needs_cuda("fused_gemv")
