import nbformat
import pytest

from gpulab.colab import SETUP_CELL
from gpulab.commands.notebook_upkeep import blank_solutions, build_exercises, stale_exercises, tidy

SOLUTION = '''bandwidth = ____
### BEGIN SOLUTION
bandwidth = nbytes / seconds
### END SOLUTION
q1.check(bandwidth)

def step(batch):
    """One step."""
    ### BEGIN SOLUTION
    return batch.to("cpu")
    ### END SOLUTION
'''


def test_regions_become_placeholders():
    blank = blank_solutions(SOLUTION)
    assert "nbytes / seconds" not in blank and 'to("cpu")' not in blank
    assert "bandwidth = ____\n# YOUR CODE HERE\nq1.check(bandwidth)" in blank
    assert '    """One step."""\n    # YOUR CODE HERE\n    raise NotImplementedError\n' in blank
    compile(blank, "exercise", "exec")  # still valid Python


def test_unbalanced_markers_are_an_error():
    with pytest.raises(ValueError, match="unbalanced"):
        blank_solutions("### BEGIN SOLUTION\nx = 1\n")


def _write(path, *sources, outputs=False):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    if outputs:
        nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="hi")]
        nb.cells[0].execution_count = 3
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def test_build_then_in_sync_then_drift_detected(tmp_path):
    _write(tmp_path / "solutions" / "01_x.ipynb", SETUP_CELL, SOLUTION, outputs=True)
    assert stale_exercises(tmp_path) == ["exercises/01_x.ipynb is missing"]
    assert build_exercises(tmp_path) == [tmp_path / "exercises" / "01_x.ipynb"]
    assert stale_exercises(tmp_path) == [] and build_exercises(tmp_path) == []
    exercise = nbformat.read(tmp_path / "exercises" / "01_x.ipynb", as_version=4)
    assert exercise.cells[0].outputs == [] and "YOUR CODE HERE" in exercise.cells[1].source
    _write(tmp_path / "solutions" / "01_x.ipynb", SETUP_CELL, SOLUTION.replace("seconds", "secs"))
    assert stale_exercises(tmp_path) == ["exercises/01_x.ipynb is out of date"]
    _write(tmp_path / "exercises" / "02_orphan.ipynb", "x = 1")
    assert "exercises/02_orphan.ipynb has no solution" in stale_exercises(tmp_path)


def test_tidy_strips_outputs_and_rewrites_setup_cells(tmp_path):
    _write(tmp_path / "notebooks" / "00_a.ipynb", "# Setup: an old version", "print(1)", outputs=True)
    assert tidy(tmp_path) == [tmp_path / "notebooks" / "00_a.ipynb"]
    nb = nbformat.read(tmp_path / "notebooks" / "00_a.ipynb", as_version=4)
    assert nb.cells[0].source == SETUP_CELL and nb.cells[0].outputs == [] and nb.cells[0].execution_count is None
    assert tidy(tmp_path) == []
