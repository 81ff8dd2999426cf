"""Lesson 06's GPU branches that no other test runs, on this CPU under the CUDA stand-in (tests/cuda_stand_in.py: the
CPU plays an NVIDIA H200), in quick mode: where the GPU's time went in the slow loop's trace (gpulab's breakdown and
HTA's beside it), the launch-bound step eager, compiled and compiled with CUDA graphs, and Nsight Compute on one kernel.
A CPU records no kernels, so the trace the GPU branch reads is the H200's own slow-loop trace (tests/data/lesson06/);
torch.compile runs with its eager backend (CUDA graphs replay only on a GPU); ncu is a stand-in script on PATH. They
prove the Python around those calls, never the GPU."""

import ast
import os
import stat
import sys
import warnings

import matplotlib.pyplot as plt
import nbformat
import pytest
import torch

import gpulab
from gpulab import traces
from gpulab.timing import Measurement

from .conftest import ROOT
from .test_lesson06_h200_traces import SLOW
from .test_mfu_lessons_03_04 import code

# A profiler asked for CUDA activity on a machine without a GPU says so and records the CPU (the stand-in's traces).
NO_CUDA_PROFILING = "CUDA is not available, disabling CUDA profiling"


def run(scope: dict, *markers: str) -> dict:
    """Run lesson 06's code cells that contain ``markers``, in order, in ``scope`` (the notebook's globals)."""
    for marker in markers:
        exec(compile(code("06", marker), f"<lesson 06: {marker}>", "exec"), scope)
    return scope


def define(scope: dict, marker: str, name: str) -> dict:
    """Run only the definition of the function ``name`` in the cell with ``marker``."""
    source = code("06", marker)
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.get_source_segment(source, node), f"<lesson 06: {name}>", "exec"), scope)
    return scope


@pytest.fixture
def lesson(cuda_stand_in, monkeypatch, results_dir):
    """The notebook's globals after its setup cell, on the CPU playing an H200, in quick mode; tables kept in ``shown``,
    figures not shown."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    before = torch.get_float32_matmul_precision()
    scope = run({"__name__": "__main__", "gpulab": gpulab, "device": torch.device("cpu")}, 'plans.lesson("06")',
                "from gpulab import fix_path")
    scope["shown"] = []
    scope["display"] = scope["shown"].append
    assert scope["on_gpu"] and scope["amp_dtype"] == torch.bfloat16  # an H200: bf16 autocast
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", NO_CUDA_PROFILING, UserWarning)
        yield scope
    torch.set_float32_matmul_precision(before)
    torch._dynamo.reset()
    plt.close("all")


def test_where_the_gpus_time_went_reads_this_machines_trace_with_gpulab_and_hta(lesson, capsys):
    """Cell 17 on a GPU's path: the GPU trace is this machine's own (here the H200's slow-loop trace), classified by
    gpulab and by HTA side by side, never the shipped reference with its caption."""
    lesson.update(trace=traces.load_trace(SLOW), slow_trace=SLOW, has_kernels=True)
    run(lesson, "hta_ok, hta_version = traces.hta_available()")
    said = capsys.readouterr().out
    temporal, idle = lesson["temporal"], lesson["idle"]
    assert len(temporal) and set(idle["idle_category"]) <= {"host_wait", "kernel_wait", "other"}
    assert "The largest idle category is host_wait" in said  # the H200's slow loop: the GPU waited for the host
    assert "The shipped trace" not in said and "No GPU trace to classify" not in said
    if lesson["hta_ok"]:
        assert "The same from HTA (µs, each event rounded inward to whole µs first):" in said


def test_the_launch_bound_step_is_compared_eager_compiled_and_with_cuda_graphs(lesson, monkeypatch, capsys):
    """Cell 27 on a GPU's path: both compiled ways are built (the CUDA-graph one marks each step's start for the graph
    trees), each compared with the eager step in interleaved pairs and logged. torch.compile runs with the eager
    backend here: Inductor's CPU code and CUDA graphs are a GPU's to show."""
    real_compile = torch.compile
    asked = []

    def compile_eagerly(model, **options):
        asked.append(options)
        return real_compile(model, backend="eager")

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    marked = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marked.append(1))
    define(lesson, "def profile_once(", "profile_once")
    run(lesson, "small_batch = 16")
    assert asked == [{}, {"mode": "reduce-overhead"}]
    assert marked  # the CUDA-graph step marks the start of each step
    rows = gpulab.ResultLog("06_launch_bound").frame().set_index("way")
    assert list(rows.index) == ["torch.compile", "torch.compile + CUDA graphs"]
    assert (rows["pairs"] == 5).all() and (rows["eager_step_ms"] > 0).all()
    said = capsys.readouterr().out
    assert "torch.compile + CUDA graphs" in said and "against eager's" in said
    assert "torch.compile is skipped in quick mode on a CPU" not in said


def test_nsight_compute_profiles_one_kernel_where_ncu_is_installed(lesson, tmp_path, monkeypatch, capsys):
    """Cell 36 on a GPU's path with ncu installed: the one-kernel script is written and run under ncu with the
    section asked for; ncu here is a script that prints its arguments."""
    ncu = tmp_path / "bin" / "ncu"
    ncu.parent.mkdir()
    ncu.write_text(f"#!{sys.executable}\nimport sys\nprint('==PROF== fake ncu', *sys.argv[1:])\n")
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{ncu.parent}{os.pathsep}{os.environ['PATH']}")
    run(lesson, 'for tool, what in {"nsys"')
    said = capsys.readouterr().out
    script = lesson["profiles"] / "06_one_kernel.py"
    assert f"Nsight Compute (ncu): {ncu}" in said
    assert f"==PROF== fake ncu --launch-skip 2 --launch-count 1 --section SpeedOfLight {sys.executable} {script}" in said
    assert "torch.randn(2**24, device='cuda')" in script.read_text()


# ----- every profiler schedule records once and exports what it recorded -------------------------------------------

MY_NOTEBOOKS = [p for folder in ("notebooks", "solutions") for p in sorted((ROOT / folder).glob("0[2467]_*.ipynb"))]


def profiler_calls(source: str):
    """Each ``profile(...)`` call of ``source`` with the ``schedule(...)`` call passed to it (None without one)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "profile":
            plan = next((k.value for k in node.keywords if k.arg == "schedule"), None)
            yield node, plan


@pytest.mark.parametrize("path", MY_NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_profiler_schedule_records_one_cycle_and_exports_it_when_it_is_ready(path):
    """torch.profiler.schedule's default repeat=0 starts a new cycle after the recorded steps, so an export after the
    `with` block holds that new, empty one (the H200's NoDeviceEvents in lesson 02, 2026-11-28): a schedule here
    records once (repeat=1) and the trace is exported in on_trace_ready, when the recorded cycle is ready."""
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    for source in cells:
        for call, plan in profiler_calls(source.replace("%%writefile", "# %%writefile")):
            if plan is None:
                continue
            assert isinstance(plan, ast.Call), f"{path.name}: {ast.unparse(call)}"
            repeat = next((k.value for k in plan.keywords if k.arg == "repeat"), None)
            assert isinstance(repeat, ast.Constant) and repeat.value >= 1, f"{path.name}: {ast.unparse(plan)}"
            assert any(k.arg == "on_trace_ready" for k in call.keywords), f"{path.name}: {ast.unparse(call)}"


def test_the_slow_loops_profile_exports_its_two_recorded_steps(lesson, monkeypatch):
    """Cell 6 on a GPU's path: the trace written by on_trace_ready holds the two recorded steps (a CPU's trace here:
    the same schedule, export and steps). The slow loop's timing before it answers at once."""
    monkeypatch.setattr(gpulab, "bench", lambda fn, *args, label=None, **kwargs: Measurement(label, (0.1,) * 3, "cpu", 1))
    run(lesson, "n_images = batch_size * (steps + 1)", "def make_run(")
    source = code("06", "def save_trace(prof):")
    exec(compile(source, "<lesson 06: the slow loop profiled>", "exec"), lesson)
    steps = traces.steps(traces.load_trace(lesson["slow_trace"]))
    assert len(steps) == 2
