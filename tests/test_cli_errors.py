"""A mistake in a `gpulab` command is one line on stderr (what is wrong, what to do) and exit status 2."""

import subprocess
import sys

import pytest

from gpulab.commands import cli


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["reference", "add", "nope.csv", "--command", "x"], "nope.csv: no such file"),
    (["bench", "--device", "tpu"], "unknown device 'tpu'"),
    (["bench", "--timers", "--rounds", "0"], "positive integer"),
    (["bench", "--timers", "--threads", "-3"], "positive integer"),
    (["course", "nothere.ipynb"], "no such notebook: nothere.ipynb"),
    (["grade", "nothere.ipynb"], "no such notebook"),
    (["grade", "x.ipynb", "--time-limit", "-5"], "must be a positive number"),
    (["grade", "x.ipynb", "--time-limit", "0"], "must be a positive number"),
    (["grade", "x.ipynb", "--time-limit", "nan"], "must be a positive number"),
    (["grade", "x.ipynb", "--time-limit", "soon"], "is not a number"),
])
def test_a_mistake_is_one_line_and_status_2(capsys, tmp_path, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    try:
        status = cli.main(argv)
    except SystemExit as done:  # argparse's own errors exit
        status = done.code
    assert status == 2 and says in _error_line(capsys)


def test_grade_out_naming_a_file_is_refused_before_grading(capsys, tmp_path, monkeypatch):
    import gpulab.grader.grading

    monkeypatch.setattr(gpulab.grader.grading, "grade", lambda *a, **k: pytest.fail("graded before checking --out"))
    notebook = tmp_path / "00_x.ipynb"
    notebook.write_text("{}")
    taken = tmp_path / "grades.csv"
    taken.write_text("keep me")
    assert cli.main(["grade", str(notebook), "--out", str(taken)]) == 2
    assert "is a file, not a folder" in _error_line(capsys) and taken.read_text() == "keep me"


def test_argparse_errors_exit_with_2_and_one_line():
    done = subprocess.run([sys.executable, "-m", "gpulab.commands.cli", "grade", "a.ipynb", "--time-limit", "-5"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("gpulab grade: error: argument --time-limit")

