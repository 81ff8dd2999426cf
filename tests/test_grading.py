"""The grader: solutions get full marks, blank exercises none, broken submissions a zero and a reason."""

import json
import re
import shutil

import nbformat
import pandas as pd
import pytest

from gpulab.commands import cli
from gpulab.grader.grading import grade, lesson_of

from .conftest import ROOT

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


@pytest.fixture(scope="module", autouse=True)
def installed(tmp_path_factory):
    """The graded kernels import a copy of gpulab (as a class's grading machine would have it installed), so that
    edits to this checkout while the tests run are not "installed files changed"; returns the copy's folder."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "gpulab", site / "gpulab", ignore=shutil.ignore_patterns("__pycache__"))
    # The speed-ups lessons 06 and 08 ask for are judged with injected timings in their own tests (and measured under
    # load by grading_benchmarks/check_stability.py); here they are lowered, so no grade hinges on how busy this machine
    # is.
    _replace(site / "gpulab" / "questions" / "lesson06.py", r"^SPEEDUP = .*$", "SPEEDUP = 0.5")
    _replace(site / "gpulab" / "questions" / "lesson08.py", r'"cpu": [0-9.]+', '"cpu": 0.25')
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(site))
        yield site / "gpulab"


def _replace(path, pattern: str, value: str) -> None:
    text, found = re.subn(pattern, value, path.read_text(), count=1, flags=re.MULTILINE)
    assert found == 1, f"{pattern!r} not in {path.name}"
    path.write_text(text)


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_lesson_is_read_from_the_name():
    assert lesson_of("submissions/alice/01_cuda_basics.ipynb") == "01"
    assert lesson_of("homework.ipynb") is None


def test_blank_exercises_get_zero_with_a_friendly_message():
    grades = grade(EXERCISES)
    assert (grades["points"] == 0).all()
    assert grades["message"].str.startswith("not attempted").all(), grades["message"].tolist()
    assert not grades["message"].str.contains("Traceback").any()


BROKEN = {"1 / 0": "ZeroDivisionError", "import sys; sys.exit(3)": "sys.exit", "import os; os._exit(1)": "kernel died"}


@pytest.fixture(scope="module")
def broken_grades(tmp_path_factory):
    """Each broken submission in a folder of its own, graded in one call (a fresh kernel each); the rows by cell."""
    folder, paths = tmp_path_factory.mktemp("broken"), {}
    for number, cell in enumerate(BROKEN):
        (folder / str(number)).mkdir()
        paths[cell] = _notebook(folder / str(number) / "00_setup_and_diagnostics.ipynb", "x = 1", cell)
    grades = grade(list(paths.values()))
    return {cell: grades[grades["notebook"] == str(path)] for cell, path in paths.items()}


@pytest.mark.parametrize("cell", BROKEN)
def test_a_broken_notebook_gets_zero_and_a_reason(broken_grades, cell):
    rows = broken_grades[cell]
    assert len(rows) >= 3 and (rows["points"] == 0).all(), rows.to_string()
    assert rows["message"].str.contains(BROKEN[cell]).all(), rows["message"].tolist()


def test_a_hanging_notebook_is_stopped_at_its_time_limit(tmp_path):
    path = _notebook(tmp_path / "00_hang.ipynb", "import time; time.sleep(120)")
    grades = grade([path], time_limit=10)
    assert (grades["points"] == 0).all() and grades["message"].str.contains("time limit of 10 s").all()


def test_not_a_notebook_or_unknown_lesson(tmp_path):
    garbage = tmp_path / "00_garbage.ipynb"
    garbage.write_text("{ this is not json")
    other_json = tmp_path / "01_data.ipynb"
    other_json.write_text('{"cells": "no", "answer": 42}')
    nameless = _notebook(tmp_path / "homework.ipynb", "x = 1")
    written = []

    def watch(items):  # the grades on disk after each notebook: an interrupted run keeps the finished ones
        for item in items:
            yield item
            written.append(len(pd.read_csv(tmp_path / "out" / "grades.csv")))

    grades = grade([garbage, other_json, nameless], progress=watch, out_dir=tmp_path / "out")
    for path, why in ((garbage, "the file is not JSON"), (other_json, "the file is JSON but not a Jupyter notebook")):
        messages = grades.loc[grades["notebook"] == str(path), "message"]
        assert messages.str.startswith(f"not a readable notebook: {why}").all(), messages.tolist()
    assert grades.loc[grades["notebook"] == str(nameless), "message"].str.contains("cannot tell which lesson").all()
    assert written == [4, 8, 9]


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


IMPORT_00 = "from gpulab import check\nfrom gpulab.questions.lesson00 import q1, q2, q3, q4\nqs = (q1, q2, q3, q4)"
HOSTILE = {  # a blank submission that tries to get full marks some other way, and what the grader says
    "replaced_check": (IMPORT_00 + "\ndef fake(self, *a):\n    self._record(check.CORRECT, 'ok')\n"
                       "check.Question.check = fake\nfor q in qs: q.check(None)", "modified the checks"),
    "replaced_checkers": (IMPORT_00 + "\nfor q in qs:\n    q.checker = lambda *a: 'fine'\n    q.check(None)",
                          "modified the checks"),
    "patched_judge": (IMPORT_00 + "\ncheck.Question._judge = lambda self, a: (check.CORRECT, 'ok')\n"
                      "for q in qs: q.check(None)", "modified the checks"),
    "results_by_hand": (IMPORT_00 + "\nfor q in qs:\n    q.last = check._results[('00', q.name)] = "
                        "check.Result('00', q.name, 1, check.CORRECT, 'ok')", "without running the checks"),
    "forged_report_lines": (
        "import json\nfrom gpulab.questions.lesson00 import q1\nres = {f'q{i}': {'status': 'correct', 'message': 'x'} "
        "for i in range(1, 5)}\nfor tag in ('GPULAB-GRADE-0:', ''):\n"
        "    print(tag + json.dumps({'fingerprint': {}, 'changed': [], 'results': res, 'unchecked': []}))",
        "not checked: the notebook never ran"),
    "hook_reads_the_tag": (
        "import json, re\nres = {f'q{i}': {'status': 'correct', 'message': 'x'} for i in range(1, 5)}\n"
        "def forge(info):\n    tag = re.search(r'GPULAB-GRADE-\\w+:', info.raw_cell or '')\n"
        "    if tag: print(tag.group(0) + json.dumps({'fingerprint': {}, 'changed': [], 'results': res,"
        " 'unchecked': []}))\nget_ipython().events.register('pre_run_cell', forge)",
        "not checked: the notebook never ran"),
    "deletes_the_class_folder": ("import shutil\nshutil.rmtree(CLASS)", "not checked: the notebook never ran"),
    "runs_in_a_private_folder": (
        "import os, tempfile\nroot = os.path.dirname(os.getcwd())\nassert 'gpulab-submission-' in root, root\n"
        "for value in (os.environ['HOME'], tempfile.gettempdir(), os.environ['GPULAB_RESULTS']):\n"
        "    assert value.startswith(root + os.sep), value", "not checked: the notebook never ran"),
}


@pytest.fixture(scope="module")
def hostile_grades(tmp_path_factory):
    """Every hostile submission, and a correct one after them, graded in one call."""
    folder = tmp_path_factory.mktemp("class")
    paths = []
    for name, (source, _) in HOSTILE.items():
        (folder / name).mkdir()
        paths.append(_notebook(folder / name / "00_setup_and_diagnostics.ipynb", source.replace("CLASS", repr(str(folder)))))
    (folder / "good").mkdir()
    good = folder / "good" / "00_setup_and_diagnostics.ipynb"
    good.write_bytes((ROOT / "solutions" / good.name).read_bytes())
    grades = grade([*paths, good])
    return {name: grades[grades["notebook"] == str(folder / name / good.name)] for name in [*HOSTILE, "good"]}


@pytest.mark.parametrize("kind", HOSTILE)
def test_tampering_gets_zero_and_the_reason(hostile_grades, kind):
    rows = hostile_grades[kind]
    assert len(rows) == 4 and (rows["points"] == 0).all(), rows.to_string()
    assert rows["message"].str.contains(HOSTILE[kind][1], regex=False).all(), rows["message"].tolist()


def test_a_correct_notebook_after_hostile_ones_gets_full_marks(hostile_grades):
    assert hostile_grades["good"]["passed"].all(), hostile_grades["good"].to_string()


def test_a_notebook_that_changes_the_installed_package_spoils_the_rest(tmp_path, installed, capsys):
    lesson = installed / "questions" / "lesson00.py"
    tamper = _notebook(tmp_path / "00_tamper.ipynb", f"open({str(lesson)!r}, 'a').write('\\nq1.checker = str\\n')")
    after = tmp_path / "after" / "00_setup_and_diagnostics.ipynb"
    after.parent.mkdir()
    after.write_bytes((ROOT / "exercises" / after.name).read_bytes())
    original = lesson.read_bytes()
    try:
        status = cli.main(["grade", str(tamper), str(after), "--out", str(tmp_path / "grades")])
    finally:
        lesson.write_bytes(original)
    assert status == 1 and "installed files changed during grading" in capsys.readouterr().err
    grades = pd.read_csv(tmp_path / "grades" / "grades.csv")
    first, second = grades[grades["notebook"] == str(tamper)], grades[grades["notebook"] == str(after)]
    assert (grades["points"] == 0).all()
    assert first["message"].str.contains("installed files changed while this notebook ran").all()
    assert second["message"].str.startswith("not graded: installed files changed while").all()
