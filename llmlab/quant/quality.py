"""How much quantization changes a model: perplexity on held-out tokens, and greedy-token agreement with a reference.

* `perplexity(model, token_ids)`: exp(mean negative log-likelihood) of each token given the ones before it, in a
  sliding window of `context` tokens (the standard recipe, e.g. Hugging Face's "Perplexity of fixed-length models").
  GPTQ (https://arxiv.org/abs/2210.17323) and AWQ (https://arxiv.org/abs/2306.00978) report quantized models this
  way (on WikiText-2 / C4); a good int8 model changes it by well under 1%, int4 round-to-nearest by a few percent.
* `greedy_agreement(model_a, model_b, prompts, n_tokens)`: the fraction of greedy tokens that are equal when both
  models continue the same prompts. A stricter, user-visible measure: after the first different token the two
  continuations have different histories and usually stay different.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

__all__ = ["perplexity", "greedy_agreement"]


def _as_ids(op: str, token_ids, vocab_size: int | None) -> torch.Tensor:
    """token ids (a list of ints, a (T,) or (1, T) integer tensor) -> (T,) int64 CPU tensor, checked."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{op}: token_ids must be token ids, got text ({token_ids[:40]!r}); encode it first: "
                        f"llm.encode(text), or llmlab.quant.evaluation_ids(llm) for the held-out text")
    if not isinstance(token_ids, torch.Tensor):
        try:
            token_ids = list(token_ids)
        except TypeError:
            raise TypeError(f"{op}: token_ids must be token ids (a list of ints or an int tensor), got "
                            f"{type(token_ids).__name__}; e.g. llm.encode(text), or llmlab.quant.evaluation_ids(llm) "
                            f"for the held-out text") from None
        if any(isinstance(t, (str, bytes)) for t in token_ids):
            raise TypeError(f"{op}: token_ids must be token ids, got a list holding text; encode each text first: "
                            f"llm.encode(text)")
    ids = token_ids if isinstance(token_ids, torch.Tensor) else torch.as_tensor(token_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"{op}: token_ids must be one sequence, (T,) or (1, T), got shape {tuple(ids.shape)}")
    if ids.numel() and (ids.is_floating_point() or ids.dtype == torch.bool):
        raise TypeError(f"{op}: token_ids must be integers, got {ids.dtype}")
    ids = ids.long().cpu()
    if vocab_size is not None and ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0].item()
        raise ValueError(f"{op}: token id {bad} is outside the vocabulary 0..{vocab_size - 1}")
    return ids


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _module(op: str, model, name: str = "model") -> torch.nn.Module:
    """The Transformer to run: `model` itself, or an `LLM`'s `.model`; TypeError for anything else."""
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "model", None), torch.nn.Module):
        model = model.model  # an LLM
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: {name} must be a llmlab Transformer or an LLM (llmlab.load()), got "
                        f"{type(model).__name__}")
    return model


@torch.no_grad()
def perplexity(model, token_ids, context: int | None = None, stride: int | None = None) -> float:
    """Perplexity of `token_ids` under `model`: exp of the mean of -log p(t_i | t_<i) over i = 1..T-1 (the first
    token has nothing to be predicted from and is not scored).

    Args:
        model: a `llmlab.model.Transformer` (any module with forward(input_ids (1, T)) -> logits (1, T, V)) or an
            `LLM` (its `.model`), quantized or not; run in eval mode under no_grad, on its own device and dtype.
        token_ids: (T,) held-out ids (a list or an int tensor; (1, T) is accepted), T >= 2.
        context: the most tokens one forward pass sees; default the model's `config.max_seq_len`. At least 2, at
            most `config.max_seq_len` (positions past it are ones the model was not built for).
        stride: how many new tokens each window after the first scores; default context // 2, at most context - 1.
            Every token is scored exactly once; token i is scored with between context - stride and context - 1
            tokens of history (fewer at the start of the text). A smaller stride gives more history, costs more
            passes.

    Returns:
        The perplexity, a float (>= 1). The log-softmax and the sum are in fp32 whatever the model's dtype.

    Raises:
        ValueError: fewer than 2 tokens; a token id outside the vocabulary; context < 2 or above the model's
            max_seq_len; stride not in 1..context-1.
        TypeError: a model that is not a module or an LLM; token ids that are not integers; context or stride not
            an int.
    """
    model = _module("perplexity", model)
    config = getattr(model, "config", None)
    ids = _as_ids("perplexity", token_ids, getattr(config, "vocab_size", None))
    T = ids.numel()
    if T < 2:
        raise ValueError(f"perplexity: got {T} token{'s' if T != 1 else ''}; need at least 2 (the first token is "
                         f"only context: perplexity scores the tokens after it). Give a longer held-out text")
    if context is None:
        context = getattr(config, "max_seq_len", None) or T
    for name, v in (("context", context), ("stride", stride)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise TypeError(f"perplexity: {name} must be an int, got {v!r}")
    context = int(context)
    if context < 2:
        raise ValueError(f"perplexity: context={context}: a window must hold at least 2 tokens")
    longest = getattr(config, "max_seq_len", None)
    if longest and context > longest:
        raise ValueError(f"perplexity: context={context} is longer than the model's max_seq_len {longest}; "
                         f"use context <= {longest} (the default)")
    stride = context // 2 if stride is None else int(stride)
    if not 1 <= stride <= context - 1:
        raise ValueError(f"perplexity: stride={stride} must be in 1..context-1 = 1..{context - 1}, so that each "
                         f"window's first scored token has a token before it in the window")
    was_training = model.training
    model.eval()
    device = _device(model)
    nll = torch.zeros((), dtype=torch.float64)
    try:
        a = 1  # first target not yet scored
        while a < T:
            b = min(a + (context - 1 if a == 1 else stride), T)  # score targets a..b-1
            s = max(0, b - context)  # window ids[s:b]; position p predicts token s + p + 1
            logits = model(ids[s:b].to(device)[None])  # (1, b - s, V)
            logp = F.log_softmax(logits[0, a - s - 1:b - s - 1].float(), dim=-1)  # (b - a, V) fp32
            nll += -logp.gather(1, ids[a:b].to(device)[:, None]).sum().double().cpu()
            a = b
    finally:
        model.train(was_training)
    return math.exp(nll.item() / (T - 1))


def greedy_agreement(model_a, model_b, prompts, n_tokens: int = 32) -> float:
    """Fraction of greedy tokens equal when `model_a` and `model_b` each continue every prompt by n_tokens.

    Args:
        model_a, model_b: `llmlab.model.Transformer`s or `LLM`s with the same vocabulary (e.g. fp32 and int8).
        prompts: a list of prompts, each a list (or 1-D tensor) of token ids; lengths may differ.
        n_tokens: tokens generated per prompt (no early stop at EOS: both always make n_tokens).

    Returns:
        (number of positions i, over all prompts, where both models' i-th generated tokens are equal) /
        (len(prompts) * n_tokens), in [0, 1]. Position-wise: after the first difference, the continuations have
        different histories, so one early difference usually costs the rest of that prompt.

    Generation: `llmlab.generate.generate` at temperature 0 (greedy, KV cache), which checks the prompts (empty,
    too long for the context, ids outside the vocabulary: ValueError).

    Raises:
        ValueError: no prompts; n_tokens < 1; bad prompts (see above; the message names the prompt); models of
            different vocabulary sizes (their token ids name different tokens).
        TypeError: a model that is not a module or an LLM; a prompt given as text; n_tokens not an int.
    """
    from llmlab.generate import generate

    model_a, model_b = _module("greedy_agreement", model_a, "model_a"), _module("greedy_agreement", model_b, "model_b")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral):
        raise TypeError(f"greedy_agreement: n_tokens must be a positive int, got {n_tokens!r}")
    if n_tokens < 1:
        raise ValueError(f"greedy_agreement: n_tokens must be a positive int, got {n_tokens!r}")
    if isinstance(prompts, torch.Tensor):
        prompts = [prompts] if prompts.dim() == 1 else list(prompts)
    prompts = list(prompts)
    if any(isinstance(p, (str, bytes)) for p in prompts):  # text, or a list of texts
        raise TypeError("greedy_agreement: prompts must be token ids, got text; encode it first: "
                        "[llm.encode(text)] (one prompt) or [llm.encode(t) for t in texts]")
    if not prompts or (prompts and isinstance(prompts[0], numbers.Integral)):
        raise ValueError("greedy_agreement: prompts must be a non-empty list of prompts, each a list of token ids "
                         "(one prompt: [ids])")
    va, vb = (getattr(getattr(m, "config", None), "vocab_size", None) for m in (model_a, model_b))
    if va is not None and vb is not None and va != vb:
        raise ValueError(f"greedy_agreement: the models have vocabularies of {va} and {vb} tokens; compare two "
                         f"versions of one model (e.g. llm and llm.quantize('int8')), whose token ids mean the same")
    equal = 0
    for i, p in enumerate(prompts):
        try:
            ta = generate(model_a, p, max_new_tokens=int(n_tokens), temperature=0.0).token_ids[0]
            tb = generate(model_b, p, max_new_tokens=int(n_tokens), temperature=0.0).token_ids[0]
        except ValueError as e:  # generate's check of this prompt (empty, too long with n_tokens, bad ids)
            raise ValueError(f"greedy_agreement: prompt {i}: {e}") from None
        equal += sum(x == y for x, y in zip(ta, tb))
    return equal / (len(prompts) * int(n_tokens))
