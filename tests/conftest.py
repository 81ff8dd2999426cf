import linecache
import sys

import pytest
import torch

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
# Fixtures, not tests: real GPU runs' executed notebooks are read by tests, never run by nbval.
collect_ignore_glob = ["data/*"]


def pytest_collection_modifyitems(config, items):
    """Tests marked long come first, in their order (pytest-xdist's loadscope hands out modules and classes in
    collection order: a long one handed out last runs alone at the end, on one core of two). Tests marked gpu run
    where torch sees a GPU; elsewhere they are skipped with the reason."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the order within each kind stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def tf32_switch_put_back():
    """The TF32 switch as each module found it: a lesson's cells run in a module's fixture may leave it on, as they
    do in a kernel (lessons 03 and 09 then read a later module's fp32 steps as TF32 ones)."""
    precision = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(precision)


@pytest.fixture(autouse=True)
def torch_left_as_found():
    """Every test leaves torch.cuda's functions as it found them: a patch restored out of order (a monkeypatch made
    inside a stand-in's ``with``) would leave the stand-in's answers to every later test in that process; the TF32
    switch is put back, as ``tf32_switch_put_back`` does for a module."""
    before, precision = dict(vars(torch.cuda)), torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(precision)
    changed = sorted(name for name, value in vars(torch.cuda).items()
                     if callable(value) and name in before and before[name] is not value)
    assert not changed, f"torch.cuda left patched after the test: {changed}"


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """Results go to a temporary folder, never the repository's results/."""
    monkeypatch.setenv("GPULAB_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


def shown_solution(question, name: str, **scope):
    """The function ``name`` defined by the solution a question shows learners, run with ``scope`` as globals."""
    return question.shown(name, **scope)


def notebook_function(source: str, name: str, **scope):
    """The function ``name`` that ``source`` defines, as a notebook cell defines it: run in ``scope`` as the
    ``__main__`` globals, its source kept where ``inspect.getsource`` finds it (IPython keeps cells in linecache)."""
    filename = f"<cell {name} {len(linecache.cache)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope.setdefault("__name__", "__main__")
    exec(compile(source, filename, "exec"), scope)
    return scope[name]


def checker_values() -> list:
    """What an answer that walks up the stack can read: the locals of the gpulab frames that called it, and the
    items of the lists, tuples and dicts among them."""
    values, frame = [], sys._getframe(1)
    while frame:
        if frame.f_globals.get("__name__", "").startswith("gpulab"):
            for value in frame.f_locals.values():
                values.append(value)
                if isinstance(value, (list, tuple)):
                    values += value
                elif isinstance(value, dict):
                    values += value.values()
        frame = frame.f_back
    return values


@pytest.fixture
def cuda_stand_in(request):
    """The CPU plays an NVIDIA H200 for the test (tests/cuda_stand_in.py: proves the code around torch.cuda's calls,
    never the GPU); another card by indirect parametrization:
    ``@pytest.mark.parametrize("cuda_stand_in", ["Tesla T4"], indirect=True)``."""
    from .cuda_stand_in import installed

    with installed(getattr(request, "param", "NVIDIA H200")) as gpu:
        yield gpu


def _on(device: str):
    """The device to pass for ``device``: the CPU itself, or the CPU playing the card named."""
    if device == "cpu":
        yield torch.device("cpu")
        return
    from .cuda_stand_in import installed

    with installed(device):
        yield torch.device("cpu")


@pytest.fixture(params=["cpu", "NVIDIA H200"], ids=["cpu", "cuda stand-in"])
def course_device(request):
    """The device-generic pattern: the test runs on the CPU, then on the CPU playing an NVIDIA H200 (its GPU branches).
    Yields the device to pass; ``gpulab.device.on_gpu`` tells the two apart."""
    yield from _on(request.param)


@pytest.fixture(params=["cpu", "NVIDIA H200", "Tesla T4"], ids=["cpu", "as an H200", "as a T4"])
def course_device_and_t4(request):
    """``course_device``, and also the CPU playing Colab's Tesla T4 (sm_75: fp16 where an H200 has bf16, no flash
    attention, no FP8, no GPM): for the branches that turn on what the card has. ``gpulab.device.STAND_IN`` names the
    card played."""
    yield from _on(request.param)


@pytest.fixture
def fake_nvml_card():
    """An H200 played by tests/fake_libnvml.py in place of libnvidia-ml, under nvidia-ml-py's real wrappers (it proves
    the Python around NVML's C calls, never a GPU's values): set its readings, then read them through gpulab."""
    from . import fake_libnvml

    with fake_libnvml.installed(fake_libnvml.h200()) as library:
        yield library.cards[0]
