"""The grader: solutions get full marks, blank exercises none, broken submissions a zero and a reason."""

import json

import nbformat
import pytest

from gpulab import cli
from gpulab.grading import grade, lesson_of

from .conftest import ROOT

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_lesson_is_read_from_the_name():
    assert lesson_of("submissions/alice/01_cuda_basics.ipynb") == "01"
    assert lesson_of("homework.ipynb") is None


def test_solutions_get_full_marks():
    grades = grade(SOLUTIONS)
    failed = grades[~grades["passed"]]
    assert failed.empty, failed.to_string()
    assert set(grades["notebook"]) == {str(p) for p in SOLUTIONS}


def test_blank_exercises_get_zero_with_a_friendly_message():
    grades = grade(EXERCISES)
    assert (grades["points"] == 0).all()
    assert grades["message"].str.startswith("not attempted").all(), grades["message"].tolist()
    assert not grades["message"].str.contains("Traceback").any()


@pytest.mark.parametrize("cell, reason", [
    ("1 / 0", "ZeroDivisionError"),
    ("import sys; sys.exit(3)", "sys.exit"),
    ("import os; os._exit(1)", "kernel died"),
])
def test_a_broken_notebook_gets_zero_and_a_reason(tmp_path, cell, reason):
    path = _notebook(tmp_path / "00_setup_and_diagnostics.ipynb", "x = 1", cell)
    grades = grade([path])
    assert len(grades) >= 3 and (grades["points"] == 0).all()
    assert grades["message"].str.contains(reason).all(), grades["message"].tolist()


def test_a_hanging_notebook_is_stopped_at_its_time_limit(tmp_path):
    path = _notebook(tmp_path / "00_hang.ipynb", "import time; time.sleep(120)")
    grades = grade([path], time_limit=10)
    assert (grades["points"] == 0).all() and grades["message"].str.contains("time limit of 10 s").all()


def test_not_a_notebook_or_unknown_lesson(tmp_path):
    garbage = tmp_path / "00_garbage.ipynb"
    garbage.write_text("{ this is not json")
    nameless = _notebook(tmp_path / "homework.ipynb", "x = 1")
    grades = grade([garbage, nameless])
    assert grades.loc[grades["notebook"] == str(garbage), "message"].str.contains("not a readable notebook").all()
    assert grades.loc[grades["notebook"] == str(nameless), "message"].str.contains("cannot tell which lesson").all()


def test_cli_grades_the_rest_and_writes_csv_and_json(tmp_path, capsys):
    broken = _notebook(tmp_path / "00_broken.ipynb", "raise RuntimeError('boom')")
    good = ROOT / "solutions" / SOLUTIONS[0].name
    status = cli.main(["grade", str(broken), str(good), "--out", str(tmp_path / "grades")])
    out = capsys.readouterr().out
    assert status == 1 and "boom" in out
    records = json.loads((tmp_path / "grades" / "grades.json").read_text())
    by_notebook = {r["notebook"]: r for r in records}
    assert by_notebook[str(good)]["passed"] and not by_notebook[str(broken)]["passed"]
    assert (tmp_path / "grades" / "grades.csv").read_text().startswith("notebook,question,points")
