"""gpulab.commands.wheelhouse without a network: the sets, pip's target options, the stand-ins for what a machine already has,
and resolution, download and the offline check through the real pip against small local wheels.

The real thing (PyPI, a fresh venv that has torch, Pythons 3.12 and 3.13): tests/test_wheelhouse_offline.py."""

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from gpulab.commands import wheelhouse
from gpulab.commands.wheelhouse import WheelhouseError

from .conftest import ROOT

pytest.importorskip("tomllib")  # the builder reads pyproject.toml (Python 3.11+)


def make_wheel(folder: Path, name: str, version: str, requires=(), extras: dict | None = None) -> Path:
    """A pure-Python wheel with one module, declaring ``requires`` (and ``extras``: extra -> requirements)."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    for extra, reqs in (extras or {}).items():
        meta += [f"Provides-Extra: {extra}"] + [f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs]
    files = {f"{name.replace('-', '_')}.py": "", f"{dist}.dist-info/METADATA": "\n".join(meta) + "\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for p, t in files.items()]
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record + [f"{dist}.dist-info/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for p, t in files.items():
            zf.writestr(p, t)
    return path


BACKEND = '''"""A PEP 517 backend in the project itself, so that pip prepares its metadata offline without setuptools."""
import os

NAME, VERSION = "course-like", "0.1"


def _metadata():
    import tomllib
    project = tomllib.load(open("pyproject.toml", "rb"))["project"]
    lines = ["Metadata-Version: 2.1", f"Name: {NAME}", f"Version: {VERSION}"]
    lines += [f"Requires-Dist: {r}" for r in project["dependencies"]]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        lines += [f"Provides-Extra: {extra}"] + [f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs]
    return "\\n".join(lines) + "\\n"


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    info = os.path.join(metadata_directory, f"course_like-{VERSION}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(_metadata())
    return os.path.basename(info)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("a dry run never builds")
'''


@pytest.fixture
def project(tmp_path):
    """A course-like project (torch and numpy needed, a course and a headless extra) and a wheelhouse with everything
    its course extra needs but torch: notebook-runner 1.0 needs helper>=2."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "pyproject.toml").write_text('''[build-system]
requires = []
build-backend = "backend"
backend-path = ["."]

[project]
name = "course-like"
version = "0.1"
dependencies = ["torch>=2.9", "torchvision>=0.24", "numpy>=1.24", "tiny-dep>=1.0"]

[project.optional-dependencies]
headless = ["notebook-runner>=1.0"]
course = ["notebook-runner>=1.0", "big-ide>=4"]
''')
    (root / "backend.py").write_text(BACKEND)
    house = tmp_path / "house"
    for args in [("tiny-dep", "1.5"), ("notebook-runner", "1.0", ["helper>=2"]), ("helper", "2.1"),
                 ("big-ide", "4.2", ["numpy>=1.20"]), ("numpy", "2.0")]:
        make_wheel(house, *args)
    (house / wheelhouse.MANIFEST).write_text(json.dumps({"set": "course", "pythons": ["3.12"],
                                                          "platform": "manylinux_2_28_x86_64"}))
    return root, house


# --------------------------------------------------------------------------------------------- no pip


def test_each_set_asks_for_all_its_extra_but_never_torch():
    for name, wheel_set in wheelhouse.SETS.items():
        declared = wheelhouse.project_requirements(ROOT, wheel_set.extra)
        asked = wheelhouse.wanted(declared, wheel_set.present)
        asked_names = {wheelhouse.name_of(r) for r in asked}
        assert not asked_names & set(wheelhouse.NEVER), name
        assert {wheelhouse.name_of(r) for r in declared} - set(wheel_set.present) <= asked_names
        assert "setuptools" in asked_names  # `pip install -e .` builds the project offline too
    assert {"numpy", "pandas", "matplotlib"} <= set(wheelhouse.SETS["headless"].present)
    assert "jupyterlab" in {wheelhouse.name_of(r) for r in wheelhouse.project_requirements(ROOT, "course")}


def test_headless_is_what_running_the_lessons_needs_and_a_part_of_course():
    headless = set(wheelhouse.project_requirements(ROOT, "headless"))
    course = set(wheelhouse.project_requirements(ROOT, "course"))
    assert headless <= course
    names = {wheelhouse.name_of(r) for r in headless}
    assert {"nbclient", "nbformat", "nbconvert", "ipykernel"} <= names  # gpulab.grader.execute, course, the kernel itself
    assert "jupyterlab" not in names


def test_requirement_names_and_floors():
    assert wheelhouse.name_of("Jupyter_Lab[x]>=4.0; python_version>'3'") == "jupyter-lab"
    assert wheelhouse.floor_of("torch>=2.9") == "2.9" and wheelhouse.floor_of("a==1.2.3") == "1.2.3"
    assert wheelhouse.floor_of("a<3") == "0"
    reqs = ["torch>=2.9", "numpy>=1.24"]
    assert wheelhouse.present_versions(reqs, ["torch", "numpy"]) == {"torch": "2.9", "numpy": "1.24"}
    assert wheelhouse.present_versions(reqs, ["torch"], {"Torch": "2.11.0", "numpy": "2.5.2"}) == {
        "torch": "2.11.0", "numpy": "2.5.2"}
    assert wheelhouse.stub_version("2.11.0+cu130") == "2.11.0+present"


def test_a_freeze_of_the_target_counts_as_present(tmp_path):
    freeze = tmp_path / "image.txt"
    freeze.write_text("# pip list --format=freeze\ntorch==2.11.0+cu130\nNumPy==2.5.2\n-e git+https://x/y#egg=z\n"
                      "pkg @ file:///tmp/pkg.whl\n")
    assert wheelhouse.read_freeze(freeze) == {"torch": "2.11.0+cu130", "numpy": "2.5.2"}


def test_platform_tags_take_every_older_manylinux():
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert not any(t.startswith(("manylinux_2_29", "manylinux_2_31")) for t in tags)
    assert "manylinux2014_aarch64" in wheelhouse.platform_tags("manylinux_2_17_aarch64")
    assert wheelhouse.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_target_options_say_which_python():
    options = wheelhouse.target_options("3.13", "manylinux_2_28_x86_64")
    assert options[:1] == ["--only-binary=:all:"]
    assert options[options.index("--python-version") + 1] == "3.13" and options[options.index("--abi") + 1] == "cp313"
    with pytest.raises(WheelhouseError, match="3.12"):
        wheelhouse.target_options("python3.12", "manylinux_2_28_x86_64")


def test_constraints_lose_the_pins_of_what_is_present(tmp_path):
    pins = tmp_path / "constraints.txt"
    pins.write_text("# pins\ntorch==2.14.1\ntorchvision==0.29.1\nnumpy==2.4.6\nnbclient==0.11.0\n")
    assert wheelhouse.constraint_lines(pins, ("torch", "torchvision", "triton")) == ["numpy==2.4.6", "nbclient==0.11.0"]
    assert wheelhouse.constraint_lines(pins, ("torch", "torchvision", "numpy")) == ["nbclient==0.11.0"]
    assert wheelhouse.constraint_lines(tmp_path / "none.txt", ()) == []


def test_the_isolated_environment_drops_pip_settings(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_INDEX_URL", "https://example.invalid/simple")
    env = wheelhouse.isolated_env()
    assert not any(k.startswith("PIP_") and k not in ("PIP_CONFIG_FILE", "PIP_DISABLE_PIP_VERSION_CHECK") for k in env)
    assert env["PIP_CONFIG_FILE"] == __import__("os").devnull


def test_a_folder_with_other_files_is_not_taken(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(WheelhouseError, match="no wheelhouse.json"):
        wheelhouse.build(tmp_path, project=ROOT)
    with pytest.raises(WheelhouseError, match="choose course or headless"):
        wheelhouse.build(tmp_path / "new", "everything", project=ROOT)


# --------------------------------------------------------------------------------------------- the real pip, offline


def test_a_stand_in_satisfies_a_requirement_and_is_never_returned(tmp_path):
    links = tmp_path / "links"
    make_wheel(links, "needs-torch", "1.0", ["torch>=2.9", "helper>=2"])
    make_wheel(links, "helper", "2.0")
    resolved = wheelhouse.resolve(["needs-torch"], "3.12", "manylinux_2_28_x86_64", present={"torch": "2.9"},
                                  find_links=[links], offline=True)
    assert sorted(i["metadata"]["name"] for i in resolved) == ["helper", "needs-torch"]
    with pytest.raises(WheelhouseError, match="torch"):  # without the stand-in, torch is missing: pip says so
        wheelhouse.resolve(["needs-torch"], "3.12", "manylinux_2_28_x86_64", find_links=[links], offline=True)


def test_check_resolves_the_editable_project_against_the_folder_alone(project, monkeypatch):
    root, house = project
    monkeypatch.setenv("PIP_FIND_LINKS", str(house.parent))  # pip's own settings must not supply anything
    would = wheelhouse.check(house, "3.13", project=root)
    assert would == ["big-ide==4.2", "helper==2.1", "notebook-runner==1.0", "numpy==2.0", "tiny-dep==1.5"]
    assert wheelhouse.check(house, "3.12", set_name="headless", project=root) == [
        "helper==2.1", "notebook-runner==1.0", "tiny-dep==1.5"]  # numpy counted as present
    # what the build counted as present is counted again: an image that has helper needs no helper wheel
    manifest = json.loads((house / wheelhouse.MANIFEST).read_text())
    (house / wheelhouse.MANIFEST).write_text(json.dumps({**manifest, "counted_as_present": {"helper": "2.0"}}))
    (house / "helper-2.1-py3-none-any.whl").unlink()
    assert "helper==2.1" not in wheelhouse.check(house, "3.12", project=root)
    (house / wheelhouse.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(WheelhouseError, match="helper"):
        wheelhouse.check(house, "3.12", project=root)


def test_build_downloads_what_pip_resolved_and_writes_its_manifest(project, tmp_path, monkeypatch):
    """resolve() stands in for PyPI (its report points at local files); the download is pip's own, hashes checked."""
    root, house = project
    (root / "constraints.txt").write_text("torch==2.14.1\ntiny-dep==1.5\n")
    seen = {}

    def fake_resolve(requirements, python, platform, *, present=None, constraints=None, **kw):
        seen.update(requirements=requirements, present=present, constraints=constraints)
        return [_report_item(house / f) for f in ("tiny_dep-1.5-py3-none-any.whl", "helper-2.1-py3-none-any.whl",
                                                  "notebook_runner-1.0-py3-none-any.whl")]

    monkeypatch.setattr(wheelhouse, "resolve", fake_resolve)
    out = tmp_path / "out"
    out.mkdir()
    (out / wheelhouse.MANIFEST).write_text("{}")
    (out / "stale-0.1-py3-none-any.whl").write_text("left by an earlier build")
    manifest = wheelhouse.build(out, "headless", ("3.12",), project=root, log=lambda *a: None)
    assert sorted(p.name for p in out.glob("*.whl")) == [
        "helper-2.1-py3-none-any.whl", "notebook_runner-1.0-py3-none-any.whl", "tiny_dep-1.5-py3-none-any.whl"]
    assert {wheelhouse.name_of(r) for r in seen["requirements"]} == {"tiny-dep", "notebook-runner", "setuptools"}
    assert seen["present"] == {"torch": "2.9", "torchvision": "0.24", "numpy": "1.24", "pandas": "0", "matplotlib": "0"}
    assert seen["constraints"] == ["tiny-dep==1.5"]  # torch's pin would fight its stand-in
    written = json.loads((out / wheelhouse.MANIFEST).read_text())
    assert written == manifest and manifest["set"] == "headless" and manifest["pythons"] == ["3.12"]
    assert manifest["install"] == f'pip install --no-index --find-links {out} -e ".[headless]"'
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in out.glob("*.whl"))
    assert manifest["counted_as_present"]["torch"] == "2.9"


def test_build_refuses_a_resolution_that_wants_torch(project, tmp_path, monkeypatch):
    root, house = project
    make_wheel(house, "triton", "3.6.0")
    monkeypatch.setattr(wheelhouse, "resolve", lambda *a, **k: [_report_item(house / "triton-3.6.0-py3-none-any.whl")])
    with pytest.raises(WheelhouseError, match="triton"):
        wheelhouse.build(tmp_path / "out", "course", project=root, constraints=None, log=lambda *a: None)


def test_the_command_line_says_a_missing_wheelhouse_in_one_line(tmp_path, capsys):
    assert wheelhouse.main(["check", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make wheelhouse" in err


def _report_item(path: Path) -> dict:
    """An entry of pip's --report "install" list for a local wheel."""
    name, version = path.name.split("-")[:2]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"metadata": {"name": name.replace("_", "-"), "version": version},
            "download_info": {"url": path.as_uri(), "archive_info": {"hashes": {"sha256": digest}}}}
