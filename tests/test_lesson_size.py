"""A lesson a learner finishes in one sitting, about 90 minutes: at most 600 non-blank code lines and 3,000 words of
text, and no code cell a learner has to scroll through (over 60 non-blank lines)."""

import re

import nbformat
import pytest

from .conftest import ROOT

PAGES = sorted((ROOT / "notebooks").glob("*.ipynb"))
CODE_LINES, WORDS, CELL_LINES = 600, 3000, 60


def size(path) -> tuple[int, int, list[tuple[int, int]]]:
    """Non-blank code lines, words of markdown, and the (code cell, lines) of cells over ``CELL_LINES``."""
    cells = nbformat.read(path, as_version=4).cells
    code = [len([line for line in c.source.splitlines() if line.strip()]) for c in cells if c.cell_type == "code"]
    words = sum(len(re.findall(r"\S+", c.source)) for c in cells if c.cell_type == "markdown")
    return sum(code), words, [(i, n) for i, n in enumerate(code) if n > CELL_LINES]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_the_lesson_fits_one_sitting(path):
    code, words, long_cells = size(path)
    assert code <= CODE_LINES, f"{code} non-blank code lines (at most {CODE_LINES})"
    assert words <= WORDS, f"{words} words of text (at most {WORDS})"
    assert not long_cells, f"code cells over {CELL_LINES} non-blank lines (code cell, lines): {long_cells}"


def test_the_counts_see_a_long_cell_and_a_wordy_lesson(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("\n".join(["x = 1", ""] * 61)),
                                         nbformat.v4.new_markdown_cell("word " * 3001)])
    nbformat.write(nb, tmp_path / "long.ipynb")
    assert size(tmp_path / "long.ipynb") == (61, 3001, [(0, 61)])
