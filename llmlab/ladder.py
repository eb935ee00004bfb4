"""The optimization ladder: the ordered list of steps that `llmlab bench`, `llmlab tour` and the dashboard climb.

A `LadderStep` names a set of switch values (`llmlab.switches`) and says in one sentence what it changes. The
steps are CUMULATIVE: each one runs with its own settings on top of every earlier step that could run here, so the
table reads as a ladder, each rung keeping what the rungs below it bought:

    no_kv_cache      recompute the whole sequence for every token (the bottom rung, for contrast)
    eager            KV cache, eager PyTorch, sampling on the host (bf16 on a GPU, fp32 on a CPU): the baseline
    +paged_kv        (side rung, not inherited) the same decode on a paged KV cache (llmlab.cache.paged_cache)
    +gpu_sampling    pick the next token on the GPU
    +pinned_memory   page-locked host buffers for host <-> device copies
    +cuda_graphs     replay each decode step as one CUDA graph instead of ~hundreds of kernel launches
    +torch_compile   fuse the small ops with torch.compile (Inductor)
    +triton_kernels  hand-written Triton kernels for RMSNorm, SwiGLU, RoPE, decode attention (llmlab.kernels)
                     INSTEAD of torch.compile's: CUDA graphs + these kernels, to compare hand fusion with Inductor's
    +step_tuning     the Triton kernels' configs chosen by timing the whole decode step (llmlab.kernels.step_tuning)
    +prefill_graphs  the prefill replayed from CUDA graphs too (prompt padded to a length bucket): a shorter TTFT
    +int8            (side rung) weight-only int8 linear layers (llmlab.quant): half the bytes per decode step
    +int4            (side rung) weight-only int4, one scale per 128 inputs: about a quarter of the bytes
    +int8_lm_head, +int4_lm_head  (side rungs) the same with the output layer (lm_head) quantized too
                     Both run on top of every rung below them; rungs added above keep the loaded weights
    +one_at_a_time       (side rung) every request alone (batch 1), one after the other: no batching, the baseline
    +static_batching     (side rung) the workload's requests as one left-padded batch (llmlab.batching.static)
    +continuous_batching (side rung) continuous batching on a paged KV pool (llmlab.batching.engine)

A lesson that adds an optimization registers its switch (`llmlab.switches.register`) and its rung here, in one
place:

    from llmlab.ladder import LadderStep, register_step
    register_step(LadderStep("+int4_g32", {"weights": "int4-g32"}, "int4 weights, one scale per 32 inputs",
                             weights="int4", weight_bytes_per_param=0.5 + 4 / 32))   # on top of the ladder

The registries live in the Python process: `run_tour` / `run_bench` called after these lines climb the new rung
(a notebook, a script); the `llmlab` command starts a new process with the built-in rungs only.

`available_steps(llm)` resolves the ladder for one model on one device: it returns the runnable steps with their
accumulated settings and, separately, the skipped ones with the reason (a switch not registered yet, a switch not
available here such as CUDA graphs on a CPU, or a GPU-only step on a CPU). A skipped rung adds nothing to the rungs
above it. Checking costs nothing: no model is converted or compiled.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable

from llmlab.switches import SWITCHES

# bytes per weight of each `weights` label (group-wise scales are added by the step that quantizes, see
# `LadderStep.weight_bytes_per_param`)
WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
_DTYPE_LABEL = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class LadderStep:
    """One rung of the ladder.

    Fields:
        name: the id used in `--steps`, bench JSON ("step") and code, e.g. "+cuda_graphs".
        settings: switch values this rung sets (switch key -> value), on top of the rungs below it.
        note: one sentence: what this rung changes and why it should be faster.
        label: shown in tables (default: name), e.g. "KV cache".
        weights: the weight format after this rung ("int8", "int4", ...); None keeps the model's dtype (bf16/fp32).
        weight_bytes_per_param: bytes per weight for MBU (None: from `weights`, see `WEIGHT_BYTES`); a group-wise
            int4 rung with bf16 scales and group 32 would give 0.5 + 2 / 32.
        gpu_only: non-empty = skip on a CPU even if its switches would accept it, with this as the reason (CUDA
            graphs, pinned memory, ... have nothing to remove there; torch.compile's warm-up would dominate a CPU run).
        requires: an extra check `requires(llm) -> (ok, reason)` beyond the switches' own `available`.
        cumulative: False = a side rung: it runs on top of the rungs below it, but the rungs above do not inherit
            its settings (e.g. "+paged_kv", an alternative cache layout compared with "eager").
    """

    name: str
    settings: dict[str, Any]
    note: str = ""
    label: str = ""
    weights: str | None = None
    weight_bytes_per_param: float | None = None
    gpu_only: str = ""
    requires: Callable[[Any], tuple[bool, str]] | None = None
    cumulative: bool = True

    def __post_init__(self) -> None:
        self.label = self.label or self.name


@dataclass
class ResolvedStep:
    """A step as it will run on one model: its accumulated settings (every runnable rung up to and including it)."""

    step: LadderStep
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.step.name


LADDER: list[LadderStep] = []


def register_step(step: LadderStep, after: str | None = None, before: str | None = None) -> LadderStep:
    """Add a rung (or replace the one with the same name, keeping its place).

    By default a new rung goes on top of the ladder; `after="eager"` or `before="+cuda_graphs"` put it elsewhere.

    Raises:
        ValueError: both `after` and `before` given, or the step they name is not in the ladder.
    """
    if after is not None and before is not None:
        raise ValueError("give `after` or `before`, not both")
    names = [s.name for s in LADDER]
    if step.name in names:
        LADDER[names.index(step.name)] = step
        return step
    anchor = after if after is not None else before
    if anchor is None:
        LADDER.append(step)
        return step
    if anchor not in names:
        raise ValueError(f"no ladder step named {anchor!r}; steps: {', '.join(names)}")
    LADDER.insert(names.index(anchor) + (1 if after is not None else 0), step)
    return step


def step_names() -> list[str]:
    """The names of all rungs, bottom first."""
    return [s.name for s in LADDER]


def get_step(name: str) -> LadderStep:
    """The rung called `name`.

    Raises:
        ValueError: no rung has that name; the message lists the names and suggests one where it can: the name
            with its leading "+" ('cuda_graphs' -> '+cuda_graphs': the rungs above "eager" add to those below), the
            rung that turns on a switch of that name ('kv_cache' -> 'eager'), or a close spelling ('eagre').
    """
    for s in LADDER:
        if s.name == name:
            return s
    names = step_names()
    guess = next((s.name for s in LADDER if s.name == "+" + name), None)
    guess = guess or next((s.name for s in LADDER if s.settings.get(name) is True), None)
    guess = guess or next(iter(difflib.get_close_matches(name, names, n=1)), None)
    hint = f" (did you mean {guess!r}?)" if guess else ""
    raise ValueError(f"unknown ladder step {name!r}{hint}; steps: {', '.join(names)}")


def weights_label(step: LadderStep, dtype) -> str:
    """The weight format a step runs with: the step's own `weights`, else the model dtype ('bf16', 'fp32', ...)."""
    if step.weights:
        return step.weights
    return _DTYPE_LABEL.get(str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))


def weight_bytes_per_param(step: LadderStep, dtype) -> float:
    """Bytes per weight read by a decode step under this rung (for MBU and the roofline)."""
    if step.weight_bytes_per_param is not None:
        return step.weight_bytes_per_param
    label = weights_label(step, dtype)
    if label not in WEIGHT_BYTES:
        raise ValueError(f"unknown weight format {label!r}; set weight_bytes_per_param on the step")
    return WEIGHT_BYTES[label]


def check_step(llm, step: LadderStep, settings: dict[str, Any]) -> tuple[bool, str]:
    """Can `step` (with the accumulated `settings`) run on `llm` here? Returns (ok, reason); never raises.

    Reasons, in the order checked: a switch not registered (its lesson is not installed), a value outside a
    switch's choices, a switch whose `available(llm)` says no (its reason), a GPU-only step on a CPU, the step's
    own `requires`.
    """
    for key, value in step.settings.items():
        if key not in SWITCHES:
            return False, (f"switch {key!r} is not registered in llmlab.switches (the lesson that adds it is not "
                           f"installed yet)")
        switch = SWITCHES[key]
        if switch.choices is not None and value not in switch.choices:
            return False, f"{key}={value!r} is not one of {switch.choices}"
    for key, value in settings.items():
        switch = SWITCHES.get(key)
        if switch is None or value == switch.default:
            continue
        try:
            ok, why = switch.available(llm)
        except Exception as e:  # a broken availability check must not stop the whole ladder
            ok, why = False, f"its availability check failed: {type(e).__name__}: {e}"
        if not ok:
            return False, f"{switch.label}: {why}"
    if step.gpu_only and llm.device.type != "cuda":
        return False, f"GPU-only step on a CPU: {step.gpu_only}"
    if step.requires is not None:
        ok, why = step.requires(llm)
        if not ok:
            return False, why
    return True, ""


def available_steps(llm, names: list[str] | str | None = None
                    ) -> tuple[list[ResolvedStep], list[tuple[LadderStep, str]]]:
    """Resolve the ladder for `llm`: (runnable steps with their accumulated settings, [(skipped step, reason)]).

    names: the rungs wanted (None, "all" or ["all"]: every rung); one name may be given as a string ("eager" is
    ["eager"]). Rungs below a wanted one still accumulate into it, so `names=["+cuda_graphs"]` runs CUDA graphs
    with the KV cache and GPU sampling that sit below it.

    Raises:
        ValueError: a name that is not a rung (the message lists them).
    """
    if isinstance(names, str):
        names = [names]  # list("eager") would be the names "e", "a", "g", ...
    wanted = None if names is None or list(names) == ["all"] else list(names)
    if wanted is not None:
        for n in wanted:
            get_step(n)  # raises with the list of names
    runnable, skipped = [], []
    accumulated: dict[str, Any] = {}
    for step in LADDER:
        settings = {**accumulated, **step.settings}
        ok, why = check_step(llm, step, settings)
        if ok and step.cumulative:
            accumulated = settings
        if wanted is not None and step.name not in wanted:
            continue
        if ok:
            runnable.append(ResolvedStep(step, dict(settings)))
        else:
            skipped.append((step, why))
    return runnable, skipped


# -- the rungs of this course -------------------------------------------------------------------------------------

register_step(LadderStep("no_kv_cache", {"kv_cache": False},
                         "recompute the whole sequence for every token: O(n) work per token", label="no KV cache"))
register_step(LadderStep("eager", {"kv_cache": True},
                         "KV cache, eager PyTorch, next token picked on the host: the baseline", label="KV cache"))
register_step(LadderStep("+paged_kv", {"paged_kv": True},
                         "KV cache in 16-token blocks of a shared pool (llmlab.cache.paged_cache): no max-length "
                         "preallocation; a side rung, the rungs above keep the contiguous cache",
                         label="paged KV cache", cumulative=False,
                         gpu_only="lab 03 runs the paged cache on a CPU itself; the ladder measures it on a GPU"))
register_step(LadderStep("+gpu_sampling", {"gpu_sampling": True},
                         "pick the next token on the GPU, no host round trip per step",
                         gpu_only="on a CPU the logits and the sampler already live on the same device"))
register_step(LadderStep("+pinned_memory", {"pinned_memory": True},
                         "page-locked host buffers: faster, asynchronous host <-> device copies",
                         gpu_only="there is no host -> device copy when the model runs on the CPU"))
register_step(LadderStep("+cuda_graphs", {"cuda_graphs": True},
                         "replay each decode step as one CUDA graph instead of hundreds of kernel launches",
                         gpu_only="CUDA graphs record and replay GPU kernel launches; a CPU has none"))
register_step(LadderStep("+torch_compile", {"torch_compile": True},
                         "fuse the small elementwise ops with torch.compile (Inductor); costs a compile warm-up",
                         gpu_only="Inductor's C++ warm-up (~20 s on a 2-core CPU) would dominate a CPU run; lab 05 "
                                  "times torch.compile's warm-up on its own"))
register_step(LadderStep("+triton_kernels", {"triton_kernels": True, "torch_compile": False},
                         "hand-written Triton kernels (lab 07) for RMSNorm, SwiGLU, RoPE and flash-decoding attention, "
                         "in place of torch.compile's generated ones, on the CUDA graphs below",
                         gpu_only="the Triton kernels are compiled for a CUDA GPU; on a CPU only the slow "
                                  "interpreter runs them (for tests)"))
register_step(LadderStep("+step_tuning", {"step_tuning": True},
                         "the Triton GEMVs' tiles and the attention's split chosen by timing the captured decode step "
                         "instead of each kernel alone "
                         "(llmlab.kernels.step_tuning; 8-19 s of tuning on an H200 before the run)",
                         gpu_only="it times CUDA-graph replays of the decode step; a CPU has none"))
register_step(LadderStep("+prefill_graphs", {"prefill_graphs": True},
                         "the prefill replayed from a CUDA graph too (the prompt padded to a length bucket, captured "
                         "once per bucket): a 128-token prefill launches as many kernels as a decode step, so the "
                         "time to the first token was the eager launch time",
                         gpu_only="CUDA graphs record and replay GPU kernel launches; a CPU has none"))
register_step(LadderStep("+int8", {"weights": "int8"},
                         "weight-only int8, one scale per output channel (llmlab.quant): half of bf16's bytes per "
                         "weight, so a bandwidth-bound step should take about half the time; lm_head stays bf16",
                         label="int8 weights", weights="int8", cumulative=False))
register_step(LadderStep("+int4", {"weights": "int4"},
                         "weight-only int4 in groups of 128 inputs per scale (llmlab.quant): a quarter of bf16's bytes "
                         "plus the scales; lm_head stays bf16",
                         label="int4 weights (g128)", weights="int4", weight_bytes_per_param=0.5 + 4 / 128,
                         cumulative=False))
# on a CPU a quantized layer dequantizes its weight in PyTorch at every step, and lm_head is the largest layer: the
# rung would show that cost (slower than bf16), not the bytes it saves
_LM_HEAD_CPU = ("on a CPU the quantized lm_head is dequantized in PyTorch at every step (the largest layer), which "
                "costs more than the bytes it saves; the GPU reads it packed")
register_step(LadderStep("+int8_lm_head", {"weights": "int8+lm_head"},
                         "+int8 with lm_head in int8 too: once the other layers are int8, the bf16 output layer is a "
                         "large share of a step's bytes (Llama-3.1-8B: 1.05 of 8.0 GB); its rounding moves the logits "
                         "directly (data/quant/perplexity_default.json has the perplexity of both)",
                         label="int8 weights + lm_head", weights="int8", cumulative=False, gpu_only=_LM_HEAD_CPU))
register_step(LadderStep("+int4_lm_head", {"weights": "int4+lm_head"},
                         "+int4 with lm_head in int4 (g128) too: on Llama-3.1-8B the bf16 output layer is 1.05 of the "
                         "4.8 GB an int4 step reads",
                         label="int4 weights (g128) + lm_head", weights="int4", weight_bytes_per_param=0.5 + 4 / 128,
                         cumulative=False, gpu_only=_LM_HEAD_CPU))
register_step(LadderStep("+one_at_a_time", {"batching": "one_at_a_time"},
                         "no batching: every request of the workload alone (batch 1) on the rungs below, one after "
                         "the other, as a server without a batcher would serve requests that arrived together; the "
                         "baseline the batching rungs are measured against",
                         label="one at a time (bs=1)", cumulative=False))
register_step(LadderStep("+static_batching", {"batching": "static", "prefill_graphs": False},
                         "all requests of the workload as ONE left-padded batch (llmlab.batching.static) instead of "
                         "one batch per prompt length: the weights are read once per step for every request, and "
                         "the padding and the rows that finished early are computed for nothing",
                         label="static batching", cumulative=False))
# what the batching engine does not take: it keeps cuda_graphs and the Triton kernels (its paged decode step)
_NOT_IN_ENGINE = {"torch_compile": False, "gpu_sampling": False, "pinned_memory": False, "step_tuning": False,
                  "prefill_graphs": False}
register_step(LadderStep("+continuous_batching", {"batching": "continuous", **_NOT_IN_ENGINE},
                         "continuous batching (llmlab.batching.engine): a scheduler admits requests as KV blocks "
                         "free up and each request leaves the batch the step it finishes; on a GPU the decode rows "
                         "run the paged-attention kernel from a CUDA graph per batch-size bucket",
                         label="continuous batching", cumulative=False))
