"""Lab 00 (the tour): the reference count of the token positions a `generate` call feeds through the decoder, the
check the notebook runs on the student's formula, and the hook that measures the same count on a real call.

The checks of the other labs share two helpers from here: `call_answer` turns the NotImplementedError of a student
copy's stub (tools/make_student_labs.py writes `raise NotImplementedError("write your answer here")` in place of each
answer) into an AssertionError that names the exercise to write, and `check_cases` runs a student's function on a
table of cases and, when an answer is wrong, names the common mistake it is (a lesson given only when the answer
equals that mistake on every case).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable, Sequence

__all__ = ["call_answer", "not_written", "close", "check_cases", "tokens_through_model", "check_tokens_through_model",
           "count_tokens_through_model"]


def not_written(name: str, error: BaseException) -> str:
    """The message for an exercise whose function (or one it calls) still raises NotImplementedError: names the
    function that raised it, read from the innermost frame of `error`'s traceback."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    raised_in = tb.tb_frame.f_code.co_name if tb is not None else name
    fix = "replace the `raise NotImplementedError(...)` line in its cell with your answer"
    if raised_in in (name, "<module>", "<lambda>"):
        return f"{name} is not written yet: {fix}"
    return f"{name} calls {raised_in}, which is not written yet: {fix}"


def call_answer(fn: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), the student's function `name` called by a check.

    Raises:
        AssertionError: fn (or a function it calls) raised NotImplementedError, i.e. is still the student copy's
            stub; the message names it and says to write the answer in its cell.
    """
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        raise AssertionError(not_written(name, e)) from e


def close(got: Any, want: float, rel_tol: float = 1e-6) -> bool:
    """True when `got` is a real number (not a bool) within `rel_tol` of `want`: the checks' test of a computed
    quantity."""
    return isinstance(got, numbers.Real) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=rel_tol)


def check_cases(name: str, fn: Callable, cases: Sequence[tuple], reference: Callable,
                mistakes: Sequence[tuple[Callable, str]] = (), describe: Callable[[tuple, Any, Any], str] | None = None,
                same: Callable[[Any, Any], bool] = operator.eq, call: Callable[[Callable, tuple], Any] | None = None,
                otherwise: str | None = None) -> None:
    """Check the student's function `fn` (called `name` in the notebook) on every case against `reference`.

    `call(fn, case)` calls the student's function on a case (default fn(*case); e.g. keywords where the notebook
    passes them so); `reference` and each wrong function of `mistakes` take the case's values in order, as
    reference(*case). All the student's answers are computed first; at the first case whose answer is not `same`
    as the reference's, the check raises with `describe(case, want, got)` (default: the case, the expected and the
    given answer) followed by the lesson of the first (wrong, lesson) of `mistakes` that gives the student's answer
    on EVERY case (a lesson is named only for an answer that is exactly that mistake), or by `otherwise` when none
    does.

    Raises:
        AssertionError: as above; or, for a stub still raising NotImplementedError, that `name` is not written.
    """
    call = call or (lambda f, case: f(*case))
    describe = describe or (lambda case, want, got: f"{name}{case}: expected {want!r}, got {got!r}")
    answers = [call_answer(call, name, fn, case) for case in cases]
    wants = [reference(*case) for case in cases]
    bad = next((i for i, (got, want) in enumerate(zip(answers, wants)) if not same(got, want)), None)
    if bad is None:
        return
    lesson = otherwise
    for wrong, why in mistakes:
        try:
            if all(same(got, wrong(*case)) for case, got in zip(cases, answers)):
                lesson = why
                break
        except Exception:  # a wrong formula that cannot run on some case is not the student's answer
            continue
    raise AssertionError(describe(cases[bad], wants[bad], answers[bad]) + (f"; {lesson}" if lesson else ""))


def tokens_through_model(prompt_len: int, new_tokens: int, use_cache: bool) -> int:
    """Token positions that pass through the decoder to generate `new_tokens` tokens after a `prompt_len` prompt.

    With the KV cache: the prompt once (prefill), then one position per further token: prompt_len + new_tokens - 1
    (the last token generated is never fed back). Without it: step i re-runs all prompt_len + i positions, for
    i = 0 .. new_tokens - 1.
    """
    if use_cache:
        return prompt_len + new_tokens - 1
    return sum(prompt_len + i for i in range(new_tokens))


# (wrong formula, what it misses), tried in order when an answer differs from the reference
_MISTAKES: tuple[tuple[Callable[[int, int, bool], int], str], ...] = (
    (lambda p, n, c: tokens_through_model(p, n, not c),
     "the two cases are swapped: WITH the cache each step feeds only the newest token; WITHOUT it each step feeds "
     "the whole sequence again"),
    (lambda p, n, c: p + n if c else tokens_through_model(p, n, c),
     "with the cache: the last token generated is never fed back through the model (nothing comes after it): "
     "one position fewer than you counted"),
    (lambda p, n, c: n if c else tokens_through_model(p, n, c),
     "with the cache the prompt still goes through once: prefill runs all prompt_len positions and makes the first "
     "token, then each later token feeds the one before it"),
    (lambda p, n, c: p + n - 1 if c else n * p,
     "without the cache the sequence grows: step i feeds the prompt AND the i tokens generated before it, "
     "prompt_len + i positions"),
    (lambda p, n, c: p + n - 1 if c else n * (p + n),
     "without the cache the sequence grows by one position per step: it is not at its final length from the "
     "start"),
    (lambda p, n, c: p + n - 1 if c else sum(p + i for i in range(1, n + 1)),
     "without the cache the first step (the prefill) feeds the prompt alone, prompt_len positions: each step "
     "feeds one position more than the step before it, from there"),
    (lambda p, n, c: p + n - 1 if c else sum(p + i for i in range(1, n)),
     "without the cache there are new_tokens forward passes, one per token made: the prefill makes the first "
     "token, and you left out one pass"),
)

_CASES = ((5, 20), (1, 1), (8, 1), (3, 2), (12, 64), (100, 7))


def check_tokens_through_model(fn: Callable[[int, int, bool], int]) -> None:
    """Compare `fn(prompt_len, new_tokens, use_cache)` with the reference on a few lengths (one new token, one-token
    prompts, long runs), with and without the cache.

    Raises:
        AssertionError: the first length that disagrees, with the count expected and, where the answer matches a
            common mistake (cases swapped, the last token fed back, the prompt left out, the growing sequence not
            counted, one step too many or too few), what it misses. A stub still raising NotImplementedError is
            reported as not written.
    """
    def describe(case, want, got):
        p, n, use_cache = case
        if got is None:
            return "tokens_through_model returned None: return the count (an int)"
        return f"prompt_len={p}, new_tokens={n}, use_cache={use_cache}: expected {want} token positions, got {got!r}"

    cases = [(p, n, use_cache) for use_cache in (True, False) for p, n in _CASES]
    check_cases("tokens_through_model", fn, cases, tokens_through_model, _MISTAKES, describe,
                otherwise="count one forward pass at a time on a small case, e.g. prompt_len=3, new_tokens=2: which "
                          "positions does each pass feed, with the cache and without it?")


def count_tokens_through_model(llm, prompt: str, new_tokens: int, use_cache: bool) -> int:
    """Measure the same number: count the token positions the embedding layer sees during one generate call."""
    seen = 0

    def hook(_module, args):
        nonlocal seen
        seen += args[0].numel()

    handle = llm.model.embed_tokens.register_forward_pre_hook(hook)
    try:
        llm.generate(prompt, max_new_tokens=new_tokens, use_cache=use_cache, stop_at_eos=False)
    finally:
        handle.remove()
    return seen
