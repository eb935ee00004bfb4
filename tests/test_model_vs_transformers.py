"""llmlab's decoder against Hugging Face transformers, on small random models built inside the tests.

Three families, each exercising different switches: Llama (GQA 8/2, tied embeddings, Llama-3 RoPE scaling with a
small original context), Qwen2 (q/k/v bias, untied) and Mistral (sliding window shorter than the prompt). Both
directions of loading are checked (transformers folder -> llmlab, llmlab folder -> transformers), and the KV-cache
path is checked against transformers' full-sequence logits. The `*_would_fail` tests prove the 1e-4 tolerance has
teeth: a deliberately wrong variant (RoPE pairing, RoPE scaling, GQA mapping, biases, window) misses it by far.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import llmlab.model as lm
from llmlab.checkpoint import load_model, save_model
from llmlab.generate import generate
from llmlab.cache.kv_cache import KVCache
from tiny_models import LLAMA3_ROPE, hf_model, prompt_ids, randomize_, tiny_config

TOL = 1e-4  # max-abs logit difference allowed at fp32
PROMPT_LEN, BATCH, PREFILL = 40, 2, 24
KINDS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (transformers model, llmlab model loaded from its save_pretrained folder, folder)."""
    out = {}
    for kind in KINDS:
        hf = hf_model(kind, seed=len(out))
        folder = tmp_path_factory.mktemp(f"hf-{kind}")
        hf.save_pretrained(folder)  # safetensors (the only format transformers 5 writes)
        out[kind] = (hf, load_model(folder), folder)
    return out


@pytest.fixture(scope="module")
def ids():
    return prompt_ids(BATCH, PROMPT_LEN)


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# -- loading a transformers checkpoint --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_config_read_from_transformers(pairs, kind):
    hf, ours, _ = pairs[kind]
    c = ours.config
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.n_rep) == (8, 2, 16, 4)
    assert c.tie_embeddings == (kind == "llama")
    assert c.attention_bias == (kind == "qwen2")
    assert c.sliding_window == (8 if kind == "mistral" else None)
    assert c.architecture == type(hf).__name__
    if kind == "llama":
        assert c.rope_scaling["rope_type"] == "llama3"
        assert c.rope_scaling["original_max_position_embeddings"] == 16
        assert ours.lm_head.weight is ours.embed_tokens.weight  # still tied after loading
    else:
        assert c.rope_scaling is None
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()) == c.num_params()


def test_rope_frequencies_match_transformers(pairs):
    """The llama3-rescaled inverse frequencies equal transformers' own (and really are rescaled)."""
    hf, ours, _ = pairs["llama"]
    theirs = hf.model.rotary_emb.inv_freq.float()
    assert torch.allclose(ours.rope.inv_freq, theirs, rtol=1e-6, atol=0)
    plain = lm.rope_inv_freq(dataclasses.replace(ours.config, rope_scaling=None))
    assert (plain - theirs).abs().max() > 1e-3  # the scaling changed them: the check above means something
    assert getattr(hf.model.rotary_emb, "attention_scaling", 1.0) == 1.0  # llama3 applies no cos/sin factor


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(pairs, ids, kind):
    hf, ours, _ = pairs[kind]
    ref = hf_logits(hf, ids)
    with torch.no_grad():
        got = ours(ids)
    assert got.shape == ref.shape == (BATCH, PROMPT_LEN, 256)
    assert got.dtype == torch.float32
    assert ref.std() > 1.0, "logits nearly constant: the random model is too tame for the comparison to mean much"
    assert max_diff(got, ref) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_last_only_equals_last_position(pairs, ids, kind):
    _, ours, _ = pairs[kind]
    with torch.no_grad():
        full, last = ours(ids), ours(ids, last_only=True)
    assert last.shape == (BATCH, 1, 256)
    assert max_diff(last[:, 0], full[:, -1]) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_kv_cache_path_matches_transformers(pairs, ids, kind):
    """Prefill PREFILL tokens into a KVCache, then feed the rest one token at a time: every position's logits equal
    transformers' full-sequence logits at that position."""
    hf, ours, _ = pairs[kind]
    ref = hf_logits(hf, ids)
    cache = KVCache(ours.config, BATCH, PROMPT_LEN, torch.float32, "cpu")
    with torch.no_grad():
        pre = ours(ids[:, :PREFILL], torch.arange(PREFILL), kv_cache=cache)
        assert cache.length == PREFILL
        assert max_diff(pre, ref[:, :PREFILL]) <= TOL
        for t in range(PREFILL, PROMPT_LEN):
            step = ours(ids[:, t:t + 1], torch.tensor([t]), kv_cache=cache)  # (B, 1, V)
            assert cache.length == t + 1
            assert max_diff(step[:, 0], ref[:, t]) <= TOL, f"position {t}"


def test_kv_cache_chunked_prefill_matches(pairs, ids):
    """Several multi-token chunks through the cache (chunked prefill) also give the full-sequence logits."""
    hf, ours, _ = pairs["llama"]
    ref = hf_logits(hf, ids)
    cache = KVCache(ours.config, BATCH, PROMPT_LEN, torch.float32, "cpu")
    with torch.no_grad():
        for start, end in [(0, 7), (7, 20), (20, 21), (21, 40)]:
            out = ours(ids[:, start:end], torch.arange(start, end), kv_cache=cache)
            assert max_diff(out, ref[:, start:end]) <= TOL, (start, end)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_rows_are_independent(pairs, ids, kind):
    _, ours, _ = pairs[kind]
    with torch.no_grad():
        both, first = ours(ids), ours(ids[:1])
    assert max_diff(both[:1], first) <= 1e-5


def test_greedy_tokens_match_transformers_generate(pairs, ids):
    """llmlab's greedy decode (KV cache) picks the same tokens as transformers' `generate`."""
    hf, ours, _ = pairs["llama"]
    n = 24
    with torch.no_grad():
        theirs = hf.generate(ids[:1], max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    ours_ids = generate(ours, ids[0], max_new_tokens=n).token_ids[0]
    assert ours_ids == theirs[0, PROMPT_LEN:].tolist()
    assert len(set(ours_ids)) > 3


# -- the tolerance has teeth --------------------------------------------------------------------------------------


def _interleaved_rotate(x: torch.Tensor) -> torch.Tensor:
    """The GPT-J / Meta-original pairing (x0, x1), (x2, x3), ...: wrong for Hugging Face checkpoints."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def test_wrong_rope_pairing_would_fail(pairs, ids, monkeypatch):
    hf, ours, _ = pairs["llama"]
    monkeypatch.setattr(lm, "rotate_half", _interleaved_rotate)
    with torch.no_grad():
        assert max_diff(ours(ids), hf_logits(hf, ids)) > 100 * TOL


def test_dropping_rope_scaling_would_fail(pairs, ids):
    hf, ours, _ = pairs["llama"]
    scaled = ours.rope.inv_freq.clone()
    try:
        ours.rope.inv_freq = lm.rope_inv_freq(dataclasses.replace(ours.config, rope_scaling=None))
        with torch.no_grad():
            assert max_diff(ours(ids), hf_logits(hf, ids)) > 100 * TOL
    finally:
        ours.rope.inv_freq = scaled
    with torch.no_grad():
        assert max_diff(ours(ids), hf_logits(hf, ids)) <= TOL  # restored


def test_wrong_gqa_mapping_would_fail(pairs, ids, monkeypatch):
    """Query head i must read KV head i // n_rep; `repeat` (i % n_kv_heads) gives different logits."""
    hf, ours, _ = pairs["llama"]
    monkeypatch.setattr(lm, "repeat_kv", lambda x, n_rep: x.repeat(1, n_rep, 1, 1))
    with torch.no_grad():
        assert max_diff(ours(ids), hf_logits(hf, ids)) > 100 * TOL


def test_missing_qkv_bias_would_fail(pairs, ids):
    hf, _, folder = pairs["qwen2"]
    ours = load_model(folder)
    with torch.no_grad():
        for layer in ours.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
        assert max_diff(ours(ids), hf_logits(hf, ids)) > 100 * TOL


def test_ignoring_sliding_window_would_fail(pairs, ids):
    hf, _, folder = pairs["mistral"]
    ours = load_model(folder)
    for layer in ours.layers:
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        assert max_diff(ours(ids), hf_logits(hf, ids)) > 100 * TOL


# -- llmlab checkpoint -> transformers ---------------------------------------------------------------------------

REVERSE = {
    "llama": dict(),  # tied, GQA 8/2, llama3 RoPE (tiny_config's defaults)
    "llama-untied-mha": dict(n_kv_heads=8, tie_embeddings=False, rope_scaling=None, rope_theta=10000.0),
    "qwen2": dict(architecture="Qwen2ForCausalLM", attention_bias=True, tie_embeddings=False, rope_scaling=None,
                  rope_theta=1e6, norm_eps=1e-6),
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=8, tie_embeddings=False, rope_scaling=None),
}


@pytest.mark.parametrize("variant", list(REVERSE))
def test_save_model_loads_in_transformers(tmp_path, ids, variant):
    torch.manual_seed(0)
    ours = randomize_(lm.Transformer(tiny_config(**REVERSE[variant])), seed=3).eval()
    save_model(ours, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert type(hf).__name__ == ours.config.architecture
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf.eval()
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert ref.std() > 1.0
    assert max_diff(got, ref) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_transformers_llmlab_llmlab(pairs, tmp_path, kind):
    """transformers folder -> llmlab -> save_model -> llmlab again: same config and bit-identical weights."""
    _, ours, _ = pairs[kind]
    again = load_model(save_model(ours, tmp_path))
    assert dataclasses.replace(again.config, name="x") == dataclasses.replace(ours.config, name="x")
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_to_hf_config_round_trips():
    """to_hf_config -> from_hf_config is the identity (Llama-3 scaling included)."""
    from llmlab.config import ModelConfig

    for overrides in REVERSE.values():
        c = tiny_config(**overrides)
        back = ModelConfig.from_hf_config(c.to_hf_config(), name=c.name)
        assert back == c
    assert tiny_config().rope_scaling == LLAMA3_ROPE
