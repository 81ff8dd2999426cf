"""Lesson 06's GPU-only cells, run here on the CPU: the cells themselves, read from the notebook, with what a GPU would
give them substituted where the CPU cannot (a real GPU trace instead of the shipped reference trace, ``on_gpu`` set
where the cell's code runs on any device). nbval runs the notebook's CPU branches; these run its GPU branches."""

import contextlib
import io
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch

from gpulab import Comparison, traces

from .test_traces_real_gpu import key_averages_of

matplotlib.use("Agg")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_profiling.ipynb"
MI250 = Path(__file__).parent / "data" / "gpu-traces" / "mi250_minitoy_train_trace.json.gz"


def code_cells() -> list[str]:
    return [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def cell(starting_with: str) -> str:
    """The source of the one code cell of lesson 06 that starts with ``starting_with``."""
    found = [source for source in code_cells() if source.startswith(starting_with)]
    assert len(found) == 1, f"{len(found)} cells of {NOTEBOOK.name} start with {starting_with!r}"
    return found[0]


def run(source: str, scope: dict) -> str:
    """Run a cell's source in ``scope`` (the notebook's globals so far); what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pd.option_context("display.width", 200, "display.max_columns", 30):
        exec(compile(source, f"<{NOTEBOOK.name}>", "exec"), scope)
    plt.close("all")
    return out.getvalue()


@pytest.fixture
def lesson(results_dir, monkeypatch):
    """The notebook's globals after its setup and imports cells, in quick mode, results in a temporary folder."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__"}
    setup, imports = code_cells()[:2]  # the setup cell, then the lesson's imports and sizes
    run(setup, scope)
    run(imports, scope)
    return scope


def test_section_5_reads_a_real_gpu_trace_with_gpulab_and_hta_side_by_side(lesson, monkeypatch):
    """With a GPU trace shipped (here the MI250 one), section 5 shows gpulab's and HTA's numbers on a CPU."""
    provenance = {"device_name": "AMD MI250 (HTA's test data)"}
    monkeypatch.setattr(traces, "reference_trace", lambda name="06_trace": (traces.load_trace(MI250), provenance))
    lesson.update(trace=None, slow_trace=Path("06_slow.json"))  # this machine's own trace: a CPU one, not used
    printed = run(cell("hta_ok, hta_version"), lesson)
    assert "The same from HTA" in printed and "HTA's rounding to whole µs is the difference" in printed
    causes = lesson["causes"]
    assert causes["HTA"].to_numpy() == pytest.approx(causes["gpulab, rounded as HTA rounds"].to_numpy(), abs=1e-5)
    assert causes.loc["host_wait", "HTA"] > causes.loc["host_wait", "gpulab, the trace's own timestamps"]
    temporal = lesson["temporal"].iloc[0]
    assert temporal["busy_ms"] == pytest.approx(temporal["compute_ms"] + temporal["non_compute_ms"])
    assert "largest idle category is host_wait on stream 0" in printed
    assert "   step " in printed and "kernel_share" in printed  # the shipped trace's busy time per step: two steps
    busy = traces.gpu_busy(MI250)
    assert list(busy["step"]) == [1, 2]


def test_the_cudnn_section_reports_the_autotuning_and_the_steady_state(lesson, results_dir):
    """The GPU branch of the cudnn.benchmark cell, on the CPU (where the flag changes nothing): it times the first
    steps at new shapes and the steady state at one shape, each as interleaved pairs, and says which the claim is
    about."""
    lesson["on_gpu"] = True
    printed = run(cell("if on_gpu:\n    cnn = "), lesson)
    first, steady = lesson["first_steps"], lesson["steady"]
    assert isinstance(first, Comparison) and isinstance(steady, Comparison)
    assert first.pairs >= 5 and steady.pairs >= 5
    assert "first step at a new shape (autotuning included): benchmark=True" in printed
    assert "steady state, one shape: benchmark=True" in printed
    assert "The claim (faster convolutions, in the steady state):" in printed
    assert torch.backends.cudnn.benchmark is False  # left as it was found
    rows = pd.read_csv(results_dir / "06_cudnn_benchmark.csv")
    assert set(rows["label"]) == {"first step at a new shape (autotuning included)", "steady state, one shape"}
    assert {"speedup", "speedup_low", "speedup_high", "verdict"} <= set(rows.columns)


def test_the_alloc_free_pattern_counts_cuda_mallocs_and_retries_and_times_the_fixes_without_the_profiler(lesson):
    """The GPU branch of the patterns cell, on the CPU: cudaMalloc/cudaFree from the trace's runtime calls, the
    caching allocator's counters (none move on a CPU), and each fix timed against its pattern without the profiler."""
    lesson.update(on_gpu=True, fixed=pd.DataFrame({"gpu_busy_share": [0.4]}))
    printed = run(cell("def profile_once"), lesson)
    assert "200 temporaries on the GPU: 0 cudaMalloc and 0 cudaFree calls" in printed
    assert "num_alloc_retries 0" in printed and "after torch.cuda.empty_cache()" in printed
    fixes = lesson["pattern_fixes"]
    assert set(fixes) == {"one op instead of tiny ops in a loop", "a buffer instead of temporaries"}
    assert all(isinstance(c, Comparison) and c.pairs >= 5 for c in fixes.values())
    assert "Timed without the profiler, a buffer instead of temporaries:" in printed


def test_section_4_shows_busy_kernel_and_idle_time_per_step_of_a_real_gpu_trace(lesson):
    """The GPU branch of the busy-time cell, on the MI250 trace: two steps (not three windows), each split into
    kernels, copies only and idle, next to NVML's samples (none on a CPU: the monitor says why)."""
    run(cell("n_images = "), lesson)  # the loop the monitor watches
    lesson.update(on_gpu=True, trace=traces.load_trace(MI250))
    printed = run(cell("if on_gpu:\n    busy = traces.gpu_busy"), lesson)
    busy = lesson["busy"]
    assert list(busy["step"]) == [1, 2]
    parts = lesson["parts"]
    segments = parts[["kernels running", "only copies or memsets", "idle"]].sum(axis=1)
    assert segments.to_numpy() == pytest.approx(busy["step_ms"].to_numpy())
    assert f"a kernel ran {busy['kernel_share'].mean():.0%} of each step's time" in printed


def test_section_3_reads_operators_and_kernels_of_a_gpu_profile_apart(lesson):
    """The tables cell on a profile with kernels in it (the MI250 run's, rebuilt with torch's own classes): operators
    by their own kernels' time, kernels by theirs, and the device time counted once in each."""
    lesson.update(on_gpu=True, prof=key_averages_of(MI250))
    printed = run(cell("table = traces.op_table(prof)"), lesson)
    assert "Top operators by self device time" in printed and "Top kernels and copies by device time" in printed
    assert lesson["ranges"].index.is_unique
    assert "Device time of the operators: 0.15 ms; of the kernels, copies and memsets: 0.15 ms" in printed
    assert set(lesson["kernels"]["device_type"]) == {"CUDA"} and set(lesson["table"]["device_type"]) == {"CPU"}
