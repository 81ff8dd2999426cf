"""Lesson 01's cells on a GPU this machine does not have: torch's device facts, events and sync-debug mode are faked
(as an NVIDIA H200 reported them in the course's first run on one), so that what the cells would size, print and
let through there is checked on a CPU."""

import ast
import contextlib
import dataclasses
import io
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace
from unittest import mock

import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch
from torch.overrides import TorchFunctionMode

import gpulab
from gpulab import plans
from gpulab.check import CORRECT, WRONG
from gpulab.questions.lesson01 import _cache_note, q1
from gpulab.questions.observe import simulated_gpu
from gpulab.questions.stand_in import virtual_clock

from .conftest import ROOT, shown_solution
from .test_mfu_lessons_03_04 import code, run

NOTEBOOK = ROOT / "notebooks" / "01_cuda_basics.ipynb"
SOLUTIONS = ROOT / "solutions" / "01_cuda_basics.ipynb"
H200_L2_BYTES = 63e6  # "L2 cache  63 MB", as lesson 01 printed it on the H200 (torch's L2_cache_size / 1e6, rounded)
GPU = torch.device("cuda", 0)


class Stop(Exception):
    """Raised by a fake to end a cell at the point a test looks at."""


def cell(cell_id: str, path=NOTEBOOK) -> str:
    return next(c.source for c in nbformat.read(path, as_version=4).cells if c.get("id") == cell_id)


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


# ----- sizes beyond L2 on a GPU, in quick mode too: the plan's (tests/test_lesson01_plan.py), read by the cells -------

def quick_plan(card: str):
    return plans.plan_for("01", plans.Card.named(card), quick=True)


def test_the_vector_add_and_the_exercise_make_the_plans_arrays(monkeypatch):
    """The H200's quick run sized its arrays itself (4 MB, in L2) before the lesson grew past it; the lesson and the
    exercise now ask for the plan's size, which is four times the card's L2 (``test_lesson01_plan``)."""
    plan = quick_plan("NVIDIA H200")
    scope = {"__name__": "__main__", "device": GPU, "gpulab": gpulab, "torch": torch, "plan": plan}
    assert sizes_asked(monkeypatch, scope, cell("lesson01-38")) == [plan.vector_n]
    source = next(c.source for c in nbformat.read(SOLUTIONS, as_version=4).cells if "plan.vector_n" in c.source)
    monkeypatch.setattr(plans, "lesson", lambda number, show=True: plan)
    assert sizes_asked(monkeypatch, scope, source) == [plan.vector_n]
    assert plan.vector_n * 4 >= 4 * H200_L2_BYTES


def test_the_copy_sweep_copies_the_plans_sizes(monkeypatch, results_dir):
    plan = quick_plan("NVIDIA H200")
    scope = {"__name__": "__main__", "device": GPU, "gpulab": gpulab, "torch": torch, "plan": plan,
             "tqdm": lambda items, desc: items}
    assert sizes_asked(monkeypatch, scope, cell("lesson01-07")) == [int(plan.copy_mb[0] * 1e6) // 4]
    assert 2 * plan.copy_mb[-1] * 1e6 >= 8 * H200_L2_BYTES and plan.copy_mb[:5] == [0.25, 1, 4, 16, 64]


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
             "calls": {"x.sum()": lambda: None, "x.sum().item()": synchronising},
             "waits": {"x.sum()": False, "x.sum().item()": True}}
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
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__", "on_gpu": True, "torch": torch, "device": GPU, "work": work, "n": 256,
             "time": SimpleNamespace(perf_counter=perf_counter), "statistics": __import__("statistics"),
             "gpulab": SimpleNamespace(sync=lambda device: None), "plan": SimpleNamespace(sync_pairs=6),
             "timings": {"torch.cuda.synchronize()": 0.555e-3, "no synchronize": 0.53e-3},
             "sync_log": SimpleNamespace(add=lambda **row: logged.append(row)),
             "reference_for": lambda name: pd.DataFrame(), "display": print}
    exec(cell("lesson01-16"), scope)
    out = capsys.readouterr().out
    events_ms, host_ms = (float(x) for x in re.findall(r"([\d.]+) ms", out)[:2])
    assert events_ms == pytest.approx(1.22) and events_ms <= host_ms
    assert logged[0]["median_s"] == pytest.approx(1.22e-3)
    # The cell above says an idle GPU stamps the start marker before the work is launched: no hold here, so the events
    # include the first launch (they said they left out the time to queue the work)
    assert "leave out the time to queue" not in out and "include queueing the first matmul" in out


# ----- warm and cold copies timed the same way on a GPU ------------------------------------------------------------

def test_the_sweep_times_every_copy_alone_warm_and_cold(monkeypatch, results_dir):
    """On the H200 the warm copies were timed back to back on the host clock (launch-bound: about 10 µs per copy up to
    32 MB) and the cold ones between events (the GPU's time alone), so warm lost to cold at every size ("a warm cache
    should never lose"). Both ways are now one call of gpulab.bench, each copy alone (its timing: below)."""
    asked = []

    def bench(fn, label, cache, alone, repeats):
        asked.append((cache, alone, repeats))
        return gpulab.Measurement(label, (1e-5,) * repeats, "cuda:0", 1, cache)

    plan = SimpleNamespace(copy_mb=[0.25, 1], copy_runs=5)
    scope = {"__name__": "__main__", "device": torch.device("cpu"), "torch": torch, "pd": pd, "tqdm": lambda items, desc: items,
             "plan": plan, "gpulab": SimpleNamespace(ResultLog=gpulab.ResultLog, bench=bench)}
    exec(cell("lesson01-07"), scope)
    assert asked == [("warm", True, 5), ("cold", True, 5)] * 2
    assert list(scope["copies"]["cache"]) == ["warm", "cold"] * 2


def overlaid_reference_labels(reference: pd.DataFrame) -> list[str]:
    """The labels of the reference lines the copy plot's cell draws from ``reference``."""
    source = cell("lesson01-08")
    source = source[source.index('ref = reference_for("01_copy_bandwidth")'):source.index("plt.show()")]
    _, ax = plt.subplots()
    try:
        exec(source, {"reference_for": lambda name: reference, "plots": gpulab.plots, "ax": ax})
        return [line.get_label() for line in ax.get_lines()]
    finally:
        plt.close("all")


def test_the_copy_plot_says_the_shipped_rows_were_timed_back_to_back():
    """The H100's rows of 2026-11-22 were timed back to back, the launch included (9.7 µs for 2 MB), beside the
    learner's copies timed alone behind the hold: several-fold apart at small sizes, so their line says why."""
    assert overlaid_reference_labels(gpulab.reference("01_copy_bandwidth")) == [
        "NVIDIA H100 80GB HBM3 · copy, back to back, launch included (reference)"]
    timed_alone = pd.DataFrame(dict(device_name="NVIDIA H200", working_set_mb=[2.0, 2.0], gb_per_s=[900.0, 450.0],
                                    label=["copy, warm cache", "copy, cold cache"], timed="alone"))
    assert overlaid_reference_labels(timed_alone) == ["NVIDIA H200 · copy, warm cache (reference)",
                                                      "NVIDIA H200 · copy, cold cache (reference)"]
    assert overlaid_reference_labels(pd.DataFrame()) == []


@pytest.mark.parametrize("colab", [False, True], ids=["a workstation", "Colab"])
def test_a_warm_copy_that_lost_gets_the_comparisons_own_advice(monkeypatch, capsys, results_dir, colab):
    """The lesson said "rerun on a quieter machine" on any machine, Colab's 2 vCPUs too, where there is none: the
    advice is now the comparison's, from the machine's state over its pairs (none on Colab)."""
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    if colab:
        monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261201-060000_RC00")
    busy = gpulab.conditions.Conditions(load_avg=5.0, cpu_cores=2)

    class Watch:  # the machine's state over warm_vs_cold's pairs: busy
        def __init__(self, device):
            self.conditions = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.conditions = busy

    fake = SimpleNamespace(conditions=SimpleNamespace(Watch=Watch), Comparison=gpulab.Comparison,
                           ResultLog=gpulab.ResultLog,
                           bench=lambda fn, cache, alone, repeats: SimpleNamespace(median={"warm": 1.2, "cold": 1.0}[cache]))
    scope = define({"torch": torch, "device": torch.device("cpu"), "gpulab": fake, "plan": SimpleNamespace(cache_pairs=6)},
                   "def warm_vs_cold(mb):", "warm_vs_cold")
    frame = pd.DataFrame({"working_set_mb": [1.0, 2.0], "gb_per_s": [100.0, 200.0]}).set_index("working_set_mb")
    scope.update(warm=frame, cold=frame, plots=gpulab.plots)
    source = cell("lesson01-08")
    exec(source[source.index("gain = warm"):source.index("if not on_gpu:")], scope)
    out = capsys.readouterr().out
    assert "slower beyond the noise" in out and "quieter machine" not in out
    assert ("rerun on a quiet machine before trusting it" in out) is not colab


# ----- a GPU's queue with the H200's costs injected (gpulab.questions.observe.simulated_gpu, on a virtual clock) ------

def define(scope: dict, marker: str, *functions: str) -> dict:
    """Run only the functions ``functions`` of the cell with ``marker``, and its constants (top-level assignments of
    a value written out, such as ``hold_cycles = 2**21``)."""
    tree = ast.parse(code("01", marker))
    constant = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple)
    kept = [node for node in tree.body if getattr(node, "name", None) in functions or isinstance(node, ast.Assign)
            and all(isinstance(t, ast.Name) for t in node.targets)
            and isinstance(node.value, constant) and not any(isinstance(n, ast.Name) for n in ast.walk(node.value))]
    assert {n.name for n in kept if hasattr(n, "name")} == set(functions)
    exec(compile(ast.Module(kept, type_ignores=[]), f"<lesson 01: {marker}>", "exec"), scope)
    return scope


@pytest.fixture
def on_the_stand_in(cuda_stand_in, monkeypatch):
    """Quick mode on the CPU playing an H200: the lesson's setup cells run as they run there; returns their globals."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the setup cell sets it where tensors live on the host: put back after
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    scope = {"__name__": "__main__", "device": torch.device("cpu"), "gpulab": gpulab,
             "plan": plans.lesson("01", show=False)}
    run(scope, "01", "def crossover(verdicts)")
    scope["info"] = gpulab.device_info(scope["device"])
    scope["displayed"] = []
    scope["display"] = scope["displayed"].append
    yield scope
    plt.close("all")


# Costs of the H200 of 2026-11-28, from what lesson 01 wrote there (quick mode; tests/data/lesson01): a 0.5 MB copy
# read 26.9 µs warm on an idle GPU and 3.9 µs cold behind the flush, so Python launched it about 23 µs before the GPU
# ran it; twenty 256×256 matmuls took 0.581 ms to queue. The flush writes 256 MiB at about 4.2 TB/s (the sweep's
# largest cold copy), and a small add costs 6 µs a call (the launch floor it printed).
H200_RUN = ROOT / "tests" / "data" / "lesson01"
H200_COPIES = pd.read_csv(H200_RUN / "h200_2026-11-28_quick_01_copy_bandwidth.csv").set_index(["working_set_mb", "cache"])
COPY_LAUNCH_S = H200_COPIES.loc[(0.5, "warm"), "median_s"] - H200_COPIES.loc[(0.5, "cold"), "median_s"]
COPY_S = {"warm": 3.0e-6,  # the GPU's own time for a 0.25 MB copy: from L2 (assumed, below the cold one) ...
          "cold": H200_COPIES.loc[(0.5, "cold"), "median_s"]}  # ... and from device memory, as the H200 timed it
FLUSH_S = 2**28 / 4.2e12
H200_SYNC = pd.read_csv(H200_RUN / "h200_2026-11-28_quick_01_sync.csv").set_index("label")
MATMUL_LAUNCH_S = H200_SYNC.loc["no synchronize", "median_s"] / 20
FP32_FLOPS = 50e12  # an H200's fp32 matmuls without TF32 (its ceiling: 51.9 TFLOP/s, lesson 09's H200 rows)
SMALL_OP_S = 6e-6


class OnTheQueue:
    """A buffer on the simulated GPU: ``copy_`` and ``zero_`` cost Python a launch on the host clock, then queue the
    GPU's time; ``l2`` remembers what the last operation left in L2 (a copy: its source and destination)."""

    def __init__(self, gpu, l2: dict):
        self.gpu, self.l2 = gpu, l2

    def copy_(self, src):
        time.sleep(COPY_LAUNCH_S)
        self.gpu.launch(COPY_S["warm" if self.l2.get("held") == (src, self) else "cold"])
        self.l2["held"] = (src, self)

    def zero_(self):
        time.sleep(COPY_LAUNCH_S)
        self.gpu.launch(FLUSH_S)
        self.l2["held"] = None


def test_warm_and_cold_copies_are_both_timed_behind_a_busy_gpu_so_neither_times_its_launch(cuda_stand_in, monkeypatch):
    """On the H200 the warm copies were timed on an idle GPU (their start event stamped before Python had launched the
    copy) and the cold ones behind the flush: a 0.5 MB copy read 26.9 µs warm and 3.9 µs cold. With the launch
    injected here, gpulab.bench(alone=True) must read the GPU's own time for the copy each way, warm below cold; back to
    back, a warm copy reads its launch, as the H200's did."""
    from gpulab import timing

    with virtual_clock(), simulated_gpu() as gpu:
        l2 = {}
        flush, src, dst = OnTheQueue(gpu, l2), OnTheQueue(gpu, l2), OnTheQueue(gpu, l2)
        monkeypatch.setattr(timing, "_cache_flush", lambda device: flush.zero_)
        timed = {cache: gpulab.bench(lambda: dst.copy_(src), cache=cache, alone=True, repeats=5)
                 for cache in ("warm", "cold")}
        back_to_back = gpulab.bench(lambda: dst.copy_(src), repeats=5)
    for cache, m in timed.items():
        assert m.cache == cache and m.times == pytest.approx([COPY_S[cache]] * 5, rel=1e-6), f"{cache}: {m.times}"
    assert back_to_back.median == pytest.approx(COPY_LAUNCH_S + COPY_S["warm"], rel=1e-6)


def test_the_lesson_leaves_the_hold_to_the_measuring_page_and_links_there():
    """Issue 39: cell 6 explained an untimed torch.cuda._sleep ten cells before events are taught. The lesson now
    neither explains nor calls the hold: it says what each way measures and links to the page that explains it."""
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    assert not any("_sleep" in c.source for c in cells)
    text = cell("lesson01-06")
    assert "how_the_course_measures.ipynb#timing" in text and "alone=True" in text
    assert "*warm*: right after the same copy" in text and "*cold*: right after a write of twice the L2" in text


# ----- the vector add: below the ceiling, beside the copy -----------------------------------------------------------------

H200_PEAK_GBS = 4814.0  # device memory's theoretical bandwidth, as lesson 01 printed it on the H200 (6016-bit, 3.2 GHz)
H200_GBS = pd.read_csv(H200_RUN / "h200_2026-11-28_quick_01_vector_add.csv").set_index("label")["gb_per_s"].to_dict()


VECTOR_ADD = ('add_log = gpulab.ResultLog("01_vector_add")', "ax = plots.bars(bandwidth")  # measured, then shown


def h200_timings(scope: dict):
    """``gpulab.bench`` and ``gpulab.compare`` answering with the H200's bandwidths (for the arrays the cell made)."""
    def seconds(label):
        moved = (2 if label == "copy" else 3) * scope["x"].nbytes
        return moved / (H200_GBS[label] * 1e9)

    def bench(fn, label, min_time):
        return gpulab.Measurement(label, (seconds(label),) * 5, "cuda:0", 2, "warm")

    def compare(baseline, candidate, labels, **options):
        copy_s, add_s = seconds(labels[0]), seconds(labels[1])
        return gpulab.Comparison.of([copy_s * (1 + j) for j in (-0.002, 0, 0.002, -0.001, 0.001)], [add_s] * 5,
                                    labels=labels)

    return bench, compare


def test_the_vector_add_shows_no_share_above_100_percent_and_calls_only_device_memory_the_ceiling(
        on_the_stand_in, monkeypatch, capsys, results_dir):
    """The H200 printed 'copy (the ceiling)' and 'PyTorch x + y … 104% of the copy bandwidth' in one table. The copy is
    a yardstick that an add (two reads per write) can pass; the ceiling is device memory's theoretical bandwidth."""
    scope = define(on_the_stand_in, "peak_gbs = None", "of_ceiling")  # section 1's share of the ceiling
    monkeypatch.setattr(torch, "randn", lambda n, device=None: torch.zeros(min(n, 4096)))
    bench, compare = h200_timings(scope)
    scope.update(peak_gbs=H200_PEAK_GBS, have_triton=True, interpreted=False, triton_add=torch.add, cuda_add=torch.add,
                 gpulab=SimpleNamespace(**{**vars(gpulab), "bench": bench, "compare": compare}))
    run(scope, "01", *VECTOR_ADD)
    out = capsys.readouterr().out
    shares = [float(p) for p in re.findall(r"(\d+(?:\.\d+)?)\s?%", out)]
    assert shares and max(shares) <= 100, out
    table = {line.split()[0]: line for line in out.splitlines() if line.startswith(("copy ", "PyTorch", "Triton", "CUDA"))}
    assert "ceiling" not in table["copy"] and "the yardstick" in table["copy"] and "(the ceiling)" not in out
    assert "89%" in table["PyTorch"] and "1.04×" in table["PyTorch"] and "86%" in table["copy"]
    assert "0.83×" in table["CUDA"] and "71%" in table["CUDA"]
    assert "Faster than the copy (PyTorch x + y, Triton" in out and "stays above both" in out


def test_an_add_less_than_two_percent_faster_than_the_copy_is_not_called_faster(on_the_stand_in, monkeypatch, capsys,
                                                                                results_dir):
    """gpulab.compare calls a difference beyond the noise only past 2 %: an add whose pairs put it at 1.002–1.008× the
    copy's bandwidth was printed "Faster than the copy (…, beyond the noise)" beside that interval."""
    scope = define(on_the_stand_in, "peak_gbs = None", "of_ceiling")
    monkeypatch.setattr(torch, "randn", lambda n, device=None: torch.zeros(min(n, 4096)))
    bench, _ = h200_timings(scope)

    def compare(baseline, candidate, labels, **options):  # the add moves its bytes at 1.005× the copy's speed
        return gpulab.Comparison.of([1 + j for j in (-0.003, 0, 0.003, -0.001, 0.001)], [1.5 / 1.005] * 5,
                                    labels=labels)

    scope.update(peak_gbs=H200_PEAK_GBS, have_triton=False, cuda_add=None,
                 gpulab=SimpleNamespace(**{**vars(gpulab), "bench": bench, "compare": compare}))
    run(scope, "01", *VECTOR_ADD)
    out = capsys.readouterr().out
    assert "1.00×" in out and "Faster than the copy" not in out, out


def test_a_bandwidth_becomes_a_share_of_the_ceiling_in_one_place_that_never_says_more_than_100_percent():
    """The H200's largest cold copy (4188 GB/s) was printed as 87 % of the theoretical 4814 GB/s in section 1 and in
    the summary, each dividing by the ceiling itself, where only the vector add's table refused a share above 100 %."""
    divisions = [line.strip() for source in (c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
                                             if c.cell_type == "code")
                 for line in source.splitlines() if re.search(r"/ peak_gbs\b", line)]
    assert divisions == ['return f"{gbs / peak_gbs:.0%}" if gbs <= peak_gbs else "above it: impossible, no share"']
    scope = define({}, "peak_gbs = None", "of_ceiling")
    assert scope["of_ceiling"](4188) == "-"  # no ceiling reported: no share
    scope["peak_gbs"] = H200_PEAK_GBS
    assert scope["of_ceiling"](4188) == "87%" and "%" not in scope["of_ceiling"](1.01 * H200_PEAK_GBS)


def test_without_a_reported_memory_clock_no_ceiling_is_shown_and_the_copy_stays_a_ratio(
        on_the_stand_in, monkeypatch, capsys, results_dir):
    scope = define(on_the_stand_in, "peak_gbs = None", "of_ceiling")  # section 1's share of the ceiling
    monkeypatch.setattr(torch, "randn", lambda n, device=None: torch.zeros(min(n, 4096)))
    bench, compare = h200_timings(scope)
    scope.update(peak_gbs=None, have_triton=False, cuda_add=None,
                 gpulab=SimpleNamespace(**{**vars(gpulab), "bench": bench, "compare": compare}))
    run(scope, "01", *VECTOR_ADD)
    out = capsys.readouterr().out
    assert not re.search(r"\d\s?%", out.split("Reference")[0]), out
    assert "1.04×" in out and "no ceiling is shown" in out


# ----- which calls wait: measured with the queue full, beside the sync-debug mode's warnings ------------------------------

class QueuedTorch(TorchFunctionMode):
    """torch's calls as an H200 runs them, on the simulated GPU: a matmul or a sum costs Python its launch and queues
    the GPU's time (the matmul's result is not computed: nothing reads it); ``.item()``, ``.cpu()``, printing and
    ``nonzero`` wait for the queue first, as torch's do (a copy to the host, a value, a shape that depends on the
    values), and warn while the sync-debug mode is on; printing a thousand numbers also costs 24 ms of its own."""

    def __init__(self, gpu):
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "matmul":
            a = args[0]
            time.sleep(MATMUL_LAUNCH_S)
            self.gpu.launch(2 * a.shape[0] * a.shape[1] * args[1].shape[1] / FP32_FLOPS)
            return a
        if name == "sum":
            time.sleep(SMALL_OP_S)
            self.gpu.launch(SMALL_OP_S / 3)
        if name in ("item", "cpu", "__repr__", "nonzero"):
            if torch.cuda.get_sync_debug_mode() in (1, "warn"):
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
            self.gpu.wait()
            time.sleep(24e-3 if name == "__repr__" else SMALL_OP_S)
        return func(*args, **kwargs)


def test_the_waits_are_measured_with_work_left_in_the_queue_and_agree_with_the_sync_debug_warnings(
        on_the_stand_in, monkeypatch, capsys, results_dir):
    """On the H200 (quick mode) twenty 256×256 matmuls ran as fast as Python queued them, so nothing was left to wait
    for: `x.cpu()` and `torch.nonzero(x)` were said to 'return at once', `print(x)` to wait only by its own 24 ms, while
    the sync-debug mode warned on all three. With the H200's costs injected, every call that synchronises in torch
    must be measured as waiting, the sum as not, and the two cells must say the same."""
    scope = on_the_stand_in
    with virtual_clock(), simulated_gpu() as gpu, QueuedTorch(gpu):
        run(scope, "01", "def wall_seconds(synchronize)", "def blocked_ms(call", 'set_sync_debug_mode("warn")')
    out = capsys.readouterr().out
    verdicts = dict(re.findall(r"^(\S+(?: \S+)?)\s+waited .*  (waits for the GPU|returns at once|unclear.*)$", out, re.M))
    assert verdicts == {"x.sum()": "returns at once", "x.sum().item()": "waits for the GPU",
                        "x.cpu()": "waits for the GPU", "print(x)": "waits for the GPU",
                        "torch.nonzero(x)": "waits for the GPU"}, out
    assert scope["n"] == 2048 and scope["waits"] == {"x.sum()": False, "x.sum().item()": True, "x.cpu()": True,
                                                     "print(x)": True, "torch.nonzero(x)": True}
    assert "agree on every call measured (5 of 5)" in out
    assert re.search(r"x\.cpu\(\)\s+warned: synchronising call\s+measured above: waited", out)


def test_with_an_empty_queue_no_call_is_said_to_wait_or_not(on_the_stand_in, capsys, results_dir):
    """On the stand-in (a CPU: work is done when the call returns) nothing is queued: no verdict is given."""
    scope = on_the_stand_in
    scope.update(timings={"torch.cuda.synchronize()": 1e-3, "no synchronize": 1e-3}, work=lambda: None)
    run(scope, "01", "def blocked_ms(call")
    out = capsys.readouterr().out
    assert "Nothing was left in the queue" in out and scope["waits"] == {}


# ----- the whole lesson on the CUDA stand-in: every GPU branch's Python, at a CPU's sizes ---------------------------------

FACTORIES = {"randn", "rand", "empty", "zeros", "ones"}


class Shrunk(TorchFunctionMode):
    """GPU-sized tensors at a CPU's size: a factory call (``torch.randn(n, n)``, ``torch.empty(nbytes)``, ...) for more
    than ``limit`` elements, every side at least ``side`` long (a model's small layers are left alone), makes a
    smaller tensor: every side shrunk by one factor, to ``limit × (asked / limit)^⅛`` elements, so that larger sizes
    asked stay larger. The lesson's code reads the sizes it got (``nbytes``), as it does on a GPU; ``asked`` keeps
    the sizes asked for, so that a test can still check them. (Triton's interpreter takes about 8 ms per block of 1024
    elements here: the vector add's 2²⁶ elements become 14 blocks.)"""

    def __init__(self, limit: int = 2**12, side: int = 512):
        super().__init__()
        self.limit, self.side, self.asked = limit, side, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in FACTORIES and args:
            sides = tuple(args[0]) if isinstance(args[0], (tuple, list, torch.Size)) else args
            if all(isinstance(s, int) for s in sides):
                self.asked.append(sides)
                args = self.shrunk(sides)
        return func(*args, **kwargs)

    def shrunk(self, sides: tuple) -> tuple:
        elements = math.prod(sides)
        if elements <= self.limit or min(sides) < self.side:
            return sides
        factor = (self.limit * (elements / self.limit) ** 0.125 / elements) ** (1 / len(sides))
        return tuple(max(1, round(s * factor)) for s in sides)


def child_here(args, capture_output=True, text=True, check=True, env=None, **kwargs):
    """``subprocess.run([python, "-c", program, *argv])`` run in this process, on the stand-in: the program's Python
    runs as it would in the child; what CUDA_LAUNCH_BLOCKING changes in a real CUDA context is for a GPU to show."""
    executable, flag, program, *argv = args
    assert executable == sys.executable and flag == "-c" and capture_output and text
    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["-c", *argv]), contextlib.redirect_stdout(out):
        exec(compile(program, "<child>", "exec"), {"__name__": "__main__"})
    return subprocess.CompletedProcess(args, 0, out.getvalue(), "")


@pytest.fixture
def a_cuda_c_build(monkeypatch):
    """nvcc and ninja are found, and ``load_inline`` returns the module it would build (``vector_add`` as x + y): the
    build itself (nvcc, the kernel) is GPU-only."""
    from torch.utils import cpp_extension

    nvcc = "/usr/local/cuda/bin/nvcc"
    which, exists = shutil.which, os.path.exists
    built = []

    def load_inline(name, cpp_sources, cuda_sources, functions, extra_cuda_cflags=()):
        built.append(name)
        assert "__global__ void add_kernel" in cuda_sources and functions == ["vector_add"]
        return SimpleNamespace(vector_add=lambda x, y: x + y)

    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: nvcc if cmd == "nvcc" else which(cmd, *a, **k))
    monkeypatch.setattr(os.path, "exists", lambda path: path == nvcc or exists(path))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    return built


def test_the_whole_lesson_runs_its_gpu_branches_on_the_stand_in(on_the_stand_in, a_cuda_c_build, monkeypatch,
                                                                capsys, results_dir):
    """Every code cell, in order, on the CPU playing an H200 in quick mode (the audit of 2026-11-28 listed cells 5, 10,
    11, 14, 15, 19, 24, 36, 39 and 41 as run by no test): its sizes for a GPU asked, made at a CPU's size; the CUDA
    C build and the CUDA_LAUNCH_BLOCKING children run their Python here, their GPU work is the GPU's to show."""
    scope = on_the_stand_in
    monkeypatch.setattr(subprocess, "run", child_here)
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    with Shrunk() as shrunk:
        for index, source in enumerate(cells[1:], start=1):  # after the setup cell (gpulab is installed here)
            with mock.patch.object(torch.cuda, "is_available", lambda: True) if "load_inline" in source else \
                    contextlib.nullcontext():  # the CUDA C build asks for a CUDA runtime (the stand-in has none)
                exec(compile(source, f"<lesson 01, code cell {index}>", "exec"), scope)
            if "plans.lesson(" in source:  # the plan's timing knobs: the fewest pairs, a short time (a loaded CI machine)
                scope["plan"] = dataclasses.replace(scope["plan"], sizes={
                    **scope["plan"].sizes, "min_time": 0.01, "compare_min_time": 0.01, "compare_pairs": 5})
    out = capsys.readouterr().out
    plan = scope["plan"]
    assert scope["on_gpu"] and plan.card.name == "NVIDIA H200" and "Lesson 01 · CUDA basics: planned for NVIDIA H200" in out
    assert "132 SMs × 2048 resident threads" in out and "No GPU here" not in out
    assert "device memory's theoretical bandwidth: 4814 GB/s (6016-bit bus, 3.20 GHz" in out  # the H200's, as it printed
    assert max(float(p) for p in re.findall(r"(\d+(?:\.\d+)?)\s?%", out)) <= 100, out
    assert 2 * plan.copy_mb[-1] * 1e6 >= 8 * 60 * 2**20 and (2**28,) in shrunk.asked  # past 8× the L2; the flush asked
    assert set(scope["copies"]["cache"]) == {"warm", "cold"}
    assert "GPU, with copies there and back" in set(scope["tradeoff"]["way"])
    assert (plan.vector_n,) in shrunk.asked and plan.vector_n * 4 >= 4 * 60 * 2**20  # the vector add's arrays, asked
    assert "Queueing a tiny kernel" in out and "CUDA_LAUNCH_BLOCKING=1" in out  # the children's times, parsed
    assert a_cuda_c_build == ["gpulab_vector_add"] and "The CUDA C kernel matches PyTorch's x + y" in out
    assert set(scope["vs_copy"]) == {"PyTorch x + y", "CUDA C"}  # Triton's interpreter checks the kernel, is not timed
    assert set(scope["split"]) == set(plan.widths) and "transferring the losses once" in out
    assert "vector add, bandwidth over the copy's" in out


# ----- exercise 1's check on the course's GPU (the stand-in): the learner's timer around work that runs long ----------

def test_q1_times_the_learners_timer_on_the_course_gpu_too(cuda_stand_in):
    """The third round of q1's check runs only where the course has a GPU: here the stand-in's (its matmuls shrunk)."""
    time_ms = shown_solution(q1, "time_ms", torch=torch, time=time, gpulab=gpulab)
    with Shrunk():
        q1.check(time_ms)
    assert q1.last.status == CORRECT and "ms of work on cpu" in q1.last.message, q1.last.message


def test_q1_on_the_course_gpu_rejects_a_clock_read_before_the_work_ran(cuda_stand_in):
    """A timer right on the CPU and on the simulated GPU, that reads 1 µs on the course's GPU (as one that stops the
    clock when the work is queued does on a real one)."""
    right = shown_solution(q1, "time_ms", torch=torch, time=time, gpulab=gpulab)
    rounds = []

    def early_on_the_third_round(fn, device):
        rounds.append(device)
        if len(rounds) < 3:
            return right(fn, device)
        fn()
        return 1e-3

    with Shrunk():
        q1.check(early_on_the_third_round)
    assert [device.type for device in rounds] == ["cpu", "cuda", "cpu"]  # the CPU, the simulated GPU, the stand-in
    assert q1.last.status == WRONG and "on cpu your timer says 0.001 ms" in q1.last.message


def test_the_checks_observer_passes_a_synchronize_on_to_the_course_gpu(cuda_stand_in, monkeypatch):
    """``observe()`` records each explicit wait and lets it through where there is a GPU to wait for: the course's
    (gpulab.on_gpu), here the stand-in's, whose synchronize a check's timing depends on as a real one's does."""
    from gpulab.questions.observe import observe

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    with observe() as seen:
        torch.cuda.synchronize()
    assert seen.syncs == ["torch.cuda.synchronize()"] and waited == [None]


def test_the_checks_observer_passes_a_synchronize_on_to_a_real_gpu_when_the_course_runs_on_the_cpu(monkeypatch):
    """A GPU machine where ``$GPULAB_DEVICE`` is the CPU: ``gpu_run`` still runs a learner's code on the GPU, and the
    learner's ``torch.cuda.synchronize()`` must wait for it there (the observer asked only the course's device, so
    the wait was recorded and dropped: a correct timer or a non-blocking copy then read the GPU's work early)."""
    from gpulab.questions.observe import observe

    waited = []
    monkeypatch.setenv("GPULAB_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the machine's CUDA runtime works
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    assert not gpulab.on_gpu()
    with observe() as seen:
        torch.cuda.synchronize(GPU)
    assert seen.syncs == ["torch.cuda.synchronize()"] and waited == [GPU]
