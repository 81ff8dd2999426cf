"""Lesson 07's plan (gpulab/plans/plan07.py): with one GPU or none, gloo processes on the CPU at CPU sizes and the one
GPU's own run at the width whose step is the card's work; with two GPUs or more, NCCL at sizes from the card's rate,
memory and link; quick mode's sizes as they were; the plan's estimates read from the runs they name."""

import dataclasses
import json

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from gpulab import distributed, flops, plans
from gpulab.commands.cli import main
from gpulab.distributed import WorkSize
from gpulab.models import WideMLP
from gpulab.plans import plan07

from .conftest import ROOT
from .test_distributed_lesson07 import SETUP, cell
from .test_plans import CARDS, LIMITS

H200_ROWS = ROOT / "tests" / "data" / "07_multi_gpu" / "h200_quick_07_ddp.csv"


@pytest.mark.parametrize("card, gpus", [(plans.Card("CPU", None, 2, 0), 0), (plans.Card.named("Tesla T4"), 1),
                                        (plans.Card.named("NVIDIA H100 80GB HBM3", gpus=4), 4)])
def test_quick_mode_keeps_the_sizes_it_had(card, gpus):
    plan = plans.plan_for("07", card, quick=True)
    assert plan.work == WorkSize(width=512, batch=64, rounds=5, calls=1, max_bytes=2**24, iters=20)
    assert plan.time_limit == 300 and plan.ranks == distributed.rank_counts(gpus)
    assert plan.backend == ("nccl" if gpus >= 2 else "gloo")
    assert plan.sizes.get("gpu_work") == (plan.work if gpus == 1 else None)  # the one GPU's own run, at quick sizes


@pytest.mark.parametrize("name", CARDS)
def test_below_two_gpus_the_runs_are_gloo_processes_on_the_cpu_and_the_plan_says_so(name):
    plan = plans.plan_for("07", plans.Card.named(name))
    assert plan.backend == "gloo" and plan.ranks == [1, 2]
    assert plan.work == WorkSize(width=512, batch=64, rounds=8, calls=2, max_bytes=2**24)  # the CPU's sizes
    assert "a second GPU: the multi-GPU runs are gloo processes on the CPU" in str(plan)
    gpu = plan.gpu_work  # the one GPU's own DDP step, for the projection: the card's work, not the host's
    assert plan07.gpu_work_s(plan.card, gpu.width, gpu.batch) >= plan07.GPU_BOUND * plan07.HOST_STEP_S
    narrower = plan07.WIDTHS[plan07.WIDTHS.index(gpu.width) - 1]
    assert plan07.gpu_work_s(plan.card, narrower, gpu.batch) < plan07.GPU_BOUND * plan07.HOST_STEP_S


def test_a_faster_card_gets_a_wider_model_for_its_one_gpu_run():
    t4, h100 = (plans.plan_for("07", plans.Card.named(n)).gpu_work for n in ("Tesla T4", "NVIDIA H100 80GB HBM3"))
    assert h100.width > t4.width


@pytest.mark.parametrize("gpus", [2, 3, 8])
@pytest.mark.parametrize("name", CARDS)
def test_on_two_gpus_or_more_nccl_fits_memory_regime_and_minutes(name, gpus):
    card = plans.Card.named(name, gpus=gpus)
    plan = plans.plan_for("07", card)
    assert plan.backend == "nccl" and plan.ranks == distributed.rank_counts(gpus) and "gpu_work" not in plan.sizes
    assert 0 < plan.memory_gb <= card.usable_gb()
    assert [r.name for r in plan.regimes if not r.holds] == []
    assert plan.minutes <= plan.target_minutes and plan.minutes <= LIMITS.get(name, (plan.target_minutes,))[0]
    assert "second gpu" in plan.features and card.lacks(plan.features) == []


def test_the_link_is_nvlink_on_sxm_boards_and_the_cards_pcie_elsewhere():
    assert plan07.gpu_link(plans.Card.named("NVIDIA H100 80GB HBM3")).name.startswith("NVLink")
    assert plan07.gpu_link(plans.Card.named("NVIDIA A100-SXM4-40GB")).bandwidth == pytest.approx(300e9 * 0.8)
    t4 = plans.Card.named("Tesla T4")
    assert plan07.gpu_link(t4).name.startswith("PCIe Gen3") and plan07.gpu_link(t4).bandwidth == t4.host_gbs * 1e9


def test_a_card_with_little_memory_gets_smaller_collectives_and_a_narrower_model_and_says_what_that_costs():
    small = dataclasses.replace(plans.Card.named("NVIDIA H100 80GB HBM3", gpus=2), memory_gb=3.0)
    plan = plans.plan_for("07", small)
    assert 3 * plan.work.max_bytes / 1e9 <= small.usable_gb() < 3 * 2 * plan.work.max_bytes / 1e9
    assert plan.memory_gb <= small.usable_gb() and plan.work.width < 8192
    bound = next(r for r in plan.regimes if r.name == "the GPU's step is the card's work")
    assert not bound.holds and "against the host's 1.64 ms" in bound.detail  # too narrow to be the card's work: said


def test_the_regimes_can_fail():
    fast_link = distributed.Link("a link as fast as memory", 3e12, 1e-6)
    assert not plan07._visible(512, 0.1, fast_link, "GPUs").holds  # a 4 µs all-reduce against 100 ms of compute
    assert not plan07._sweep(WorkSize(512, 64, 8, 2, max_bytes=2**20), 2, plan07.GLOO).holds  # stops below crossover


@pytest.mark.parametrize("width", [64, 512, 4096])
def test_the_plans_count_of_the_mlps_flops_is_the_flop_counters(width):
    with torch.device("meta"):
        model, x, y = WideMLP(width=width), torch.empty(1, 3, 32, 32), torch.zeros(1, dtype=torch.long)
    assert plan07.mlp(width) == (sum(p.numel() for p in model.parameters()),
                                 flops.training_flops(model, x, y, F.cross_entropy).total)


def test_the_plans_estimates_are_the_h200_runs_it_names():
    """H200_CPU_STEP_S and HOST_STEP_S: the compute of one rank's step at width 512 (gloo on the CPU, one NCCL rank
    on the GPU) in the course's first H200 run; the gloo link fitted to that run's all-reduces."""
    rows = pd.read_csv(H200_ROWS).query("part == 'scaling' and kind == 'compute' and ranks == 1").set_index("device")
    assert plan07.H200_CPU_STEP_S == pytest.approx(rows.median_s["cpu"], rel=0.01)
    assert plan07.HOST_STEP_S == pytest.approx(rows.median_s["cuda"], rel=0.01)
    card = plans.Card.named("NVIDIA H200")
    assert plan07.compute_s(card, plan07.GLOO_WORK, gpu=False) == pytest.approx(plan07.H200_CPU_STEP_S)


def test_the_command_plans_a_machine_of_eight_gpus(capsys):
    assert main(["plan", "--card", "NVIDIA H100 80GB HBM3", "--gpus", "8", "--json"]) == 0
    entry = next(e for e in json.loads(capsys.readouterr().out) if e["lesson"] == "07")
    assert entry["sizes"]["backend"] == "nccl" and entry["sizes"]["ranks"] == [1, 2, 4, 8]
    assert entry["minutes"] <= 2 and entry["lacks"] == []


def test_the_lesson_says_plainly_where_its_ranks_run(monkeypatch, capsys, results_dir):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    scope = {"__name__": "__main__", "plan": plans.plan_for("07", plans.Card.named("Tesla T4"))}
    exec(cell(SETUP), scope)
    said = capsys.readouterr().out
    assert "One GPU here: the multi-process runs are 2 gloo processes on the CPU" in said
    assert "The GPU also trains the DDP step on one NCCL rank" in said
