"""The plotly figures of lab 01: the dashboard's live panels, its comparison of runs, and static figures of a
recorded trace (`trace_figure`, `kernel_timeline_figure`).

The dashboard (`llmlab.telemetry.dashboard`) builds its widgets from `live_figure`, `comparison_bars` and
`results_table_html`, and fills them as a run goes; the trace figures are plain `go.Figure`s (no widget).
"""

from __future__ import annotations

import html
import json
import math
from copy import deepcopy

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from llmlab.telemetry.trace import Trace

# the GPU panel's series: (key in sampler readings, legend name)
GPU_SERIES = (
    ("gpu_util_pct", "GPU-Util (nvidia-smi)"),
    ("sm_active_pct", "SM activity"),
    ("sm_occupancy_pct", "SM occupancy"),
    ("dram_bw_util_pct", "DRAM bandwidth"),
    ("mem_util_pct", "memory busy (nvidia-smi)"),  # shown only where GPM (the three above) is missing
)
GPM_KEYS = ("sm_active_pct", "sm_occupancy_pct", "dram_bw_util_pct")
# the comparison: (row key, bar title, unit)
BAR_METRICS = (
    ("tokens_per_s", "tokens/s", ""),
    ("ttft_ms", "TTFT", "ms"),
    ("tpot_ms", "TPOT", "ms"),
    ("mbu_pct", "MBU", "%"),
    ("gpu_util_pct", "mean<br>GPU-Util", "%"),
    ("sm_active_pct", "mean<br>SM activity", "%"),
)
# the table of runs: (row key, column title, format or None for text)
TABLE_COLUMNS = (
    ("run", "run", None), ("device", "device", None), ("source", "source", None),
    ("tokens", "tokens", "d"), ("tokens_per_s", "tokens/s", ".1f"), ("ttft_ms", "TTFT ms", ".1f"),
    ("tpot_ms", "TPOT ms", ".2f"), ("tpot_p90_ms", "TPOT p90 ms", ".2f"), ("mbu_pct", "MBU %", ".1f"),
    ("gpu_util_pct", "GPU-Util %", ".1f"), ("sm_active_pct", "SM activity %", ".1f"),
    ("dram_bw_util_pct", "DRAM BW %", ".1f"),
)


def shown_gpu_series(series) -> set:
    """The GPU_SERIES keys to draw for a source reporting `series`: NVML's coarse memory-busy line only where the
    GPM metrics (SM activity, occupancy, DRAM bandwidth) are missing."""
    has_gpm = any(k in series for k in GPM_KEYS)
    return {k for k, _ in GPU_SERIES if k in series and (k != "mem_util_pct" or not has_gpm)}


# Plotly draws its modebar (zoom, pan, save, ...) over the top right corner of the figure, MODEBAR_PX tall; a
# subplot title sits just above its panel, TITLE_PX tall per line. The top margin leaves room for both, so the
# modebar never covers a title.
MODEBAR_PX = 28
TITLE_PX = 16
# what every dashboard figure's views are drawn with: resize with the window, no plotly logo, only the modebar
# buttons that help here (zoom, pan, reset, save as PNG)
FIGURE_CONFIG = {"responsive": True, "displaylogo": False,
                 "modeBarButtonsToRemove": ["select2d", "lasso2d", "zoomIn2d", "zoomOut2d", "autoScale2d",
                                            "toggleSpikelines", "hoverClosestCartesian", "hoverCompareCartesian"]}


def top_margin_px(titles) -> int:
    """The top margin (px) that keeps the modebar clear of the highest subplot title among `titles` (plotly's
    '<br>' breaks a title into lines)."""
    lines = max((str(t).count("<br>") + 1 for t in titles), default=0)
    return MODEBAR_PX + lines * (TITLE_PX + 4) + 8


def _widget(fig) -> go.FigureWidget:
    """`fig` as a FigureWidget that fills the width it is given and carries FIGURE_CONFIG."""
    fig.update_layout(autosize=True, width=None, modebar={"orientation": "h"})
    fig.update_annotations(selector=lambda a: a.font.size is None, font_size=TITLE_PX)  # the subplot titles
    w = go.FigureWidget(fig)
    w._config = dict(FIGURE_CONFIG)  # the synced trait each browser view reads its plotly config from
    return w


def live_figure() -> go.FigureWidget:
    """The dashboard's live panels: the GPU series in % (one trace each, in GPU_SERIES order), then the latency of
    each token (ms), then tokens/s over the last 16 tokens, all against one shared time axis (seconds since the
    run started: the three x axes are linked, so they always show the same span; `set_time_span` sets it)."""
    titles = ("GPU", "latency of each token (ms)", "tokens/s (last 16 tokens)")
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.44, 0.28, 0.28],
                        subplot_titles=titles)
    for key, name in GPU_SERIES:
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=name, legendgroup="gpu",
                                 line={"width": 2, "dash": "dot" if key == "mem_util_pct" else "solid"}),
                      row=1, col=1)
    fig.add_trace(go.Scatter(x=[], y=[], mode="markers", marker={"size": 4}, name="latency (ms)"),
                  row=2, col=1)
    fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name="tokens/s"), row=3, col=1)
    fig.update_yaxes(title_text="%", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="ms", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(showticklabels=True, rangemode="tozero")  # shared_xaxes hides the upper rows' tick labels
    fig.update_xaxes(title_text="seconds since Run", row=3, col=1)
    # annotations 0-2 are the subplot titles; 3 says, inside the GPU panel, what it cannot show (empty: hidden)
    fig.add_annotation(text="", visible=False, showarrow=False, xref="x domain", yref="y domain", x=0.01, y=0.97,
                       xanchor="left", yanchor="top", align="left", font={"size": 12, "color": "#444"},
                       bgcolor="rgba(255,255,255,0.85)", row=1, col=1)
    fig.update_layout(height=680, margin={"l": 60, "r": 20, "t": top_margin_px(titles), "b": 40},
                      legend={"orientation": "v", "x": 1.02, "y": 1, "yanchor": "top"})
    return _widget(fig)


def set_time_span(fig: go.FigureWidget, t_end_s: float | None) -> None:
    """Show seconds [0, t_end_s] on every panel of `live_figure` (None: autorange over all the panels' data).
    The x axes are linked, so setting the bottom one sets them all."""
    if t_end_s is None or not t_end_s > 0:
        fig.update_xaxes(autorange=True)
    else:
        fig.update_xaxes(range=[0, float(t_end_s)], autorange=False)


def show_gpu_series(fig: go.FigureWidget, series: set | None, live: bool) -> list[str]:
    """Show the GPU traces of `live_figure` that a source reporting `series` has (`shown_gpu_series`), hide the
    others, and write inside the GPU panel what it cannot show. series None: a live source not heard from yet;
    an empty set with live False: nothing to replay. Returns the notes (`missing_gpu_notes`; [] for those two)."""
    shown = shown_gpu_series(series or ())
    notes: list[str] = []
    if series is None:
        text = "waiting for the first reading ..."
    elif not series and not live:
        text = "nothing to show: no GPU here and no recorded trace to replay"
    else:
        notes = missing_gpu_notes(series)
        text = "<br>".join(html.escape(n) for n in notes)
        if not shown:
            text = "the GPU reports none of these series<br>" + text
    with fig.batch_update():
        for i, (key, _) in enumerate(GPU_SERIES):
            fig.data[i].visible = key in shown
        fig.layout.annotations[3].text = text
        fig.layout.annotations[3].visible = bool(text)
    return notes


def comparison_bars() -> go.Figure:
    """One bar chart per BAR_METRICS entry, side by side: every run as one bar. A plain figure (no widget):
    the dashboard shows it with `figure_output`."""
    titles = [f"{t} ({u})" if u else t for _, t, u in BAR_METRICS]
    bars = make_subplots(rows=1, cols=len(BAR_METRICS), horizontal_spacing=0.05, subplot_titles=titles)
    for i, _ in enumerate(BAR_METRICS):
        bars.add_trace(go.Bar(x=[], y=[], showlegend=False), row=1, col=i + 1)
    bars.update_xaxes(type="category", tickangle=0)
    bars.update_layout(height=300, margin={"l": 40, "r": 10, "t": top_margin_px(titles), "b": 30}, autosize=True,
                       width=None, modebar={"orientation": "h"})
    bars.update_annotations(font_size=TITLE_PX)
    return go.Figure(bars)


def figure_output(fig: go.Figure) -> dict:
    """`fig` as one output of an ipywidgets `Output` (nbformat display_data): plotly's mimetype, drawn by
    JupyterLab's plotly renderer at the width of the output area, with FIGURE_CONFIG; a line of text elsewhere.
    Raises nothing for a valid figure."""
    spec = fig.to_plotly_json()
    spec = json.loads(pio.to_json({"data": spec["data"], "layout": spec["layout"]}, validate=False))
    spec["config"] = dict(FIGURE_CONFIG)
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": spec, "text/plain": f"<plotly figure: {len(fig.data)} traces>"}}


def sync_widget_state(fig: go.FigureWidget) -> None:
    """Copy the figure's data and layout, as the kernel holds them, into the widget state a browser view is drawn
    from.

    A FigureWidget tells the views already on the page about a change with a one-off restyle/relayout message,
    and sends its full state (`_widget_data`, `_widget_layout`) only when it is built or displayed on its own. A
    view drawn later (the page reloaded, or the widget's JavaScript still loading when the first run's messages
    arrived, as after Run All) would be drawn from that first, empty state and miss every message sent before
    it: empty axes while the kernel holds the data. Call this after each change: it sends only what differs."""
    data = deepcopy(fig._data)
    layout = deepcopy(fig._layout_obj._props)
    if data != fig._widget_data:
        fig._widget_data = data
    if layout != fig._widget_layout:
        fig._widget_layout = layout


GPM_NOTE = "need{s} NVML GPM (Hopper or newer): not shown"


def missing_gpu_notes(series) -> list[str]:
    """What the GPU panel cannot show for a source reporting `series` (sampler reading keys), one sentence each.

    The GPM series (SM activity, SM occupancy, DRAM bandwidth) exist only on Hopper and newer GPUs with NVML GPM;
    an older GPU (A100, L4, T4) reports GPU-Util and NVML's coarse memory-busy counter, drawn instead. GPU-Util
    itself is missing where NVML does not report utilisation (e.g. a MIG slice). [] when everything is there."""
    series = set(series)
    notes = []
    names = dict(GPU_SERIES)
    gpm_missing = [names[k] for k in GPM_KEYS if k not in series]
    if gpm_missing:
        what = gpm_missing[0] if len(gpm_missing) == 1 else ", ".join(gpm_missing[:-1]) + " and " + gpm_missing[-1]
        note = f"{what} {GPM_NOTE.format(s='s' if len(gpm_missing) == 1 else '')}"
        if "mem_util_pct" in series:
            note += f"; the dotted line is NVML's coarser '{names['mem_util_pct']}' instead"
        notes.append(note + ".")
    if "gpu_util_pct" not in series:
        notes.append(f"{names['gpu_util_pct']}: NVML does not report it on this device (e.g. a MIG slice): not shown.")
    return notes


def results_table_html(results: list[dict]) -> str:
    """The runs (dicts with the TABLE_COLUMNS keys) as an HTML table, with a note on MBU below it. Cells do not
    wrap; a table wider than the output area scrolls sideways inside it instead of widening the page."""

    def cell(v, fmt):
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "–"
        return html.escape(format(v, fmt) if fmt else str(v))

    cols = TABLE_COLUMNS
    pad = "padding:2px 8px;white-space:nowrap"
    head = "".join(f"<th style='{pad}'>{html.escape(t)}</th>" for _, t, _ in cols)
    body = "".join("<tr>" + "".join(f"<td style='{pad}'>{cell(r.get(k), f)}</td>" for k, _, f in cols)
                   + "</tr>" for r in results)
    if not results:
        body = f"<tr><td colspan='{len(cols)}' style='padding:2px 8px'>no run yet</td></tr>"
    note = "<div style='font-size:85%'>MBU (model bandwidth utilisation) is computed for GPU runs only, " \
           "against the measured copy bandwidth; on a CPU a small model runs from caches.</div>"
    return f"<div style='overflow-x:auto;max-width:100%'><table class='llmlab-results'><thead><tr>{head}</tr>" \
           f"</thead><tbody>{body}</tbody></table></div>{note}"


# -- static figures of a recorded trace ----------------------------------------------------------------------------


def trace_figure(trace: Trace, height: int = 560) -> go.Figure:
    """GPU-Util vs SM activity vs SM occupancy vs DRAM bandwidth over the recording (top), and the latency of
    each token (bottom), with the decoding window shaded. A static `go.Figure` (no widget)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4],
                        subplot_titles=(f"{trace.device}: what NVML reports (%)",
                                        "latency of each token (ms); the first of each call includes the prefill"))
    ts = trace.samples["t_s"]
    shown = shown_gpu_series(trace.samples)
    for key, name in GPU_SERIES:
        if key in shown:
            fig.add_scatter(x=ts, y=trace.samples[key], mode="lines", name=name, row=1, col=1,
                            line={"dash": "dot" if key == "mem_util_pct" else "solid"})
    fig.add_scatter(x=trace.tokens["t_s"], y=trace.tokens["step_ms"], mode="markers", marker={"size": 3},
                    name="token latency (ms)", row=2, col=1)
    a, b = trace.decode_window
    fig.add_vrect(x0=a, x1=b, fillcolor="gray", opacity=0.08, line_width=0, row=1, col=1)
    fig.update_yaxes(title_text="%", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="ms", type="log", row=2, col=1)
    fig.update_xaxes(title_text="seconds (shaded: decoding)", row=2, col=1)
    fig.update_layout(height=height, title=f"Replay of {trace.label}", legend={"orientation": "h", "y": -0.15})
    return fig


def kernel_timeline_figure(trace: Trace, height: int = 260) -> go.Figure | None:
    """The profiled decode steps of a trace as a timeline: a bar where a GPU kernel ran, white where none did.
    None if the trace has no kernel profile."""
    k = trace.kernels
    if not k or not k.get("intervals_us"):
        return None
    xs, ys = [], []
    for a, b in k["intervals_us"]:
        xs += [a / 1e3, a / 1e3, b / 1e3, b / 1e3, None]
        ys += [0, 1, 1, 0, None]
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="lines", fill="toself", line={"width": 0.5},
                               name="a kernel is running"))
    t = 0.0
    for i, step in enumerate(k.get("step_us", [])):
        t += step / 1e3
        if i < len(k["step_us"]) - 1:
            fig.add_vline(x=t, line_dash="dash", line_color="gray")
    busy = 100 * k["busy_us"] / k["window_us"]
    fig.update_layout(height=height, yaxis={"visible": False, "range": [0, 1.3]},
                      xaxis_title="ms (dashed: token boundaries)",
                      title=f"{k['steps']} decode steps on {trace.device}: {k['n_kernels']} kernels, "
                            f"a kernel running {busy:.0f}% of the time")
    return fig
