"""The dashboard's controls: one widget per optimization in `llmlab.switches.SWITCHES`, lengths, Run and Stop;
and the lines that say where the GPU panel's data comes from and what this machine cannot run or show.

An on/off switch becomes a checkbox, a switch with choices a dropdown. A switch that cannot run on the model's
device (e.g. CUDA graphs on a CPU; `Switch.available`) is shown disabled, with the reason in its tooltip AND in
a visible line under the controls: a browser shows no tooltip over a disabled input, and a student should not
have to hover to learn why a control does nothing.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W

from llmlab import envinfo
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


def run_controls(prompt_tokens: int, new_tokens: int, ctx: int) -> tuple[W.BoundedIntText, W.BoundedIntText,
                                                                         W.Button, W.Button]:
    """The prompt and new-token lengths (bounded to 1 .. ctx - 1 for a context of `ctx` tokens; the new tokens
    start at min(new_tokens, ctx - prompt_tokens)), and the Run and Stop buttons (CSS classes llmlab-run,
    llmlab-stop; Stop disabled). The caller connects the buttons."""
    prompt_w = W.BoundedIntText(value=prompt_tokens, min=1, max=max(1, ctx - 1), description="prompt",
                                layout=W.Layout(width="130px"), style={"description_width": "auto"})
    new_w = W.BoundedIntText(value=min(new_tokens, ctx - prompt_tokens), min=1, max=max(1, ctx - 1),
                             description="new tokens", layout=W.Layout(width="165px"),
                             style={"description_width": "auto"})
    run_button = W.Button(description="Run", button_style="success", icon="play",
                          tooltip="decode once with these settings", layout=W.Layout(width="90px"))
    stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                           tooltip="stop the decode after the current token", layout=W.Layout(width="90px"))
    run_button.add_class("llmlab-run")
    stop_button.add_class("llmlab-stop")
    return prompt_w, new_w, run_button, stop_button


def live_mode_line(llm: LLM, source: str, interval_s: float) -> str:
    """The dashboard's first line when it samples the GPU live: what, through which `source`, how often (s)."""
    return f"Live: sampling {envinfo.device_name(llm.device)} through {source} every {interval_s * 1000:.0f} ms " \
           f"while {llm.name} decodes on it."


def replay_mode_line(llm: LLM, nvml: tuple[bool, str], traces: list, where: str) -> str:
    """The dashboard's first line without a GPU to watch: why (`nvml` is `nvml_available()`'s answer; when it
    is yes, the model is on the CPU), and which recorded trace the GPU panel replays (the first of `traces`) or,
    with none, that the panel stays empty (`where`: the folder searched)."""
    ok, why = nvml
    head = f"No GPU to watch here ({why.rstrip('.')})" if not ok else \
        f"No GPU to watch: the model runs on the CPU ({llm.device})"
    if traces:
        t = traces[0]
        return f"{head}: the GPU panel replays a trace recorded on {t.device} on {t.date}; latency and tokens/s " \
               f"are measured live on this CPU."
    return f"{head}, and there is no recorded trace in {where}: the GPU panel stays empty; latency and " \
           f"tokens/s are measured live on this CPU."


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
