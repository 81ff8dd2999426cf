"""Notebook upkeep: which notebooks are lessons and which are pages, exercise notebooks generated from solutions, setup
cells, stripped outputs."""

import re
from pathlib import Path

import nbformat

from ..colab import SETUP_CELL

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
NOTEBOOK_DIRS = ("notebooks", "solutions", "exercises")
# notebooks/ holds two kinds. A lesson is numbered (NN_name.ipynb): it has an exercise and a solution, writes the results
# a full run ships as reference results, and has a plan and a place in the verification. A page is named here: every
# lesson links to it, `make course` and `make test` run it, and it has no exercise, no solution and ships no results.
PAGES = ("how_the_course_measures.ipynb",)
_LESSON = re.compile(r"\d\d_.+\.ipynb")
_REGION = re.compile(rf"^([ \t]*){re.escape(BEGIN)}[^\n]*\n.*?^[ \t]*{re.escape(END)}[^\n]*(\n|$)", re.M | re.S)


def blank_solutions(source: str) -> str:
    """Replace every solution region of a cell's source by a placeholder for the learner."""

    def placeholder(match: re.Match) -> str:
        indent = match.group(1)
        lines = [f"{indent}# YOUR CODE HERE"]
        if indent:  # inside a function: the body must still be valid, and say it is unfinished
            lines.append(f"{indent}raise NotImplementedError")
        return "\n".join(lines) + match.group(2)

    blanked = _REGION.sub(placeholder, source)
    if BEGIN in blanked or END in blanked:
        raise ValueError(f"unbalanced {BEGIN!r}/{END!r} markers in:\n{source}")
    return blanked


def exercise_from_solution(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The exercise notebook for a solution notebook: regions blanked, outputs cleared."""
    exercise = nbformat.from_dict(strip_outputs(solution))
    for cell in exercise.cells:
        if cell.cell_type == "code":
            cell.source = blank_solutions(cell.source)
    return exercise


def build_exercises(root: Path = Path(".")) -> list[Path]:
    """Write exercises/NN_*.ipynb for every solutions/NN_*.ipynb; returns the files written."""
    written = []
    (root / "exercises").mkdir(exist_ok=True)
    for path in sorted((root / "solutions").glob("*.ipynb")):
        target = root / "exercises" / path.name
        text = _dumps(exercise_from_solution(nbformat.read(path, as_version=4)))
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            written.append(target)
    return written


def stale_exercises(root: Path = Path(".")) -> list[str]:
    """Exercise notebooks missing, out of date, or without a solution (empty when all is in sync)."""
    problems = []
    solutions = {p.name for p in (root / "solutions").glob("*.ipynb")}
    for name in sorted(solutions):
        target = root / "exercises" / name
        expected = _dumps(exercise_from_solution(nbformat.read(root / "solutions" / name, as_version=4)))
        if not target.exists():
            problems.append(f"exercises/{name} is missing")
        elif target.read_text() != expected:
            problems.append(f"exercises/{name} is out of date")
    problems += [f"exercises/{p.name} has no solution" for p in (root / "exercises").glob("*.ipynb")
                 if p.name not in solutions]
    return problems


def strip_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook without outputs, execution counts and per-run metadata."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            for key in ("execution", "collapsed", "scrolled"):
                cell.metadata.pop(key, None)
    nb.metadata.pop("widgets", None)
    return nb


def notebooks(root: Path = Path(".")) -> list[Path]:
    return sorted(p for d in NOTEBOOK_DIRS for p in (root / d).glob("*.ipynb"))


def is_lesson(path: Path) -> bool:
    """Whether a notebook is a lesson: numbered, ``NN_name.ipynb``."""
    return bool(_LESSON.fullmatch(Path(path).name))


def lessons(root: Path = Path(".")) -> list[Path]:
    """The lessons in ``root``/notebooks/, in order."""
    return sorted(p for p in (root / "notebooks").glob("*.ipynb") if is_lesson(p))


def pages(root: Path = Path(".")) -> list[Path]:
    """The pages in ``root``/notebooks/ (``PAGES`` that exist there)."""
    return [root / "notebooks" / name for name in PAGES if (root / "notebooks" / name).is_file()]


def course(root: Path = Path(".")) -> list[Path]:
    """What `gpulab course` runs: the lessons, then the pages."""
    return lessons(root) + pages(root)


def tidy(root: Path = Path(".")) -> list[Path]:
    """Strip outputs and rewrite setup cells in every notebook; returns the files changed."""
    changed = []
    for path in notebooks(root):
        nb = strip_outputs(nbformat.read(path, as_version=4))
        first = next((c for c in nb.cells if c.cell_type == "code"), None)
        if first is not None and first.source.startswith("# Setup"):
            first.source = SETUP_CELL
        text = _dumps(nb)
        if path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


def _dumps(nb) -> str:
    return nbformat.writes(nb) + "\n"
