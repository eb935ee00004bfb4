"""The "Triton kernels" switch: a tiny model with the kernels patched in gives the PyTorch path's logits.

On a CPU this runs in Triton's interpreter (fp32); the switch itself is GPU-only and says why on a CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from llmlab.kernels._util import interpret_mode
from llmlab.cache.kv_cache import KVCache
from tiny_models import tiny_model

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import patch_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _prefill_then_decode(model, ids, steps=3):
    """Logits of a prefill and of `steps` greedy decode steps through a KVCache."""
    cache = KVCache(model.config, ids.shape[0], 64, torch.float32, DEV)
    out = [model(ids, kv_cache=cache)]
    pos = ids.shape[1]
    nxt = out[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        out.append(model(nxt, positions=torch.tensor([pos], device=DEV), kv_cache=cache))
        nxt, pos = out[-1][:, -1:].argmax(-1), pos + 1
    return out


def _count_calls(monkeypatch, names) -> dict:
    """Count the calls of the switch's kernel wrappers `names` (patch_model._kernels()) into the returned dict."""
    calls = {}
    ns = patch_model._kernels()
    for name in names:
        def counted(*a, _f=getattr(ns, name), _n=name, **kw):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **kw)
        monkeypatch.setattr(ns, name, counted)
    return calls


def _run_patched(model, run):
    """run() with the Triton switch on, then off again."""
    patch_model.enable(model)
    try:
        return run()
    finally:
        patch_model.disable(model)


@torch.no_grad()
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}], ids=["llama", "qkv-bias"])
def test_patched_model_matches_pytorch_path_with_kv_cache(monkeypatch, overrides):
    model = tiny_model(seed=1, **overrides).to(DEV)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEV)
    ref = _prefill_then_decode(model, ids)
    calls = _count_calls(monkeypatch, ("rmsnorm", "swiglu", "rope_one", "decode_attention"))
    patch_model.enable(model)
    assert patch_model.is_enabled(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: every op went through its kernel
        got = _prefill_then_decode(model, ids)
    n_layers = model.config.n_layers
    # per forward: 2 norms per layer (the second with the residual add) + the final one; q and k rotated together
    assert calls == {"rmsnorm": 4 * (2 * n_layers + 1), "swiglu": 4 * n_layers, "rope_one": 4 * n_layers,
                     "decode_attention": 3 * n_layers}
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    patch_model.disable(model)
    assert not patch_model.is_enabled(model)
    torch.testing.assert_close(_prefill_then_decode(model, ids)[-1], ref[-1], atol=0, rtol=0)


@torch.no_grad()
def test_patched_model_matches_with_a_static_cache(monkeypatch):
    """Decode steps on a static cache with the rows at DIFFERENT positions: the fused RoPE + cache write and the
    per-row lengths must match the PyTorch path (scatter + mask)."""
    from llmlab.cache.static_cache import StaticKVCache

    model = tiny_model(seed=2).to(DEV)
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1)).to(DEV)

    def run():
        cache = StaticKVCache(model.config, 2, 16, torch.float32, DEV)
        outs = [model(ids, kv_cache=cache)]
        for step in range(3):
            pos = torch.tensor([[5 + step], [3 + step]], device=DEV)  # row 1 overwrites its slots 3, 4, 5
            outs.append(model(ids[:, step:step + 1], positions=pos, kv_cache=cache))
        return outs

    ref = run()
    calls = []
    ns = patch_model._kernels()
    monkeypatch.setattr(ns, "rope_and_cache_", lambda *a, _f=ns.rope_and_cache_, **k: calls.append(1) or _f(*a, **k))
    patch_model.enable(model)
    try:
        for got, want in zip(run(), ref):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        patch_model.disable(model)
    assert len(calls) == 3 * model.config.n_layers  # every decode step of every layer took the fused path


@torch.no_grad()
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}], ids=["llama", "qkv-bias"])
def test_batch_one_decode_on_a_static_cache_fuses_the_small_ops_into_the_gemvs(monkeypatch, overrides):
    """Batch 1, one token, static cache (the CUDA-graph decode at batch 1): four fused GEMVs per layer and no
    separate RMSNorm/SwiGLU launches except the final norm — and the same logits as the PyTorch path. A model the
    fused step does not cover (biases) takes the per-module path and matches too."""
    from llmlab.cache.static_cache import StaticKVCache

    model = tiny_model(seed=4, **overrides).to(DEV)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4)).to(DEV)

    def run():
        cache = StaticKVCache(model.config, 1, 24, torch.float32, DEV)
        outs = [model(ids, kv_cache=cache)]
        nxt = outs[-1][:, -1:].argmax(-1)
        for step in range(4):
            outs.append(model(nxt, positions=torch.tensor([[6 + step]], device=DEV), kv_cache=cache))
            nxt = outs[-1][:, -1:].argmax(-1)
        return outs

    ref = run()
    calls = _count_calls(monkeypatch, ("fused_gemv", "rmsnorm", "swiglu"))
    got = _run_patched(model, run)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    L = model.config.n_layers
    prefill = {"rmsnorm": 2 * L + 1, "swiglu": L}  # the prompt takes the per-module path
    if overrides:  # not fusable: every decode step runs the per-module kernels too
        assert calls == {"rmsnorm": 5 * (2 * L + 1), "swiglu": 5 * L}
    else:
        assert calls == {"fused_gemv": 4 * 4 * L, "rmsnorm": prefill["rmsnorm"] + 4, "swiglu": prefill["swiglu"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for tensors the interpreter cannot take")
@torch.no_grad()
def test_unsupported_dtype_falls_back_to_pytorch_with_one_warning():
    model = tiny_model(seed=3).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 4))
    ref = model(ids)
    patch_model.enable(model)
    patch_model._warned.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(ids)
        msgs = [str(c.message) for c in caught if "Triton kernels" in str(c.message)]
        assert len(msgs) == 1 and "bfloat16" in msgs[0]
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
    finally:
        patch_model.disable(model)


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
    assert not patch_model.is_enabled(llm2.model)


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
    """A runner captured before the switch holds the old kernels: `runner_for` must not hand it back."""
    from llmlab.runtime.cuda_graphs import runner_for

    model = tiny_model(seed=3).to(DEV)
    before = runner_for(model, "static", 1, 32)
    assert runner_for(model, "static", 1, 32) is before  # nothing changed: reused
    patch_model.enable(model)
    try:
        patched = runner_for(model, "static", 1, 32)
        assert patched is not before
        assert runner_for(model, "static", 1, 32) is patched
    finally:
        patch_model.disable(model)
    assert runner_for(model, "static", 1, 32) is not patched


def test_the_triton_rung_replaces_torch_compile_on_top_of_cuda_graphs():
    from llmlab import ladder

    step = ladder.get_step("+triton_kernels")
    assert step.settings == {"triton_kernels": True, "torch_compile": False}


@torch.no_grad()
def test_fused_projections_follow_weight_changes_and_are_dropped_by_disable():
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

    patch_model.enable(model)
    try:
        model(ids)
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        assert "_llmlab_fused_qkv" in attn.__dict__ and "_llmlab_fused_gate_up" in mlp.__dict__
        for how in ("data", "inplace", "replaced"):
            edit(model, how)
            edit(twin, how)
            torch.testing.assert_close(model(ids), twin(ids), atol=1e-4, rtol=1e-4, msg=f"after a {how} edit")
    finally:
        patch_model.disable(model)
    assert "_llmlab_fused_qkv" not in attn.__dict__ and "_llmlab_fused_gate_up" not in mlp.__dict__
    torch.testing.assert_close(model(ids), twin(ids), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_patched_bucketed_prefill_equals_the_pytorch_prefill():
    """The prefill a prefill graph replays (prompt padded to 16 tokens, the pads first at later positions) through
    the Triton kernels: the same last-position logits and prompt K/V as the PyTorch path's unpadded prefill.
    (Captured on a GPU, eager in the interpreter.)"""
    from llmlab.runtime.cuda_graphs import GraphDecoder

    model = tiny_model(seed=4).to(DEV)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3)).to(DEV)
    ref_runner = GraphDecoder(model, max_batch=2, max_seq_len=32, cuda_graphs=False)
    ref = ref_runner.prefill(ids)
    patch_model.enable(model)
    try:
        runner = GraphDecoder(model, max_batch=2, max_seq_len=32)  # captures on a GPU
        got = runner.prefill(ids, bucketed=True).clone()
    finally:
        patch_model.disable(model)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    for a, b in zip(ref_runner.cache.k + ref_runner.cache.v, runner.cache.k + runner.cache.v):
        torch.testing.assert_close(b[:, :, :9], a[:, :, :9], atol=1e-4, rtol=1e-4)
    assert len(runner.prefill_graphs) == (1 if DEV == "cuda" else 0)


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("prefill_graph", [False, True], ids=["eager-prefill", "prefill-graph"])
@pytest.mark.parametrize("batch", [1, 3])
def test_graph_replayed_triton_decode_equals_eager_decode(batch, prefill_graph):
    """The +triton_kernels rung as it runs in the ladder: CUDA graphs over the patched model (fp32, so the greedy
    tokens must match the eager PyTorch decode exactly), 48 steps, rows padded up to the bucket; with
    prefill_graph the prefill (7 tokens padded to 16) is replayed from a graph too (the +prefill_graphs rung)."""
    from llmlab.runtime.fast_generate import generate_fast
    from llmlab.generate import generate

    model = tiny_model(seed=5).to("cuda")
    prompts = torch.randint(0, 256, (batch, 7), generator=torch.Generator().manual_seed(2)).tolist()
    ref = generate(model, prompts, max_new_tokens=48)
    patch_model.enable(model)
    try:
        got = generate_fast(model, prompts, max_new_tokens=48, mode="graphs", prefill_graph=prefill_graph)
    finally:
        patch_model.disable(model)
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
def test_a_positions_tensor_updated_in_place_gives_fresh_lengths():
    """A decode loop may keep one positions tensor and add 1 to it each step: the per-step lengths must follow."""
    from llmlab.cache.static_cache import StaticKVCache

    model = tiny_model(seed=6).to(DEV)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3)).to(DEV)

    def run():
        cache = StaticKVCache(model.config, 2, 32, torch.float32, DEV)
        model(ids, kv_cache=cache)
        P = torch.tensor([[12], [12]], device=DEV)
        outs = []
        for step in range(3):
            outs.append(model(ids[:, step:step + 1], positions=P, kv_cache=cache))
            P += 1
        return outs

    ref = run()
    for a, b in zip(_run_patched(model, run), ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_a_patched_model_saves_and_loads_like_the_original(tmp_path):
    """The fused projections make q/k/v (gate/up) views of one tensor: saving must still write separate weights."""
    from llmlab.checkpoint import load_model, save_model

    model = tiny_model(seed=7).to(DEV)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4)).to(DEV)
    ref = model(ids)
    patch_model.enable(model)
    try:
        model(ids)  # builds the fused tensors
        save_model(model, tmp_path)
    finally:
        patch_model.disable(model)
    loaded = load_model(tmp_path, device=DEV, dtype=torch.float32)
    torch.testing.assert_close(loaded(ids), ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 2])
def test_a_position_outside_the_static_cache_is_refused_before_anything_is_written(batch):
    """As the PyTorch path's indexing refuses it — and the cache is left as it was, still usable."""
    from llmlab.cache.static_cache import StaticKVCache

    model = tiny_model(seed=3).to(DEV)
    patch_model.enable(model)
    try:
        cache = StaticKVCache(model.config, batch, 8, torch.float32, DEV)
        model(torch.randint(0, 256, (batch, 4), generator=torch.Generator().manual_seed(0)).to(DEV), kv_cache=cache)
        before = [t.clone() for t in cache.k + cache.v]
        tok = torch.full((batch, 1), 5, device=DEV)
        for bad in (8, -1):
            with pytest.raises(ValueError, match="outside the static KV cache's 8 slots"):
                model(tok, positions=torch.full((batch, 1), bad, device=DEV), kv_cache=cache)
            assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))
        out = model(tok, positions=torch.full((batch, 1), 4, device=DEV), kv_cache=cache)  # still usable
        assert torch.isfinite(out).all()
    finally:
        patch_model.disable(model)


def test_kernel_demos_exit_cleanly_without_a_gpu(monkeypatch):
    """`python -m llmlab.kernels.<op>` times the kernel on a GPU; without one it says so and how to run on a CPU."""
    from llmlab.kernels import _util

    monkeypatch.setattr(_util.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="fused_gemv: .*no.*bench_kernels --smoke"):
        _util.demo_needs_cuda("fused_gemv")
