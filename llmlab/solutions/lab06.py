"""Lab 06 (batching): the check the notebook runs on the student's `left_pad_mask_and_positions(prompts, pad_id)`.

The exercise builds the three tensors of a left-padded static batch, the layout of `llmlab.batching.static`
(`left_pad` and `position_ids` are the reference answer):

    input_ids       (B, T) int64, T = the longest prompt; row b = [pad_id] * (T - L_b) + prompts[b]
    attention_mask  (B, T) True / 1 on real tokens, False / 0 on pads: torch.bool or an integer dtype holding 0 and 1
                    (Hugging Face tokenizers return int64 0/1); a float mask is refused (it reads as an additive mask)
    position_ids    (B, T) int64: 0, 1, ..., L_b - 1 on row b's real tokens; its T - L_b pads take the positions right
                    after the prompt, L_b, ..., T - 1 (on a static KV cache slot = position, so the pads' keys and
                    values land in slots that a decode step overwrites before any real query can see them)

`check_left_pad` runs the function on several batches — ragged lengths, equal lengths (no pads), a single prompt, a
one-token prompt, a pad id other than 0 — and compares every tensor with the reference. When they differ it says
which common mistake the answer matches: right padding, the mask inverted, positions counted from the batch's first
column (0..T-1 on every row), positions starting at 1, pads placed at position 0 (two tokens of a row would write one
cache slot in the same pass: `scatter_` leaves the winner undefined with repeated indices,
https://pytorch.org/docs/stable/generated/torch.Tensor.scatter_.html), pad_id ignored, the wrong dtype, the input
prompts changed.
"""

from __future__ import annotations

from typing import Callable

import torch

from llmlab.batching.static import left_pad, position_ids

__all__ = ["CASES", "check_left_pad", "left_pad_mask_and_positions"]

_NOT_WRITTEN = ("left_pad_mask_and_positions is not written yet: replace the `raise NotImplementedError(...)` line "
                "with your answer (return input_ids, attention_mask, position_ids)")


def left_pad_mask_and_positions(prompts: list[list[int]], pad_id: int = 0):
    """The reference answer: (input_ids, attention_mask, position_ids) of a left-padded batch, as the package makes
    them (`llmlab.batching.static.left_pad` and `position_ids`)."""
    ids, mask = left_pad(prompts, pad_id)
    return ids, mask, position_ids(mask)


# (what the batch is, prompts, pad_id)
CASES: tuple[tuple[str, list[list[int]], int], ...] = (
    ("three prompts of 3, 5 and 1 tokens", [[5, 6, 7], [11, 12, 13, 14, 15], [9]], 0),
    ("four prompts of different lengths, pad_id=42", [[3, 1, 4, 1, 5, 9], [2, 6], [5, 3, 5, 8], [9, 7, 9]], 42),
    ("two prompts of equal length (no pads at all)", [[8, 9, 10], [20, 21, 22]], 0),
    ("a single prompt", [[4, 5, 6, 7]], 0),
    ("a one-token prompt beside a long one, pad_id=1", [[3], [10, 11, 12, 13, 14, 15, 16]], 1),
)


def _call(fn, prompts, pad_id, what):
    given = [list(p) for p in prompts]
    try:
        out = fn(given, pad_id)
    except NotImplementedError as e:
        raise AssertionError(_NOT_WRITTEN) from e
    if given != prompts:
        raise AssertionError(f"{what}: your function changed the prompts it was given; build new tensors and leave "
                             f"the input lists as they are")
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise AssertionError(f"{what}: return three tensors, (input_ids, attention_mask, position_ids); got "
                             f"{type(out).__name__}")
    names = ("input_ids", "attention_mask", "position_ids")
    for name, t in zip(names, out):
        if not isinstance(t, torch.Tensor):
            raise AssertionError(f"{what}: {name} is a {type(t).__name__}; return torch tensors (torch.tensor(...), "
                                 f"torch.full(...))")
    return out


def _row_text(t: torch.Tensor, b: int) -> str:
    return str(t[b].tolist())


def _check_shapes_and_dtypes(what, B, T, ids, mask, pos) -> None:
    for name, t in (("input_ids", ids), ("attention_mask", mask), ("position_ids", pos)):
        if tuple(t.shape) != (B, T):
            raise AssertionError(f"{what}: {name} has shape {tuple(t.shape)}; expected (B, T) = ({B}, {T}): one row "
                                 f"per prompt, as wide as the longest prompt")
    if ids.dtype != torch.int64:
        raise AssertionError(f"{what}: input_ids is {ids.dtype}; token ids are torch.int64 (dtype=torch.long), what "
                             f"an embedding lookup takes")
    if pos.dtype != torch.int64:
        raise AssertionError(f"{what}: position_ids is {pos.dtype}; positions are torch.int64 (dtype=torch.long)")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise AssertionError(f"{what}: attention_mask is {mask.dtype}; give a torch.bool mask (True on real tokens) "
                             f"or 0/1 integers. A float mask reads as an additive one (0 and -inf), another thing")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise AssertionError(f"{what}: attention_mask holds values other than 0 and 1: {mask.tolist()}")


def _check_mask_and_ids(what, prompts, pad_id, ids, mask) -> None:
    want_ids, want_mask = left_pad(prompts, pad_id)
    right_ids = torch.full_like(want_ids, pad_id)
    right_mask = torch.zeros_like(want_mask)
    for b, p in enumerate(prompts):
        right_ids[b, :len(p)] = torch.tensor(p)
        right_mask[b, :len(p)] = True
    padded = not bool(want_mask.all())
    if padded and torch.equal(mask.bool(), ~want_mask):
        raise AssertionError(f"{what}: the attention mask is inverted: it must be True (1) on the real tokens and "
                             f"False (0) on the pads")
    if padded and (torch.equal(ids, right_ids) or torch.equal(mask.bool(), right_mask)):
        raise AssertionError(f"{what}: the pads are on the RIGHT. Put them on the left, before each prompt, so that "
                             f"every row's last column is its last real token (the one whose logits give its first "
                             f"new token) and all rows decode their next token in the same column")
    if not torch.equal(mask.bool(), want_mask):
        b = next(b for b in range(len(prompts)) if not torch.equal(mask[b].bool(), want_mask[b]))
        raise AssertionError(f"{what}: attention_mask row {b} is {_row_text(mask.long(), b)}; expected "
                             f"{_row_text(want_mask.long(), b)} (0 on the {int((~want_mask[b]).sum())} pads first, "
                             f"then 1 on the {len(prompts[b])} real tokens)")
    if not torch.equal(ids, want_ids):
        if torch.equal(ids[want_mask], want_ids[want_mask]):
            found = sorted(set(ids[~want_mask].tolist()))
            raise AssertionError(f"{what}: the pad columns hold {found}; write pad_id={pad_id} there (use the "
                                 f"pad_id argument, not a fixed number)")
        b = next(b for b in range(len(prompts)) if not torch.equal(ids[b], want_ids[b]))
        raise AssertionError(f"{what}: input_ids row {b} is {_row_text(ids, b)}; expected {_row_text(want_ids, b)} "
                             f"(its {int((~want_mask[b]).sum())} pads, then prompts[{b}] unchanged)")


def _check_positions(what, prompts, mask, pos) -> None:
    real = mask.bool()
    want = position_ids(real)
    if torch.equal(pos, want):
        return
    B, T = real.shape
    shared = torch.arange(T).expand(B, T)
    if torch.equal(pos[real], shared[real]):
        raise AssertionError(f"{what}: the positions are counted from the batch's first column (0..T-1 on every "
                             f"row). RoPE must count from 0 at each row's FIRST REAL token: a prompt padded with P "
                             f"pads would otherwise be encoded as if it came after P other tokens, and its logits "
                             f"would differ from those of the same prompt alone")
    if torch.equal(pos[real], want[real] + 1):
        raise AssertionError(f"{what}: the real tokens' positions start at 1; they start at 0 (a cumulative sum "
                             f"of the mask counts the token itself: subtract 1)")
    if not torch.equal(pos[real], want[real]):
        b = next(b for b in range(B) if not torch.equal(pos[b][real[b]], want[b][real[b]]))
        raise AssertionError(f"{what}: row {b}'s real tokens got positions {pos[b][real[b]].tolist()}; expected "
                             f"0..{len(prompts[b]) - 1}, the positions they have when the prompt runs alone")
    b = next(b for b in range(B) if not torch.equal(pos[b], want[b]))
    L = len(prompts[b])
    raise AssertionError(f"{what}: the real tokens are right, but row {b}'s pads got positions "
                         f"{pos[b][~real[b]].tolist()}; give them {list(range(L, T))}, the positions right after the "
                         f"prompt (L_b, L_b + 1, ..., T - 1). On the course's static KV cache a token's position is "
                         f"its slot: a pad at 0, 1 or another real token's position writes its keys and values into "
                         f"that token's slot in the same forward pass, and which write wins is undefined (torch's "
                         f"scatter with repeated indices; on a GPU it can change from run to run). Slots L_b..T-1 are "
                         f"free: each decode step overwrites the next one before a real query can see it")


def check_left_pad(fn: Callable) -> None:
    """Check `fn(prompts, pad_id) -> (input_ids, attention_mask, position_ids)` against `llmlab.batching.static`'s
    left_pad / position_ids on `CASES`.

    Raises:
        AssertionError: the stub (NotImplementedError) is still there, or an answer differs from the reference; the
            message names the case and the mistake it matches (right padding, an inverted mask, positions counted
            from the batch's first column, positions from 1, pads at the wrong positions, pad_id ignored, a wrong
            dtype or shape, input changed) or else the first row that differs.
    """
    for what, prompts, pad_id in CASES:
        ids, mask, pos = _call(fn, prompts, pad_id, what)
        B, T = len(prompts), max(len(p) for p in prompts)
        _check_shapes_and_dtypes(what, B, T, ids, mask, pos)
        _check_mask_and_ids(what, prompts, pad_id, ids, mask)
        _check_positions(what, prompts, mask, pos)
