"""Multi-turn prefix reuse: keep the conversation's KV cache between turns and prefill only the new message.

In a chat, turn n's prompt is the whole conversation so far plus the new message. Re-running that prompt from
scratch (what a stateless server does) costs a prefill over every earlier token, so the time to first token grows
with the conversation. The keys and values of those tokens were already computed in the previous turn: keeping them
makes the prefill cover only the new tokens.

`Conversation` runs a chat three ways, with identical greedy outputs:

* mode="none": every turn prefills the whole history into a fresh `KVCache` (no reuse: the baseline);
* mode="contiguous": one `KVCache` lives across turns; a turn continues at the cache's length;
* mode="paged": a `PagedKVCache` whose block manager hashes full blocks by their token prefix. Each turn frees its
  sequence (the blocks keep their contents and hashes on the free list) and the next turn's prompt finds its prefix
  blocks by hash (`BlockManager.allocate` returns how many tokens are already cached) — vLLM's automatic prefix
  caching (https://docs.vllm.ai/en/latest/design/prefix_caching.html). It works across requests too: two chats
  with the same system prompt share its blocks.

Every turn reports TTFT (ms), the tokens prefilled and the tokens reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmlab.generate import prepare_prompt
from llmlab.cache.kv_cache import KVCache
from llmlab.cache.paged_cache import PagedKVCache
from llmlab.measure.timing import sync


@dataclass
class Turn:
    """One turn of a `Conversation`."""

    reply: list[int]  # generated token ids (greedy)
    ttft_ms: float  # prefill + first token
    total_ms: float
    prompt_tokens: int  # the whole conversation fed as this turn's prompt (history + message)
    prefilled: int  # tokens the prefill actually computed
    reused: int  # tokens whose K/V came from the cache
    cache_bytes: int  # KV bytes holding this conversation after the turn (used blocks for the paged cache)


class Conversation:
    """A greedy multi-turn chat over token ids, with or without KV reuse between turns.

    Args:
        model: a `Transformer`, or an `llmlab.LLM` (its `.model` is used).
        mode: 'none' | 'contiguous' | 'paged' (see the module docstring).
        block_size: of the paged cache.
        max_seq_len: the longest conversation (default: the model's context).

    Raises: ValueError for an unknown mode or a max_seq_len that is not 1 .. the model's context; from `say`,
    ValueError when the conversation would exceed max_seq_len.
    """

    def __init__(self, model, mode: str = "contiguous", block_size: int = 16, max_seq_len: int | None = None):
        if mode not in ("none", "contiguous", "paged"):
            raise ValueError(f"mode={mode!r}: use 'none', 'contiguous' or 'paged'")
        model = getattr(model, "model", model)  # an LLM wraps the Transformer
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model is a {type(model).__name__}: give an llmlab Transformer or LLM")
        self.model, self.mode = model, mode
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        context = model.config.max_seq_len
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or not 1 <= max_seq_len <= context):
            raise ValueError(f"max_seq_len={max_seq_len!r}: give a whole number of tokens from 1 to the model's "
                             f"context ({context}), or None for the whole context")
        self.max_seq_len = context if max_seq_len is None else max_seq_len
        self.history: list[int] = []  # every token of the conversation (prompts and replies)
        self.cached = 0  # tokens of history whose K/V are in the cache (contiguous mode)
        self.cache = None
        if mode == "contiguous":
            self.cache = KVCache(model.config, 1, self.max_seq_len, self.dtype, self.device)
        elif mode == "paged":
            self.cache = PagedKVCache(model.config, 1, self.max_seq_len, self.dtype, self.device,
                                      block_size=block_size)

    def _forward(self, ids: list[int], start: int, cache) -> torch.Tensor:
        x = torch.tensor([ids], device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)
        return self.model(x, pos, kv_cache=cache, last_only=True)[0, -1]  # (V,)

    @torch.inference_mode()
    def say(self, message: list[int], max_new_tokens: int = 32, eos_token_id: int | None = None) -> Turn:
        """Append `message` (token ids) to the conversation and generate a greedy reply (appended too).

        eos_token_id: None, one id or a list of ids (as `LLM.eos_token_id`): the reply stops after any of them.

        Raises:
            TypeError / ValueError: as `llmlab.generate.prepare_prompt` for the message (not token ids, empty, ids
                outside the vocabulary) and max_new_tokens; ValueError for more than one sequence or the
                conversation past max_seq_len. The conversation is unchanged by a failed (or interrupted) turn.
        """
        if hasattr(message, "__next__"):  # a generator or other one-pass iterator: take its ids once
            message = list(message)
        ids = prepare_prompt(self.model, message, max_new_tokens)  # types, emptiness, vocabulary, max_new_tokens
        if ids.shape[0] != 1:
            raise ValueError(f"message must be one sequence of token ids, got a batch of {ids.shape[0]}")
        stop = set() if eos_token_id is None else set(torch.as_tensor(eos_token_id).flatten().tolist())  # id or ids
        prompt = self.history + ids[0].tolist()
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"the conversation would reach {len(prompt) + max_new_tokens} tokens, beyond "
                             f"max_seq_len={self.max_seq_len}; start a new conversation")
        sync(self.device)
        t0 = time.perf_counter()
        if self.mode == "none":
            cache = KVCache(self.model.config, 1, len(prompt) + max_new_tokens, self.dtype, self.device)
            reused = 0
        elif self.mode == "contiguous":
            cache, reused = self.cache, self.cached
        else:
            cache = self.cache
            if 0 in cache.blocks.tables:
                cache.blocks.free(0)  # the blocks keep contents + hashes: the prompt below finds them
            reused = cache.blocks.allocate(0, prompt)
        try:
            logits = self._forward(prompt[reused:], reused, cache)
            reply = [int(logits.argmax())]
            sync(self.device)
            ttft = (time.perf_counter() - t0) * 1e3
            pos = len(prompt)
            while len(reply) < max_new_tokens and reply[-1] not in stop:
                if self.mode == "paged":
                    for src, dst in cache.blocks.append(0, [reply[-1]]):
                        cache.copy_block(src, dst)
                logits = self._forward([reply[-1]], pos, cache)
                reply.append(int(logits.argmax()))
                pos += 1
            sync(self.device)
        except BaseException:  # an error or an interrupt (Ctrl-C) part-way: the history is left as it was, and
            if self.mode == "paged":  # blocks hashed for tokens whose K/V may not be written must not be reused
                cache.blocks.forget_prefix(0, reused)
                cache.blocks.free(0)
            raise
        total = (time.perf_counter() - t0) * 1e3
        self.history = prompt + reply
        self.cached = len(self.history) - 1  # the last reply token was never fed to the model
        if self.mode == "paged":
            used = cache.used_bytes
        else:
            used = self.cached * KVCache.bytes_per_token(self.model.config, self.dtype)
        return Turn(reply, ttft, total, len(prompt), len(prompt) - reused, reused, used)


def compare_ttft(model, messages: list[list[int]], max_new_tokens: int = 16, repeats: int = 3,
                 block_size: int = 16, max_seq_len: int | None = None, check_replies: bool = True) -> list[dict]:
    """Run the same conversation in the three modes; one row per (turn, mode) with TTFT (median of `repeats`
    runs, ms), tokens prefilled and reused, and whether the reply equals mode 'none''s ("same_reply").

    max_seq_len: the size of the kept caches (default: the model's context, which may be far more memory than the
    conversation needs: 128K tokens for Llama 3.2).
    check_replies: assert that every mode replies the same. Leave it on for a trained model; turn it off for
    random weights in bf16, whose near-flat logits let rounding (a full vs an incremental prefill) flip a greedy
    token without anything being wrong — the timings stay comparable, the rows still say whether replies matched.

    Raises:
        AssertionError: with check_replies, a mode produced a different reply.
        ValueError: repeats that is not a whole number >= 1.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: time each turn at least once (a whole number >= 1)")
    rows = []
    replies = {}
    for mode in ("none", "contiguous", "paged"):
        runs = []
        for _ in range(repeats):
            conv = Conversation(model, mode, block_size=block_size, max_seq_len=max_seq_len)
            runs.append([conv.say(m, max_new_tokens) for m in messages])
        replies[mode] = [t.reply for t in runs[0]]
        for i in range(len(messages)):
            turns = sorted((r[i] for r in runs), key=lambda t: t.ttft_ms)
            t = turns[len(turns) // 2]
            rows.append({"turn": i + 1, "mode": mode, "ttft_ms": t.ttft_ms, "prompt_tokens": t.prompt_tokens,
                         "prefilled": t.prefilled, "reused": t.reused, "cache_bytes": t.cache_bytes,
                         "same_reply": replies[mode][i] == replies["none"][i]})
    if check_replies:
        assert replies["none"] == replies["contiguous"] == replies["paged"], "prefix reuse changed the output"
    return rows
