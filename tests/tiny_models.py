"""Small random models shared by the tests: llmlab `Transformer`s and Hugging Face `transformers` models.

Weights are drawn with a large std (0.15, not the usual 0.02) and RMSNorm gains around 1 +- 0.2, so that every part
of the network (RoPE pairing and scaling, the GQA head mapping, q/k/v biases, the sliding window) moves the logits
by whole units, far more than the 1e-4 tolerance, and greedy decoding does not settle on one repeated token. Larger
stds (0.3) make the logits so large (|logit| ~ 15) that honest fp32 rounding alone reaches ~7e-5 against
transformers; at 0.15 it is ~1e-5 (logits std ~1.8, max ~7), a 10x margin under the tolerance.

Not a test module (the name does not start with test_); the tests import it as `tiny_models`.
"""

from __future__ import annotations

import torch
import transformers

from llmlab.config import ModelConfig
from llmlab.model import Transformer

TF_MAJOR = int(transformers.__version__.split(".")[0])

# Llama-3 RoPE rescaling with a tiny original context, so that at a 40-token prompt it changes the angles. With
# theta 500 and head_dim 16 the wavelengths are 2*pi*500^(i/8), i = 0..7: 6.3 13.7 29.7 64.6 140 306 664 1445 tokens.
# The first two lie in the blended band [16/4, 16/1] = [4, 16]; the other six are longer than 16 and get divided by
# `factor`. So all three branches of the llama3 formula are exercised.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
ROPE_THETA = 500.0


def randomize_(model: torch.nn.Module, std: float = 0.15, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter in place: norm gains ~ 1 + 0.2 N(0, 1), everything else (biases too) std * N(0, 1).

    Works on llmlab and transformers models alike (both name their norms `*norm.weight`); tied weights are drawn
    once (named_parameters skips the duplicate). Returns the model.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(std * noise)
    return model


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Llama-3-style config: 8 query heads / 2 KV heads, head_dim 16, tied embeddings, llama3 RoPE."""
    params = dict(
        vocab_size=256, dim=128, n_layers=2, n_heads=8, n_kv_heads=2, intermediate_size=192, norm_eps=1e-5,
        rope_theta=ROPE_THETA, rope_scaling=dict(LLAMA3_ROPE), max_seq_len=256, tie_embeddings=True,
    )
    params.update(overrides)
    return ModelConfig(**params)


def tiny_model(seed: int = 0, std: float = 0.15, **overrides) -> Transformer:
    """A random llmlab model (fp32, CPU, eval mode) built from `tiny_config(**overrides)`; same seed -> same weights."""
    torch.manual_seed(seed)
    return randomize_(Transformer(tiny_config(**overrides)), std=std, seed=seed).eval()


def _rope_kwargs(rope_scaling: dict | None, theta: float) -> dict:
    """RoPE settings in the form the installed transformers accepts (v5: rope_parameters; v4: rope_scaling)."""
    if TF_MAJOR >= 5:
        params = {"rope_type": "default"} if rope_scaling is None else dict(rope_scaling)
        params["rope_theta"] = theta
        return {"rope_parameters": params}
    return {"rope_theta": theta, "rope_scaling": None if rope_scaling is None else dict(rope_scaling)}


def hf_model(kind: str, seed: int = 0, std: float = 0.15, **overrides):
    """A random transformers model of family `kind`, fp32, eval mode, eager attention.

    kind: "llama" (GQA 8/2, tied, llama3 RoPE), "qwen2" (GQA 8/2, q/k/v bias, untied), "mistral" (GQA 8/2,
    untied, sliding window 8: shorter than the 40-token test prompt, so the window matters).
    """
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True,
                                       **_rope_kwargs(LLAMA3_ROPE, ROPE_THETA), **overrides)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False,
                                       **_rope_kwargs(None, 10000.0), **overrides)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=8,
                                         **_rope_kwargs(None, 10000.0), **overrides)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"unknown kind {kind!r}")
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    return randomize_(model, std=std, seed=seed).eval()


def prompt_ids(batch: int = 2, length: int = 40, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    """(batch, length) int64 random token ids."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# A few lines of Python source: what the shipped model is trained on, and enough text to learn ~50 BPE merges.
PY_SNIPPET = '''def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)
'''
EOS_TOKEN = "<|endoftext|>"


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE `tokenizers.Tokenizer` trained on PY_SNIPPET: any text round-trips exactly.

    Id 0 is EOS_TOKEN; ids 1..256 are the byte alphabet; the rest are merges (at most vocab_size in all).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PY_SNIPPET] * 4, trainer=trainer)
    return tok


def model_folder(folder, seed: int = 0, tokenizer: bool = True, **overrides):
    """Save a random llmlab model (vocab sized to `tiny_tokenizer`, EOS = its id 0) and, optionally, tokenizer.json
    into `folder`. Returns (folder, model)."""
    from pathlib import Path

    from llmlab.checkpoint import save_model

    folder = Path(folder)
    overrides = {"vocab_size": 300, "eos_token_id": 0, "bos_token_id": None, **overrides}
    model = tiny_model(seed=seed, **overrides)
    save_model(model, folder)
    if tokenizer:
        tiny_tokenizer(overrides["vocab_size"]).save(str(folder / "tokenizer.json"))
    return folder, model


def pad_row_logits(runner, prompts, pad_token: int, pad_pos: int, poison: bool, steps: int = 16) -> list:
    """Prefill `prompts` (3 real rows) on a `GraphDecoder` and decode `steps` steps in its bucket of 4, with the pad
    row 3 fed `pad_token` at `pad_pos` and, if `poison`, NaN written into its cache row before every step.
    Returns the logits of every step (cloned) — for checking that pad rows never change real rows."""
    token = runner.prefill(prompts).argmax(-1)
    runner.start(token, prompts.shape[1])
    seen = []
    for _ in range(steps):
        if poison:
            for t in runner.cache.k + runner.cache.v:
                t[3].fill_(float("nan"))
        runner.ids[3, 0], runner.pos[3] = pad_token, pad_pos  # overwrite the pad row's inputs
        logits, token = runner.step()
        seen.append(logits.clone())
        runner.advance(token)
    return seen


def greedy_on_static_cache(fwd, model, ids: torch.Tensor, steps: int, cache_len: int = 24) -> list:
    """Prefill `ids` (1, T) through `fwd` (a model's forward, or a wrapper around it) on a fresh fp32 static cache of
    `cache_len` slots, then feed back the greedy token `steps` times. Returns the logits of every call."""
    from llmlab.cache.static_cache import StaticKVCache

    cache = StaticKVCache(model.config, 1, cache_len, torch.float32, ids.device)
    outs = [fwd(ids, kv_cache=cache)]
    for i in range(steps):
        nxt = outs[-1][:, -1:].argmax(-1)
        pos = torch.tensor([[ids.shape[1] + i]], device=ids.device)
        outs.append(fwd(nxt, positions=pos, kv_cache=cache))
    return outs


def quantized_layer(scheme: str, N: int, K: int, group: int = 32, seed: int = 0, bias: bool = False,
                    device="cpu"):
    """An N x K `Int8Linear` (scheme "int8") or `Int4Linear` of `group` from a random fp32 Linear (std 0.05)."""
    from llmlab.quant import Int4Linear, Int8Linear

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
    q = Int8Linear.from_linear(lin) if scheme == "int8" else Int4Linear.from_linear(lin, group)
    return q.to(device)


def one_token_inputs(N: int, K: int, swiglu: bool, seed: int = 1, dtype=torch.float32, device="cpu"):
    """A one-token GEMV's inputs: x (1, 1, K), or (1, 1, 2K) [gate | up] with swiglu, an RMSNorm weight (K,) around
    1 and a residual (1, 1, N)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, 1, 2 * K if swiglu else K, generator=g) * 2).to(device, dtype)
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(device, dtype)
    res = torch.randn(1, 1, N, generator=g).to(device, dtype)
    return x, nw, res
