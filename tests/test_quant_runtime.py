"""A weight-only quantized model on every path the float model runs: the fused q/k/v and gate/up layers the kernel
modules use (`llmlab.quant.fused`), the kernels' decode step, the `weights` switch, the `+int8` / `+int4` rungs and
the bench's byte counts.

On a CPU the kernel modules run in Triton's interpreter and the quantized layers dequantize in PyTorch; the GPU
tests (marked) run the int8 / int4 kernels inside CUDA graphs and compare the tokens with the eager quantized model.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.engine import LLM
from llmlab.ladder import available_steps, step_names
from llmlab.measure.model_bytes import allocated_weight_bytes, step_weight_bytes
from llmlab.quant import Int4Linear, Int8Linear, quantize_model, weight_bytes
from llmlab.quant.fused import fuse_quantized
from llmlab.switches import SWITCHES, apply_switches
from tiny_models import tiny_model

SCHEMES = [("int8", 32), ("int4", 32), ("int4", 64)]


def _layers(scheme, group, n_rows=(48, 16, 16), k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in n_rows:
        lin = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        out.append(Int8Linear.from_linear(lin) if scheme == "int8" else Int4Linear.from_linear(lin, group))
    return out


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_fused_quantized_layer_equals_the_layers_side_by_side_and_shares_their_memory(scheme, group):
    layers = _layers(scheme, group)
    x = torch.randn(3, 5, 128)
    want = torch.cat([lin(x) for lin in layers], dim=-1)
    fused = fuse_quantized(layers)
    assert fused.sizes == (48, 16, 16) and fused.layer.out_features == 80
    torch.testing.assert_close(fused.layer(x), want, rtol=0, atol=0)
    # the layers now read views of the fused tensors: the same outputs, no second copy
    torch.testing.assert_close(torch.cat([lin(x) for lin in layers], dim=-1), want, rtol=0, atol=0)
    for lin in layers:
        for t in lin.packed_tensors():
            assert t.untyped_storage().data_ptr() == fused.layer.packed_tensors()[0].untyped_storage().data_ptr() \
                or t.untyped_storage().data_ptr() == fused.layer.packed_tensors()[1].untyped_storage().data_ptr()
    assert fuse_quantized(layers, fused) is fused  # nothing moved: reused


def test_fused_quantized_layer_is_rebuilt_when_a_buffer_is_replaced():
    layers = _layers("int8", None)
    fused = fuse_quantized(layers)
    layers[1].scales = layers[1].scales * 2  # a new tensor, not a view of the fused one
    again = fuse_quantized(layers, fused)
    assert again is not fused
    x = torch.randn(2, 128)
    torch.testing.assert_close(again.layer(x), torch.cat([lin(x) for lin in layers], dim=-1))


def test_fusing_layers_of_different_formats_is_refused():
    a = _layers("int8", None, n_rows=(16,))[0]
    b = _layers("int4", 32, n_rows=(16,))[0]
    with pytest.raises(ValueError, match="same scheme"):
        fuse_quantized([a, b])
    c, d = _layers("int4", 32, n_rows=(16,))[0], _layers("int4", 64, n_rows=(16,))[0]
    with pytest.raises(ValueError, match="group size"):
        fuse_quantized([c, d])


def test_the_weights_switch_runs_a_quantized_copy_and_leaves_the_loaded_model_alone():
    assert SWITCHES["weights"].choices == (None, "int8", "int4", "int4-g64", "int4-g32", "int8+lm_head",
                                           "int4+lm_head")
    llm = LLM(tiny_model())
    before = {k: v.clone() for k, v in llm.model.state_dict().items()}
    q, kwargs = apply_switches(llm, {"weights": "int4-g64"})
    assert q is not llm and "int4 g64" in q.name
    layers = [m for m in q.model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.group_size == 64 for m in layers)
    assert all(torch.equal(v, llm.model.state_dict()[k]) for k, v in before.items())
    same, _ = apply_switches(llm, {"weights": None})
    assert same is llm
    with pytest.raises(ValueError, match="weights='int3' is not one of"):
        apply_switches(llm, {"weights": "int3"})
    assert llm.generate([1, 2, 3], max_new_tokens=3).token_ids  # the loaded model still decodes


def test_the_quantized_rungs_sit_on_top_of_the_ladder_and_run_on_a_cpu():
    names = step_names()
    assert names.index("+int8") > names.index("+prefill_graphs") and names.index("+int4") > names.index("+int8")
    runnable, skipped = available_steps(LLM(tiny_model()), ["eager", "+int8", "+int4"])
    by_name = {r.name: r for r in runnable}
    assert set(by_name) == {"eager", "+int8", "+int4"}, skipped
    assert by_name["+int8"].settings == {"kv_cache": True, "weights": "int8"}
    assert by_name["+int4"].settings["weights"] == "int4"


def test_the_lm_head_formats_quantize_the_output_layer_too_and_their_rungs_wait_for_a_gpu():
    llm = LLM(tiny_model())  # tied embeddings: a quantized lm_head gets its own copy, the embedding stays float
    heads = {}
    for value in ("int4", "int4+lm_head", "int8+lm_head"):
        q, _ = apply_switches(llm, {"weights": value})
        heads[value] = type(q.model.lm_head).__name__
        assert isinstance(q.model.embed_tokens, torch.nn.Embedding)
        assert q.generate([1, 2, 3], max_new_tokens=3).token_ids
    assert heads == {"int4": "Linear", "int4+lm_head": "Int4Linear", "int8+lm_head": "Int8Linear"}
    assert type(llm.model.lm_head) is torch.nn.Linear  # the loaded model keeps its float layers
    runnable, skipped = available_steps(llm, ["+int8_lm_head", "+int4_lm_head"])
    if llm.device.type == "cpu":
        assert not runnable and all("dequantized in PyTorch" in why for _, why in skipped)
    gpu_settings = [s.settings for s, _ in skipped] + [r.settings for r in runnable]
    assert sorted(s["weights"] for s in gpu_settings) == ["int4+lm_head", "int8+lm_head"]


def test_bytes_read_per_step_and_allocated_follow_the_format():
    model = tiny_model()  # tied embeddings: lm_head reads the embedding table
    fp32 = step_weight_bytes(model)
    assert fp32 == weight_bytes(model) == allocated_weight_bytes(model)
    q = quantize_model(tiny_model(), "int8")
    linear_params = sum(m.in_features * m.out_features for m in q.modules() if isinstance(m, Int8Linear))
    scales = sum(m.out_features * 4 for m in q.modules() if isinstance(m, Int8Linear))
    assert step_weight_bytes(q) == fp32 - 3 * linear_params + scales  # 4 -> 1 byte per weight, + fp32 scales
    assert allocated_weight_bytes(q) == step_weight_bytes(q)
    untied = tiny_model(tie_embeddings=False)
    table = untied.embed_tokens.weight
    assert step_weight_bytes(untied) == weight_bytes(untied) - table.numel() * table.element_size()


def test_an_int8_row_of_the_bench_counts_the_bytes_it_reads(tmp_path):
    from llmlab.measure.bench import run_bench

    llm = LLM(tiny_model())
    doc = run_bench("chat", "tiny", steps=["eager", "+int8"], peers=False, out=None, quick=True, llm=llm,
                    print_fn=lambda *a: None)
    rows = {r["step"]: r for r in doc["results"]}
    assert {"eager", "+int8"} <= set(rows), doc["skipped"]
    eager, int8 = rows["eager"], rows["+int8"]
    assert int8["weights"] == "int8" and eager["weights"] == "fp32"
    assert int8["weights_read_GB"] < 0.5 * eager["weights_read_GB"]  # tied 256 x 128 table stays fp32
    assert int8["weight_bytes_per_param"] == pytest.approx(
        int8["weights_read_GB"] * 1e9 / eager["weights_read_GB"] / 1e9 * 4)
    assert int8["weights_allocated_GB"] > 0


# -- the kernel modules on a quantized model ---------------------------------------------------------------------

def _kernels_or_skip():
    pytest.importorskip("triton")
    from llmlab.kernels._util import interpret_mode

    if not torch.cuda.is_available() and not interpret_mode():
        pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set")


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_kernel_modules_on_a_quantized_model_give_its_logits(scheme, group):
    _kernels_or_skip()
    from llmlab.cache.kv_cache import KVCache
    from llmlab.kernels.decode_step import KernelDecodeStep, fusable_shape
    from llmlab.kernels.modules import swap_in
    from llmlab.kernels.step_tuning import fusable

    q = quantize_model(tiny_model(), scheme, group_size=group)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    ref_cache = KVCache(q.config, 2, 32, torch.float32, "cpu")
    want = [q(ids, kv_cache=ref_cache)]
    want.append(q(want[0][:, -1:].argmax(-1), positions=torch.tensor([9]), kv_cache=ref_cache))
    swap_in(q)
    # its batch-1 step fuses the small ops into the quantized GEMVs, whose step step tuning can time
    assert fusable_shape(q, torch.float32) and fusable(q) == (True, "")
    step = KernelDecodeStep(q)
    cache = KVCache(q.config, 2, 32, torch.float32, "cpu")
    got = [step(ids, kv_cache=cache)]
    got.append(step(want[0][:, -1:].argmax(-1), positions=torch.tensor([9]), kv_cache=cache))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert q.layers[0].self_attn.fused.layer.out_features == q.config.dim + 2 * q.config.n_kv_heads * 16


# -- on a GPU: the int8 / int4 kernels inside the captured decode step ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("value", ["int8", "int4-g64"])
def test_quantized_rung_on_cuda_graphs_and_kernels_decodes_like_the_eager_quantized_model(value):
    import llmlab

    llm = llmlab.load(device="cuda", dtype=torch.float32)
    prompt = "def fibonacci(n):"
    q, _ = apply_switches(llm, {"weights": value})
    want = q.generate(prompt, max_new_tokens=48, stop_at_eos=False).token_ids[0]
    runnable, skipped = available_steps(llm, ["+int8" if value == "int8" else "+int4"])
    settings = dict(runnable[0].settings, weights=value)
    assert settings.get("cuda_graphs") and settings.get("triton_kernels"), skipped
    fast, kwargs = apply_switches(llm, settings)
    got = fast.generate(prompt, max_new_tokens=48, stop_at_eos=False, **kwargs).token_ids[0]
    assert got == want
    assert allocated_weight_bytes(fast.model) < 0.6 * allocated_weight_bytes(llm.model)
