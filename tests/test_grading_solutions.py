"""The grader gives every solution notebook full marks. Each runs in a fresh kernel, as a class's notebook would: a
cell that fails (a deprecation warning too, under GPULAB_STRICT_WARNINGS) zeroes it, so this is also the run of the
solutions that CI makes. A module of its own: the longest grading test, so that a second pytest worker can take it
beside the other grading tests."""

import pytest

from gpulab.grader.grading import grade

from .test_grading import SOLUTIONS, installed  # noqa: F401 — the graded kernels import a copy of gpulab

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)


def test_solutions_get_full_marks():
    grades = grade(SOLUTIONS)
    failed = grades[~grades["passed"]]
    assert failed.empty, failed.to_string()
    assert set(grades["notebook"]) == {str(p) for p in SOLUTIONS}
    # lesson 08's q1 (the shown solution: tests/test_lesson08.py) timed against the baseline, all of the model trained
    capstone = grades.loc[grades["notebook"].str.endswith("08_capstone.ipynb"), "message"]
    assert capstone.str.contains("steady-state speed-up").all(), capstone.tolist()
    assert capstone.str.contains("all of it trained, on every image").all(), capstone.tolist()
