"""Choosing the next token from the logits: greedy, temperature, top-k, top-p (nucleus).

Temperature T divides the logits (T -> 0 is greedy, T = 1 the model's own distribution); top-k keeps the k most
likely tokens; top-p keeps the smallest set whose probabilities add up to at least p (Holtzman et al. 2019,
https://arxiv.org/abs/1904.09751). Everything stays on the logits' device: no host round trip to pick a token
(and no hidden one either: `sample_from_probs` replaces `torch.multinomial`, whose input checks synchronize).
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings

import torch
import torch.nn.functional as F

ARGMAX_CHUNK = 1024  # keys per first-stage slice of `argmax_rows`
FP32_TINY = torch.finfo(torch.float32).tiny  # below this temperature 1 / T is no fp32 number: `sample` is greedy


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, V) float -> (B,) int64: the index of each row's first maximum, as `x.argmax(dim=-1)`, in two stages
    (any other shape or dtype: `x.argmax(dim=-1)` itself).

    PyTorch reduces a row into one value with ONE thread block when there are few rows: the greedy token of a
    128K-vocabulary model at batch 1 then runs on one SM while the rest idle, a visible share of a small model's
    decode step (docs/results.md). Here the row is cut into slices of ARGMAX_CHUNK (padded with -inf), each slice's
    max is found in parallel, then the best slice: ~5 small kernels of a few microseconds. Ties go to the lowest
    index, as in torch.argmax.
    """
    if x.dim() != 2 or not x.is_floating_point():  # the one-stage op (any shape, integer scores)
        return x.argmax(dim=-1)
    B, V = x.shape
    if V <= ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    n = -(-V // ARGMAX_CHUNK)
    slices = F.pad(x, (0, n * ARGMAX_CHUNK - V), value=float("-inf")).view(B, n, ARGMAX_CHUNK)
    best, where = slices.max(dim=-1)  # (B, n): each slice's max and its first position
    s = best.argmax(dim=-1, keepdim=True)  # (B, 1): the first slice holding the row's max
    return (s * ARGMAX_CHUNK + where.gather(-1, s))[:, 0]


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError, naming the argument and the valid range, for settings that make no distribution (and
    TypeError for a setting that is not a number)."""
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"{name}={value!r} is not a number: pass e.g. temperature=0.8, top_k=50, top_p=0.9")
    if temperature is None or not 0 <= temperature < math.inf:  # also catches NaN
        raise ValueError(f"temperature={temperature} is invalid: use 0 for greedy decoding or a finite positive "
                         f"number")
    if top_k is not None and (not math.isfinite(top_k) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k={top_k} is invalid: use a whole number >= 1, or None to keep every token")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} is outside (0, 1]: use e.g. 0.9, or None (= 1.0) to keep every token")


_INTERNAL = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)  # llmlab's, torch's files


def warn_greedy_filters(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Warn (UserWarning) when top_k or top_p is given at temperature 0: greedy decoding takes the most likely token,
    which every top-k / top-p filter keeps, so they change nothing. Not an error: Hugging Face accepts it too.

    Called once per generate call (not per token); the warning points at the first caller outside llmlab and torch
    (the user's line), however deep inside llmlab it is raised."""
    if temperature != 0:
        return
    given = [f"{name}={value!r}" for name, value in (("top_k", top_k), ("top_p", top_p)) if value is not None]
    if not given:
        return
    level, frame = 1, sys._getframe(0)  # stacklevel 1 is this function
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        level, frame = level + 1, frame.f_back
    warnings.warn(f"{' and '.join(given)} {'have' if len(given) > 1 else 'has'} no effect with greedy decoding "
                  f"(temperature=0 always takes the most likely token): set temperature > 0 (e.g. 0.8) to sample "
                  f"with {'them' if len(given) > 1 else 'it'}, or leave {'them' if len(given) > 1 else 'it'} unset",
                  UserWarning, stacklevel=level)


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: (B, V) scores of the next token, any float dtype (computed in fp32 here).
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature). A temperature below
            fp32's smallest normal number (~1.2e-38), where the division would underflow, is greedy too.
        top_k: keep only the k highest-scoring tokens, exactly k: of the tokens tied with the k-th score, those
            torch.topk returns (None: all).
        top_p: keep the smallest set of tokens whose probability mass reaches top_p (None or 1.0: all).
        generator: a seeded torch.Generator on logits.device for reproducible sampling.

    Returns:
        (B,) int64 token ids on logits.device.

    Raises:
        ValueError: temperature < 0, top_k < 1, top_p outside (0, 1]; logits that are not (B, V).
    """
    check_sampling_args(temperature, top_k, top_p)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"sample: logits must be a (B, V) tensor, one row of scores per sequence; got {shape} "
                         f"(one row: logits[None])")
    if temperature < FP32_TINY:  # 0, or so small that dividing by it would underflow: greedy
        return argmax_rows(logits)
    logits = logits.float()
    # shift the best score to 0 before dividing: at a tiny temperature (1e-40) the plain logits / T overflows to inf
    # and softmax turns inf - inf into NaN; shifted, the best token stays at 0 and the rest go to -inf (greedy)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        # exactly k survive: masking by the k-th score (`logits < kth`) would also keep every token tied with it
        kept = torch.topk(logits, int(top_k), dim=-1).indices  # (B, k)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, kept, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of all tokens ranked above this one
        drop_sorted = mass_before >= top_p  # the most likely token always survives (mass_before = 0)
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return sample_from_probs(probs, generator)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of (B, V) probabilities -> (B,) int64, with no host synchronization.

    argmax(p / q), q ~ Exp(1) per entry, picks token i with probability p_i (the exponential race, a form of the
    Gumbel-max trick). It is exactly what `torch.multinomial(probs, 1)` computes — same random draws, same tokens
    for the same generator state — minus multinomial's input checks, which read a GPU value on the host
    (`.item()`) and so stall the CPU until the GPU has caught up, once per token. Source: `multinomial_out` in
    PyTorch's aten/src/ATen/native/Distributions.cpp.
    """
    q = torch.empty_like(probs).exponential_(1, generator=generator)  # (B, V)
    return argmax_rows(probs / q)
