"""Lesson 02's "GPU busy" per DataLoader configuration is that configuration's own: a short profile of its own steps
(gpulab.busy.measure), never NVML's mean over its short epochs, and each row carries the GPU's state over its own
measurement. The lesson's cells run here on the CPU, with a fake profiler and a fake GPU watch where a GPU's answer is
needed, and the real H200 run's rows as fixtures; nothing is asserted on a real timing."""

import ast
import math
import types
from collections import Counter
from pathlib import Path

import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

import gpulab
from gpulab import Comparison, busy, conditions, plots
from gpulab.conditions import Conditions
from gpulab.timing import Measurement

from .conftest import ROOT
from .test_mfu_lessons_03_04 import code
from .test_notebooks_00_04_gpu_path import function_source

DATA = Path(__file__).parent / "data" / "lesson02"
PLAN, SWEEP = 'plans.lesson("02")', 'ResultLog("02_dataloader")'  # the plan's cell; the loader sweep's
CPU = torch.device("cpu")


@pytest.fixture
def lesson_env(monkeypatch, results_dir):
    """Quick mode, results in a temporary folder, no figure shown; gpulab.bench answers 5 ms without timing."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    monkeypatch.setattr(gpulab, "bench", lambda fn, *args, label=None, **kwargs: Measurement(label, (0.005,) * 3,
                                                                                             "cpu", 1))
    yield results_dir
    plt.close("all")


def run(scope: dict, *markers: str) -> dict:
    """Run lesson 02's code cells that contain ``markers``, in order, in ``scope`` (the notebook's globals)."""
    scope.setdefault("__name__", "__main__")
    for marker in markers:
        exec(compile(code("02", marker), f"<lesson 02: {marker}>", "exec"), scope)
    return scope


def assigned(marker: str, name: str, scope: dict) -> None:
    """Run the top-level assignment of ``name`` in the cell containing ``marker`` (if the cell has one)."""
    for node in ast.parse(code("02", marker)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            exec(compile(ast.Module([node], []), f"<lesson 02: {name}>", "exec"), scope)


def plot_loader():
    """The lesson's plot_loader, defined as its cell defines it."""
    scope = {"plots": plots, "plt": plt, "pd": pd}
    assigned(SWEEP, "BUSY_NAMES", scope)
    exec(compile(function_source("02", "plot_loader"), "<lesson 02: plot_loader>", "exec"), scope)
    return scope["plot_loader"]


def h200_sweep() -> pd.DataFrame:
    """The loader sweep lesson 02 logged on the H200 (quick mode, 2026-11-27, eight other lessons on the same GPU)."""
    return pd.read_csv(DATA / "h200_quick_02_dataloader.csv")


def test_the_h200_nvml_epoch_means_are_not_drawn_as_each_configurations_busy_share(capsys):
    frame = h200_sweep()
    # What the H200 run printed: 0 workers trained 23× slower than the tuned loader, and NVML's means over their
    # epochs differ by under 3 points. They belong to NVML's averaging window, not to the configurations.
    assert frame["samples_per_s"].max() / frame["samples_per_s"].min() > 20
    assert frame["gpu_util_pct"].max() - frame["gpu_util_pct"].min() < 3
    fig = plot_loader()(frame, "NVIDIA H200")
    assert len(fig.axes) == 1 and "throughput" in fig.axes[0].get_title()
    assert "cannot be told apart from one configuration to the next, so it is not drawn" in capsys.readouterr().out


def busy_frame() -> pd.DataFrame:
    return pd.DataFrame({"config": ["0 workers", "2 workers", "tuned"], "startup_s": [0.4, 0.7, 0.3],
                         "samples_per_s": [25.0, 127.0, 585.0], "kernel_busy": [0.05, 0.2, 0.8],
                         "nvml_util": [1.0, 1.0, 1.0], "sm_activity": [math.nan] * 3,
                         "ceiling_samples_per_s": [600.0] * 3, "ceiling_kernel_busy": [0.9] * 3})


def test_the_busy_panel_draws_each_configurations_profiled_kernel_share_with_nvml_beside_it():
    fig = plot_loader()(busy_frame(), "a GPU")
    throughput, shares = fig.axes[:2]
    assert "GPU busy per configuration (kernel time over its profiled steps)" in shares.get_title()
    kernels, nvml = shares.containers  # SM activity was not measured (all NaN): no bars for it
    assert [bar.get_width() for bar in kernels] == pytest.approx([5.0, 20.0, 80.0, 90.0])  # with the ceiling's
    assert [bar.get_width() for bar in nvml][:3] == pytest.approx([100.0] * 3)
    legend = [t.get_text() for t in shares.get_legend().get_texts()]
    assert legend == ["GPU busy: a kernel ran (its profiled steps)", "NVML utilisation: any kernel, even on one SM"]
    assert [t.get_text() for t in shares.get_yticklabels()] == ["0 workers", "2 workers", "tuned",
                                                                "(data already on the device)"]


def test_the_busy_panel_says_how_long_nvml_read_the_steps_from_the_value_used():
    """busy.measure reads NVML over plan.nvml_seconds (0.2 s in quick mode), which the title said was "about a
    second"; reference rows, whose period the lesson does not know, get no number."""
    assert "over 0.2 s of its steps after them" in plot_loader()(busy_frame(), "a GPU", 0.2).axes[1].get_title()
    assert "over its steps after them" in plot_loader()(busy_frame(), "a GPU").axes[1].get_title()
    sweep = code("02", "busy.measure(lambda: train_on(next(batches))")
    assert "nvml_seconds=plan.nvml_seconds" in sweep and "about a second" not in function_source("02", "plot_loader")
    plt.close("all")


class FakeGpu:
    """busy.measure and conditions.Watch as on a GPU: each Watch a span at its own SM clock (1000, 1001, ... MHz),
    each measure a profile of the step it is given, whose busy share is ``shares[label]``; which loader served the
    step, and whether a Watch was open meanwhile, is recorded."""

    def __init__(self, shares: dict):
        self.shares, self.watches, self.measured = shares, [], []
        self.last_loader = None
        gpu = self

        class Watch:
            def __init__(self, device=None, interval=0.05):
                self.clock, self.open, self.conditions = 1000.0 + len(gpu.watches), False, None
                gpu.watches.append(self)

            def __enter__(self):
                self.open = True
                return self

            def __exit__(self, *exc):
                self.open = False
                self.conditions = Conditions(1.0, 16, gpu=True, sm_clock_mhz=self.clock, sm_clock_low_mhz=self.clock,
                                             sm_clock_high_mhz=self.clock)

        class Loader(DataLoader):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.settings = {k: kwargs[k] for k in ("num_workers", "pin_memory", "persistent_workers",
                                                        "prefetch_factor") if k in kwargs}

            def __iter__(self):
                for batch in super().__iter__():
                    gpu.last_loader = self.settings
                    yield batch

        self.Watch, self.Loader = Watch, Loader

    def measure(self, step, *, label="", device=None, **kwargs):
        self.last_loader = None
        step()
        watch = next((w for w in self.watches if w.open), None)
        self.measured.append((label, self.last_loader, watch.clock if watch else None))
        share = self.shares[label]
        return busy.Busy(label, 3, 5.0, share, share + 0.01, nvml_util=0.42)


def sweep(monkeypatch, gpu=None) -> dict:
    """Lesson 02's imports, data set, model and loader sweep, run on the CPU (with ``gpu`` standing in for one)."""
    scope = run({"gpulab": gpulab, "device": CPU}, PLAN, "from gpulab.transfers import")
    shown = scope["shown"] = []
    scope["display"] = lambda frame: shown.append(frame)
    if gpu is not None:
        monkeypatch.setattr(busy, "measure", gpu.measure)
        monkeypatch.setattr(conditions, "Watch", gpu.Watch)
        scope["DataLoader"] = gpu.Loader
    return run(scope, "one augmented sample", "def train_step(", "def steady_rate(", SWEEP)


def test_each_loader_row_carries_its_own_configurations_busy_share_and_gpu_state(lesson_env, monkeypatch):
    shares = {"data already on the device": 0.9, "0 workers": 0.05, "2 workers": 0.2,
              "2 workers, persistent, prefetch 4": 0.6}
    gpu = FakeGpu(shares)
    scope = sweep(monkeypatch, gpu)
    configs = scope["configs"]
    assert list(configs) == list(shares)[1:]
    # each configuration profiled on steps its own loader served, inside the Watch over its own measurements
    assert gpu.measured[0] == ("data already on the device", None, None)  # the model alone, data on the device
    for (label, loader, clock), watch, name in zip(gpu.measured[1:], gpu.watches, configs):
        assert label == name and loader == configs[name] and clock == watch.clock
    rows = scope["log"].frame().set_index("config")
    assert rows["kernel_busy"].to_dict() == {name: shares[name] for name in configs}
    assert (rows["nvml_util"] == 0.42).all() and (rows["ceiling_kernel_busy"] == 0.9).all()
    assert "gpu_util_pct" not in rows  # NVML's mean over a configuration's epochs is no busy share of it
    assert rows["sm_clock_mhz"].tolist() == [w.clock for w in gpu.watches]  # each row: its own span's GPU state
    assert scope["loader_results"]["kernel_busy"].tolist() == [shares[name] for name in configs]


def test_the_start_up_skipped_is_what_a_loader_can_prepare_ahead_never_more_than_an_epoch(lesson_env, monkeypatch):
    """A loader hands its workers the indices of the current epoch only, so no more than an epoch's batches are ever
    prepared ahead: steady_rate skips 2 × min(workers × prefetch, batches per epoch) + 1 batches before it starts the
    clock, and times as many again (at least min_steady). Counting workers × prefetch alone made full mode skip 121
    ResNet-50 steps for 15 workers × prefetch 4, with 10 batches in an epoch."""
    gpu = FakeGpu({"data already on the device": 0.9, "0 workers": 0.05, "2 workers": 0.2,
                   "2 workers, persistent, prefetch 4": 0.6})
    drawn = Counter()

    class Counting(gpu.Loader):
        def __iter__(self):
            for batch in super().__iter__():
                drawn[self.settings["num_workers"], self.settings["prefetch_factor"]] += 1
                yield batch

    gpu.Loader = Counting
    scope = sweep(monkeypatch, gpu)
    per_epoch, min_steady = scope["batches_per_epoch"], scope["min_steady"]
    assert scope["prepared_ahead"](2, 4) == per_epoch < 2 * 4  # the quick sizes: an epoch holds fewer than 8
    for settings in scope["configs"].values():
        workers, prefetch = settings["num_workers"], settings["prefetch_factor"]
        skip = 2 * min(workers * (prefetch or 2), per_epoch) + 1
        # the skipped batches, the timed ones, and one more that the fake busy.measure trained on
        assert drawn[workers, prefetch] == skip + max(skip, min_steady) + 1, settings


def test_on_a_cpu_the_sweep_says_the_busy_share_needs_a_gpu(lesson_env, monkeypatch, capsys):
    scope = sweep(monkeypatch)
    rows = scope["log"].frame()
    assert (rows["busy_steps"] == scope["busy_steps"]).all()  # each configuration's steps profiled on the CPU
    assert rows["kernel_busy"].isna().all() and "sm_clock_mhz" not in rows  # no kernels in a CPU trace, no GPU state
    printed = capsys.readouterr().out
    assert (f"GPU busy per configuration: each configuration's {scope['busy_steps']} steps were profiled on this CPU, "
            "but the trace has no GPU kernels (recorded on a CPU)") in printed
    assert "How busy a loader keeps a GPU needs a GPU" in printed


def test_a_single_run_above_the_data_on_device_rate_is_called_noise_not_a_result(monkeypatch, capsys):
    """The H200 run's tuned loader came out at 585 samples/s in one run, above the 476 of data already on the
    device ("no loader can do better"); the comparison in interleaved pairs had the on-device epochs 1.84× faster."""
    frame = h200_sweep()
    tuned = frame["config"].iloc[-1]
    scope = {"loader_results": frame, "ceiling": float(frame["ceiling_samples_per_s"].iloc[0]),
             "one_sample": Measurement("one augmented sample", (0.00133,) * 3, "cpu", 1), "cores": 16,
             "on_gpu": True, "nvml_ok": False, "nvml_note": "not sampled in this test", "tuned": tuned,
             "loader_cmp": {f"data already on the device, against {tuned}": Comparison.of(
                 [1.84] * 5, [1.0] * 5, labels=(tuned, "data already on the device"))}}
    run(scope, "Highest steady rate measured")
    printed = capsys.readouterr().out
    assert "585 samples/s; the model trains at 476 samples/s" in printed
    assert ("Faster than data already on the device, in a single run: 2 workers, pinned, persistent, prefetch 4. No "
            "pipeline can beat that rate") in printed


def test_the_overlap_figure_draws_the_loops_not_the_comparisons_row():
    rows = pd.DataFrame({"loop": ["serial", "overlapped", "overlapped against serial"],
                         "median_s": [0.022, 0.013, math.nan]})
    drawn = []
    scope = {"plots": types.SimpleNamespace(bars=lambda values, **kwargs: drawn.append(values))}
    exec(compile(function_source("02", "plot_overlap"), "<lesson 02: plot_overlap>", "exec"), scope)
    scope["plot_overlap"](rows, "a GPU")
    assert drawn == [{"serial": pytest.approx(22.0), "overlapped": pytest.approx(13.0)}]


def test_the_hazard_reports_whether_the_copy_had_finished_when_the_read_began():
    """On the H200 it printed "65,536 of 1,048,576 values had arrived (copy finished: True)": the copy was asked about
    after the read, when it had finished."""
    tree = ast.parse(code("02", "Read at once"))
    lines = {ast.unparse(node.func): node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)}
    read = next(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and ast.unparse(node.targets[0]) == "early")
    assert lines["copied.query"] < read


def lesson_calls(lesson: str, method: str):
    path = next((ROOT / "notebooks").glob(f"{lesson}_*.ipynb"))
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            for node in ast.walk(ast.parse(cell.source)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method:
                    yield node


@pytest.mark.parametrize("lesson", ["02", "04"])
def test_no_measurements_row_takes_a_comparisons_gpu_state(lesson):
    """add_measurement records the measurement's own conditions; a comparison's row() spread into it overrides them
    with the GPU's state over the comparison's pairs (lesson 02's overlapped loop and lesson 04's training steps
    did): a comparison goes into a row of its own."""
    for call in lesson_calls(lesson, "add_measurement"):
        spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
        assert not any(".row()" in s for s in spread), f"lesson {lesson}: {ast.unparse(call)}"


def test_the_names_lesson_02_imports_from_gpulab_are_never_rebound():
    """`busy` is gpulab.busy in lesson 02; the hazard cell's matrix was called `busy` once."""
    path = next((ROOT / "notebooks").glob("02_*.ipynb"))
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    imported = {alias.asname or alias.name for source in cells for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) and node.module == "gpulab" for alias in node.names}
    assert "busy" in imported
    bound = {node.id for source in cells for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del))}
    assert not imported & bound
