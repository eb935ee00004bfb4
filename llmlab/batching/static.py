"""Static batching: prompts of different lengths decoded together, left-padded into one rectangular batch.

One decode step reads every weight once, whatever the batch size; a batch of B requests shares that read (the
memory wall, lab 02). The batch must be a rectangle (B, T), so shorter prompts are padded. Three pieces make the
padding invisible to the real tokens (Hugging Face `generate` does the same with a padding mask):

* left padding (`left_pad`): pads go BEFORE each prompt, so every row's last column is its last real token — the
  one whose logits give the first new token — and every row decodes its next token in the same column;
* an attention mask (B, T): True on real tokens, False on pads;
* per-row position ids (`position_ids`): RoPE counts from 0 at each row's first real token, so a row's real
  tokens get the positions they would have alone; pads get positions no real token uses.

How the pads stay out of attention. On a static KV cache (`llmlab.cache.static_cache.StaticKVCache`) slot s of a row
holds that row's token at position s, and a query at position p may see slots 0..p. `position_ids` gives a row of L
real tokens and P = T - L pads the positions 0..L-1 for the real tokens and L, L+1, ..., T-1 for the pads: the pads'
K/V land in the slots right AFTER the prompt. There no real query can see them: a prompt token's position is below
L, and the first decode step writes its own token into slot L (a step writes its slot before it attends), the next
one into slot L+1, and so on — every slot is overwritten by a real token before the mask lets a real query see it.
So the real tokens attend to exactly what they would alone, which is what a padding mask (key is a pad -> hidden)
gives; the cache's own position mask does the work and the model needs no padding argument. The pads' queries see
real tokens and earlier pads: finite numbers, thrown away. The same trick pads a prompt to a captured prefill
length in `llmlab.runtime.cuda_graphs`.

Every row then decodes in lock-step, one token per step. A row that produced EOS keeps being computed until the
whole batch is done (its tokens are dropped): that waste, and the pads', is what `PaddingStats` counts and what
continuous batching removes (`llmlab.batching.scheduler`). Static batching is the "request-level" batching of the
Orca paper (Yu et al. 2022, https://www.usenix.org/conference/osdi22/presentation/yu), which it improves on.

The decode loop runs on a `llmlab.runtime.cuda_graphs.GraphDecoder` (per-row positions held on the device, no host
read of a position per step), so the same code replays CUDA graphs per batch size on a GPU (mode "graphs").
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch

from llmlab.generate import (Generation, check_finite_logits, check_lengths, check_on_token, check_seed,
                             make_generator, to_device)
from llmlab.measure.timing import StepTimer, sync
from llmlab.runtime.cuda_graphs import MODES, GraphDecoder, RunnerCache
from llmlab.sampling import check_sampling_args, sample, warn_greedy_filters


# -- the two pieces of a padded batch -----------------------------------------------------------------------------


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts of different lengths into one batch, pads on the left.

    prompts: B lists of token ids (lengths L_0..L_{B-1}, each >= 1); pad_id: the id written in the pad columns (its
    value never reaches a real token: see the module docstring).

    Returns:
        input_ids: (B, T) int64, T = max L_b; row b is [pad_id] * (T - L_b) + prompts[b].
        attention_mask: (B, T) bool, False on the pads, True on the real tokens.

    Raises:
        ValueError: no prompts, or an empty one (named by its index).

    The layout of Hugging Face tokenizers with padding_side="left"
    (https://huggingface.co/docs/transformers/llm_tutorial#wrong-padding-side).
    """
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompts[{lengths.index(0)}] is empty: every prompt needs at least one token")
    B, T = len(prompts), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.bool)
    for b, p in enumerate(prompts):
        input_ids[b, T - len(p):] = torch.as_tensor(p, dtype=torch.long)
        attention_mask[b, T - len(p):] = True
    return input_ids, attention_mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row RoPE positions of a left-padded batch: 0 at each row's first real token.

    attention_mask: (B, T) bool or 0/1 integers, left-padded (`left_pad`): each row's pads, then its real tokens.

    Returns:
        (B, T) int64 on the mask's device. A row with L real tokens gets 0..L-1 on them; its P = T - L pads get
        L, L+1, ..., T-1 — the positions right after the prompt, so that on a static KV cache (slot = position)
        the pads' keys and values sit where no real query can see them before a decode step overwrites them (the
        module docstring). E.g. mask [0, 0, 1, 1, 1] -> [3, 4, 0, 1, 2]. (Hugging Face gives pads the dummy
        position 1 and hides them with the mask instead; any value is harmless there.)

    Raises:
        ValueError: a mask that is not 2-D, or a row with a real token before a pad (right padding or a hole):
            the positions would not be those of the row alone.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, T), got shape {tuple(attention_mask.shape)}")
    real = attention_mask.bool()
    if bool((real[:, :-1] & ~real[:, 1:]).any()):  # once a row's real tokens start, no pad may follow
        raise ValueError("attention_mask is not left-padded (a real token is followed by a pad): put each row's "
                         "pads first, as left_pad does")
    T = real.shape[1]
    count = real.long().cumsum(dim=-1)  # (B, T): real tokens up to and including each column
    length = count[:, -1:]  # (B, 1): real tokens per row
    parked = length + torch.arange(T, device=real.device)  # pad column c of a row -> position L + c
    return torch.where(real, count - 1, parked)


# -- the waste ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaddingStats:
    """What a static batch computed for nothing: pad tokens in the prefill, finished rows in the decode steps.

    prompt_lens: each row's real prompt tokens; new_tokens: each row's kept new tokens (EOS included, >= 1);
    step_ms: measured step times (ms), step 0 = the prefill plus the first token, then one per decode step.

    A step's time is split among its rows x tokens in proportion: the padded share of the prefill's tokens, and in
    each decode step the share of rows already finished. This is an estimate — attention's cost is not linear in
    the tokens, and a small batch is paced by reading the weights, not by its rows — so the measured counterpart
    is the same requests run one at a time (`llmlab.batching.static` module docstring; lab 06).

    Raises ValueError (at construction) for lengths that do not fit together.
    """

    prompt_lens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    step_ms: tuple[float, ...]

    def __post_init__(self):
        if len(self.prompt_lens) == 0 or len(self.prompt_lens) != len(self.new_tokens):
            raise ValueError(f"prompt_lens ({len(self.prompt_lens)} rows) and new_tokens ({len(self.new_tokens)} "
                             f"rows) must give one entry per row, at least one row")
        if len(self.step_ms) == 0:
            raise ValueError("step_ms is empty: a run has at least one step (the prefill)")
        bad = [n for n in self.new_tokens if not 1 <= n <= len(self.step_ms)]
        if bad:
            raise ValueError(f"new_tokens {bad[0]} is impossible in {len(self.step_ms)} steps (each row keeps 1 to "
                             f"len(step_ms) tokens)")
        if min(self.prompt_lens) < 1:
            raise ValueError(f"prompt_lens must be >= 1, got {min(self.prompt_lens)}")

    @property
    def batch(self) -> int:
        return len(self.prompt_lens)

    @property
    def padded_len(self) -> int:
        """T: the longest prompt, the width of the padded batch."""
        return max(self.prompt_lens)

    # prefill: B x T token slots
    @property
    def prompt_slots(self) -> int:
        return self.batch * self.padded_len

    @property
    def prompt_useful(self) -> int:
        return sum(self.prompt_lens)

    @property
    def prompt_padded(self) -> int:
        return self.prompt_slots - self.prompt_useful

    # decode: B rows x (steps - 1) decode steps
    @property
    def decode_steps(self) -> int:
        return len(self.step_ms) - 1

    @property
    def decode_slots(self) -> int:
        return self.batch * self.decode_steps

    @property
    def decode_useful(self) -> int:
        """Row b is useful in decode steps 1..n_b - 1 (step k feeds its token k-1 and makes token k)."""
        return sum(n - 1 for n in self.new_tokens)

    @property
    def decode_wasted(self) -> int:
        """Row-steps spent on rows that had already finished (EOS) while others went on."""
        return self.decode_slots - self.decode_useful

    @property
    def useful_share(self) -> float:
        """Useful token slots / all token slots computed, prefill and decode together (1.0 = no waste)."""
        return (self.prompt_useful + self.decode_useful) / (self.prompt_slots + self.decode_slots)

    # time (ms)
    @property
    def prefill_ms(self) -> float:
        return self.step_ms[0]

    @property
    def decode_ms(self) -> float:
        return sum(self.step_ms[1:])

    @property
    def padded_prefill_ms(self) -> float:
        """The prefill's time x its padded share of B x T tokens (estimate)."""
        return self.prefill_ms * self.prompt_padded / self.prompt_slots

    @property
    def wasted_decode_ms(self) -> float:
        """Sum over decode steps k of step_ms[k] x (rows finished before step k) / B (estimate)."""
        return sum(ms * sum(n <= k for n in self.new_tokens) / self.batch
                   for k, ms in enumerate(self.step_ms) if k > 0)

    @property
    def wasted_ms(self) -> float:
        return self.padded_prefill_ms + self.wasted_decode_ms

    @property
    def wasted_time_share(self) -> float:
        total = self.prefill_ms + self.decode_ms
        return self.wasted_ms / total if total > 0 else float("nan")

    def summary(self) -> dict:
        """The counts and times as one flat dict (for a table)."""
        return {"batch": self.batch, "padded_len": self.padded_len, "prompt_useful": self.prompt_useful,
                "prompt_padded": self.prompt_padded, "decode_steps": self.decode_steps,
                "decode_useful": self.decode_useful, "decode_wasted": self.decode_wasted,
                "useful_share": self.useful_share, "prefill_ms": self.prefill_ms, "decode_ms": self.decode_ms,
                "padded_prefill_ms": self.padded_prefill_ms, "wasted_decode_ms": self.wasted_decode_ms,
                "wasted_time_share": self.wasted_time_share}

    def __str__(self) -> str:
        return (f"prefill: {self.prompt_useful} useful + {self.prompt_padded} pad tokens ({self.batch} x "
                f"{self.padded_len}), {self.prefill_ms:.1f} ms, ~{self.padded_prefill_ms:.1f} ms on pads; decode: "
                f"{self.decode_useful} useful + {self.decode_wasted} finished-row slots ({self.batch} x "
                f"{self.decode_steps} steps), {self.decode_ms:.1f} ms, ~{self.wasted_decode_ms:.1f} ms on finished "
                f"rows; useful share {self.useful_share:.1%}, time wasted ~{self.wasted_time_share:.1%}")


@dataclass
class StaticGeneration(Generation):
    """A `Generation` of a padded static batch: token_ids has one list per prompt, in the order given; prompt_len
    is the padded length T; prompt_lens each prompt's own length; padding the waste (`PaddingStats`)."""

    prompt_lens: list[int] = field(default_factory=list)
    padding: PaddingStats | None = None


def as_static(g: Generation) -> StaticGeneration:
    """`g`, a batch of equal-length prompts run without padding, as the `StaticGeneration` that batching="static"
    returns: every prompt_lens entry its prompt_len, and padding that counts only the rows finished early."""
    fields = {name: getattr(g, name) for name in g.__dataclass_fields__}
    rows = len(g.token_ids)
    stats = PaddingStats((g.prompt_len,) * rows, tuple(len(t) for t in g.token_ids), tuple(g.step_ms))
    return StaticGeneration(**fields, prompt_lens=[g.prompt_len] * rows, padding=stats)


# -- checks -------------------------------------------------------------------------------------------------------


def is_ragged(prompts) -> bool:
    """True for a list (or tuple) of token-id lists (or tuples) of different lengths: the batch that
    `generate_static` takes and `llmlab.generate.generate` refuses."""
    return (isinstance(prompts, (list, tuple)) and len(prompts) > 1
            and all(isinstance(p, (list, tuple)) for p in prompts) and len({len(p) for p in prompts}) > 1)


def check_prompts(prompts, max_new_tokens, context_len: int, vocab_size: int, pad_id) -> list[list[int]]:
    """The prompts as lists of ints, checked before any work: each error names the argument (prompts[i],
    max_new_tokens, pad_id) and the fix.

    Raises:
        TypeError: prompts not a list of token-id lists; ids that are not ints; max_new_tokens or pad_id not an int.
        ValueError: no prompts, an empty prompt, max_new_tokens < 1, a prompt (+ max_new_tokens) beyond the
            model's context, an id or pad_id outside the vocabulary.
    """
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        prompts = list(prompts)
    elif not isinstance(prompts, (list, tuple, torch.Tensor)) and callable(getattr(prompts, "tolist", None)):
        prompts = prompts.tolist()  # a (B, T) NumPy array
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts, each a list of token ids; got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
    rows = []
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, bytes, list, tuple, torch.Tensor)) and callable(getattr(p, "tolist", None)):
            p = p.tolist()  # a NumPy row
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple, torch.Tensor)):
            raise TypeError(f"prompts[{i}] is {type(p).__name__}, not a list of token ids (encode text first: "
                            f"llm.encode(text))")
        try:
            ids = torch.as_tensor(p) if len(p) else torch.empty(0, dtype=torch.long)
        except (TypeError, ValueError, RuntimeError) as e:  # text, None, nested lists or ints beyond int64
            j, bad = next(((j, v) for j, v in enumerate(p) if not isinstance(v, numbers.Number)), (None, None))
            if j is None:  # numbers only: an int beyond int64
                raise ValueError(f"prompts[{i}] holds a token id too large to read ({e}), outside the model's "
                                 f"vocabulary (0..{vocab_size - 1})") from None
            raise TypeError(f"prompts[{i}][{j}] is {type(bad).__name__} {bad!r}, not a token id (an int); each "
                            f"prompt is one list of ints: encode text first, llm.encode(text)") from None
        if ids.dim() != 1:
            raise ValueError(f"prompts[{i}] has shape {tuple(ids.shape)}: each prompt is one list of token ids")
        if ids.numel() == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"prompts[{i}] holds {str(ids.dtype).removeprefix('torch.')} values, not token ids")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompts[{i}] holds token id {lo if lo < 0 else hi}, outside the model's vocabulary "
                             f"(0..{vocab_size - 1}); was it encoded with another model's tokenizer?")
        rows.append(ids.tolist())
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    check_lengths(len(rows[longest]), max_new_tokens, context_len, name=f"prompts[{longest}]")
    if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral):
        raise TypeError(f"pad_id={pad_id!r}: give a token id (an int), e.g. pad_id=0")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id={pad_id} is outside the model's vocabulary (0..{vocab_size - 1}); any id in it "
                         f"works (pads are never seen by real tokens), e.g. pad_id=0")
    return rows


# -- generation ---------------------------------------------------------------------------------------------------


@torch.no_grad()  # not inference_mode: a runner kept in `runners` is stepped later by generate_fast
def generate_static(
    model_or_llm,
    prompts: list[list[int]],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    on_token: Callable[[int, list[int]], bool | None] | None = None,
    *,
    pad_id: int = 0,
    mode: str = "static",
    runners: RunnerCache | None = None,
    kernels=None,
    pin_memory: bool = False,
) -> StaticGeneration:
    """Generate after every prompt at once: one left-padded static batch (the module docstring says how).

    Args:
        model_or_llm: a `llmlab.model.Transformer`, or an `llmlab.LLM` (its model, and its `kernels` and `runners`
            unless given).
        prompts: B lists of token ids, any lengths >= 1 (a (B, T) tensor is taken row by row).
        max_new_tokens: new tokens per row at most (>= 1); the batch stops when every row has produced EOS.
        temperature, top_k, top_p, seed: as `llmlab.generate.generate` (one draw per row per step: a sampled row
            differs from the same prompt sampled alone, whose draws come in another order; greedy rows equal it).
        eos_token_id: id(s) that end a row; None (the default, as in `generate`) never stops early.
            `LLM.generate` passes the model's.
        on_token: on_token(step, tokens) after every step with every row's new token (B ints, finished rows' too);
            True stops the batch.
        pad_id: the token fed in the pad columns (any id of the vocabulary: real tokens never see it).
        mode: the decode runner (`llmlab.runtime.cuda_graphs.MODES`): "static" (eager on a static cache), "graphs"
            (CUDA graphs per batch size, a CUDA model), "compile", "compile+graphs".
        runners: take the runner from this `RunnerCache` (an LLM's own, `LLM.runners`, in every mode but "static"),
            built and captured on first use and reused by later calls. None in mode "static": a runner whose cache
            holds exactly this batch (T + max_new_tokens slots per row; a cached runner's is rounded up, to 1024
            slots or the model's context at least, and every eager decode step reads all of them).
        kernels: as `llmlab.runtime.fast_generate.generate_fast`.
        pin_memory: copy the batch to a CUDA device through pinned memory (no effect on a CPU).

    Returns:
        A `StaticGeneration`: token_ids[i] the tokens after prompts[i] (EOS included), step_ms (step 0 = the padded
        prefill and the first token, then one entry per decode step of the whole batch), padding (`PaddingStats`),
        prompt_lens, finish_reason "eos" / "length" / "stopped".

    Warns:
        UserWarning: top_k or top_p at temperature 0 (`llmlab.sampling.warn_greedy_filters`).

    Raises:
        ValueError: no prompts, an empty prompt, a prompt (+ max_new_tokens) beyond the context, ids or pad_id
            outside the vocabulary, max_new_tokens < 1, bad sampling settings or seed, an unknown mode, a graphs
            mode on a CPU model, the prefill's logits not finite. TypeError: arguments of the wrong type. All but
            the last are checked before any work.
    """
    llm = None if isinstance(model_or_llm, torch.nn.Module) else model_or_llm
    model = model_or_llm if llm is None else getattr(llm, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model_or_llm must be an llmlab Transformer or an LLM, got {type(model_or_llm).__name__}")
    if llm is not None:
        kernels = llm.kernels if kernels is None else kernels
        runners = llm.runners if runners is None and mode != "static" else runners
    check_sampling_args(temperature, top_k, top_p)
    check_seed(seed)
    check_on_token(on_token)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if MODES[mode][0] and device.type != "cuda":
        raise ValueError(f"mode {mode!r} needs a model on a CUDA GPU (this one is on {device}); use 'static'")
    config = model.config
    rows = check_prompts(prompts, max_new_tokens, config.max_seq_len, config.vocab_size, pad_id)
    warn_greedy_filters(temperature, top_k, top_p)
    max_new_tokens = int(max_new_tokens)
    lengths = [len(r) for r in rows]
    B, T = len(rows), max(lengths)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    generator = make_generator(seed, device)

    if mode == "static" and runners is None:  # nothing to capture: a cache of exactly this batch's size
        runner = GraphDecoder(model, max_batch=B, max_seq_len=T + max_new_tokens, cuda_graphs=False, kernels=kernels)
    else:
        runners = RunnerCache() if runners is None else runners  # (an empty RunnerCache is falsy: no `or`)
        runner = runners.runner_for(model, mode, B, T + max_new_tokens, kernels=kernels)
    cache = runner.cache if B == runner.max_batch else runner.cache.rows(0, B)
    for t in cache.k + cache.v:  # a reused cache may hold NaN: -inf (masked) + NaN is still NaN
        t.zero_()
    input_ids, mask = left_pad(rows, int(pad_id))
    input_ids = to_device(input_ids, device, pin_memory)
    positions = position_ids(mask).to(device)  # (B, T), computed on the host: its check reads the mask

    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    finish = "length"
    sync(device)
    timer = StepTimer(device)
    timer.start()
    for step in range(max_new_tokens):
        if step == 0:  # the padded prefill: every row's last column is its last real token
            logits = runner.forward(input_ids, positions, kv_cache=cache, last_only=True)[:, -1]  # (B, V)
            token = sample(logits, temperature, top_k, top_p, generator)  # (B,)
        else:
            logits, greedy = runner.step()  # (B, V), (B,): every row one position further
            token = greedy if temperature == 0 else sample(logits, temperature, top_k, top_p, generator)
        tokens = token.tolist()  # the host needs them: EOS per row
        timer.mark()
        if step == 0:
            check_finite_logits(logits)
        for b, t in enumerate(tokens):
            if not done[b]:
                out[b].append(t)
                done[b] = t in eos
        stop = on_token is not None and on_token(step, tokens)
        if all(done):
            finish = "eos"
            break
        if stop:
            finish = "stopped"
            break
        if step + 1 < max_new_tokens:
            if step == 0:
                runner.start(token, lengths)  # row b's first new token sits at position L_b
            else:
                runner.advance(token)

    step_ms = timer.step_ms()
    stats = PaddingStats(tuple(lengths), tuple(len(o) for o in out), tuple(step_ms))
    return StaticGeneration(token_ids=out, prompt_len=T, step_ms=step_ms, finish_reason=finish, use_cache=True,
                            device=str(device), dtype=str(dtype).removeprefix("torch."),
                            extra={"decode_mode": runner.mode, "bucket": runner.bucket(B), "pad_id": int(pad_id)},
                            prompt_lens=lengths, padding=stats)
