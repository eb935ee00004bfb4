"""The dashboard's controls: one widget per optimization in `llmlab.switches.SWITCHES`, and the notes that say
what this machine cannot run or show.

An on/off switch becomes a checkbox, a switch with choices a dropdown. A switch that cannot run on the model's
device (e.g. CUDA graphs on a CPU; `Switch.available`) is shown disabled, with the reason in its tooltip AND in
a visible line under the controls: a browser shows no tooltip over a disabled input, and a student should not
have to hover to learn why a control does nothing.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W

from llmlab.engine import LLM
from llmlab.switches import SWITCHES


def switch_controls(llm: LLM) -> tuple[dict[str, W.Widget], dict[str, str]]:
    """One widget per registered switch, in registry order, for a model `llm`.

    Returns (controls, unavailable): switch key -> widget (Checkbox for on/off, Dropdown whose option values are
    indices into `Switch.choices` for a switch with choices), and switch key -> the reason it cannot run here
    (its widget disabled, the reason in its tooltip) for every switch `Switch.available(llm)` refuses.
    """
    controls: dict[str, W.Widget] = {}
    unavailable: dict[str, str] = {}
    for key, sw in SWITCHES.items():
        ok, why = sw.available(llm)
        tip = sw.help if ok else f"not available here: {why} ({sw.help})"
        if sw.choices is None:
            w = W.Checkbox(value=bool(sw.default), description=sw.label, indent=False, tooltip=tip,
                           layout=W.Layout(width="auto"))
        else:
            # the options' values are indices into sw.choices: ipywidgets reads a value of None as "nothing
            # selected", and None is a real choice here ("as loaded")
            options = [("as loaded" if c is None else str(c), i) for i, c in enumerate(sw.choices)]
            w = W.Dropdown(options=options, value=sw.choices.index(sw.default), description=sw.label,
                           tooltip=tip, layout=W.Layout(width="170px"), style={"description_width": "auto"})
        if not ok:
            w.disabled = True
            w.add_class("llmlab-unavailable")
            unavailable[key] = why or "not available on this device"
        controls[key] = w
    return controls, unavailable


def unavailable_html(unavailable: dict[str, str]) -> str:
    """A visible line naming each switch that cannot run here and why ('' when every switch can)."""
    if not unavailable:
        return ""
    items = "; ".join(f"<b>{html.escape(SWITCHES[k].label)}</b>: {html.escape(why)}" for k, why in unavailable.items())
    return f"<div class='llmlab-unavailable-note' style='font-size:90%'>Greyed out, not available here: {items}.</div>"


def notes_html(unavailable: dict[str, str], gpu_notes: list[str]) -> str:
    """The dashboard's notes under its controls: the switches it cannot run here (`unavailable_html`), then what
    the GPU panel cannot show (`llmlab.telemetry.figures.missing_gpu_notes`). '' when there is nothing to say."""
    parts = [unavailable_html(unavailable)]
    if gpu_notes:
        parts.append("<div class='llmlab-gpu-note' style='font-size:90%'>GPU panel: "
                     + " ".join(html.escape(n) for n in gpu_notes) + "</div>")
    return "".join(p for p in parts if p)


def read_settings(controls: dict[str, W.Widget]) -> dict[str, Any]:
    """The switch values `controls` (from `switch_controls`) show now: switch key -> value."""
    out = {}
    for k, w in controls.items():
        choices = SWITCHES[k].choices
        out[k] = w.value if choices is None else choices[w.value]
    return out


def show_settings(controls: dict[str, W.Widget], settings: dict[str, Any]) -> None:
    """Set the widgets to `settings` (switch key -> value, already checked by `apply_switches`); keys without a
    control are ignored."""
    for k, v in settings.items():
        if k in controls:
            choices = SWITCHES[k].choices
            controls[k].value = v if choices is None else choices.index(v)
