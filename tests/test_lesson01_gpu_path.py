"""Lesson 01's cells on a GPU this machine does not have: torch's device facts, events and sync-debug mode are faked
(as an NVIDIA H200 reported them in the course's first run on one), so that what the cells would size, print and
let through there is checked on a CPU."""

import re
import warnings
from types import SimpleNamespace

import nbformat
import pandas as pd
import pytest
import torch

import gpulab
from gpulab.questions.lesson01 import _cache_note

from .conftest import ROOT

NOTEBOOK = ROOT / "notebooks" / "01_cuda_basics.ipynb"
SOLUTIONS = ROOT / "solutions" / "01_cuda_basics.ipynb"
H200_L2_BYTES = 63e6  # "L2 cache  63 MB", as lesson 01 printed it on the H200 (torch's L2_cache_size / 1e6, rounded)
GPU = torch.device("cuda", 0)


class Stop(Exception):
    """Raised by a fake to end a cell at the point a test looks at."""


def cell(cell_id: str, path=NOTEBOOK) -> str:
    return next(c.source for c in nbformat.read(path, as_version=4).cells if c.get("id") == cell_id)


@pytest.fixture
def h200(monkeypatch):
    """Quick mode on a faked H200: the setup cell of section 0 run as it would run there; returns its variables."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=H200_L2_BYTES))
    scope = {"__name__": "__main__", "device": GPU, "gpulab": gpulab}
    exec(cell("lesson01-02"), scope)
    return scope


def sizes_asked(monkeypatch, scope: dict, source: str) -> list[int]:
    """The element counts ``source`` asks torch.randn for before the fake stops it (at the first one)."""
    asked = []

    def fake_randn(n, *args, **kwargs):
        asked.append(n)
        raise Stop

    monkeypatch.setattr(torch, "randn", fake_randn)
    with pytest.raises(Stop):
        exec(source, scope)
    return asked


# ----- sizes beyond L2 on a GPU, in quick mode too -----------------------------------------------------------

def test_the_vector_add_arrays_are_four_times_the_l2_on_a_gpu_in_quick_mode(h200, monkeypatch):
    (n,) = sizes_asked(monkeypatch, h200, cell("lesson01-38"))
    assert n * 4 >= 4 * H200_L2_BYTES, f"{n * 4 / 1e6:.0f} MB arrays fit in L2: the add and the copy measure L2"


def test_the_exercise_sizes_its_vector_add_beyond_l2_on_a_gpu(h200, monkeypatch):
    source = next(c.source for c in nbformat.read(SOLUTIONS, as_version=4).cells
                  if c.source.startswith("n = gpulab.by_mode(full=2**26"))
    (n,) = sizes_asked(monkeypatch, h200, source)
    assert n * 4 >= 4 * H200_L2_BYTES


def test_the_copy_sweep_reaches_eight_times_the_l2_on_a_gpu_in_quick_mode(h200, monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: None)  # the L2 flush's buffer
    sizes_asked(monkeypatch, h200, cell("lesson01-07"))
    assert 2 * h200["copy_mb"][-1] * 1e6 >= 8 * H200_L2_BYTES
    assert h200["copy_mb"][:5] == [0.25, 1, 4, 16, 64]  # the quick sizes, then only larger ones


def test_on_a_cpu_quick_mode_keeps_the_vector_add_small(monkeypatch):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__", "device": torch.device("cpu"), "gpulab": gpulab}
    exec(cell("lesson01-02"), scope)
    (n,) = sizes_asked(monkeypatch, scope, cell("lesson01-38"))
    assert n == 2**20 and scope["l2_bytes"] == 0


def test_the_bandwidth_check_says_when_the_arrays_sit_in_l2(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=H200_L2_BYTES))
    assert "L2" in _cache_note(GPU, 2**20 * 4)  # the 4 MB arrays the H200's quick run used
    assert _cache_note(GPU, 2**26 * 4) == ""
    assert _cache_note(torch.device("cpu"), 4) == ""


# ----- the sync-debug mode's prototype note --------------------------------------------------------------------

PROTOTYPE = ("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations "
             "(Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)")  # as the H200 run showed it


def test_the_sync_debug_prototype_note_is_explained_not_left_to_the_learner(monkeypatch, capsys):
    said = []

    def set_sync_debug_mode(mode):  # torch warns once per process, at the first switch
        if not said:
            warnings.warn(PROTOTYPE, UserWarning, stacklevel=2)
        said.append(mode)

    def synchronising():
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_sync_debug_mode)
    scope = {"__name__": "__main__", "on_gpu": True, "torch": torch, "warnings": warnings,
             "calls": {"x.sum()": lambda: None, "x.sum().item()": synchronising}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning that reaches the learner fails the test
        exec(cell("lesson01-20"), scope)
    out = capsys.readouterr().out
    assert said == ["warn", "default"]
    assert re.search(r"x\.sum\(\)\s+no warning", out) and re.search(r"x\.sum\(\)\.item\(\)\s+warned", out)
    assert "prototype" in out and "Triggered internally" not in out


# ----- CUDA events beside the host clock of the same runs --------------------------------------------------------

def test_events_are_printed_beside_the_host_clock_of_the_same_runs(monkeypatch, capsys):
    """The H200 printed events 1.22 ms beside a host clock of 0.555 ms taken from other runs: an event time longer
    than the wall time around it. Here the work takes 1.22 ms and the earlier sweep said 0.555 ms."""
    now = [0.0]

    def perf_counter():
        now[0] += 1e-5  # reading the clock takes 10 µs
        return now[0]

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = now[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    def work():
        now[0] += 1.22e-3

    logged = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__", "on_gpu": True, "torch": torch, "device": GPU, "work": work, "n": 256,
             "time": SimpleNamespace(perf_counter=perf_counter), "statistics": __import__("statistics"),
             "gpulab": SimpleNamespace(by_mode=gpulab.by_mode, sync=lambda device: None),
             "timings": {"torch.cuda.synchronize()": 0.555e-3, "no synchronize": 0.53e-3},
             "sync_log": SimpleNamespace(add=lambda **row: logged.append(row)),
             "reference_for": lambda name: pd.DataFrame(), "display": print}
    exec(cell("lesson01-16"), scope)
    out = capsys.readouterr().out
    events_ms, host_ms = (float(x) for x in re.findall(r"([\d.]+) ms", out)[:2])
    assert events_ms == pytest.approx(1.22) and events_ms <= host_ms
    assert logged[0]["median_s"] == pytest.approx(1.22e-3)


# ----- warm and cold copies timed the same way on a GPU ------------------------------------------------------------

def test_on_a_gpu_the_sweep_times_warm_and_cold_copies_alone_between_events(h200, monkeypatch):
    """On the H200 the warm copies were timed back to back on the host clock (launch-bound: about 10 µs per copy up to
    32 MB) and the cold ones between events (the GPU's time alone), so warm lost to cold at every size ("a warm cache
    should never lose"). Here a faked GPU copies in 2 µs from L2 and in 8 µs after a flush."""
    state = {"flushed": False}

    class Flush:
        def zero_(self):
            state["flushed"] = True

    class Event:
        def __init__(self, enable_timing=False):
            self.after_flush = None

        def record(self):
            self.after_flush = state["flushed"]

        def synchronize(self):
            state["flushed"] = False  # the copy has run: its data is in L2 again

        def elapsed_time(self, end):
            return 8e-3 if self.after_flush else 2e-3

    class Log:
        def __init__(self, name):
            pass

        def add_measurement(self, m, **params):
            return {**params, "label": m.label, "cache": m.cache, "median_s": m.median}

    def no_bench(*args, **kwargs):
        raise AssertionError("a copy of the sweep was timed with gpulab.bench on the GPU")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: Flush())
    monkeypatch.setattr(torch, "randn", lambda n, device=None: torch.zeros(min(n, 1024)))
    h200["gpulab"] = SimpleNamespace(by_mode=gpulab.by_mode, Measurement=gpulab.Measurement, ResultLog=Log,
                                     bench=no_bench)
    exec(cell("lesson01-07"), h200)
    copies = h200["copies"]
    assert set(copies[copies.cache == "warm"].median_s) == {2e-6}
    assert set(copies[copies.cache == "cold"].median_s) == {8e-6}
