"""The optimizations a student can switch on and off — one registry read by `llmlab tour`, the dashboard and the
benchmark ladder.

A `Switch` is one knob (KV cache on/off, dtype, ...). A lesson that adds an optimization registers its switch here
with `register(...)`; nothing else needs to change for the tour, the dashboard's checkboxes or the ladder to show it.

Applying a set of switch values turns an `LLM` and a dict of `generate` keyword arguments into the ones to run:

    llm2, kwargs = apply_switches(llm, {"kv_cache": False, "dtype": "fp32"})
    llm2.generate(prompt, **kwargs)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any, Callable

from llmlab.engine import BATCHING, DTYPES, LLM, check_fast_paths


@dataclass
class Switch:
    key: str  # the name used in settings dicts, e.g. "kv_cache"
    label: str  # shown next to the checkbox / in tables, e.g. "KV cache"
    default: Any
    help: str  # one sentence: what it changes and why it helps
    # apply(llm, value, generate_kwargs) -> llm: may return a converted model and/or edit generate_kwargs in place
    apply: Callable[[LLM, Any, dict], LLM]
    choices: tuple | None = None  # None: a boolean switch (a checkbox); else the allowed values (a dropdown)
    # available(llm) -> (ok, reason): whether the switch can be turned on here (e.g. CUDA graphs need a GPU)
    available: Callable[[LLM], tuple[bool, str]] = lambda llm: (True, "")


SWITCHES: dict[str, Switch] = {}


def register(switch: Switch) -> Switch:
    """Add (or replace) a switch; the order of registration is the order shown in the UI."""
    SWITCHES[switch.key] = switch
    return switch


def defaults() -> dict[str, Any]:
    return {k: s.default for k, s in SWITCHES.items()}


def apply_switches(llm: LLM, settings: dict[str, Any]) -> tuple[LLM, dict]:
    """Return the LLM to run and the `generate` keyword arguments for `settings` (missing keys take defaults).

    Raises:
        ValueError: an unknown switch name, a value outside a switch's choices, a switch not available here (the
            message says why, and to leave it off), or switches that `LLM.generate` would refuse together (e.g. GPU
            sampling without the KV cache; `llmlab.engine.check_fast_paths`, same message). All checked before any
            switch changes the model. Also: two switches on together that both set one generate argument (two
            KV-cache layouts, each a cache_factory), or a KV-cache layout (the paged cache) with a switch that decodes
            on the static cache (CUDA graphs, torch.compile, GPU sampling; `check_fast_paths` again, naming the
            switches) — found while applying them, as soon as the switch that sets the argument is applied (the
            switches that change the model in place come after those that set generate arguments). And switches
            that the batching switch's mode cannot run with (`check_batching`, e.g. continuous batching without the
            KV cache or with the paged one), named as the settings name them, before any switch changes the model.
        TypeError: settings that are not a dict of switch names to values.
    """
    if not isinstance(settings, dict):
        raise TypeError(f"settings must be a dict of switch names to values, e.g. {{'kv_cache': False}}, got "
                        f"{type(settings).__name__} {settings!r:.80}")
    unknown = set(settings) - set(SWITCHES)
    if unknown:
        raise ValueError(f"unknown switch(es) {sorted(unknown)}; known: {', '.join(SWITCHES)}")
    for key, switch in SWITCHES.items():  # every value checked before any switch changes the model
        value = settings.get(key, switch.default)
        if switch.choices is not None and value not in switch.choices:
            raise ValueError(f"{key}={value!r} is not one of {switch.choices}")
        if switch.choices is None and not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: this switch is on or off; give True or False")
        if value != switch.default:
            ok, why = switch.available(llm)
            if not ok:
                fix = "leave it off" if switch.choices is None else f"leave it at {switch.default!r}"
                if why == NEEDS_CUDA:
                    fix += " or load the model on a CUDA GPU (device='cuda', --device cuda)"
                raise ValueError(f"switch {switch.label!r} cannot be set to {value!r} here: {why}; {fix}")
    values = {key: settings.get(key, switch.default) for key, switch in SWITCHES.items()}
    check_fast_paths(llm.device, use_cache=values["kv_cache"], cuda_graphs=values["cuda_graphs"],  # as generate
                     torch_compile=values["torch_compile"], gpu_sampling=values["gpu_sampling"],
                     prefill_graphs=values["prefill_graphs"])
    check_batching(values)
    kwargs: dict = {}
    set_by: dict[str, str] = {}  # generate argument -> the switch that set it
    for key, switch in SWITCHES.items():
        before = dict(kwargs)
        llm = switch.apply(llm, settings.get(key, switch.default), kwargs)
        for arg in [a for a, v in kwargs.items() if a not in before or before[a] is not v]:
            if arg in set_by:  # e.g. two switches that each pick the KV cache (cache_factory): the row would run
                # the last one while its label names both
                raise ValueError(f"switches {set_by[arg]!r} and {key!r} both set generate's {arg}: they cannot be on "
                                 f"together; turn one of them off")
            set_by[arg] = key
        # the arguments set so far, as generate would take them (a KV-cache layout that only the eager decode
        # runs, with a switch that decodes on the static cache, is refused here, before a later switch changes
        # the model); the refusal names the switches
        check_fast_paths(llm.device, use_cache=kwargs.get("use_cache", True),
                         cuda_graphs=bool(kwargs.get("cuda_graphs")), torch_compile=bool(kwargs.get("torch_compile")),
                         gpu_sampling=bool(kwargs.get("gpu_sampling")),
                         prefill_graphs=bool(kwargs.get("prefill_graphs")),
                         cache_factory=kwargs.get("cache_factory") is not None, switch_names=set_by)
    return llm, kwargs


def describe(settings: dict[str, Any]) -> str:
    """A readable label, in registry order: {"kv_cache": True, "dtype": "bf16"} -> 'KV cache, bf16';
    {"kv_cache": False} -> 'no KV cache'. Choice switches left at None, and optimizations that are off by default
    and left off, are not named, nor the paged KV cache with the KV cache off (there is no cache to page: it runs
    without one, as `apply_switches` sets it); 'defaults' if nothing is left."""
    parts = []
    for key, sw in SWITCHES.items():
        if key not in settings or (key == "paged_kv" and settings.get("kv_cache", True) is False):
            continue
        v = settings[key]
        if sw.choices is None:
            if not v and sw.default is False:
                continue
            parts.append(sw.label if v else f"no {sw.label}")
        elif v is not None:
            parts.append(str(v))
    return ", ".join(parts) or "defaults"


# -- the switches of the foundation ----------------------------------------------------------------------------

def _kv_cache(llm: LLM, value: bool, kwargs: dict) -> LLM:
    kwargs["use_cache"] = bool(value)
    return llm


def _dtype(llm: LLM, value: str | None, kwargs: dict) -> LLM:
    if value is None:
        return llm
    return llm.to(dtype=DTYPES[value])


register(Switch("kv_cache", "KV cache", True, "keep past keys/values instead of recomputing the sequence each step",
                _kv_cache))
register(Switch("dtype", "dtype", None, "weights and activations in fp32, bf16 or fp16 (None: as loaded)", _dtype,
                choices=(None, "fp32", "bf16", "fp16")))


# -- lab 04: weight-only quantization (llmlab.quant) --------------------------------------------------------------
# Runs a quantized COPY of the model (the loaded one keeps its weights for the other rows). Registered before the
# kernel switches: the "Triton kernels" switch, applied after it, swaps its modules into the quantized copy (their
# q/k/v and gate/up GEMVs then run on the packed weights: llmlab.quant.fused).

# value -> (scheme, group size, lm_head quantized too)
WEIGHT_FORMATS = {"int8": ("int8", None, False), "int4": ("int4", 128, False), "int4-g64": ("int4", 64, False),
                  "int4-g32": ("int4", 32, False), "int8+lm_head": ("int8", None, True),
                  "int4+lm_head": ("int4", 128, True)}


def _weights(llm: LLM, value: str | None, kwargs: dict) -> LLM:
    if value is None:
        return llm
    scheme, group_size, lm_head = WEIGHT_FORMATS[value]
    if llm.kernels is not None:  # the loaded model may hold the kernel modules from an earlier row: put the
        from llmlab.kernels import modules  # PyTorch ones back before copying (the copy gets its own later)

        modules.swap_out(llm.model)
        llm.kernels = None
    return llm.quantize(scheme, group_size=group_size, include_lm_head=lm_head)


def _weights_available(llm: LLM) -> tuple[bool, str]:
    from llmlab.quant import is_quantized, quantized_layers

    if is_quantized(llm.model):  # e.g. a folder `save_quantized` wrote: rounding the rounded weights again
        layer = next(iter(quantized_layers(llm.model).values()))
        return False, (f"the loaded model's layers are already quantized ({type(layer).__name__}, e.g. from a folder "
                       f"save_quantized wrote); this switch quantizes a float model: load the float checkpoint to "
                       f"compare formats")
    return True, ""


register(Switch("weights", "weights", None,
                "store the linear layers' weights in int8 (one scale per output channel) or int4 (one scale per "
                "group of 128, 64 or 32 inputs) and dequantize them in the matmul: fewer bytes per decode step; "
                "'+lm_head' quantizes the output layer too",
                _weights, choices=(None, *WEIGHT_FORMATS), available=_weights_available))


# -- system-overhead fixes (llmlab.runtime.cuda_graphs, llmlab.runtime.fast_generate) ----------------------------------
# Each sets one `LLM.generate` keyword; any of cuda_graphs / torch_compile / gpu_sampling routes the call to
# `generate_fast` (static KV cache). Turning several on combines them (graphs + compile = "compile+graphs").

NEEDS_CUDA = "needs a CUDA GPU"  # `apply_switches` adds the fix: load the model on one


def _needs_cuda(llm: LLM) -> tuple[bool, str]:
    return (True, "") if llm.device.type == "cuda" else (False, NEEDS_CUDA)


def _compile_available(llm: LLM) -> tuple[bool, str]:
    if llm.device.type == "cuda":
        return True, ""
    if any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return True, ""
    return False, "torch.compile on a CPU needs a C++ compiler (g++ or clang++)"


def _kwarg_switch(name: str) -> Callable[[LLM, Any, dict], LLM]:
    def apply(llm: LLM, value: bool, kwargs: dict) -> LLM:
        if value:
            kwargs[name] = True
        return llm
    return apply


register(Switch("cuda_graphs", "CUDA graphs", False,
                "replay the decode step from a CUDA graph (one per batch-size bucket): one launch instead of "
                "hundreds of kernel launches per token", _kwarg_switch("cuda_graphs"), available=_needs_cuda))
register(Switch("torch_compile", "torch.compile", False,
                "compile the decode step: fused kernels (and, on CUDA without the CUDA graphs switch, "
                "mode='reduce-overhead' = Inductor's own CUDA graphs)", _kwarg_switch("torch_compile"),
                available=_compile_available))
register(Switch("gpu_sampling", "GPU sampling", False,
                "sample on the GPU and keep the tokens there, reading them (and checking EOS) every 16 steps "
                "instead of synchronizing with the GPU on every token", _kwarg_switch("gpu_sampling")))


def _prefill_graphs(llm: LLM, value: bool, kwargs: dict) -> LLM:
    if value:
        if not kwargs.get("cuda_graphs"):  # cuda_graphs is registered (so applied) first
            raise ValueError("prefill CUDA graphs are captured beside the decode step's: turn the cuda_graphs "
                             "switch on too")
        kwargs["prefill_graphs"] = True
    return llm


register(Switch("prefill_graphs", "prefill CUDA graphs", False,
                "replay the prefill from a CUDA graph too, the prompt padded to a length bucket: a short prompt's "
                "prefill is as launch-bound as a decode step, so this cuts the time to the first token (needs the "
                "CUDA graphs switch)", _prefill_graphs, available=_needs_cuda))
register(Switch("pinned_memory", "pinned memory", False,
                "copy the prompt to the GPU from page-locked host memory, non_blocking", _kwarg_switch("pin_memory"),
                available=_needs_cuda))


# -- lab 03: the paged KV cache (llmlab.cache.paged_cache) ----------------------------------------------------------

def _paged_kv(llm: LLM, value: bool, kwargs: dict) -> LLM:
    if value and kwargs.get("use_cache", True):  # with the KV cache off there is no cache to page
        from llmlab.cache.paged_cache import PagedKVCache
        kwargs["cache_factory"] = PagedKVCache  # eager decode only; the static-cache fast paths keep their cache
    return llm


register(Switch("paged_kv", "paged KV cache", False,
                "keep keys/values in 16-token blocks of a shared pool, found through a block table, instead of one "
                "max-length buffer per sequence (PagedAttention)", _paged_kv))


# -- Triton kernels (llmlab.kernels, lab 07) -------------------------------------------------------------------
# Swaps the model's RMSNorm, MLP and Attention modules for the Triton kernels' modules (llmlab.kernels.modules, in
# place, the same parameters) and gives the LLM the kernels' decode step (`LLM.kernels`: residual adds folded into
# the norms, the fused batch-1 step, the greedy token in one launch); turning the switch off swaps the PyTorch
# modules back. Nothing imports triton until the switch is used.

def _triton_available(llm: LLM) -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton; Linux only)"
    return _needs_cuda(llm) if llm.device.type != "cuda" else (True, "")


def _triton_kernels(llm: LLM, value: bool, kwargs: dict) -> LLM:
    from llmlab.kernels import modules

    if value:
        modules.swap_in(llm.model)
        if llm.kernels is None or llm.kernels.model is not llm.model:
            from llmlab.kernels.decode_step import KernelDecodeStep

            llm.kernels = KernelDecodeStep(llm.model)
    else:
        modules.swap_out(llm.model)
        llm.kernels = None
    return llm


register(Switch("triton_kernels", "Triton kernels", False,
                "run RMSNorm, SwiGLU, RoPE and decode attention as hand-written Triton kernels (one launch per op, "
                "flash-decoding split over the sequence) instead of PyTorch's chains of small kernels",
                _triton_kernels, available=_triton_available))


# -- step tuning (llmlab.kernels.step_tuning) --------------------------------------------------------------------
# Chooses the Triton kernels' GEMV tiles and the attention's split by timing the captured batch-1 decode step (once
# per model, dtype and device; 8-19 s on an H200), instead of the autotuner's picks made by timing each kernel
# alone. Off: the autotuner's picks again (the chosen tiles are remembered: on -> off -> on does not retune).

def _step_tuning(llm: LLM, value: bool, kwargs: dict) -> LLM:
    if not value:
        if llm.kernels is not None:
            llm.kernels.tiles = {}
        return llm
    if llm.kernels is None:
        raise ValueError("step tuning chooses the Triton kernels' tiles: turn the triton_kernels switch on too")
    from llmlab.kernels import step_tuning

    step_tuning.tune_once(llm.kernels, log=print)
    return llm


def _step_tuning_available(llm: LLM) -> tuple[bool, str]:
    ok, why = _triton_available(llm)
    if not ok:
        return ok, why
    from llmlab.kernels.step_tuning import fusable

    return fusable(llm.model)


register(Switch("step_tuning", "step tuning", False,
                "choose each Triton GEMV's tile and the attention's split by timing the whole captured decode step "
                "(batch 1), not each kernel alone: inside the step, kernels overlap their neighbours (programmatic "
                "dependent launch)",
                _step_tuning, available=_step_tuning_available))


# -- lab 06: batching (llmlab.batching) ----------------------------------------------------------------------------
# How the requests of a workload share the GPU: None runs equal-length prompts as one batch and a ragged list as one
# left-padded static batch; "static" says so explicitly; "continuous" serves them by continuous batching (a
# scheduler over a paged KV pool, requests joining and leaving between steps); "one_at_a_time" is the baseline
# without batching: each request alone (batch 1), one after the other.

def _batching(llm: LLM, value: str | None, kwargs: dict) -> LLM:
    if value is not None:
        kwargs["batching"] = value
    return llm


register(Switch("batching", "batching", None,
                "serve many requests together: 'static' pads them into one batch that runs until its longest "
                "request is done; 'continuous' lets each request join and leave the running batch at every step; "
                "'one_at_a_time' serves them alone, one after the other (no batching: the baseline)",
                _batching, choices=BATCHING))


# What LLM.generate cannot run with a batching mode, in switch terms: mode -> {switch: the value that sets a generate
# argument the mode refuses}. llmlab/engine.py, `LLM.generate`'s `batching == "continuous"` check: its engine takes
# no use_cache=False (kv_cache off), torch_compile, gpu_sampling, prefill_graphs or cache_factory (set by paged_kv
# with the KV cache on); its on_token is no switch's. tests/test_switches_batching.py checks this table against
# LLM.generate, switch by switch, so the two cannot drift. Prompts of different lengths run as one left-padded
# static batch (batching None or "static"), which refuses the RAGGED_REFUSES switches: apply_switches does not see
# the prompts, so those are left to generate.
BATCHING_REFUSES: dict[str, dict[str, Any]] = {
    "continuous": {"kv_cache": False, "paged_kv": True, "torch_compile": True, "gpu_sampling": True,
                   "prefill_graphs": True},
}
# engine.py's `is_ragged` branch: what a left-padded static batch of prompts of different lengths cannot take
RAGGED_REFUSES: dict[str, Any] = {"kv_cache": False, "paged_kv": True, "prefill_graphs": True}
_BATCHING_WHY = {"continuous": "runs its own engine on a paged KV pool (llmlab.batching.engine)"}


def check_batching(values: dict[str, Any]) -> None:
    """Refuse switch values that the `batching` switch's mode cannot run with, naming the switches and the fix.

    values: every switch's value (the defaults filled in), as `apply_switches` reads them. Refused: the switches
    `BATCHING_REFUSES` lists for the mode, and continuous batching with cuda_graphs but without triton_kernels (its
    engine captures the Triton paged-attention decode step only: `llmlab.batching.engine.paged_step_reason`).

    Raises:
        ValueError: such a combination; the message names the switches as a settings dict does (kv_cache=False).
    """
    mode = values.get("batching")
    clash = {key: value for key, value in BATCHING_REFUSES.get(mode, {}).items() if values.get(key) == value}
    if clash:
        turn = [f"{key} {'on' if value is False else 'off'}" if isinstance(value, bool) else
                f"{key} back to {SWITCHES[key].default!r}" for key, value in clash.items()]
        others = "'one_at_a_time'" + ("" if set(clash) & set(RAGGED_REFUSES) else " or 'static'")
        given = " and ".join(f"{key}={value!r}" for key, value in clash.items())
        raise ValueError(f"batching={mode!r} {_BATCHING_WHY[mode]}, which cannot run with {given}: turn "
                         f"{' and '.join(turn)}, or set batching to {others}")
    if mode == "continuous" and values.get("cuda_graphs") and not values.get("triton_kernels"):
        raise ValueError("batching='continuous' with cuda_graphs=True captures its engine's decode step on the Triton "
                         "kernels' paged attention: turn triton_kernels on too, or cuda_graphs off")


def check_per_token_settings(settings: dict[str, Any], where: str) -> None:
    """Refuse switch values that `apply_switches` accepts but a run timed token by token cannot use:
    batching='continuous'. The dashboard's runs (`llmlab.telemetry.live_run.decode`), `llmlab record` and `llmlab
    profile` time each token as it comes (generate's on_token), and continuous batching advances each request at
    its own step, so `LLM.generate` refuses on_token with it. They decode one prompt (or one batch) at a time:
    batching changes nothing there.

    Raises:
        ValueError: settings with batching='continuous', naming `where`, the other choices, and where continuous
            batching is compared.
    """
    if settings.get("batching") == "continuous":
        raise ValueError(f"batching='continuous' cannot run in {where}: it times each token as it comes (generate's "
                         f"on_token), and continuous batching advances each request at its own step; leave batching "
                         f"as loaded (None), or set 'static' or 'one_at_a_time', and compare continuous batching on "
                         f"many prompts with llm.generate(prompts, batching='continuous') (lab 06)")
