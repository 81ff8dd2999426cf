import pytest
import torch

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run where torch sees a GPU; elsewhere they are skipped with the reason."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """Results go to a temporary folder, never the repository's results/."""
    monkeypatch.setenv("GPULAB_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


def shown_solution(question, name: str, **scope):
    """The function ``name`` defined by the solution a question shows learners, run with ``scope`` as globals."""
    exec(question.solution_text, scope)
    return scope[name]
