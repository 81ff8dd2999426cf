"""The notebooks themselves: stored clean, same setup cell, exercises generated from solutions.

Executing them is nbval's job for the lessons (`pytest --nbval-lax notebooks`, as `make test` does) and the grader's for the
solutions (test_grading_solutions.py).
"""

import re

import nbformat
import pytest

from gpulab import check
from gpulab.colab import SETUP_CELL, colab_url
from gpulab.commands.notebook_upkeep import lessons, notebooks, stale_exercises

from .conftest import ROOT

ALL = notebooks(ROOT)
LESSONS = lessons(ROOT)  # the numbered lessons; the pages beside them: test_measuring_page.py
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def _code(path):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def test_there_are_lessons():
    assert LESSONS and SOLUTIONS


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_without_outputs(path):
    dirty = [i for i, c in enumerate(_code(path), 1) if c.outputs or c.execution_count]
    assert not dirty, f"code cells {dirty} carry outputs: run `make notebooks`"


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_starts_with_the_setup_cell(path):
    assert _code(path)[0].source == SETUP_CELL, "run `make notebooks` to rewrite the setup cell"


def test_exercises_are_generated_from_solutions():
    assert stale_exercises(ROOT) == [], "run `make exercises`"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_checks_every_question_of_its_lesson(path):
    lesson = path.name[:2]
    source = "\n".join(c.source for c in _code(path))
    for q in check.questions(lesson):
        assert f"{q.name}.check(" in source, f"{path.name} never calls {q.name}.check()"
    assert f'progress("{lesson}")' in source
    assert (ROOT / "notebooks").glob(f"{lesson}_*.ipynb"), "a solution without its lesson"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_readme_lists_lesson_with_its_colab_badge(path):
    readme = (ROOT / "README.md").read_text()
    assert f"notebooks/{path.name}" in readme
    assert colab_url(f"notebooks/{path.name}") in readme


def test_no_machine_paths_in_notebooks():
    for path in ALL:
        assert not re.search(r"/(work|tmp|root|home)/", path.read_text()), path


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_every_question_has_a_hint_and_a_solution_that_compiles(path):
    for q in check.questions(path.name[:2]):
        assert q.hint_text.strip(), f"{q.name} has no hint"
        compile(q.solution_text, f"{q.lesson} {q.name} solution", "exec")


def test_the_checklist_links_every_lesson_and_only_notebooks_that_exist():
    checklist = (ROOT / "CHECKLIST.md").read_text()
    links = re.findall(r"\]\((notebooks/[^)]+)\)", checklist)
    assert links and all((ROOT / link).exists() for link in links), [link for link in links if not (ROOT / link).exists()]
    assert {f"notebooks/{path.name}" for path in LESSONS} <= set(links)
