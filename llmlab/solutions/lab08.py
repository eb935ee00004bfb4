"""Lab 08 (diagnosis): the check the notebook runs on the student's `classify(m)`.

The rules are `llmlab.measure.diagnosis.RULES` (the reference answer is `llmlab.measure.diagnosis.classify`): in
order, launch-bound when idle_share >= 0.5, compute-bound when mfu >= mbu, KV-bound when kv_share >= 0.5, else
bandwidth-bound. `check_classify` runs the student's function on a set of measured-looking steps — recorded-like
H200 rows, each rule's boundary, and steps where two rules compete, so that the order matters — and, when the
answers differ, says which common mistake they match (idle share never read or read backwards, a low MBU taken for
launch-bound, a fixed MFU threshold instead of MFU against MBU, the rules out of order, > instead of >=) or which
step and rule they got wrong.
"""

from __future__ import annotations

from typing import Callable

from llmlab.measure.diagnosis import CLASSES, COMPUTE_BOUND, KV_BOUND, LAUNCH_BOUND, BANDWIDTH_BOUND, Measurements
from llmlab.measure.diagnosis import classify as reference
from llmlab.measure.diagnosis import diagnose

__all__ = ["CASES", "WRONG_ANSWERS", "check_classify", "classify"]

classify = reference

_NOT_WRITTEN = ("classify is not written yet: replace the `raise NotImplementedError(...)` line with your answer "
                "(return one of " + ", ".join(repr(c) for c in CLASSES) + ")")


def _m(idle, mbu, mfu, kv) -> Measurements:
    return Measurements(idle_share=idle, mbu=mbu, mfu=mfu, kv_share=kv)


# (what the step is, its measurements). The first three look like the chat rows recorded on the H200.
CASES: tuple[tuple[str, Measurements], ...] = (
    ("eager decode of a 1B model (GPU-Util 25%)", _m(0.75, 0.052, 0.0003, 0.003)),
    ("the same step replayed from a CUDA graph (busy 94% of the step at 24% MBU)", _m(0.06, 0.24, 0.0015, 0.003)),
    ("the fused Triton rung (busy 96%, MBU 77%)", _m(0.04, 0.77, 0.0048, 0.003)),
    ("64 sequences of 32K tokens each", _m(0.03, 0.62, 0.02, 0.85)),
    ("batch 512, short contexts", _m(0.05, 0.35, 0.48, 0.04)),
    ("an eager step with a long context: host-paced although the cache is most of the bytes",
     _m(0.7, 0.05, 0.001, 0.8)),
    ("a CPU (ridge ~5 FLOP/byte) at batch 32 with long contexts", _m(0.2, 0.3, 0.35, 0.6)),
    ("a high MFU that is still below the MBU", _m(0.05, 0.9, 0.6, 0.1)),
    ("a low MFU that is above the MBU (intensity past the ridge, slow kernels)", _m(0.1, 0.02, 0.03, 0.1)),
    ("a small model on a CPU whose caches beat the copy benchmark (MBU > 1)", _m(0.2, 1.3, 0.2, 0.05)),
    ("idle exactly half the step", _m(0.5, 0.3, 0.01, 0.1)),
    ("idle just under half the step", _m(0.49, 0.3, 0.01, 0.1)),
    ("MFU exactly equal to MBU (at the ridge)", _m(0.1, 0.2, 0.2, 0.1)),
    ("KV cache exactly half the bytes", _m(0.1, 0.5, 0.01, 0.5)),
    ("KV cache just under half the bytes", _m(0.1, 0.5, 0.01, 0.49)),
    ("KV cache 60% of the bytes, read at 80% MBU", _m(0.1, 0.8, 0.01, 0.6)),
    ("KV cache 40% of the bytes, read at 30% MBU", _m(0.1, 0.3, 0.01, 0.4)),
)


def _ordered(*rules: tuple[str, Callable[[Measurements], bool]]) -> Callable[[Measurements], str]:
    def fn(m):
        return next((label for label, test in rules if test(m)), BANDWIDTH_BOUND)
    return fn


def _launch(m):
    return m.idle_share >= 0.5


def _compute(m):
    return m.mfu >= m.mbu


def _kv(m):
    return m.kv_share >= 0.5


# plausible wrong answers, each with the message that explains what it misses
WRONG_ANSWERS: tuple[tuple[Callable[[Measurements], str], str], ...] = (
    (_ordered((COMPUTE_BOUND, _compute), (KV_BOUND, _kv)),
     "your answer never says launch-bound: read idle_share first. When the GPU runs no kernel for half of the step "
     "or more, the host sets the pace, whatever the MBU or the bytes of the cache would say"),
    (_ordered((LAUNCH_BOUND, lambda m: m.idle_share < 0.5), (COMPUTE_BOUND, _compute), (KV_BOUND, _kv)),
     "your launch-bound test is backwards: idle_share is the share of the step in which NO kernel runs (1 - "
     "GPU-Util), so a LARGE idle share means the GPU waits for the host: launch-bound when idle_share >= 0.5"),
    (_ordered((LAUNCH_BOUND, lambda m: m.mbu < 0.5), (COMPUTE_BOUND, _compute), (KV_BOUND, _kv)),
     "a low MBU alone does not make a step launch-bound: replayed from a CUDA graph the step kept the GPU busy 94% "
     "of the time at 24% MBU; its kernels were slow, not missing. Launch-bound is read from idle_share >= 0.5"),
    (_ordered((LAUNCH_BOUND, _launch), (COMPUTE_BOUND, lambda m: m.mfu >= 0.5), (KV_BOUND, _kv)),
     "compute-bound is not a fixed MFU: compare MFU with MBU. MFU / MBU is the step's arithmetic intensity over the "
     "ridge point, so mfu >= mbu means the arithmetic, not the memory, is the closer roof"),
    (_ordered((LAUNCH_BOUND, _launch), (COMPUTE_BOUND, lambda m: m.mfu > 0.5 * m.mbu), (KV_BOUND, _kv)),
     "compute-bound starts where MFU reaches MBU (intensity = ridge), not at a fraction of it: mfu >= mbu"),
    (_ordered((LAUNCH_BOUND, _launch), (KV_BOUND, _kv), (COMPUTE_BOUND, _compute)),
     "the order of the rules matters: test compute-bound (mfu >= mbu) BEFORE KV-bound. KV-bound is a kind of "
     "memory-bound, and a step whose intensity is past the ridge is not memory-bound, however big its cache"),
    (_ordered((KV_BOUND, _kv), (LAUNCH_BOUND, _launch), (COMPUTE_BOUND, _compute)),
     "the order of the rules matters: test launch-bound (idle_share >= 0.5) FIRST. A host-paced step stays "
     "host-paced when its cache is big: a smaller cache would not bring the missing kernels"),
    (_ordered((LAUNCH_BOUND, _launch), (COMPUTE_BOUND, _compute), (KV_BOUND, lambda m: m.kv_share >= m.mbu)),
     "KV-bound compares the cache's share of the bytes with one half, not with the MBU: kv_share says WHICH bytes "
     "the step reads, MBU how fast it reads them; kv_share >= 0.5 means most of them are the cache's"),
    (_ordered((LAUNCH_BOUND, lambda m: m.idle_share > 0.5), (COMPUTE_BOUND, lambda m: m.mfu > m.mbu),
              (KV_BOUND, lambda m: m.kv_share > 0.5)),
     "at exactly a threshold the rules say >=: idle_share = 0.5 is launch-bound, mfu = mbu compute-bound, "
     "kv_share = 0.5 KV-bound"),
)


def _answer(fn, what: str, m: Measurements) -> str:
    try:
        got = fn(m)
    except NotImplementedError as e:
        raise AssertionError(_NOT_WRITTEN) from e
    if got not in CLASSES:
        hint = ""
        if isinstance(got, str) and got.lower() in {c.lower() for c in CLASSES}:
            hint = " (mind the capitals: 'KV-bound', the others lower case)"
        raise AssertionError(f"{what}: classify returned {got!r}; return exactly one of "
                             f"{', '.join(repr(c) for c in CLASSES)}{hint}")
    return got


def check_classify(fn: Callable[[Measurements], str]) -> None:
    """Check `fn(m) -> class` against the rules on `CASES`.

    Raises:
        AssertionError: the stub (NotImplementedError) is still there; fn returns something that is not one of
            `CLASSES`; or its answers differ from the rules' — the message names the common mistake they match
            (`WRONG_ANSWERS`), else the first step it got wrong, its numbers, and the rule that decides it.
    """
    got = [_answer(fn, what, m) for what, m in CASES]
    want = [reference(m) for _, m in CASES]
    if got == want:
        return
    for wrong, why in WRONG_ANSWERS:
        if got == [wrong(m) for _, m in CASES]:
            raise AssertionError(why)
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    what, m = CASES[i]
    d = diagnose(m)
    raise AssertionError(
        f"{what} (idle_share={m.idle_share}, mbu={m.mbu}, mfu={m.mfu}, kv_share={m.kv_share}): your classify says "
        f"{got[i]!r}, the rules say {want[i]!r}: " + "; ".join(d.evidence) + f". Why: {d.rule.why}")
