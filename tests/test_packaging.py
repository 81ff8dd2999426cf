"""pyproject.toml, environment.yml and constraints.txt describe the same set of packages."""

import re

import pytest
import yaml

from .conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_environment_yml_installs_what_pyproject_declares():
    project = _pyproject()
    declared = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= {_name(r) for r in extra}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    conda = {_name(d) for d in env if isinstance(d, str)} - {"python", "pip"}
    pip = {_name(d) for d in next(d["pip"] for d in env if isinstance(d, dict))} - {"-e"}
    assert conda | pip == declared


def test_constraints_pin_every_declared_package():
    pins = {_name(line): line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    assert all("==" in line for line in pins.values())
    project = _pyproject()
    declared = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= {_name(r) for r in extra}
    assert declared <= set(pins), declared - set(pins)
    assert pins["torch"] == "torch==2.14.1" and pins["torchvision"] == "torchvision==0.29.1"


def test_torch_is_not_pinned_tightly_in_the_package():
    torch_req = next(r for r in _pyproject()["dependencies"] if _name(r) == "torch")
    assert "==" not in torch_req and "<" not in torch_req
