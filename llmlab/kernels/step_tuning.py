"""Choose the batch-1 decode step's GEMV tiles and attention split by timing the whole captured step.

Triton's autotuner (https://triton-lang.org/main/python-api/generated/triton.autotune.html) times a kernel by
itself: launch, wait, repeat. Inside a decode step a kernel runs in a different world. With programmatic dependent
launch its programs start while the kernel before it still streams its own weights, and they load their first tile
before they wait (`fused_gemv`); the kernel after it does the same to it. A tile that wins alone can lose there,
and the other way round: a down projection's isolated pick can make the whole step slower than the tile the step
itself favours (`docs/results.md`, "Step tuning").

So this module times the step itself. For each GEMV role of `KernelDecodeStep.one_token` (q/k/v, o, gate/up,
down; every layer shares the role's shape), in turn, it captures the step with each tile the autotuner would have
timed for that shape (`fused_gemv.candidate_configs`), replays it, and keeps the fastest; then the same for decode
attention's split config (`decode_attention.candidate_configs`), whose best depends on the static cache's size,
so the choice is made for caches the size of the timed runner's and named by it (`decode_step.attention_role`,
e.g. "attention@1024"). It is coordinate descent — one role at a time, the others at their current config — with
the closest few timed again in rounds of alternating order, so that drift hits them alike. The chosen configs go
into the step (`KernelDecodeStep.tiles`), which runs them; runners captured before are not reused (their
fingerprint changes). Tuning takes seconds (about 100 captures of a 1B step); what it gains is in
`docs/results.md`, "Step tuning".

A weight-only quantized model's step (`KernelDecodeStep._quantized_token`) is tuned the same way: for each int8
GEMV role, which of the two int8 GEMVs runs and with what tile (`int8_matmul.candidate_configs`: the K-walking
GEMV's rows per program, K tile, split-K and stages, one split where the GEMV's prologue is the RMSNorm, which
needs the whole row; the input-stationary GEMV's rows per chunk and programs per SM, `int8_gemv.py`, and its Gluon
build's rows per chunk where it runs, `int8_gemv_gluon.py`); for each int4 role, the Gluon GEMV's rows per chunk
and chunks requested ahead, and for the down projection's long rows split-K (`int4_gemv_gluon.candidate_configs`;
none where the Gluon GEMV does not run, e.g. on a CPU); and the attention's split.

    from llmlab.kernels import KernelDecodeStep, step_tuning, swap_in
    step = KernelDecodeStep(swap_in(model))   # model: an llmlab Transformer on a CUDA GPU
    report = step_tuning.tune_decode_step(step)

The "step tuning" switch (`llmlab.switches`, a ladder rung) does this once per model, dtype and device
(`tune_once`); `chosen_tiles(llm)` and `tuning_report(llm)` say what it chose and how long it took.
"""

from __future__ import annotations

import functools
import math
import numbers
import statistics
import time
import weakref

import torch
import triton

from . import _util, attention_splits, decode_attention, fused_gemv, int8_matmul
from .decode_step import GEMV_ROLES, KernelDecodeStep, attention_role, float_projections, fusable_shape

# GEMV roles in the order they are tuned: the largest weights first (their tiles move the step most); the
# attention (role "attention@<slots>", `attention_role`) last
ORDER = ("gate_up", "down", "qkv", "o")


def runner_slots(model, context: int = 256, steps: int = 32) -> int:
    """Slots per row of the static cache `measure_step_ms` builds: 1024 (a chat runner's size,
    `llmlab.runtime.cuda_graphs.RunnerCache`), more if context + steps needs it, the model's context if shorter.

    Raises ValueError if steps < 1, context < 0, or the model's context cannot hold `steps` + 8 tokens."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or isinstance(context, bool) \
            or not isinstance(context, int) or context < 0:
        raise ValueError(f"step tuning: steps must be a whole number >= 1 and context >= 0, got steps={steps!r}, "
                         f"context={context!r}")
    slots = min(model.config.max_seq_len, max(1024, context + steps + 8))
    if slots < steps + 8:
        raise ValueError(f"step tuning: {steps} timed steps need a context of at least {steps + 8} tokens; "
                         f"this model has {model.config.max_seq_len}: time fewer steps")
    return slots


def measure_step_ms(step: KernelDecodeStep, context: int = 256, steps: int = 32) -> float:
    """Mean time (ms) of one batch-1 decode step of `step` (with its tiles), replayed from a CUDA graph captured
    now, with `context` tokens in the cache (fewer if the model's context is short; their values do not matter for
    the time): CUDA events around `steps` steps (each a replay plus the device-side advance of the token and
    position, as `generate_fast` runs them), after three untimed ones. The cache has `runner_slots` slots. (On a
    CPU: the same steps run eagerly and are timed by the host clock — in Triton's interpreter that says nothing
    about a GPU; the tests use it.)

    Raises ValueError if the model's context cannot hold `steps` + 8 tokens, or steps < 1, or context < 0."""
    from llmlab.runtime.cuda_graphs import GraphDecoder

    slots = runner_slots(step.model, context, steps)
    context = min(context, slots - steps - 4)
    runner = GraphDecoder(step.model, max_batch=1, max_seq_len=slots, kernels=step)
    runner.start(torch.zeros(1, dtype=torch.long, device=runner.device), context)
    for _ in range(3):
        runner.advance(runner.step()[1])
    if runner.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.advance(runner.step()[1])
        return (time.perf_counter() - t0) * 1e3 / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.advance(runner.step()[1])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def tune_decode_step(step: KernelDecodeStep, *, context: int = 256, steps: int = 32, measure=None,
                     candidates: dict | None = None, rounds: int = 3, finalists: int = 3, keep_margin: float = 0.005,
                     log=None) -> dict:
    """Choose a tile for each GEMV role of the batch-1 decode step, and the attention's split config, by timing
    the captured step (see above).

    Args:
        step: the Triton kernels' decode step (`KernelDecodeStep`, `LLM.kernels`) of an `llmlab.model.Transformer`,
            Llama-shaped (the fused batch-1 step runs it: no biases, no sliding window, one dtype), with float or
            weight-only quantized projections (int8: its GEMV tiles; int4: its Gluon GEMV's R, DEPTH and SPLITS).
        context, steps: the step is timed `steps` times with `context` tokens cached (default 256: between a chat
            turn's 128-token prompt and its end), on a static cache of `runner_slots(model, context, steps)` slots;
            the attention's choice is made for caches of that size (role `attention_role(slots)`).
        measure: step -> step time in ms (a finite number > 0), with the tiles it holds now. Default
            `measure_step_ms` (CUDA) with context and steps. Tests pass a stand-in.
        candidates: {role: [triton.Config, ...]} (roles from `GEMV_ROLES`, or the attention role) to
            try instead of `gemv_candidates` / `decode_attention.candidate_configs`; a role with fewer
            than two candidates is left alone (with autotuning off there is one).
        rounds: rounds over the finalists, the order reversed every other round; each finalist is kept by its
            median.
        finalists: how many of the first pass's fastest tiles are timed again, besides the role's current tile.
        keep_margin: the role's current tile (at first the autotuner's pick) stays unless the fastest finalist is
            faster by more than this fraction — below it, the difference is noise (~0.5% between rounds).
        log: a print-like callable for one line per role, or None.

    Returns:
        {role: {"chosen": str, "current": str, "step_ms": {config: median ms}, "first_pass_ms": {config: ms},
        "failed": {config: error}}} ("autotuner" names the autotuner's own pick; a tile that could not run, e.g. too
        many registers for this GPU, is in "failed" and never chosen). The chosen tiles are the step's `tiles`.
        Empty where every role has fewer than two candidates (autotuning off), with a line saying so to `log`.

    Raises:
        ValueError: not a KernelDecodeStep (the Triton kernels are not on); a model the fused batch-1 step does
            not run; rounds or
            finalists not whole numbers >= 1; keep_margin outside [0, 1); candidates with an unknown role, or
            split int8 tiles for q/k/v or gate/up (their prologue is the RMSNorm); `measure` returning anything but
            a finite number > 0.
        TypeError: candidates that are not {role: [triton.Config with BLOCK_N, BLOCK_K, STAGES]} (an int8 model:
            BLOCK_N, BLOCK_K, SPLIT_K, STAGES, or R with PPS or GLUON; an int4 model: R, DEPTH, maybe SPLITS).
        RuntimeError: no `measure` given and no CUDA GPU.
        On any error (or an interrupt) the step keeps the tiles it had before the call.
    """
    if not isinstance(step, KernelDecodeStep):
        raise ValueError(f"tune_decode_step: turn the Triton kernels on first and pass their decode step "
                         f"(llmlab.kernels.KernelDecodeStep(swap_in(model)), or LLM.kernels after the triton_kernels "
                         f"switch), not {type(step).__name__}: its batch-1 decode step is what it tunes")
    model = step.model
    ok, why = fusable(model)
    if not ok:
        raise ValueError(f"tune_decode_step: {why}")
    probe = next(model.parameters())
    slots = runner_slots(model, context, steps)
    if measure is None:
        if probe.device.type != "cuda":
            raise RuntimeError(f"tune_decode_step: timing the captured step needs a CUDA GPU (the model is on "
                               f"{probe.device}); pass measure= to time it another way")
        measure = functools.partial(measure_step_ms, context=context, steps=steps)
    whole = all(isinstance(n, int) and not isinstance(n, bool) for n in (rounds, finalists))
    if not whole or rounds < 1 or finalists < 1:
        raise ValueError(f"tune_decode_step: rounds and finalists must be whole numbers >= 1, got {rounds!r}, "
                         f"{finalists!r}")
    if isinstance(keep_margin, bool) or not isinstance(keep_margin, numbers.Real) or not 0 <= keep_margin < 1:
        raise ValueError(f"tune_decode_step: keep_margin must be a fraction in [0, 1) (0.005 = 0.5%), got "
                         f"{keep_margin!r}")
    attention = attention_role(slots)
    scheme = "float" if float_projections(model) else step.quantized_gemv_layers()["down"].scheme
    _check_candidates(candidates, attention, scheme)
    gemv_cands = gemv_candidates(step)
    before = dict(step.tiles)
    tiles = dict(before)
    report = {}
    try:
        for role in ORDER + (attention,):
            cands = (candidates or {}).get(role)
            if cands is None and role == attention:
                cands = _attention_candidates(model, slots)
            elif cands is None:
                cands = gemv_cands[role]
            if len(cands) < 2:
                continue
            report[role] = _tune_role(step, tiles, role, cands, _checked(measure), rounds, finalists,
                                      keep_margin)
            if log is not None:
                r = report[role]
                log(f"step tuning {role:7s}: {r['chosen']} ({r['step_ms'][r['chosen']]:.4f} ms/step; "
                    f"{r['current']}: {r['step_ms'][r['current']]:.4f})")
    except BaseException:
        step.tiles = before
        raise
    step.tiles = dict(tiles)
    if not report and log is not None:
        log("step tuning: every role has one config here (autotuning is off: Triton's interpreter, or "
            "LLMLAB_TRITON_AUTOTUNE=0), so there is nothing to choose")
    return report


def fusable(model) -> tuple[bool, str]:
    """(True, "") if `model`'s batch-1 decode step runs the fused GEMVs step tuning chooses tiles for (float, or
    weight-only quantized of one format); else (False, why): biases, a sliding window, mixed dtypes or quantized
    layers of mixed formats take the per-module path."""
    if not fusable_shape(model, next(model.parameters()).dtype):
        return False, ("this model's decode step does not run the fused batch-1 GEMVs (biases, a sliding window, "
                       "mixed dtypes, or quantized layers of mixed formats): there are no tiles to choose; leave "
                       "step tuning off for it")
    return True, ""


def _attention_candidates(model, slots: int) -> list:
    """The attention's split configs the autotuner would time for the step's static cache (batch 1), and their
    fused-merge twins of a few splits (`attention_splits.with_fused_merge`: timed here inside the whole step)."""
    probe = next(model.parameters())
    cfg = model.config
    q = torch.empty(1, cfg.n_heads, cfg.head_dim, device=probe.device, dtype=probe.dtype)
    k = torch.empty(1, cfg.n_kv_heads, slots, cfg.head_dim, device="meta", dtype=probe.dtype)
    configs = decode_attention.candidate_configs(q, k, has_lens=True)
    if len(configs) < 2:  # autotuning off: the one config, as for the GEMVs
        return configs
    return attention_splits.with_fused_merge(configs, triton.next_power_of_2(slots))


def gemv_candidates(step: KernelDecodeStep) -> dict:
    """{role: [config, ...]} the GEMV tiles step tuning times for each role of `step`'s batch-1 step: the float
    GEMV's (`fused_gemv.candidate_configs`), the int8 GEMV's (`int8_matmul.candidate_configs`; one split where the
    RMSNorm is its prologue: q/k/v and gate/up) or the int4 Gluon GEMV's (`int4_gemv_gluon.candidate_configs`: none
    where it does not run)."""
    if float_projections(step.model):
        return {role: fused_gemv.candidate_configs(w, swiglu_out=glu) for role, (w, glu) in step.gemv_weights().items()}
    from . import int4_gemv_gluon  # imports Gluon: only for a quantized model

    device = next(step.model.parameters()).device
    return {role: int8_matmul.candidate_configs(layer.out_features, layer.in_features,
                                                 rmsnorm=role in ("qkv", "gate_up"), device=device)
            if layer.scheme == "int8" else
            int4_gemv_gluon.candidate_configs(layer.in_features, device)
            for role, layer in step.quantized_gemv_layers().items()}


def _check_candidates(candidates, attention: str, scheme: str = "float") -> None:
    """Refuse candidates this step cannot run: unknown roles, configs of the wrong kind for the role and the
    weights' format ("float", "int8", "int4"), a split int8 tile where the RMSNorm is the GEMV's prologue (q/k/v,
    gate/up)."""
    if candidates is None:
        return
    from . import int4_gemv_gluon  # imports Gluon: only when candidates are given

    if not isinstance(candidates, dict):
        raise TypeError(f"tune_decode_step: candidates must be a dict {{role: [triton.Config, ...]}}, got "
                        f"{type(candidates).__name__}")
    roles = GEMV_ROLES + (attention,)
    unknown = set(candidates) - set(roles)
    if unknown:
        raise ValueError(f"tune_decode_step: unknown role(s) {sorted(unknown)} in candidates; the roles of this "
                         f"step are {', '.join(roles)}")
    for role, cands in candidates.items():
        gemv = role != attention
        what = ("a split config (BLOCK_N, SPLIT_N, FUSED_MERGE) as decode_attention.candidate_configs returns"
                if not gemv else "BLOCK_N, BLOCK_K and STAGES (as fused_gemv.candidate_configs returns)"
                if scheme == "float" else "BLOCK_N, BLOCK_K, SPLIT_K and STAGES, or R with PPS "
                                          "or GLUON (as int8_matmul.candidate_configs returns)" if scheme == "int8"
                else "R and DEPTH (as int4_gemv_gluon.candidate_configs returns)")
        check = (decode_attention._check_split_config if not gemv else fused_gemv._check_tile if scheme == "float"
                 else functools.partial(int8_matmul.check_gemv_config, rmsnorm=role in ("qkv", "gate_up"))
                 if scheme == "int8" else int4_gemv_gluon.check_config)
        if not isinstance(cands, (list, tuple)):
            raise TypeError(f"tune_decode_step: candidates[{role!r}] must be a list of triton.Config with {what}, "
                            f"got {cands!r}")
        for c in cands:
            try:
                check(c)
            except TypeError as e:
                raise TypeError(f"tune_decode_step: candidates[{role!r}] must be a list of triton.Config with "
                                f"{what}: {e}") from None
            except ValueError as e:  # a split int8 tile where the RMSNorm is the prologue (q/k/v, gate/up)
                raise ValueError(f"tune_decode_step: candidates[{role!r}] holds a split tile: {e} "
                                 f"(int8_matmul.candidate_configs(N, K, rmsnorm=True) gives the tiles it "
                                 f"takes)") from None


class MeasureError(ValueError):
    """`measure` returned something that is not a step time."""


def _checked(measure):
    """`measure`, refusing what is not a time: NaN, inf, zero, negative or not a number (MeasureError)."""
    def timed(step):
        t = measure(step)
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t <= 0:
            raise MeasureError(f"tune_decode_step: measure returned {t!r}; it must return the step's time in ms, a "
                             f"finite number > 0")
        return float(t)
    return timed


def _name(config) -> str:
    return "autotuner" if config is None else str(config)


def _tune_role(step: KernelDecodeStep, tiles: dict, role: str, cands: list, measure, rounds: int, finalists: int,
               keep_margin: float) -> dict:
    """Time the step with each of `cands` for `role` (the other roles as in `tiles`), then the current tile and
    the fastest few in rounds (order reversed every other round); set tiles[role] to the winner. Returns the
    role's report."""
    current = tiles.get(role)  # None: the autotuner's pick
    cur = _name(current)

    def timed(config):
        step.tiles = ({**tiles, role: config} if config is not None else
                      {r: c for r, c in tiles.items() if r != role})
        return measure(step)

    first, failed = {}, {}
    by_name = {cur: current}
    for config in cands:
        name = _name(config)
        if name == cur or name in first or name in failed:
            continue  # the current tile is a finalist anyway; a duplicate adds nothing
        try:
            first[name] = timed(config)
        except MeasureError:
            raise  # `measure` returned something that is not a time: a broken measurement, not a broken tile
        except Exception as e:  # noqa: BLE001 -- a tile this GPU cannot launch (registers, shared memory)
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        by_name[name] = config
    finals = [cur] + sorted(first, key=first.get)[:finalists]
    times = {n: [] for n in finals}
    for r in range(rounds):
        for n in (finals if r % 2 == 0 else finals[::-1]):
            times[n].append(timed(by_name[n]))
    med = {n: statistics.median(ts) for n, ts in times.items()}
    best = min(med, key=med.get)
    chosen = best if best != cur and med[best] < med[cur] * (1 - keep_margin) else cur
    if by_name[chosen] is None:
        tiles.pop(role, None)
    else:
        tiles[role] = by_name[chosen]
    step.tiles = dict(tiles)
    return {"chosen": chosen, "current": cur, "step_ms": med, "first_pass_ms": first, "failed": failed}


# -- the switch: tune once per model, dtype and device -----------------------------------------------------------

# model -> (what the tiles were tuned for, the tiles, {"seconds": tuning time, "roles": tune_decode_step's report}).
# Weak keys: a model that is gone takes its entry with it (the entries hold no reference to the model).
_tuned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tuned_for(step: KernelDecodeStep) -> tuple:
    """What chosen tiles depend on: device, dtype, the four GEMV weights' formats and shapes, and whether PDL is
    on."""
    probe = next(step.model.parameters())
    if float_projections(step.model):
        shapes = tuple((role, "float", tuple(w.shape)) for role, (w, _) in step.gemv_weights().items())
    else:
        shapes = tuple((role, layer.scheme, getattr(layer, "group_size", None), layer.out_features,
                        layer.in_features) for role, layer in step.quantized_gemv_layers().items())
    return (str(probe.device), probe.dtype, shapes, _util.pdl_enabled(probe.device))


def tune_once(step: KernelDecodeStep, log=print) -> None:
    """Give `step` the tiles chosen for its model as it is now (device, dtype, shapes: `tuned_for`), tuning
    (`tune_decode_step`, starting from the autotuner's picks) only if they were never chosen for it. Remembered per
    model, so the switch turned off and on again does not retune. On an error or an interrupt the step keeps the
    tiles it had."""
    ok, why = fusable(step.model)
    if not ok:  # e.g. a model with biases: nothing to tune, the kernels' own picks stay
        log(f"step tuning skipped: {why}")
        step.tiles = {}
        return
    key = tuned_for(step)
    held = _tuned.get(step.model)
    if held is None or held[0] != key:  # never tuned, or tuned for another dtype / device / shape
        before = step.tiles
        step.tiles = {}
        t0 = time.perf_counter()
        try:
            report = tune_decode_step(step, log=log)
        except BaseException:
            step.tiles = before
            raise
        held = _tuned[step.model] = (key, dict(step.tiles), {"seconds": time.perf_counter() - t0, "roles": report})
    step.tiles = dict(held[1])


def chosen_tiles(llm) -> dict:
    """{role: triton.Config} the LLM's kernel decode step runs now ({}: the autotuner's picks, or no kernels)."""
    return {} if llm.kernels is None else dict(llm.kernels.tiles)


def tuning_report(llm) -> dict | None:
    """{"seconds": the tuning's own time, "roles": `tune_decode_step`'s report} of the last tuning of the LLM's
    model by the switch (`tune_once`); None if it was never tuned."""
    held = _tuned.get(llm.model)
    return None if held is None else held[2]
