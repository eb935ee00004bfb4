"""Autoregressive generation: prefill the prompt, then decode one token per forward pass.

Two paths, kept side by side because their difference is the first lesson of the course:

* `use_cache=True`: prefill runs the whole prompt once and fills a `KVCache`; each decode step then feeds only the
  newest token (T = 1) and reads the cached keys/values of all earlier ones.
* `use_cache=False`: the reference. Every step re-runs the entire sequence so far (prompt + generated), computing
  the same logits from scratch — O(n) work per token instead of O(1) projections.

At fp32 both paths give the same greedy tokens. Each run reports TTFT (time to first token: prefill + first
sample), TPOT (mean time per output token after the first) and tokens/s.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from typing import Callable

import torch

from llmlab.cache.kv_cache import KVCache
from llmlab.model import Transformer
from llmlab.measure.roofline import RunMetrics
from llmlab.sampling import check_sampling_args, sample, warn_greedy_filters
from llmlab.measure.timing import StepTimer, sync


@dataclass
class Generation:
    """The result of one `generate` call. Times are milliseconds between token boundaries (CUDA events on a GPU,
    the host clock on a CPU), so they include the CPU work between forward passes (the GPU's "dark time")."""

    token_ids: list[list[int]]  # generated tokens per sequence, EOS included if it was produced
    prompt_len: int
    step_ms: list[float]  # step 0 = prefill + first token (TTFT); then one entry per decode step
    finish_reason: str  # "eos", "length", or "stopped" (on_token asked to stop)
    use_cache: bool
    device: str
    dtype: str
    text: str | None = None  # row 0's continuation, filled in by `LLM.generate` when a tokenizer is known
    texts: list[str] | None = None  # every row's continuation (a batch has one per prompt), same source
    extra: dict = field(default_factory=dict)

    @property
    def n_generated(self) -> int:
        return max(len(t) for t in self.token_ids)

    @property
    def metrics(self) -> RunMetrics:
        """TTFT, TPOT (mean, p50, p90) and tokens/s of this run as a `llmlab.measure.roofline.RunMetrics`. Its
        tokens_per_s counts batch x steps — the work the GPU did, rows that stopped at EOS included — where
        `tokens_per_s` below counts the tokens kept (the two agree for a run timed by request). A run that timed
        each request (`extra["requests"]`: batching="continuous", whose steps mix prefill chunks and decodes, and
        "one_at_a_time", whose steps are every call's in turn) is read from those timings instead
        (`RunMetrics.from_requests`: means over the requests)."""
        requests = self.extra.get("requests")
        if requests:
            return RunMetrics.from_requests(requests, [len(t) for t in self.token_ids], self.total_ms / 1e3)
        return RunMetrics.from_step_times([ms / 1e3 for ms in self.step_ms], batch=len(self.token_ids))

    @property
    def ttft_ms(self) -> float:
        """Time to first token (ms): the prefill forward pass plus sampling the first token. For a run that timed
        each request (`metrics`), the mean of the requests' TTFTs, each from the call's start (waiting included)."""
        return self.metrics.ttft_ms

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first (ms), the mean decode-step latency (for a run that timed each
        request, the mean of their TPOTs). NaN when one token was generated (max_new_tokens=1, or EOS first):
        there is no decode step to time. Print it with `format_ms`, which shows "-" for NaN."""
        return self.metrics.tpot_ms

    @property
    def total_ms(self) -> float:
        return sum(self.step_ms)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole call (prefill included), summed over the batch: the tokens
        kept, so a row that stopped at EOS counts only up to it (`metrics.tokens_per_s` counts every step of every
        row, as the decode ran them)."""
        n = sum(len(t) for t in self.token_ids)
        return n / (self.total_ms / 1e3) if self.total_ms > 0 else float("nan")

    def summary(self) -> dict:
        return {"use_cache": self.use_cache, "device": self.device, "dtype": self.dtype,
                "prompt_tokens": self.prompt_len, "new_tokens": self.n_generated, "ttft_ms": self.ttft_ms,
                "tpot_ms": self.tpot_ms, "tokens_per_s": self.tokens_per_s}


def format_ms(ms: float | None, spec: str = ".2f", unit: str = "") -> str:
    """A time for a table or a status line: `ms` formatted with `spec`, then `unit`; "-" (no unit) where there is no
    time: None or NaN, e.g. the TPOT of a run that generated one token (`Generation.tpot_ms`)."""
    if ms is None or math.isnan(ms):
        return "-"
    return f"{ms:{spec}}{unit}"


def check_max_new_tokens(max_new_tokens) -> None:
    """Raise TypeError for a max_new_tokens that is not a whole number (2.5, '8', None), ValueError below 1."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens={max_new_tokens!r}: max_new_tokens must be a positive int (the number of "
                        f"new tokens to generate), e.g. 64")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: max_new_tokens must be a positive int; ask for at least "
                         f"1 new token")


def check_flags(**flags) -> None:
    """Raise TypeError for an on/off argument that is not a bool (use_cache='false' would count as on)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: this argument is on or off; give True or False")


SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes (a negative seed s is taken as 2**64 + s)


def check_seed(seed) -> None:
    """Raise TypeError for a seed that is not an int or None (torch would say "manual_seed expected a long"),
    ValueError for one outside `SEED_RANGE` (torch would say "Overflow when unpacking long long")."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed={seed!r}: the seed must be an int (or None for an unseeded run)")
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed={seed} is outside the range a torch generator takes (-2**63 .. 2**64 - 1); use an "
                         f"int in that range, e.g. 0 (or None for an unseeded run)")


def make_generator(seed, device: torch.device) -> torch.Generator | None:
    """The sampler's generator on `device`, seeded with `seed`; None for seed=None.

    The callers (`generate`, `generate_fast`) check the seed first, before any work (`check_seed`)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


def check_on_token(on_token) -> None:
    """Raise TypeError for an on_token that is not None and not callable (it would fail only after the first token,
    as "'int' object is not callable")."""
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token={on_token!r} is not callable: give a function on_token(step, tokens) (return True "
                        f"to stop), or None")


def check_lengths(prompt_len: int, max_new_tokens: int, context_len: int, name: str = "the prompt") -> None:
    """Raise ValueError naming the numbers when the prompt (plus what is to be generated) exceeds the context, and
    TypeError / ValueError for a max_new_tokens that is not a positive int (`check_max_new_tokens`). name: what the
    messages call the prompt (a batch names its longest row, e.g. "prompts[3]")."""
    if prompt_len == 0:
        raise ValueError(f"{name} is empty: give at least one token")
    check_max_new_tokens(max_new_tokens)
    if prompt_len > context_len:
        raise ValueError(f"{name} has {prompt_len} tokens, longer than the model's context of {context_len} "
                         f"tokens; shorten {name}")
    if prompt_len == context_len:
        raise ValueError(f"{name} has {prompt_len} tokens and already fills the model's context of "
                         f"{context_len} tokens, leaving no room for a new token; shorten {name}")
    if prompt_len + max_new_tokens > context_len:
        raise ValueError(f"{name.removeprefix('the ')} ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{prompt_len + max_new_tokens} exceeds the model's context of {context_len} tokens; "
                         f"lower max_new_tokens to at most {context_len - prompt_len} or shorten {name}")


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError for a token id outside 0..vocab_size-1 (checked on the host: on CUDA the embedding lookup
    would fail with a device-side assert that poisons the process)."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the model's vocabulary (ids 0..{vocab_size - 1}); "
                         f"was the prompt encoded with another model's tokenizer?")


def to_device(ids: torch.Tensor, device: torch.device, pin_memory: bool = False) -> torch.Tensor:
    """Copy host token ids to `device`. pin_memory (CUDA only): through page-locked memory, non_blocking, so the
    DMA engine copies while the CPU goes on (a pageable copy is staged through a driver buffer first).
    https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers"""
    if pin_memory and device.type == "cuda" and ids.device.type == "cpu":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


def prepare_prompt(model: Transformer, prompt_ids, max_new_tokens: int) -> torch.Tensor:
    """Prompt ids as a (B, T) int64 CPU tensor, checked against the model's context and vocabulary.

    Raises TypeError for something that is not token ids (None, float or bool ids — they are not truncated),
    ValueError for rows of unequal length or a prompt that is not 1-D or 2-D (see also `check_lengths`,
    `check_token_ids`), all before any work is done.
    """
    what = ("token ids: a list of ints, a list of equal-length lists of ints (a batch), or an integer tensor of "
            "shape (T,) or (B, T)")
    if prompt_ids is None or isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"the prompt is {prompt_ids!r}; give {what}")
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(isinstance(r, (list, tuple)) for r in prompt_ids):
        lengths = [len(r) for r in prompt_ids]
        if len(set(lengths)) > 1:
            raise ValueError(f"the prompts of this batch have different lengths ({', '.join(map(str, lengths))} "
                             f"tokens); this loop decodes equal-length rows: run them as one left-padded batch "
                             f"with llmlab.batching.static.generate_static (LLM.generate does), or one at a time")
    try:
        ids = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"the prompt is not {what} ({e})") from None
    if ids.numel() and (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex()):
        raise TypeError(f"the prompt holds {str(ids.dtype).removeprefix('torch.')} values (e.g. "
                        f"{ids.flatten()[0].item()!r}), not token ids; give {what}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() == 0:
        raise ValueError(f"the prompt is {prompt_ids!r}, a single number (shape ()); give {what} (LLM.generate also "
                         f"takes text)")
    if ids.dim() != 2:
        raise ValueError(f"the prompt has shape {tuple(ids.shape)}; give {what}")
    if ids.shape[0] == 0:
        raise ValueError(f"the prompt has shape {tuple(ids.shape)}: a batch of no sequences; give {what}")
    ids = ids.to(torch.long)
    check_lengths(ids.shape[1], max_new_tokens, model.config.max_seq_len)
    check_token_ids(ids, model.config.vocab_size)
    return ids


def check_finite_logits(logits: torch.Tensor) -> None:
    """Raise ValueError when the prefill's logits (B, V) hold NaN or inf: sampling would then pick token 0 every
    step (the shipped model's EOS) and the run would end or ramble with no error anywhere. Checked once per call,
    at the first token, where the host reads the token anyway."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"the model's logits hold NaN or inf ({logits.dtype}): a weight, the config (norm_eps, "
                         f"rope_theta) or the dtype's range made the forward pass non-finite. Check the checkpoint, "
                         f"or load the model in bf16 / fp32 if it runs in fp16")


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt_ids: torch.Tensor | list[int] | list[list[int]],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    on_token: Callable[[int, list[int]], bool | None] | None = None,
    pin_memory: bool = False,
    cache_factory: Callable | None = None,
    kernels=None,
) -> Generation:
    """Generate up to `max_new_tokens` tokens after each prompt.

    Args:
        model: the decoder (its device and dtype are used).
        prompt_ids: (T,) or (B, T) token ids — a list or an int64 tensor; all prompts of one call have equal length.
        max_new_tokens: stop after this many new tokens (or earlier, once every sequence produced EOS).
        temperature, top_k, top_p: see `llmlab.sampling.sample`; temperature 0 is greedy.
        use_cache: True = prefill + KV-cache decode; False = recompute the whole sequence every step (reference).
        eos_token_id: id(s) that end a sequence; None never stops early.
        seed: seeds the sampler's generator (sampled runs are then reproducible).
        on_token: called after every step as on_token(step, tokens) with the new token of each sequence (a list of
            B ints); returning True stops generation early (finish_reason "stopped") — a live plot or a Stop button.
        pin_memory: copy the prompt to a CUDA device through pinned memory (`to_device`); no effect on a CPU.
        cache_factory: builds the KV cache as cache_factory(config, batch, max_seq_len, dtype, device); default
            `KVCache` (contiguous). E.g. `llmlab.cache.paged_cache.PagedKVCache` or
            `llmlab.cache.kv_quant.QuantizedKVCache`.
        kernels: run every forward pass through `kernels.forward` (the arguments and logits of the model's own):
            the Triton kernels' decode step (`llmlab.kernels.KernelDecodeStep(model)`, `LLM.kernels`); None: the
            model itself.

    Returns:
        A `Generation` with the new token ids and per-step timings.

    Warns:
        UserWarning: top_k or top_p given at temperature 0, where they have no effect (`warn_greedy_filters`).

    Raises:
        ValueError: empty prompt, prompt (+ max_new_tokens) longer than the context, a token id outside the
            vocabulary, max_new_tokens < 1, bad sampling settings, a seed outside `SEED_RANGE`, a cache_factory
            with use_cache=False, a paged cache whose fixed pool cannot hold the run (`PagedKVCache.check_holds`).
            TypeError: prompt ids that are not ints (or None), a max_new_tokens or seed that is not an int,
            use_cache / pin_memory not a bool, an on_token or cache_factory that is not callable. Checked before any
            work, so the model is untouched.
    """
    check_sampling_args(temperature, top_k, top_p)
    check_flags(use_cache=use_cache, pin_memory=pin_memory)
    check_seed(seed)
    check_on_token(on_token)
    warn_greedy_filters(temperature, top_k, top_p)
    if cache_factory is not None and not callable(cache_factory):
        raise TypeError(f"cache_factory={cache_factory!r} is not callable: give a KV cache class such as "
                        f"llmlab.cache.paged_cache.PagedKVCache, a factory such as "
                        f"llmlab.cache.kv_quant.quantized_cache(), or None for the contiguous cache")
    if cache_factory is not None and not use_cache:
        raise ValueError("cache_factory builds the KV cache, but use_cache=False runs without one: turn the cache on "
                         "or drop cache_factory")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    ids = prepare_prompt(model, prompt_ids, max_new_tokens)
    max_new_tokens = int(max_new_tokens)  # a numpy or other Integral count, checked above; the cache wants an int
    B, T = ids.shape
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    generator = make_generator(seed, device)
    forward = model if kernels is None else kernels.forward

    ids = to_device(ids, device, pin_memory)
    make_cache = cache_factory or KVCache
    cache = make_cache(model.config, B, T + max_new_tokens, dtype, device) if use_cache else None
    if use_cache and not callable(getattr(cache, "update", None)):
        raise TypeError(f"cache_factory returned {type(cache).__name__}, not a KV cache: it must return an object "
                        f"with update(layer, positions, k, v) -> (k_all, v_all), such as llmlab.cache.kv_cache.KVCache "
                        f"or llmlab.cache.paged_cache.PagedKVCache")
    if callable(getattr(cache, "check_holds", None)):  # a fixed block pool (PagedKVCache): the whole run must fit
        cache.check_holds(B, T + max_new_tokens - 1)  # the last token is sampled, never written
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    seq = ids  # the no-cache path keeps the whole sequence here
    next_input, positions = ids, torch.arange(T, device=device)
    finish = "length"

    sync(device)
    timer = StepTimer(device)
    timer.start()
    for step in range(max_new_tokens):
        if use_cache:
            logits = forward(next_input, positions, kv_cache=cache, last_only=True)  # (B, 1, V)
        else:
            logits = forward(seq, last_only=True)  # (B, 1, V): the whole sequence again, every step
        token = sample(logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
        token_list = token.tolist()  # the host needs the token anyway: to detect EOS and to detokenize
        timer.mark()  # a step runs from one token to the next: host work between forward passes is included

        if step == 0:
            check_finite_logits(logits[:, -1])
        for b, t in enumerate(token_list):
            if not done[b]:
                out[b].append(t)
                done[b] = t in eos
        stop = on_token is not None and on_token(step, token_list)  # every step, the one ending at EOS too
        if all(done):
            finish = "eos"
            break
        if stop:
            finish = "stopped"
            break
        next_input = token[:, None]  # (B, 1)
        positions = torch.tensor([T + step], device=device)
        if not use_cache:
            seq = torch.cat([seq, next_input], dim=1)

    return Generation(token_ids=out, prompt_len=T, step_ms=timer.step_ms(), finish_reason=finish, use_cache=use_cache,
                      device=str(device), dtype=str(dtype).removeprefix("torch."))
