"""End to end in a real browser: JupyterLab on loopback serves the quickstart, headless Chromium (driven by
Playwright) runs every cell, and the live dashboard shows the rank logs and the version panel.

Needs Debian's ``chromium`` (``apt-get install -y chromium``), the ``browser`` extra (``jupyterlab``,
``playwright``; Playwright drives the system Chromium, no browser download) and ``RLSDK_BROWSER_TESTS=1`` (it
takes about a minute, so the plain local suite skips it; ``.ci/run`` sets it and installs Chromium where it can).
Skipped with the reason otherwise.
The screenshot of the dashboard is saved as ``dashboard.png`` in the test's temporary directory.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.notebook, pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
TOKEN = "rlsdk-browser-test"
STEPS = 5  # the quickstart's config.train.max_steps


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def jupyter_lab(tmp_path: Path) -> Iterator[str]:
    """JupyterLab serving a copy of notebooks/quickstart.ipynb from ``tmp_path``; yields its base URL."""
    if os.environ.get("RLSDK_BROWSER_TESTS") != "1":
        pytest.skip("browser: ~1 min; set RLSDK_BROWSER_TESTS=1 to run it (.ci/run does)")
    if CHROMIUM is None:
        pytest.skip("browser: no chromium on PATH (apt-get install -y chromium)")
    pytest.importorskip("jupyterlab", reason="browser: jupyterlab is not installed: pip install -e '.[browser]'")
    pytest.importorskip("playwright", reason="browser: playwright is not installed: pip install -e '.[browser]'")
    import psutil

    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", root / "quickstart.ipynb")
    jupyter = tmp_path / "jupyter"
    settings = jupyter / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # Without this a news/update pop-up covers the page.
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(jupyter / "config"),
        "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(jupyter / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(jupyter / "workspaces"),
    }
    port = _free_port()
    log = (tmp_path / "jupyterlab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip", "127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={TOKEN}", "--allow-root", f"--ServerApp.root_dir={root}",
         "--ServerApp.port_retries=0", "--LabApp.expose_app_in_browser=True"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        children = psutil.Process(server.pid).children(recursive=True) if server.poll() is None else []
        server.send_signal(signal.SIGTERM)  # stops its kernels; the kernel's Session ranks die with it (pdeathsig)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        _, alive = psutil.wait_procs(children, timeout=20)
        for proc in alive:
            proc.kill()
        log.close()
        assert not alive, f"processes outlived JupyterLab: {[p.pid for p in alive]}"


def test_quickstart_in_jupyterlab_runs_all_cells_and_the_dashboard_shows_rank_logs_and_versions(
    jupyter_lab: str, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{jupyter_lab}/lab/tree/quickstart.ipynb?reset&token={TOKEN}")
            page.wait_for_function(
                "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
                " return k && k.status === 'idle'; }",
                timeout=120_000,
            )
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")

            dashboard = page.locator(".rlsdk-dashboard").first
            # The last cell closes the session; the dashboard's own task then shows it closed.
            expect(dashboard).to_contain_text("(closed)", timeout=240_000)
            versions = page.locator("div.rlsdk-versions").first
            expect(versions).to_contain_text(re.compile(rf"trainer published\s*v{STEPS}"))
            expect(versions).to_contain_text(re.compile(rf"engine served\s*v{STEPS}\s*\(in sync\)"))
            expect(versions).to_contain_text("on-policy")
            logs = page.locator("div.rlsdk-logs").first
            expect(logs).to_contain_text("[rank 0/2")
            expect(logs).to_contain_text("[rank 1/2")
            expect(page.locator("div.rlsdk-tracer").first).to_contain_text("collective trace")  # the tracer view
            dashboard.scroll_into_view_if_needed()
            dashboard.screenshot(path=str(tmp_path / "dashboard.png"))
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            tracebacks = [text for text in errors.all_inner_texts() if "Traceback" in text or "Error" in text]
            assert not tracebacks, tracebacks
        finally:
            browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
