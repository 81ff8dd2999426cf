"""Lesson 00 planned from the card (gpulab/plans/plan00.py): quick mode keeps the sizes the lesson chose before it was
planned, on a CPU and on any card (tests/test_plans.py checks memory, regimes and minutes for the six cards); and what
the lesson says of its comparisons is what gpulab.compare does."""

import inspect
import math

import nbformat
import pytest

import gpulab
from gpulab import plans

from .conftest import ROOT

NOTEBOOK = ROOT / "notebooks" / "00_setup_and_diagnostics.ipynb"

# The quick sizes of the lesson's by_mode calls before it was planned (main at 692ec49^): the CPU-GPU comparison took
# min_time=0.5 in both modes, the CPU side stopped at 4096.
TODAYS_QUICK = dict(matmul_sizes=[16, 32, 64, 128, 256, 512], cpu_max=4096, min_time=0.05, compare_min_time=0.5,
                    threads_min_time=0.3, threads_pairs=5)


def test_quick_mode_on_a_cpu_keeps_todays_sizes():
    plan = plans.plan_for("00", plans.Card("CPU", None, 2, 0), quick=True)
    assert plan.sizes == TODAYS_QUICK and math.isnan(plan.minutes)


@pytest.mark.parametrize("card", ["Tesla T4", "NVIDIA H200"])
def test_quick_mode_on_a_gpu_keeps_todays_sizes(card):
    assert plans.plan_for("00", plans.Card.named(card), quick=True).sizes == TODAYS_QUICK


def test_the_lesson_says_a_verdict_needs_the_interval_beyond_the_comparisons_least_effect():
    """It said "beyond 1"; gpulab.compare calls nothing faster or slower within 2 % of it."""
    effect = inspect.signature(gpulab.compare).parameters["min_effect"].default
    markdown = " ".join(" ".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
                                 if c.cell_type == "markdown").split())
    assert effect == 0.02 and f"lies beyond 1 (by {effect * 100:g} %)" in markdown
