"""Lesson 01 planned from the card (gpulab/plans/plan01.py): quick mode keeps its sizes (on a GPU the copies and the
vector add still pass the L2, the matmuls still outlast their launches), full mode sizes each section so that it stays
in the regime it shows, and the plan's model is the lesson's. tests/test_plans.py checks memory, regimes and minutes
for the six cards."""

import math

import nbformat
import pytest
import torch

from gpulab import datasheets, flops, plans
from gpulab.plans import plan01

from .conftest import ROOT
from .cuda_stand_in import CARDS
from .test_plans import CARDS as PLANNED

NOTEBOOK = ROOT / "notebooks" / "01_cuda_basics.ipynb"
# The quick sizes the lesson chose with gpulab.by_mode before it was planned (main at 65e8026): quick mode keeps them.
TODAYS_QUICK = dict(min_time=0.05, compare_min_time=0.2, compare_pairs=5, copy_mb=[0.25, 1, 4, 16, 64], copy_runs=5,
                    cache_pairs=5, tanh_sizes=[4**k for k in range(5, 11)], matmul_n=256, sync_pairs=6, widths=[64, 128],
                    batch_size=64, steps=20, launch_sizes=[4**k for k in range(10)], chunk=1024, count=256,
                    check_sizes=[1, 1000, 1024, 4097, 98_765], vector_n=2**20)


def quick(card: str):
    return plans.plan_for("01", plans.Card.named(card), quick=True)


def test_quick_mode_on_a_cpu_keeps_todays_sizes():
    plan = plans.plan_for("01", plans.Card("CPU", None, 2, 0), quick=True)
    assert plan.sizes == TODAYS_QUICK and math.isnan(plan.minutes)


@pytest.mark.parametrize("card", PLANNED)
def test_quick_mode_on_a_gpu_passes_its_l2_and_outlasts_its_launches(card):
    """As the lesson did on a GPU in quick mode (sizes grown by the L2 torch reported): now by the datasheet's L2."""
    plan, l2 = quick(card), plans.Card.named(card).sheet.l2_mib * 2**20
    assert plan.copy_mb[:5] == TODAYS_QUICK["copy_mb"] and 2 * plan.copy_mb[-1] * 1e6 >= 8 * l2
    assert plan.vector_n * 4 >= 4 * l2 and plan.widths == [64, 128] and plan.steps == 20
    product = 2 * plan.matmul_n**3 / (plans.Card.named(card).tflops("fp32") * 1e12)
    assert product >= 10 * plans.Card.named(card).launch_s


def test_quick_mode_on_the_h200_asks_what_the_h200_ran():
    plan = quick("NVIDIA H200")  # 2026-11-28: copies up to 256 MB, arrays of 2^26 floats, 2048² matmuls
    assert plan.copy_mb == [0.25, 1, 4, 16, 64, 256] and plan.vector_n == 2**26 and plan.matmul_n == 2048


def test_a_t4s_quick_matmuls_are_smaller_than_an_h200s():
    """A T4's fp32 is a seventh of an H200's: 1024² products outlast their launch there, and a CPU playing the T4 in
    the course's tests runs them in a fraction of the time 2048² would take."""
    assert quick("Tesla T4").matmul_n == 1024


@pytest.mark.parametrize("card", PLANNED)
def test_the_datasheets_l2_is_the_one_cuda_reports(card):
    assert datasheets.find(card).l2_mib * 2**20 == CARDS[card].L2_cache_size


def test_a_card_without_a_listed_l2_is_planned_past_any_listed_one():
    sheet = datasheets.SHEETS["B200"]
    assert math.isnan(sheet.l2_mib)
    assert plan01.l2_bytes(plans.Card("NVIDIA B200", sheet, 16)) > max(
        s.l2_mib * 2**20 for s in datasheets.SHEETS.values() if not math.isnan(s.l2_mib))


@pytest.mark.parametrize("card", PLANNED)
def test_full_mode_runs_the_loops_from_launch_bound_to_gpu_bound(card):
    """The sync in a loop was sized for nothing: at the H200's quick widths (64, 128) each step was launch-bound, and
    a sync every step cost nothing this machine could show. The plan's widths cross the balance on every card."""
    c = plans.Card.named(card)
    widths = plans.plan_for("01", c).widths
    ratios = [plan01.step_gpu_s(c, w) / plan01.step_queue_s(c) for w in widths]
    assert ratios == sorted(ratios) and ratios[0] <= 0.5 and ratios[-1] >= 2
    assert any(0.5 <= r <= 2 for r in ratios), dict(zip(widths, ratios))


@pytest.mark.parametrize("card", PLANNED)
def test_full_mode_keeps_the_launch_bound_sizes_launch_bound_and_reaches_the_bandwidth(card):
    """The adds are timed back to back on the host's clock, launch included: judged against the host's launch."""
    c = plans.Card.named(card)
    plan = plans.plan_for("01", c)
    launch = c.launch_s
    bytes_s = lambda nbytes: nbytes / (c.copy_gbs * 1e9)  # noqa: E731
    assert sum(bytes_s(12 * n) <= launch / 10 for n in plan.launch_sizes) >= 4
    assert bytes_s(12 * plan.launch_sizes[-1]) >= 10 * launch and bytes_s(12 * plan.vector_n) >= 10 * launch


@pytest.mark.parametrize("card", PLANNED)
def test_full_mode_copies_run_from_the_kernels_own_fixed_time_to_the_bandwidth(card):
    """Each copy is timed alone between events behind an untimed hold, which leaves the launch out (10.6 µs on the
    H100, gpulab bench's host-side add): the small copies' fixed cost is the kernel's own time on the GPU, so the
    smallest copy's bytes take a tenth of that, not of a launch (the H100's smallest was 1 MB: 0.67 µs of bytes)."""
    c = plans.Card.named(card)
    plan = plans.plan_for("01", c)
    bytes_s = lambda nbytes: nbytes / (c.copy_gbs * 1e9)  # noqa: E731
    assert plan01.KERNEL_GPU_S < c.launch_s
    assert bytes_s(2 * plan.copy_mb[0] * 1e6) <= plan01.KERNEL_GPU_S / 10
    assert bytes_s(2 * plan.copy_mb[-1] * 1e6) >= 10 * plan01.KERNEL_GPU_S
    copies = next(r for r in plan.regimes if r.name.startswith("the copies run from"))
    assert copies.name == "the copies run from fixed-cost-bound to bandwidth-bound" and "own GPU time" in copies.detail


def test_the_plans_model_is_the_lessons():
    """The plan counts the FLOPs of the lesson's own make_model, not of a model of its own."""
    source = next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
                  if c.cell_type == "code" and "def make_model(width)" in c.source)
    scope = {"torch": torch, "device": torch.device("meta")}
    exec(source.split("\n\n\ndef train_step")[0], scope)
    model = scope["make_model"](96)
    with torch.device("meta"):
        xb, yb = torch.empty(32, 96), torch.empty(32, 1)
    lessons = flops.training_flops(model, xb, yb, torch.nn.functional.mse_loss).total
    assert lessons == plan01.step_flops(96, 32) > 0


def test_the_plan_cell_follows_the_setup_cell_and_no_size_is_chosen_by_mode():
    cells = [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    assert "gpulab.setup()" in cells[0].source and 'plans.lesson("01")' in cells[1].source
    assert not any("by_mode" in c.source or "quick_mode()" in c.source for c in cells)
