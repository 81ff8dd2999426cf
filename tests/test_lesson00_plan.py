"""Lesson 00 planned from the card (gpulab/plans/plan00.py): quick mode keeps the sizes the lesson chose before it was
planned, on a CPU and on any card. tests/test_plans.py checks memory, regimes and minutes for the six cards."""

import math

import pytest

from gpulab import plans

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
