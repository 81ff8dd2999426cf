"""Lesson 01's sync in a loop shows what it teaches, or says from its own numbers why not.

The H200 (2026-11-28, quick mode, widths 64 and 128) printed "within noise" at both widths and explained it as "each
GPU step outlasts the wait", for steps the GPU runs in a fraction of the time Python takes to queue them: a GPU that
idles anyway loses little to a sync. The lesson now splits each width's step into Python's time to queue it and the
GPU's time to run it (gpulab.timing.queue_and_run), and reads its verdict from them. These tests inject the timings:
the explanation on the H200's own numbers, and the whole cell on a simulated GPU (a virtual clock: nothing here depends
on this machine's speed)."""

import math
import time
import types

import nbformat
import pandas as pd
import pytest
import torch
from torch.overrides import TorchFunctionMode

import gpulab
from gpulab import Comparison, plots
from gpulab.questions.observe import simulated_gpu
from gpulab.questions.stand_in import virtual_clock
from gpulab.timing import QueueAndRun, queue_and_run

from .conftest import ROOT
from .test_mfu_lessons_03_04 import code

NOTEBOOK = ROOT / "notebooks" / "01_cuda_basics.ipynb"
H200_LOOPS = ROOT / "tests" / "data" / "lesson01" / "h200_2026-11-28_quick_01_sync_in_loop.csv"


def lesson_functions() -> dict:
    """The cell that defines the loops and the explanation, run with its imports."""
    scope = {"__name__": "__main__", "torch": torch, "plots": plots, "device": torch.device("cpu"),
             "plan": types.SimpleNamespace(steps=4)}
    exec(compile(code("01", "def why_sync_costs("), "<lesson 01: the loops>", "exec"), scope)
    return scope


def comparison(ratios) -> Comparison:
    """Five interleaved pairs whose ratios (sync every step over transfer once) are ``ratios``."""
    return Comparison.of(list(ratios), [1.0] * len(ratios), labels=("train_sync_every_step", "train_transfer_once"))


# ----- the explanation, on injected timings --------------------------------------------------------------------------

def h200_split() -> tuple[dict, dict]:
    """The H200's quick run: Python's time per step is what the transfer-once loop took a step there (0.93 and 1.01
    ms, both launch-bound); the GPU's time per step is injected (the steps' 25 kernels at about 2 µs each: 50 µs, and
    60 µs at width 128); the pairs' ratios give the medians and intervals the H200 printed (1.04×, 0.87–1.24×; 1.09×,
    0.89–1.54×)."""
    loops = pd.read_csv(H200_LOOPS).pivot_table(index="width", columns="label", values="ms_per_step")
    queue = loops["train_transfer_once"] / 1e3
    split = {64: QueueAndRun(queue[64], 50e-6), 128: QueueAndRun(queue[128], 60e-6)}
    return split, {64: comparison([1.04, 0.87, 1.24, 1.0, 1.1]), 128: comparison([1.09, 0.89, 1.54, 1.0, 1.2])}


def test_on_the_h200s_numbers_the_lesson_says_the_steps_were_launch_bound_not_that_the_gpu_outlasted_the_wait():
    scope = lesson_functions()
    split, comparisons = h200_split()
    assert {w: scope["bound"](s.queue_s, s.run_s) for w, s in split.items()} == {64: "launch-bound",
                                                                                 128: "launch-bound"}
    said = scope["why_sync_costs"](split, comparisons)
    assert "every width was launch-bound" in said and "waited for Python whether or not" in said
    assert "0.054× at width 64, 0.059× at width 128" in said  # the GPU's time over Python's, read out
    assert "outlasts" not in said


def test_where_a_sync_cost_most_the_lesson_names_the_width_its_times_and_the_most_it_could_cost():
    scope = lesson_functions()
    split = {256: QueueAndRun(300e-6, 40e-6), 512: QueueAndRun(300e-6, 290e-6), 1024: QueueAndRun(300e-6, 1.2e-3)}
    comparisons = {256: comparison([1.05] * 5), 512: comparison([1.35, 1.3, 1.4, 1.33, 1.36]),
                   1024: comparison([1.1] * 5)}
    said = scope["why_sync_costs"](split, comparisons)
    assert said.startswith("Syncing every step cost most at width 512 (balanced: Python 300 µs, the GPU 290 µs a step)")
    assert "at most 1.97×" in said  # (300 + 290) / 300


def test_a_balanced_width_within_noise_is_said_as_such():
    scope = lesson_functions()
    split = {512: QueueAndRun(300e-6, 60e-6), 1024: QueueAndRun(300e-6, 280e-6)}
    said = scope["why_sync_costs"](split, {512: comparison([1.0, 0.9, 1.1, 1.05, 0.95]),
                                           1024: comparison([1.2, 0.95, 1.5, 1.1, 1.0])})
    assert "not even at width 1024, where Python (300 µs) and the GPU (280 µs) took about as long" in said
    assert "quieter machine" not in said and said.endswith("×)).")  # quiet machine, no advice: none given


@pytest.mark.parametrize("colab", [False, True], ids=["a workstation", "Colab"])
def test_a_balanced_width_within_noise_gets_the_comparisons_own_advice(monkeypatch, colab):
    """"Measure more pairs on a quieter machine" was said on Colab too, whose 2 vCPUs are all there is."""
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    if colab:
        monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261201-060000_RC00")
    busy = gpulab.conditions.Conditions(load_avg=5.0, cpu_cores=2)
    noisy = Comparison.of([1.2, 0.95, 1.5, 1.1, 1.0], [1.0] * 5, labels=("train_sync_every_step", "train_transfer_once"),
                          conditions=busy)
    said = lesson_functions()["why_sync_costs"]({1024: QueueAndRun(300e-6, 280e-6)}, {1024: noisy})
    assert "quieter machine" not in said
    assert said.endswith(": rerun on a quiet machine before trusting it." if not colab else "×)).")


def test_widths_that_miss_the_balance_are_said_with_their_ratios():
    scope = lesson_functions()
    split = {256: QueueAndRun(300e-6, 60e-6), 2048: QueueAndRun(300e-6, 3e-3)}
    said = scope["why_sync_costs"](split, {w: comparison([1.0, 0.99, 1.01, 1.0, 1.0]) for w in split})
    assert "no width had Python and the GPU take about as long" in said and "10× at width 2048" in said


# ----- queue_and_run: Python's time and the GPU's, each per call ------------------------------------------------------

def test_queue_and_run_splits_a_call_on_a_simulated_gpu(cuda_stand_in):
    """A call that costs Python 30 µs and queues 200 µs of GPU work: the host clock without waiting reads the first,
    the events behind the hold the second, whichever is longer."""
    with virtual_clock(), simulated_gpu() as gpu:
        def call():
            time.sleep(30e-6)
            gpu.launch(200e-6)

        split = queue_and_run(call, calls=10)
    assert split.queue_s == pytest.approx(30e-6) and split.run_s == pytest.approx(200e-6)


def test_queue_and_run_on_a_cpu_times_the_call_once_for_both():
    split = queue_and_run(lambda: time.sleep(1e-3), calls=3, device="cpu")
    assert split.queue_s == split.run_s >= 1e-3


# ----- the whole cell on a simulated GPU: the loops of the lesson, a step's costs injected ----------------------------

# Python's and the GPU's time for one training step at each width (seconds): launch-bound, balanced, GPU-bound
STEP = {64: (1e-3, 50e-6), 128: (500e-6, 500e-6), 256: (200e-6, 2e-3)}


class WaitsOnTheGpu(TorchFunctionMode):
    """``Tensor.cpu`` waits for the simulated GPU's queue, as a copy to the host does."""

    def __init__(self, gpu):
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "cpu":
            self.gpu.wait()
        return func(*args, **(kwargs or {}))


def test_the_loops_cell_measures_each_width_and_explains_the_cost_from_its_own_numbers(cuda_stand_in, monkeypatch, capsys,
                                                                                       results_dir):
    """Each step costs Python its time (a sleep on the virtual clock), then queues the GPU's (one kernel): a sync every
    step makes them take turns, (Python + GPU) against the longer of the two. The balanced width costs most."""
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *args, **kwargs: None)
    scope = lesson_functions()
    with virtual_clock(), simulated_gpu() as gpu, WaitsOnTheGpu(gpu):
        def train_step(model, optimizer, xb, yb):
            python_s, gpu_s = STEP[xb.shape[1]]
            time.sleep(python_s)
            gpu.launch(gpu_s)
            return torch.zeros(())

        scope.update(gpulab=gpulab, queue_and_run=queue_and_run, plt=__import__("matplotlib.pyplot").pyplot,
                     tqdm=lambda items, desc: items, statistics=__import__("statistics"), on_gpu=True,
                     comparing=dict(min_time=0.001, pairs=5), reference_for=lambda name: pd.DataFrame(),
                     plan=types.SimpleNamespace(widths=list(STEP), batch_size=4, steps=10), train_step=train_step)
        exec(compile(code("01", 'loop_log = gpulab.ResultLog("01_sync_in_loop")'), "<lesson 01: loops>", "exec"), scope)
    out = capsys.readouterr().out
    for width, (python_s, gpu_s) in STEP.items():
        split = scope["split"][width]
        assert split.queue_s == pytest.approx(python_s) and split.run_s == pytest.approx(gpu_s)
        steps = scope["plan"].steps  # overlapped, the loop ends with the last step's GPU work (or the first's Python)
        once, synced = max(steps * python_s + gpu_s, python_s + steps * gpu_s), steps * (python_s + gpu_s)
        assert scope["loop_cmp"][width].speedup == pytest.approx(synced / once, rel=0.01)
    assert [line.split()[5] for line in out.splitlines() if line.split()[:1] in (["64"], ["128"], ["256"])] == [
        "launch-bound", "balanced", "GPU-bound"]
    assert "Syncing every step cost most at width 128 (balanced: Python 500 µs, the GPU 500 µs a step)" in out
    rows = pd.read_csv(results_dir / "01_sync_in_loop.csv")
    assert set(rows["label"]) == {"train_sync_every_step", "train_transfer_once"} and math.isclose(
        rows.query("width == 128 and label == 'train_sync_every_step'")["ms_per_step"].iloc[0], 1.0, rel_tol=0.01)


def test_the_h200_data_is_the_runs_own():
    rows = pd.read_csv(H200_LOOPS)
    assert set(rows["width"]) == {64, 128} and set(rows["device_name"]) == {"NVIDIA H200"}
    assert nbformat.read(NOTEBOOK, as_version=4)  # the lesson these tests read
