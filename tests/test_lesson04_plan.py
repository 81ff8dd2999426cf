"""Lesson 04's plan (gpulab/plans/plan04.py): the launches that decide whether the MLP's step is the GPU's work (and so
whether it shows MFU) are counted from the lesson's own training step, not typed in."""

import nbformat
import pytest
import torch

from gpulab import tasks
from gpulab.plans import plan04
from gpulab.plans.predict import Launches, step_launches

from .conftest import ROOT


def lesson_train_step():
    """The lesson's ``train_step`` (its autocast on ``device.type``), defined here on the CPU."""
    cells = nbformat.read(ROOT / "notebooks" / "04_mixed_precision.ipynb", as_version=4).cells
    source = next(c.source for c in cells if c.cell_type == "code" and "def train_step(" in c.source)
    scope = {"device": torch.device("cpu")}
    exec(source.split("\n\n\nAMP_DTYPE")[0], {"torch": torch, "F": torch.nn.functional, **scope}, scope)
    return scope["train_step"]


def test_the_plans_launches_are_the_lessons_bf16_step_counted():
    train_step = lesson_train_step()
    for depth in (2, 3):
        model = tasks.student_mlp(plan04.DIM, 8, depth, plan04.CLASSES)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # foreach: what a GPU's AdamW runs
        scaler = torch.amp.GradScaler("cpu", enabled=False)  # bf16: no loss scaling
        run = (model, opt, scaler, torch.randn(4, plan04.DIM), torch.zeros(4, dtype=torch.long), torch.bfloat16)
        assert step_launches(lambda run=run: train_step(*run)) == plan04.launches(depth)
    assert plan04.launches(3) > plan04.launches(2) > 20  # they were typed in as 132 and 102, views and .item() included


def test_a_view_or_a_host_read_launches_no_kernel():
    x = torch.ones(4, 4)
    with Launches() as counted:
        x.t().expand(2, 4, 4)
        (x + 1).sum().item()
    assert counted.count == 2  # the add and the sum


def test_the_text_names_the_dashed_peak_as_peak_fields_takes_it():
    """The roofline's dashed peak is flops.ceiling's, or the sweep's fastest product where that beat it
    (precision.peak_fields); the text said it was always the ceiling section 3 divides by."""
    from gpulab import flops, precision
    from gpulab.timing import Measurement

    ceiling = flops.Ceiling("fp32", 1.0, shape=(64, 64, 64))
    faster = {4096: Measurement("n=4096", (2 * 4096**3 / 2e12,) * 3, "cpu", 1)}  # 2 TFLOP/s
    assert precision.peak_fields(ceiling, faster)["tflops"] == pytest.approx(2.0)
    cells = nbformat.read(ROOT / "notebooks" / "04_mixed_precision.ipynb", as_version=4).cells
    text = " ".join(" ".join(c.source.split()) for c in cells if c.cell_type == "markdown")
    assert ("the ceiling section 3 divides by, or the fastest matmul of the sweep if that was faster still" in text)
