"""The optimizations a student can switch on and off — one registry read by `llmlab tour`, the dashboard and the
benchmark ladder.

A `Switch` is one knob (KV cache on/off, dtype, ...). A lesson that adds an optimization registers its switch here
with `register(...)`; nothing else needs to change for the tour, the dashboard's checkboxes or the ladder to show it.

Applying a set of switch values turns an `LLM` and a dict of `generate` keyword arguments into the ones to run:

    llm2, kwargs = apply_switches(llm, {"kv_cache": False, "dtype": "fp32"})
    llm2.generate(prompt, **kwargs)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .engine import DTYPES, LLM


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
        ValueError: an unknown switch name, a value outside a switch's choices, or a switch not available here
            (the message says why).
    """
    unknown = set(settings) - set(SWITCHES)
    if unknown:
        raise ValueError(f"unknown switch(es) {sorted(unknown)}; known: {', '.join(SWITCHES)}")
    kwargs: dict = {}
    for key, switch in SWITCHES.items():
        value = settings.get(key, switch.default)
        if switch.choices is not None and value not in switch.choices:
            raise ValueError(f"{key}={value!r} is not one of {switch.choices}")
        if value != switch.default:
            ok, why = switch.available(llm)
            if not ok:
                raise ValueError(f"switch {switch.label!r} cannot be set to {value!r} here: {why}")
        llm = switch.apply(llm, value, kwargs)
    return llm, kwargs


def describe(settings: dict[str, Any]) -> str:
    """A short label for a settings dict, listing what differs from the defaults ('defaults' if nothing)."""
    parts = []
    for key, value in settings.items():
        s = SWITCHES[key]
        if value == s.default:
            continue
        parts.append(s.label if value is True else f"no {s.label}" if value is False else f"{s.label}={value}")
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
