"""Lesson 00 as a learner runs it: JupyterLab in headless Chromium, Run → Run All Cells, every cell runs clean.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/install-browser``). ``make test-browser`` installs
them when missing and runs this file; ``make test`` leaves it out. Where they are missing the tests are
skipped with the reason, except under CI, where they fail. Screenshots go to ``build/browser/``.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSON = "notebooks/00_setup_and_diagnostics.ipynb"
SHOTS = ROOT / "build" / "browser"
RUN_TIMEOUT_S = 300  # quick mode on an idle 2-core machine takes a small fraction of this
# Headless Chromium with no network of its own: without the background-networking flags it tries to
# reach Google's services, and on a closed network its connections are refused.
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1000",
]
# No "get notified about Jupyter news?" toast over the notebook, and no request for news or updates.
NEWS_SETTINGS = "@jupyterlab/apputils-extension/notification.jupyterlab-settings"

# The open notebook as the page shows it: each code cell's prompt ("[ ]:" not run, "[*]:" running or
# queued, "[3]:" done), the matplotlib figures loaded as images, and any dialog in the way. The kernel's
# state and the errors come from the app (window.jupyterapp): the page shows an idle indicator before a
# kernel is connected, and renders an error like any other stderr text.
PAGE_STATE_JS = """
const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
if (!panel || !widget || !widget.context) return null;
const kernel = widget.sessionContext.session && widget.sessionContext.session.kernel;
const dialog = document.querySelector('.jp-Dialog');
const images = [...panel.querySelectorAll('.jp-OutputArea-output[data-mime-type="image/png"] img')];
const cells = widget.context.model.toJSON().cells;
return {
  kernel: kernel ? `${kernel.connectionStatus}, ${kernel.status}` : null,
  dialog: dialog ? dialog.textContent : null,
  prompts: [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim()),
  plots: images.filter(img => img.complete && img.naturalWidth > 0).length,
  errors: cells.flatMap((cell, i) => (cell.outputs || []).filter(out => out.output_type === 'error')
                                                          .map(out => `cell ${i}: ${out.ename}: ${out.evalue}`)),
};
"""
IDLE = "connected, idle"
MENU_ITEM = "//li[contains(@class, 'lm-Menu-item')][div[contains(@class, 'lm-Menu-itemLabel') and text()='{}']]"
NOTEBOOK_JS = "return window.jupyterapp.shell.currentWidget.context.model.toJSON();"


def browser_binaries() -> tuple[str, str]:
    """Paths of chromium and chromedriver; skip (fail under CI) when either is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    reason = "needs Debian's chromium and chromium-driver: run .ci/install-browser, or make test-browser"
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI runs the browser test, it must not skip it)", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium driven by chromedriver, with a fresh profile; quit afterwards, pass or fail."""
    chromium, driver_path = browser_binaries()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    tmp = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}"]:
        options.add_argument(flag)
    # A driver path given: Selenium uses it and never tries to download one.
    driver = webdriver.Chrome(options=options, service=Service(driver_path, log_output=str(tmp / "chromedriver.log")))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def jupyterlab(browser, tmp_path_factory):
    """JupyterLab from this environment on 127.0.0.1 (a free port, a random token) serving a folder with a
    copy of the lesson, so that the repository's notebook never gets outputs saved into it. Yields
    (url, token, folder); stops the server and its kernels afterwards, pass or fail."""
    tmp = tmp_path_factory.mktemp("jupyterlab")
    root = tmp / "course"
    (root / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / LESSON, root / LESSON)
    settings = tmp / "lab-settings"
    (settings / NEWS_SETTINGS).parent.mkdir(parents=True)
    (settings / NEWS_SETTINGS).write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    token, port = secrets.token_hex(16), free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "GPULAB_QUICK": "1",
        "GPULAB_RESULTS": str(tmp / "results"),
        "JUPYTER_CONFIG_DIR": str(tmp / "jupyter-config"),  # no personal settings or extensions
        "JUPYTER_RUNTIME_DIR": str(tmp / "jupyter-runtime"),
    }
    log = tmp / "jupyterlab.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
             f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp / 'lab-workspaces'}",
             *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_until_serving(server, url, token, log)
        yield url, token, root
    finally:
        stop(server, url, token)


def wait_until_serving(server: subprocess.Popen, url: str, token: str, log: Path, timeout_s: float = 90) -> None:
    request = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited with status {server.returncode}:\n{tail(log)}", pytrace=False)
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer at {url} within {timeout_s:.0f} s:\n{tail(log)}", pytrace=False)


def stop(server: subprocess.Popen, url: str, token: str) -> None:
    """Ask the server to shut down (it stops its kernels first); signal its process group if it does not."""
    if server.poll() is None:
        request = urllib.request.Request(f"{url}/api/shutdown", method="POST", headers={"Authorization": f"token {token}"})
        try:
            urllib.request.urlopen(request, timeout=10).close()
            server.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if server.poll() is not None:
            return
        os.killpg(server.pid, sig)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def wait_for(browser, condition, timeout_s: float, what: str) -> dict:
    """Poll the page state until ``condition(state)`` holds; fail with the last state seen."""
    deadline, state = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        state = browser.execute_script(PAGE_STATE_JS)
        if state and state["dialog"]:
            pytest.fail(f"{what}: JupyterLab asks: {state['dialog']}", pytrace=False)
        if state and condition(state):
            return state
        time.sleep(0.5)
    pytest.fail(f"{what}: not done after {timeout_s:.0f} s; last page state: {state}", pytrace=False)


def ran(prompt: str) -> bool:
    return prompt.startswith("[") and prompt.rstrip(":").strip("[]").isdigit()


def run_all_cells(browser, lab: tuple, path: str) -> dict:
    """Open a notebook in JupyterLab, click Run → Run All Cells as a learner would, and wait until the kernel
    is idle and every cell has run (or one failed: the cells after it never run). Returns the page state."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.wait import WebDriverWait

    url, token, _ = lab
    workspace = Path(path).stem  # a workspace of its own: only this notebook open
    browser.get(f"{url}/lab/workspaces/{workspace}/tree/{path}?token={token}")
    before = wait_for(browser, lambda s: s["kernel"] == IDLE and s["prompts"], 120, f"opening {path} with an idle kernel")
    assert not any(ran(p) for p in before["prompts"]), f"cells of {path} had run before Run All: {before['prompts']}"
    for xpath in ["//div[contains(@class, 'lm-MenuBar-itemLabel') and text()='Run']", MENU_ITEM.format("Run All Cells")]:
        WebDriverWait(browser, 10).until(ec.element_to_be_clickable((By.XPATH, xpath))).click()
    return wait_for(browser, lambda s: s["kernel"] == IDLE and (s["errors"] or all(ran(p) for p in s["prompts"])),
                    RUN_TIMEOUT_S, f"Run All Cells in {path}")


def screenshot(browser, element_css: str, path: Path, block: str = "start") -> None:
    browser.execute_script("document.querySelector(arguments[0]).scrollIntoView({block: arguments[1]});", element_css, block)
    time.sleep(0.5)  # let the scroll settle before the capture
    browser.save_screenshot(str(path))


def stdout_of(cell: dict) -> str:
    return "".join("".join(out["text"]) for out in cell.get("outputs", []) if out.get("name") == "stdout")


def test_lesson_00_runs_all_cells_in_jupyterlab(browser, jupyterlab):
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"
    try:
        start = time.monotonic()
        state = run_all_cells(browser, jupyterlab, LESSON)
        print(f"\nRun All Cells: {len(state['prompts'])} code cells, {state['plots']} plots rendered, "
              f"{time.monotonic() - start:.1f} s from opening the lesson")
        screenshot(browser, f"{panel} .jp-Cell", SHOTS / "01_top.png")
        notebook = browser.execute_script(NOTEBOOK_JS)
        (SHOTS / "00_setup_and_diagnostics.ipynb").write_text(json.dumps(notebook, indent=1))

        assert state["errors"] == [], "cells raised errors in the browser"
        code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
        lesson = nbformat.read(ROOT / LESSON, as_version=4)
        in_lesson = sum(cell.cell_type == "code" for cell in lesson.cells)
        assert len(state["prompts"]) == len(code) == in_lesson, "not every code cell of the lesson is on the page"
        assert all(cell["execution_count"] for cell in code), "a cell has no execution count"
        assert "mode: quick" in stdout_of(code[0]), f"the setup cell did not report quick mode:\n{stdout_of(code[0])}"
        assert state["plots"] >= 1, "no matplotlib figure was rendered as an image in an output area"
        screenshot(browser, f"{panel} .jp-OutputArea-output[data-mime-type='image/png']", SHOTS / "02_first_plot.png", "center")
    except BaseException:
        browser.save_screenshot(str(SHOTS / "failure.png"))
        raise


def test_an_error_stops_the_run_and_is_seen(browser, jupyterlab):
    """The checks above can fail: a notebook whose second cell raises is reported with its error, the cell
    after it never runs, and there is no plot."""
    broken = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in
                                             ["print('fine')", "1 / 0", "import matplotlib.pyplot as plt; plt.plot([1, 2])"]])
    broken.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(broken, jupyterlab[2] / "broken.ipynb")

    state = run_all_cells(browser, jupyterlab, "broken.ipynb")
    assert state["errors"] == ["cell 1: ZeroDivisionError: division by zero"]
    assert ran(state["prompts"][0]) and not ran(state["prompts"][2]), state["prompts"]
    assert state["plots"] == 0
