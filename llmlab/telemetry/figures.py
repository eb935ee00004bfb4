"""The plotly figures of lab 01: the dashboard's live panels, its comparison of runs, and static figures of a
recorded trace (`trace_figure`, `kernel_timeline_figure`).

The dashboard (`llmlab.telemetry.dashboard`) builds its widgets from `live_figure`, `comparison_bars` and
`results_table_html`, and fills them as a run goes; the trace figures are plain `go.Figure`s (no widget).
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go
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


def live_figure() -> go.FigureWidget:
    """The dashboard's live panels: the GPU series in % (one trace each, in GPU_SERIES order), then the latency of
    each token (ms), then tokens/s over the last 16 tokens, all against seconds."""
    fig = make_subplots(rows=3, cols=1, vertical_spacing=0.09, row_heights=[0.44, 0.28, 0.28],
                        subplot_titles=("GPU", "latency of each token (ms)", "tokens/s (last 16 tokens)"))
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
    fig.update_xaxes(title_text="seconds", row=3, col=1)
    fig.update_layout(height=640, margin={"l": 60, "r": 20, "t": 30, "b": 40},
                      legend={"orientation": "v", "x": 1.02, "y": 1, "yanchor": "top"})
    return go.FigureWidget(fig)


def comparison_bars() -> go.FigureWidget:
    """One bar chart per BAR_METRICS entry, side by side: every run as one bar."""
    bars = make_subplots(rows=1, cols=len(BAR_METRICS), horizontal_spacing=0.05,
                         subplot_titles=[f"{t} ({u})" if u else t for _, t, u in BAR_METRICS])
    for i, _ in enumerate(BAR_METRICS):
        bars.add_trace(go.Bar(x=[], y=[], showlegend=False), row=1, col=i + 1)
    bars.update_xaxes(type="category", tickangle=0)
    bars.update_layout(height=280, margin={"l": 40, "r": 10, "t": 50, "b": 30})
    return go.FigureWidget(bars)


def results_table_html(results: list[dict]) -> str:
    """The runs (dicts with the TABLE_COLUMNS keys) as an HTML table, with a note on MBU below it."""

    def cell(v, fmt):
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "–"
        return html.escape(format(v, fmt) if fmt else str(v))

    cols = TABLE_COLUMNS
    head = "".join(f"<th style='padding:2px 8px'>{html.escape(t)}</th>" for _, t, _ in cols)
    body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px'>{cell(r.get(k), f)}</td>" for k, _, f in cols)
                   + "</tr>" for r in results)
    if not results:
        body = f"<tr><td colspan='{len(cols)}' style='padding:2px 8px'>no run yet</td></tr>"
    note = "<div style='font-size:85%'>MBU (model bandwidth utilisation) is computed for GPU runs only, " \
           "against the measured copy bandwidth; on a CPU a small model runs from caches.</div>"
    return f"<table class='llmlab-results'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"


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
