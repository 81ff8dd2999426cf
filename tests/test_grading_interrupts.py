"""Ctrl-C or SIGTERM during `gpulab grade`: one line, the finished grades kept, nothing left running or on disk;
after a SIGKILL, the next run ends what was left."""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pandas as pd
import psutil
import pytest

from gpulab.grader import execute

from .conftest import ROOT


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A copy of gpulab for the graded kernels (edits to this checkout meanwhile are not "installed files changed")."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "gpulab", site / "gpulab", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _notebook(path: Path, source: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("how, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_grading_stops_in_one_line_and_keeps_the_finished_grades(site, tmp_path, how, status):
    token = f"gpulab-grade-hang-{secrets.token_hex(4)}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _notebook(tmp_path / "a" / "00_setup_and_diagnostics.ipynb", "x = 1")
    hang = _notebook(tmp_path / "b" / "00_setup_and_diagnostics.ipynb", "import subprocess, sys, time\n"
                     f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {token!r}], "
                     "start_new_session=True)\ntime.sleep(600)")
    grades = tmp_path / "grades"
    cli = subprocess.Popen([sys.executable, "-m", "gpulab.commands.cli", "grade", str(first), str(hang), "--out", str(grades)],
                           env={**os.environ, "PYTHONPATH": str(site)}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # a terminal's foreground job
    deadline = time.monotonic() + 300
    while not _running(token):
        assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()
        time.sleep(0.2)
    os.killpg(cli.pid, how)  # what Ctrl-C does: the signal goes to the foreground process group
    try:
        out, err = cli.communicate(timeout=240)  # seconds when quiet; once over 60 in CI beside busy loops
    except subprocess.TimeoutExpired:
        signals = Path(f"/proc/{cli.pid}/status").read_text()  # blocked, ignored or pending: the cause, if any
        cli.kill()
        pytest.fail(f"the grader did not stop: {cli.communicate()[1][-500:]!r}; "
                    + "; ".join(line for line in signals.splitlines() if line.startswith(('State', 'Sig', 'Shd'))))
    assert cli.returncode == status and "Traceback" not in err, err
    said = f"stopped by {'SIGTERM' if how == signal.SIGTERM else 'Ctrl-C'} after 1 of 2 notebooks"
    assert err.replace("\r", "\n").strip().splitlines()[-1].startswith(f"gpulab grade: {said}"), err
    assert str(first) in out and str(hang) not in out
    assert pd.read_csv(grades / "grades.csv")["notebook"].unique().tolist() == [str(first)]
    assert not _running(token) and not _leftovers(cli.pid)


def _running(token: str) -> list:
    return [p for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or [])]


def test_what_a_killed_grader_leaves_is_ended_by_the_next_run(site, tmp_path):
    token = f"gpulab-grade-orphan-{secrets.token_hex(4)}"
    hang = _notebook(tmp_path / "00_setup_and_diagnostics.ipynb", "import subprocess, sys, time\n"
                     f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {token!r}], "
                     "start_new_session=True)\ntime.sleep(600)")
    cli = subprocess.Popen([sys.executable, "-m", "gpulab.commands.cli", "grade", str(hang), "--out", str(tmp_path / "grades")],
                           env={**os.environ, "PYTHONPATH": str(site)}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not _running(token):
        assert cli.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    cli.kill()  # SIGKILL: the grader cannot clean up; its worker dies with it, its kernel soon after
    cli.wait()
    assert _running(token) and _leftovers(cli.pid)
    execute.clear_leftovers()  # what the next `gpulab grade` or `gpulab course` does first
    assert not _running(token) and not _leftovers(cli.pid)


def _leftovers(pid: int) -> list:
    home = execute._cgroup_home()
    return [*(f for where in {tempfile.gettempdir(), "/tmp"} for f in Path(where).glob(f"gpulab-*-{pid}-*")),
            *(home.glob(f"gpulab-{pid}-*") if home else [])]
