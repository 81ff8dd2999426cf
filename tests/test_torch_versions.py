"""`make test-versions` picks the right torch and torchvision pairs (the index's answers injected: no network)."""

import re

import pandas as pd
import pytest
from packaging.version import Version

from gpulab.commands.torch_versions import (
    Pair,
    constraints_without_torch,
    declared_dependencies,
    floor_pair,
    newest_pair,
    parse_index_versions,
    result_row,
)

from .conftest import ROOT

# What `pip index versions` answered on the development machine (2026-12): torch 2.15.0 is served, its
# torchvision 0.30 is not yet.
PIP_TORCH = """torch (2.15.0)
Available versions: 2.15.0, 2.14.1, 2.14.0, 2.13.0+cpu, 2.13.0, 2.12.1, 2.12.0, 2.11.0, 2.6.0, 2.5.1, 1.13.1
  INSTALLED: 2.14.1
"""
PIP_VISION = """torchvision (0.29.2)
Available versions: 0.29.2, 0.29.1, 0.29.0, 0.28.0, 0.27.1, 0.21.0, 0.20.1, 0.15.2
"""


def test_pip_index_versions_output_is_read_in_full():
    assert parse_index_versions(PIP_TORCH)[:4] == ["2.15.0", "2.14.1", "2.14.0", "2.13.0+cpu"]
    assert len(parse_index_versions(PIP_VISION)) == 8
    with pytest.raises(ValueError, match="Available versions"):
        parse_index_versions("ERROR: No matching distribution found for torch\n")


def test_the_newest_pair_is_the_newest_torch_whose_torchvision_is_served():
    pair = newest_pair(parse_index_versions(PIP_TORCH), parse_index_versions(PIP_VISION))
    assert (pair.torch, pair.torchvision) == ("torch==2.14.*", "torchvision==0.29.*")
    assert "2.15 has none there yet" in pair.why


def test_the_newest_pair_takes_the_newest_torch_once_its_torchvision_arrives():
    pair = newest_pair(["2.15.0", "2.14.1"], ["0.30.0", "0.29.1"])
    assert (pair.torch, pair.torchvision) == ("torch==2.15.*", "torchvision==0.30.*")
    assert "none there yet" not in pair.why


def test_pre_releases_and_local_builds_are_not_releases():
    # 2.16.0rc1 with 0.31.0rc1, and a local 2.15.0+cpu: none counts; 2.15's torchvision is missing, so 2.14 it is
    pair = newest_pair(["2.16.0rc1", "2.15.0+cpu", "2.14.1", "2.14.0"], ["0.31.0rc1", "0.29.1", "0.29.0"])
    assert pair.torch == "torch==2.14.*"


def test_no_served_pair_is_an_error():
    with pytest.raises(ValueError, match="no torch 2.x with its torchvision"):
        newest_pair(["2.15.0", "1.13.1"], ["0.14.1"])


def test_the_floor_is_pyprojects_lower_bounds_pinned_exactly():
    pair = floor_pair(["numpy>=1.24", "torch>=2.6", "torchvision>=0.21"])
    assert (pair.torch, pair.torchvision) == ("torch==2.6.0", "torchvision==0.21.0")
    assert floor_pair(["torch >= 2.8.1", "torchvision>=0.23.1"]).torch == "torch==2.8.1"


def test_a_floor_that_does_not_pair_is_refused():
    with pytest.raises(ValueError, match="do not pair"):
        floor_pair(["torch>=2.8", "torchvision>=0.21"])
    with pytest.raises(ValueError, match="one '>='"):
        floor_pair(["torch", "torchvision>=0.21"])


def test_the_floor_is_read_from_this_pyproject_and_is_the_one_the_readme_states():
    """The venv of `make test-versions` installs pyproject's lower bounds; the README's Versions section names them."""
    pair = floor_pair(declared_dependencies(ROOT / "pyproject.toml"))
    stated = re.search(r"\*\*Versions\.\*\* The course needs torch (\S+) or newer \(torchvision (\S+) or newer\)",
                       (ROOT / "README.md").read_text())
    assert stated, "README.md's Versions section no longer says 'The course needs torch X or newer (torchvision Y ...'"
    assert Version(pair.torch.removeprefix("torch==")) == Version(stated[1])
    assert Version(pair.torchvision.removeprefix("torchvision==")) == Version(stated[2])


def test_the_venvs_get_cis_pins_for_everything_but_torch_and_torchvision(tmp_path):
    source = tmp_path / "constraints.txt"
    source.write_text("# pins\ntorch==2.14.1\ntorchvision==0.29.1\nnumpy==2.4.6\ntorchaudio==2.14.1\n")
    lines = constraints_without_torch(source, tmp_path / "out.txt").read_text().splitlines()
    assert lines == ["# pins", "numpy==2.4.6", "torchaudio==2.14.1"]


def test_a_pairs_row_counts_lessons_and_names_the_failed_ones():
    course = pd.DataFrame({"lesson": ["00_setup", "01_cuda_basics", "06_profiling"],
                           "status": ["passed", "FAILED", "FAILED"], "seconds": [10, 20, 30], "error": ["", "x", "y"]})
    row = result_row(Pair("floor", "torch==2.6.0", "torchvision==0.21.0", ""),
                     {"torch": "2.6.0+cu124", "torchvision": "0.21.0+cu124", "python": "3.11.7"}, course, 612,
                     2.5, 3.1)
    assert (row["passed"], row["lessons"], row["failed"], row["minutes"]) == (1, 3, "01_cuda_basics 06_profiling", 10.2)
