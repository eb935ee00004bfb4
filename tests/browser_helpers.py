"""What the browser tests share (tests/test_browser.py, tests/test_browser_labs.py): a headless JupyterLab server,
Debian's Chromium driven by playwright, a polling wait that explains itself when it times out, and the scripts that
read the notebook's state from the page.

Needs /usr/bin/chromium (`apt-get install -y chromium`; another path in LLMLAB_CHROMIUM) and the `playwright` Python
package (`pip install playwright`; never `playwright install`: the browser is Debian's). `require_browser()` skips
the calling test, with the reason, where either is absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

CHROMIUM = os.environ.get("LLMLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "llmlab-browser-test"
# where a timed-out wait leaves its screenshot: outside the checkout, which a test run leaves clean
SCREENSHOTS = Path(tempfile.gettempdir()) / "llmlab-test-screenshots"


def require_browser() -> None:
    """Skip the calling test (pytest.skip, with the install command) unless Chromium and playwright are both here."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed: pip install playwright")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    """Poll `url` until it answers 200. Raises RuntimeError (with the log's tail) when `proc` exits first and
    TimeoutError after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited early with status {proc.returncode}:\n"
                               + "\n".join(log.read_text().splitlines()[-15:]))
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"jupyter lab did not answer on {url} within {timeout_s} s")


@contextlib.contextmanager
def jupyter_lab(root: Path, state: Path, settings: dict[str, dict] | None = None) -> Iterator[tuple[str, Path]]:
    """Run `jupyter lab` headless on a free localhost port over the folder `root`; yield (base_url, log_path).

    `state` (created) holds the server's runtime, config, user settings and workspaces, so the user's own JupyterLab
    setup neither leaks in nor is changed. `settings` maps a plugin's settings file, relative to the user settings
    folder (e.g. "@jupyterlab/notebook-extension/tracker.jupyterlab-settings"), to its JSON content; the news and
    update checks are always off (their toast would cover the page). On exit the server is shut down through its
    REST API (which shuts its kernels down too), then by SIGTERM/SIGKILL to its process group.
    """
    state.mkdir(parents=True, exist_ok=True)
    user_settings = state / "settings"
    files = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
             {"fetchNews": "false", "checkForUpdates": False}, **(settings or {})}
    for rel, content in files.items():
        path = user_settings / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    port = free_port()
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(state / "runtime"), JUPYTER_CONFIG_DIR=str(state / "cfg"),
               JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1")
    log = state / "jupyter.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={TOKEN}",
           f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
           f"--LabApp.user_settings_dir={user_settings}", f"--LabApp.workspaces_dir={state / 'workspaces'}",
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/api/status?token={TOKEN}", 60, proc, log)
        yield base, log
    finally:
        try:  # a clean shutdown also shuts the kernels down
            api(base, "POST", "/api/shutdown")
            proc.wait(timeout=20)
        except Exception:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def api(base: str, method: str, path: str) -> Any:
    """Call the Jupyter server's REST API (`path` like "/api/sessions"); return the decoded JSON, or None when the
    answer has no body. Raises urllib.error.HTTPError on a status >= 400."""
    req = urllib.request.Request(f"{base}{path}?token={TOKEN}", method=method,
                                 data=b"" if method in ("POST", "PATCH", "PUT") else None)
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


def watch_console(page) -> list[str]:
    """Record the page's console errors and warnings and its uncaught exceptions, as "type: text" strings (text cut
    to 500 characters), in a list that grows while the page lives; the list is also `page.llmlab_console`, which
    `wait_for` reports when it times out."""
    seen: list[str] = []
    page.llmlab_console = seen
    page.on("console", lambda m: seen.append(f"{m.type}: {m.text[:500]}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: seen.append(f"pageerror: {str(e)[:500]}"))
    return seen


def wait_for(page, predicate_js: str, timeout_s: float, what: str,
             describe: Callable[[Any], str] | None = None, shot: str = "timeout.png") -> Any:
    """Evaluate `predicate_js` in the page every 250 ms until it returns something truthy; return that value.

    After `timeout_s` seconds: a full-page screenshot goes to SCREENSHOTS / `shot` and AssertionError is raised with
    `what`, the last value, `describe(page)` when given, and the last 20 console errors and warnings.
    """
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = page.evaluate(predicate_js)
        if last:
            return last
        page.wait_for_timeout(250)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / shot), full_page=True)
    extra = f"; {describe(page)}" if describe else ""
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last state: {last!r}{extra}; "
                         f"page: {SCREENSHOTS / shot}; the browser console's errors and warnings "
                         f"(last 20): {getattr(page, 'llmlab_console', [])[-20:]}")


# true once JupyterLab is up, a notebook is the current tab and its kernel is idle
NOTEBOOK_READY_JS = """() => {
    const app = window.jupyterapp;
    if (!app || !app.shell) return false;
    const w = app.shell.currentWidget;
    const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
    return !!(k && k.status === 'idle');
}"""


# the current notebook's error outputs, as "cell <index>: <ename>: <evalue>", read from the notebook's model
CELL_ERRORS_JS = """() => {
    const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
    const errors = [];
    for (let i = 0; i < cells.length; i++) {
        const cell = cells.get(i);
        if (cell.type !== 'code') continue;
        for (let j = 0; j < cell.outputs.length; j++) {
            const out = cell.outputs.get(j).toJSON();
            if (out.output_type === 'error') errors.push(`cell ${i}: ${out.ename}: ${out.evalue}`);
        }
    }
    return errors;
}"""
