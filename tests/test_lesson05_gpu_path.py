"""Lesson 05's GPU branches, run on the CPU playing an NVIDIA H200 (tests/cuda_stand_in.py): section 1 measured by
the allocator's statistics, the memory outside PyTorch's allocator, allocated against reserved and empty_cache(), the
allocator's snapshot drawn as a timeline (from the H200's own snapshot: the history is GPU-only), and the
out-of-memory demo inside its cap, with every figure printed beside the budget that bounds it.

What runs here is the code around torch's calls; the stand-in's allocator counts tensors (no rounding, no workspaces),
so its numbers prove the lesson's arithmetic, never the GPU's."""

import ast
import os
import shutil
from unittest import mock

import matplotlib.pyplot as plt
import pytest
import torch

import gpulab
from gpulab import memory

from .conftest import ROOT
from .test_memory import lesson_cell, run_cell

MiB = 2**20
H200_SNAPSHOT = ROOT / "tests" / "data" / "lesson05" / "h200_05_memory_snapshot.pickle"
PER_SAMPLE = 20.3 * 1024  # bytes of activations per sample of the deeper ResidualMLP, as the H200 fitted them


@pytest.fixture
def lesson(cuda_stand_in, results_dir, monkeypatch, capsys):
    """Lesson 05's imports and measuring functions, in quick mode, on the CPU playing an H200."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    scope = {"__name__": "__main__", "gpulab": gpulab, "device": torch.device("cpu")}
    for marker in ("plans.lesson(", "import contextlib", "def measuring():"):
        run_cell(marker, scope)
    scope["displayed"] = []
    scope["display"] = scope["displayed"].append
    capsys.readouterr()
    yield scope
    plt.close("all")


def statement(marker: str, text: str) -> str:
    """The one top-level statement of the lesson's cell with ``marker`` whose source contains ``text``."""
    source = lesson_cell(marker)
    found = [ast.get_source_segment(source, node) for node in ast.parse(source).body]
    found = [segment for segment in found if text in segment]
    assert len(found) == 1, f"{len(found)} statements of the cell with {marker!r} contain {text!r}"
    return found[0]


def test_section_1_reads_the_allocator_and_every_part_is_as_predicted(lesson, capsys):
    assert lesson["on_gpu"] and lesson["amp_dtype"] == torch.bfloat16  # an H200: bf16 is native
    run_cell("def predict(", lesson)
    lesson.update(width=32, depth=3, batch_size=4)  # the same code at a size this test runs in no time
    run_cell("def first_step_phases", lesson)
    run_cell("warm_up()  # needed", lesson)
    breakdown = lesson["breakdown"]
    off = (breakdown.measured_MiB - breakdown.predicted_MiB) * MiB
    assert off.between(0, 8).all(), off  # every part to the byte, but the loss (a scalar alive in two phases)
    assert "On a GPU the allocator rounds every block" in capsys.readouterr().out


def test_the_memory_outside_the_allocator_is_measured_and_logged(lesson, capsys, fake_nvml_card):
    """NVML (tests/fake_libnvml.py's H200) says this process uses 742 MiB, as the H200's did on 2026-11-28."""
    fake_nvml_card.processes = [(os.getpid(), 742 * MiB + torch.cuda.memory_reserved())]
    run_cell('ResultLog("05_cuda_context")', lesson)
    out = capsys.readouterr().out
    assert "Memory this process uses on the GPU that PyTorch does not count: 742 MiB (NVML's memory of this process" in out
    row = lesson["context_log"].frame().iloc[-1]
    assert row.outside_allocator_MiB == 742 and row.reserved_MiB == torch.cuda.memory_reserved() / MiB


def test_allocated_and_reserved_move_as_the_caching_allocator_moves_them(lesson, capsys):
    run_cell('ResultLog("05_allocator")', lesson)
    steps = lesson["steps"].set_index("after")
    start, size = steps.allocated_MiB.iloc[0], lesson["size"] / MiB
    assert steps.allocated_MiB.tolist() == pytest.approx([start, start + size, start, start + size, start])
    reserved = steps.reserved_MiB
    assert reserved.iloc[1] >= start + size and reserved.iloc[1] == reserved.iloc[2] == reserved.iloc[3]  # kept
    assert reserved.iloc[4] < reserved.iloc[3]  # empty_cache() gave the cached block back
    assert steps.device_used_MiB.tolist() == reserved.tolist()  # what the driver sees as used: what torch reserved
    assert "PyTorch CUDA memory summary" in capsys.readouterr().out


def test_the_snapshot_cell_records_python_stacks_and_draws_the_h200s_snapshot(lesson, capsys):
    """The history and the snapshot are GPU-only (the stand-in refuses them): here the recording is a spy and the dump
    writes the snapshot the H200 wrote on 2026-11-28 (its frames cut to the innermost one)."""
    calls = []
    lesson["make_step"] = lambda k: (lambda: None)  # section 4's step: three of them ran between record and dump
    with mock.patch.object(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: calls.append((a, kw))), \
            mock.patch.object(torch.cuda.memory, "_dump_snapshot", lambda path: shutil.copy(H200_SNAPSHOT, path)):
        run_cell("snapshot_path = results_dir()", lesson)
    assert calls == [((), {"max_entries": 100_000, "context": "all", "stacks": "python"}), ((), {"enabled": None})]
    events = lesson["events"]
    assert len(events) == 1809 and events["allocated"].min() > 0  # a history of three steps, on top of the model
    assert events["allocated"].iloc[-1] == memory.live_bytes(memory.load_snapshot(H200_SNAPSHOT)["segments"])
    assert "Snapshot: " in capsys.readouterr().out


def test_the_oom_demo_stays_inside_its_cap_and_prints_each_figure_beside_what_bounds_it(lesson, capsys, cuda_stand_in):
    """The H200 (2026-11-28) printed "held 142.0 MiB ... within a budget of 64 MiB": 142 MiB was all that was
    allocated, the budget what the demo may take on top of what the process held."""
    lesson.update(mlp_width=64, mlp_depth=8, fits={"ResidualMLP, 8 blocks": (PER_SAMPLE, 0.0)})
    run_cell("oom_model = models.ResidualMLP", lesson)
    out = capsys.readouterr().out
    budget, baseline, during = lesson["oom_budget"], lesson["baseline"], lesson["during"]
    assert "BudgetExceeded" in out  # the stand-in's card refused, as a torch.OutOfMemoryError
    reserved_before, cap, held_most = lesson["reserved_before"], lesson["cap"], lesson["held_most"]
    assert cap == reserved_before + budget and during <= cap and held_most <= cap
    assert cuda_stand_in.tracker.budget == cuda_stand_in.card.total_memory  # the cap lifted: the whole card again
    assert lesson["after"] == baseline and lesson["taken"] == held_most - reserved_before <= budget
    assert (f"inside `except` {during / MiB:.1f} MiB ({(during - baseline) / MiB:.1f} MiB more: the failed step's "
            "tensors") in out
    assert (f"The demo took at most {(held_most - reserved_before) / MiB:.1f} MiB more reserved memory than the process "
            "held before it: within its budget of 64 MiB.") in out
    assert ("outgrew what the process reserved on top" in out) == (during - baseline > lesson["taken"])
    row = lesson["oom_log"].frame().iloc[-1]
    assert row.taken_MiB <= row.budget_MiB == 64 and row.reserved_most_MiB <= row.cap_MiB

    exec(statement("adam_step = breakdown", "out-of-memory"), lesson)  # the lesson's summary of it
    summary = capsys.readouterr().out
    assert (f"held the failed step's {(during - baseline) / MiB:.1f} MiB of tensors while it was alive, 0.0 MiB after "
            f"the `except` block (above the {baseline / MiB:.1f} MiB allocated before the step)") in summary
    assert f"at most {lesson['taken'] / MiB:.1f} MiB more reserved memory than the process held before it, within" \
           in summary
