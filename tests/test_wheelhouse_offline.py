"""The wheelhouse for real (`make test-wheelhouse`): built from PyPI for CPython 3.11, 3.12 and 3.13, resolved offline
for 3.12 and 3.13 with torch counted as present, and installed offline (--no-index, no pip configuration) into a
fresh venv of this Python that already has torch, as on a GPU VM without internet.

It needs PyPI and a torch this machine installs without a large download, and takes about 15 minutes: it runs only
when GPULAB_WHEELHOUSE_TEST=1 (make test-wheelhouse sets it)."""

import json
import os
import subprocess
import sys
import time
import venv

import pytest

from gpulab.commands import wheelhouse

from .conftest import ROOT

pytestmark = [
    pytest.mark.skipif(os.environ.get("GPULAB_WHEELHOUSE_TEST") != "1",
                       reason="needs PyPI and a torch to install: make test-wheelhouse (GPULAB_WHEELHOUSE_TEST=1)"),
    pytest.mark.timeout(1800),
]
PYTHONS = ("3.11", "3.12", "3.13")
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def _timed(what, fn, *args, **kwargs):
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    print(f"{what}: {time.perf_counter() - start:.0f} s")
    return value


@pytest.fixture(scope="module")
def houses(tmp_path_factory):
    """Both sets, built for three Pythons (the one here among them, for the real install)."""
    assert HERE in PYTHONS
    root = tmp_path_factory.mktemp("wheelhouses")
    built = {}
    for name in wheelhouse.SETS:
        built[name] = _timed(f"build {name}", wheelhouse.build, root / name, name, PYTHONS, project=ROOT,
                             constraints=ROOT / "constraints.txt")
        print(f"{name}: {len(built[name]['wheels'])} wheels, {built[name]['total_bytes'] / 1e6:.1f} MB")
    return root, built


@pytest.fixture(scope="module")
def torch_venv(tmp_path_factory):
    """A fresh venv of this Python with this machine's torch and torchvision, pandas and matplotlib (what a GPU
    image has), installed the ordinary way before going offline."""
    from importlib.metadata import version

    where = tmp_path_factory.mktemp("venv") / "gpu-image"
    venv.create(where, with_pip=True)
    python = str(where / "bin" / "python")
    pins = [f"{name}=={version(name)}" for name in ("torch", "torchvision", "pandas", "matplotlib")]
    _timed("torch into a fresh venv", subprocess.run, [python, "-m", "pip", "install", "-q", *pins], check=True)
    return python


def _offline_install(python, house, extra):
    done = subprocess.run([python, "-m", "pip", "install", "--no-index", "--find-links", str(house),
                           "-e", f"{ROOT}[{extra}]"], capture_output=True, text=True, env=wheelhouse.isolated_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _versions(python) -> dict:
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    return {wheelhouse.name_of(p["name"]): p["version"] for p in json.loads(listed.stdout)}


def test_the_sets_hold_no_torch_and_headless_is_small(houses):
    root, built = houses
    for name, manifest in built.items():
        names = {wheelhouse.name_of(w["name"]) for w in manifest["wheels"]}
        assert not names & {"torch", "torchvision", "triton"}
        assert not [n for n in names if n.startswith(("nvidia-", "cuda-")) and n != "nvidia-ml-py"]  # torch's CUDA
        assert {p.name for p in (root / name).glob("*.whl")} == {w["file"] for w in manifest["wheels"]}
    assert "jupyterlab" in {wheelhouse.name_of(w["name"]) for w in built["course"]["wheels"]}
    one_python = sum(w["bytes"] for w in built["headless"]["wheels"] if "3.12" in w["pythons"])
    assert one_python < 30e6, f"the headless set for one Python is {one_python / 1e6:.1f} MB"


@pytest.mark.parametrize("python", ["3.12", "3.13"])
@pytest.mark.parametrize("name", ["course", "headless"])
def test_other_pythons_resolve_against_the_wheelhouse_alone(houses, name, python):
    root, _ = houses
    would = _timed(f"check {name} {python}", wheelhouse.check, root / name, python, project=ROOT)
    assert not {wheelhouse.name_of(w.split("==")[0]) for w in would} & {"torch", "torchvision", "triton"}


def test_a_venv_with_torch_installs_the_course_offline_and_keeps_its_torch(houses, torch_venv):
    root, _ = houses
    before = _versions(torch_venv)
    _timed("offline install, headless", _offline_install, torch_venv, root / "headless", "headless")
    _timed("offline install, course", _offline_install, torch_venv, root / "course", "course")
    after = _versions(torch_venv)
    for kept in ("torch", "torchvision", "triton", "pandas", "matplotlib"):
        assert after.get(kept) == before.get(kept), kept
    assert {"gpulab", "jupyterlab", "holistictraceanalysis", "nbclient"} <= set(after)
    subprocess.run([torch_venv, "-m", "pip", "check"], check=True, env=wheelhouse.isolated_env())
    subprocess.run([torch_venv, "-c", "import gpulab.commands.course, gpulab.commands.record, hta, jupyterlab, nbclient"],
                   check=True)
