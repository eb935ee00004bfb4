"""Every lab in a real browser: JupyterLab headless + Debian's Chromium driven by playwright, one lab per test.

One `jupyter lab` server (module scope) serves a temporary folder laid out like the repository: `labs/` gets a fresh
COPY of each notebook (JupyterLab autosaves: the repository's notebooks must stay without outputs) and `data` links to
the repository's data/, so the paths the labs read relative to their folder (`../data/...`) resolve as in a clone.
Each test opens its lab in headless Chromium, runs every cell (the notebook's Run All), waits until the run ends
and the kernel is idle, then walks the code cells, each scrolled into view as a reader would, and checks that

* no cell has an output of type error (a traceback) and no widget says "Error displaying widget";
* every plotly figure drew: each `.js-plotly-plot` on the page drew at least one trace (an SVG path with data or
  a bar), has a width, and there are at least as many as the outputs call for (a plotly mimetype output, or a
  FigureWidget named in a widget's text form);
* every ipywidget rendered: each widget output holds a widget view with a height;
* the browser console logged no error (`console.error` or an uncaught exception) while the lab loaded and ran.

`test_the_checks_catch_a_broken_notebook` runs a notebook with one fault of each kind, to show each check can fail.
Lab 01's dashboard (Run/Stop buttons, a reload) has its deeper checks in tests/test_browser.py.

On a 2-core CPU the module takes about 10 minutes (each lab 20-110 s, its Run All most of it). The kernel of each
lab is shut down after its test. LLMLAB_BROWSER_LAB_TIMEOUT (seconds, default 900) bounds one lab's Run All. Needs
Chromium and playwright (see tests/browser_helpers.py); skipped, with the reason, without them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from browser_helpers import CELL_ERRORS_JS, CHROMIUM, CHROMIUM_ARGS, NOTEBOOK_READY_JS, SCREENSHOTS, TOKEN, api, \
    jupyter_lab, require_browser, wait_for, watch_console

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LABS = sorted((REPO / "labs").glob("[0-9][0-9]_*.ipynb"))  # the solution notebooks; labs/student/ is not here
LAB_TIMEOUT_S = float(os.environ.get("LLMLAB_BROWSER_LAB_TIMEOUT", "900"))
CELL_DRAW_TIMEOUT_S = 30  # one cell's figures and widgets to draw once it is in view

# Console errors that say nothing about the labs, as (text the message contains, why it is harmless). None is needed
# today: every lab loads and runs without a console error.
HARMLESS_CONSOLE: list[tuple[str, str]] = []


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """(base_url, labs_folder): one JupyterLab server for every lab of this module, over a folder whose `labs/`
    receives each test's copy of its notebook and whose `data` links to the repository's data/."""
    require_browser()
    root = tmp_path_factory.mktemp("browser-labs")
    (root / "labs").mkdir()
    (root / "data").symlink_to(REPO / "data", target_is_directory=True)
    with jupyter_lab(root / "labs", root / "jupyter") as (base, _log):
        yield base, root / "labs"


@pytest.fixture(scope="module")
def chromium(lab_server):
    """One headless Chromium for every lab of this module (each test opens its own browser context)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


# Starts Run All and keeps its promise's outcome in window.llmlabRunAll: {ok} (false when a cell failed and the rest
# were not run) or {error}.
RUN_ALL_JS = """() => {
    window.llmlabRunAll = null;
    window.jupyterapp.commands.execute('notebook:run-all-cells')
        .then(ok => { window.llmlabRunAll = {ok: ok}; }, e => { window.llmlabRunAll = {error: String(e)}; });
}"""

# Run All has ended, the kernel is idle and no code cell is left running or queued
RUN_DONE_JS = """() => {
    if (!window.llmlabRunAll) return false;
    const w = window.jupyterapp.shell.currentWidget;
    const k = w.sessionContext.session && w.sessionContext.session.kernel;
    if (!k || k.status !== 'idle') return false;
    const pending = w.content.widgets.filter(c => c.model.type === 'code'
        && c.model.executionState === 'running').length;
    return pending === 0 ? window.llmlabRunAll : false;
}"""

# indices of the code cells that have outputs, and of the non-empty code cells that never ran
CELLS_JS = """() => {
    const nb = window.jupyterapp.shell.currentWidget.content;
    const withOutputs = [], notRun = [];
    nb.widgets.forEach((c, i) => {
        if (c.model.type !== 'code') return;
        if (c.model.outputs.length > 0) withOutputs.push(i);
        if (c.model.sharedModel.getSource().trim() && c.model.executionCount === null) notRun.push(i);
    });
    return {withOutputs: withOutputs, notRun: notRun};
}"""

# Scroll cell `i` into view and read what each of its outputs drew, against what the output's data calls for: a
# plotly mimetype output, one plotly graph; a widget view, a drawn widget, holding one plotly graph per FigureWidget
# its text form names. A graph counts as drawn when one of its traces has a path with data (a line, a marker, a bar).
CELL_STATE_JS = """async (i) => {
    const nb = window.jupyterapp.shell.currentWidget.content;
    const cell = nb.widgets[i];
    nb.activeCellIndex = i;
    await nb.scrollToItem(i, 'start');
    cell.node.scrollIntoView({block: 'start'});
    const graph = gd => {
        let drawn = 0;
        for (const tr of gd.querySelectorAll('.trace')) {
            for (const p of tr.querySelectorAll('path')) {
                const d = p.getAttribute('d') || '';
                if (d.length > 10 && d !== 'M0,0Z') { drawn += 1; break; }
            }
        }
        const title = gd.querySelector('.gtitle');
        return {drawn: drawn, traces: (gd._fullData || []).length, width: Math.round(gd.getBoundingClientRect().width),
                title: title ? title.textContent : ''};
    };
    const outputs = [];
    const views = cell.outputArea.widgets;
    for (let j = 0; j < cell.model.outputs.length; j++) {
        const data = cell.model.outputs.get(j).toJSON().data || {};
        const isWidget = 'application/vnd.jupyter.widget-view+json' in data;
        const text = [].concat(data['text/plain'] || '').join('');
        const wantPlots = ('application/vnd.plotly.v1+json' in data ? 1 : 0)
            + (isWidget ? (text.match(/FigureWidget[(]/g) || []).length : 0);
        if (!isWidget && !wantPlots) continue;
        const node = views[j] ? views[j].node : null;
        const out = {output: j, widget: isWidget, wantPlots: wantPlots, plots: [], drawnWidget: false, error: ''};
        if (node) {
            out.plots = Array.from(node.querySelectorAll('.js-plotly-plot')).map(graph);
            const shown = node.innerText;
            if (shown.includes('Error displaying widget')) out.error = shown.slice(0, 300);
            const view = node.querySelector('.jupyter-widgets, .js-plotly-plot');
            out.drawnWidget = !!view && view.getBoundingClientRect().height > 0;
        }
        out.ok = !!node && !out.error && out.plots.length >= wantPlots
            && out.plots.every(p => p.drawn > 0 && p.width > 0) && (!isWidget || out.drawnWidget);
        outputs.push(out);
    }
    const text = cell.node.innerText;
    return {ok: outputs.every(o => o.ok) && !text.includes('Error displaying widget'), outputs: outputs,
            traceback: text.includes('Traceback (most recent call last)')};
}"""


def _harmless(message: str) -> bool:
    return any(pattern in message for pattern, _reason in HARMLESS_CONSOLE)


def _run_in_browser(chromium, base: str, notebook: Path, draw_timeout_s: float = CELL_DRAW_TIMEOUT_S) -> dict:
    """Open `notebook` (a file in the server's folder) in a fresh browser context and JupyterLab workspace (no tab of
    an earlier lab comes back with it), Run All, wait for the end, and check every output, giving each cell
    `draw_timeout_s` seconds to draw once in view; shut its kernel down.

    Returns {"outcome": Run All's {ok} or {error}, "errors": error outputs, "not_run": code cells that never ran,
    "problems": outputs that did not draw, "console": console errors not listed as harmless, "plots", "widgets":
    how many were checked, "run_s", "check_s": seconds}. Raises AssertionError when the notebook does not open or
    Run All does not end within LAB_TIMEOUT_S (with a screenshot in SCREENSHOTS).
    """
    name, shot = notebook.name, f"{notebook.stem}_failure.png"
    context = chromium.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    console = watch_console(page)
    report: dict = {"problems": [], "plots": 0, "widgets": 0}
    t0 = time.monotonic()
    try:
        page.goto(f"{base}/lab/workspaces/{notebook.stem}/tree/{name}?token={TOKEN}", timeout=60_000)
        ready = f"() => window.jupyterapp && window.jupyterapp.shell.currentWidget " \
                f"&& window.jupyterapp.shell.currentWidget.context.path === {json.dumps(name)} " \
                f"&& ({NOTEBOOK_READY_JS})()"
        wait_for(page, ready, 120, f"{name} and an idle kernel", shot=shot)
        page.evaluate(RUN_ALL_JS)
        report["outcome"] = wait_for(page, RUN_DONE_JS, LAB_TIMEOUT_S, f"Run All of {name} to end", shot=shot,
                                     describe=lambda p: f"cell errors: {p.evaluate(CELL_ERRORS_JS)}")
        report["run_s"] = time.monotonic() - t0
        report["errors"] = page.evaluate(CELL_ERRORS_JS)
        cells = page.evaluate(CELLS_JS)
        report["not_run"] = cells["notRun"]
        for i in cells["withOutputs"]:
            deadline = time.monotonic() + draw_timeout_s
            while True:
                state = page.evaluate(CELL_STATE_JS, i)
                if state["ok"] or time.monotonic() > deadline:
                    break
                page.wait_for_timeout(250)
            if not state["ok"] or state["traceback"]:
                report["problems"].append(f"cell {i}: {json.dumps(state)}")
            report["plots"] += sum(len(o["plots"]) for o in state["outputs"])
            report["widgets"] += sum(o["widget"] for o in state["outputs"])
        if report["problems"]:
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / shot), full_page=True)
        page.wait_for_timeout(500)  # late console messages from the last views drawn
        report["console"] = [m for m in console if m.startswith(("error:", "pageerror:")) and not _harmless(m)]
        report["warnings"] = sum(m.startswith("warning:") for m in console)
        report["check_s"] = time.monotonic() - t0 - report["run_s"]
        return report
    finally:
        context.close()
        for session in api(base, "GET", "/api/sessions") or []:  # the kernel's memory back for the next lab
            if session.get("path", "").endswith(name):
                api(base, "DELETE", f"/api/sessions/{session['id']}")


@pytest.mark.parametrize("notebook", LABS, ids=[p.stem for p in LABS])
def test_lab_runs_in_the_browser(lab_server, chromium, notebook):
    base, folder = lab_server
    shutil.copy(notebook, folder / notebook.name)
    r = _run_in_browser(chromium, base, folder / notebook.name)
    name = notebook.name
    assert not r["errors"], f"{name}: a cell failed in the browser: {r['errors']}"
    assert r["outcome"].get("ok") is True, f"{name}: Run All did not complete: {r['outcome']}"
    assert not r["not_run"], f"{name}: code cells never ran: {r['not_run']}"
    shot = SCREENSHOTS / f"{notebook.stem}_failure.png"
    assert not r["problems"], f"{name}: outputs that did not draw (page: {shot}):\n" + "\n".join(r["problems"])
    assert not r["console"], f"{name}: JavaScript console errors: {r['console']}"
    print(f"{name}: ran in {r['run_s']:.0f} s, checked in {r['check_s']:.0f} s; {r['plots']} plotly figures, "
          f"{r['widgets']} widgets; console warnings: {r['warnings']}")


# A notebook with one fault of each kind the lab test looks for, the failing cell last (Run All stops there).
BROKEN_CELLS = [
    "import plotly.graph_objects as go\nimport ipywidgets as widgets\nfrom IPython.display import Javascript, display",
    "widgets.VBox([widgets.HTML('drawn'), go.FigureWidget(go.Bar(x=[1, 2], y=[3, 4]))])",  # fine
    "go.Figure().show()",  # a figure with no trace: blank
    "display({'application/vnd.jupyter.widget-view+json': {'model_id': 'no-such-model', 'version_major': 2, "
    "'version_minor': 0}, 'text/plain': 'a view of a widget model the kernel never made'}, raw=True)",
    "display(Javascript(\"console.error('llmlab browser self-test')\"))",
    "raise ValueError('llmlab browser self-test')",
]


def test_the_checks_catch_a_broken_notebook(lab_server, chromium):
    """Each check fails where it should: an error output, a blank figure, a widget that cannot display, a console
    error; and the well-drawn widget beside them passes."""
    base, folder = lab_server
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                     "source": src} for i, src in enumerate(BROKEN_CELLS)],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = folder / "browser_self_test.ipynb"
    path.write_text(json.dumps(nb))
    r = _run_in_browser(chromium, base, path, draw_timeout_s=5)
    assert r["outcome"].get("ok") is False and any("ValueError: llmlab browser self-test" in e for e in r["errors"])
    flagged = {int(p.split(":")[0].split()[1]) for p in r["problems"]}
    # the blank figure, the missing widget model and the traceback on the page, not the good widget
    assert flagged == {2, 3, 5}, r["problems"]
    assert any("llmlab browser self-test" in m for m in r["console"]), r["console"]
