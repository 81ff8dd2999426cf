"""pyproject.toml, environment.yml and constraints.txt describe the same set of packages."""

import json
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


# The first torch release with each API the course's code uses (from PyTorch's sources and release notes): the
# declared floor must be at least the newest of them. Lower bounds are enough here: none but the first two sets it.
TORCH_APIS = {
    r"torch\.backends\.(cuda\.matmul|cudnn\.conv)\.fp32_precision\s*=": (2, 9),  # the per-backend TF32 setters
    r"from torch\.distributed\.fsdp import[^\n]*\bfully_shard\b": (2, 6),  # FSDP2's public name (lesson 07)
    r"from torch\.distributed\.tensor import": (2, 5),  # DTensor's public module
    r"torch\.get_autocast_dtype\(": (2, 4),
    r"from torch\.nn\.attention import[^\n]*\bsdpa_kernel\b": (2, 3),
    r"torch\.utils\.flop_counter": (2, 1),
    r"torch\.amp\.GradScaler\(": (2, 3),
    r"register_post_accumulate_grad_hook\(": (2, 1),
    r"torch\.compiler\.disable\(": (2, 1),
}


# Torch behaviour the lessons rely on, with the first release that has it: each failed its lesson on the release
# before in the quick course (`make test-versions`, torch 2.6.0 on Python 3.11 without a GPU). The floor must cover
# these too.
TORCH_FIXES = {
    # lesson 07: FSDP2 on CPU (gloo) ranks calls torch.cpu.Stream.record_event, added in 2.7 (pytorch/pytorch#145935)
    r"\bfully_shard\(": (2, 7),
    # lesson 06: "Python replay stack is empty" INTERNAL ASSERT (pytorch/pytorch#101632), gone in 2.7.0 (#150102)
    r"with_stack=True": (2, 7),
    # lesson 01 on a CPU: Triton's interpreter tested every global of a kernel's module with `in [tl, tl.core]`, which
    # a DataFrame refuses; Triton 3.3, torch 2.7's, tests for modules first (triton-lang/triton#5484)
    r"@triton\.jit": (2, 7),
}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _floor(name: str) -> tuple[int, ...]:
    requirement = next(r for r in _pyproject()["dependencies"] if _name(r) == name)
    return _version(re.search(r">=\s*([\d.]+)", requirement).group(1))


def _code(path) -> str:
    """A module's source, or a notebook's code cells (prose that names an API does not need it)."""
    if path.suffix == ".py":
        return path.read_text()
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")


def _course_code() -> str:
    sources = [p for folder in ("gpulab", "notebooks", "solutions") for p in (ROOT / folder).rglob("*")
               if p.suffix in (".py", ".ipynb")]
    return "\n".join(_code(p) for p in sources)


@pytest.mark.parametrize("table", [TORCH_APIS, TORCH_FIXES], ids=["apis", "fixes"])
def test_the_declared_torch_floor_covers_every_api_and_fix_the_course_uses(table):
    text = _course_code()
    used = {pattern: first for pattern, first in table.items() if re.search(pattern, text)}
    assert used, "none of the table's patterns is used any more: update the table and the floor"
    newest = max(used.values())
    assert _floor("torch") >= newest, f"the code needs torch {newest} ({used}); pyproject declares {_floor('torch')}"


def test_torchvision_floor_is_the_torch_floors_release_and_environment_yml_agrees():
    torch_floor, vision_floor = _floor("torch"), _floor("torchvision")
    assert vision_floor[:2] == (0, torch_floor[1] + 15)  # torchvision 0.(N+15) is built for torch 2.N
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    pip = next(d["pip"] for d in env if isinstance(d, dict))
    for name in ("torch", "torchvision"):
        declared = next(r for r in _pyproject()["dependencies"] if _name(r) == name)
        assert declared in pip, f"environment.yml should ask for {declared}"


def test_the_pinned_torch_meets_the_floor_and_the_readme_names_it():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert _version(pins["torch"].split("+")[0])[:2] >= _floor("torch")
    floor = ".".join(map(str, _floor("torch")))
    assert f"torch {floor}" in (ROOT / "README.md").read_text(), "the README says which torch the course needs"


def test_the_headless_extra_is_part_of_the_course_extra():
    extras = _pyproject()["optional-dependencies"]
    assert set(extras["headless"]) <= set(extras["course"])
