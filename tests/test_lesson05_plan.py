"""Lesson 05's plan (gpulab/plans/plan05.py): quick mode keeps the sizes the lesson always had and takes the card's
precision; the byte accounting that sizes every experiment is measured here (``MemoryTracker`` on the meta device:
shapes, no memory, no time); and checkpointing's demonstration, which today's full sizes hid on a GPU behind foreach
Adam's temporaries, shows at the sizes planned for every card. tests/test_plans.py checks every card's memory,
regimes and minutes, and that the lesson prints this plan."""

import re

import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gpulab
from gpulab import models, plans
from gpulab.memory import MemoryTracker
from gpulab.plans import plan05
from gpulab.plans.card import Card
from gpulab.plans.predict import step_launches

from .conftest import ROOT
from .test_memory import run_cell
from .test_plans import CARDS

MiB = 2**20
LESSON = ROOT / "notebooks" / "05_memory.ipynb"
BEFORE = dict(mlp_width=1024, mlp_depth=16, ckpt_batch=2048)  # full mode's section 4 before the plan, on every card


@pytest.mark.parametrize("name, precision", [("Tesla T4", "fp16"), ("NVIDIA L4", "bf16"), ("NVIDIA H200", "bf16")])
def test_quick_mode_keeps_its_sizes_and_takes_the_cards_precision(name, precision):
    quick = plans.plan_for("05", Card.named(name), quick=True)
    assert quick.amp_precision == precision
    assert {k: v for k, v in quick.sizes.items() if k != "amp_precision"} == dict(
        width=512, batch_size=64, compare_min_time=0.5, block_mib=256, cnn_width=8, activation_batches=[8, 16, 32, 64],
        mlp_width=64, mlp_depth=8, ckpt_batch=256, ckpt_k=[1, 2, 4, 8], leak_steps=20, leak_width=256, val_batch=256,
        oom_mib=64, fragmentation_mib=512)
    assert plans.plan_for("05", Card("CPU", None, 2, 0), quick=True).amp_precision == "bf16"  # a CPU's autocast


def test_the_lesson_reads_every_size_from_its_plan():
    source = "\n".join(c.source for c in nbformat.read(LESSON, as_version=4).cells if c.cell_type == "code")
    assert "by_mode" not in source and "quick_mode" not in source
    read = set(re.findall(r"plan\.(\w+)", source))
    assert read == set(plan05.QUICK) | {"amp_precision"}, read ^ (set(plan05.QUICK) | {"amp_precision"})


def test_a_smaller_card_gets_smaller_experiments():
    laptop, h100 = (plans.plan_for("05", Card.named(n)) for n in ("NVIDIA GeForce RTX 4060 Laptop GPU",
                                                                  "NVIDIA H100 80GB HBM3"))
    assert laptop.width < h100.width and laptop.leak_width < h100.leak_width and laptop.oom_mib < h100.oom_mib
    assert laptop.memory_gb <= laptop.card.usable_gb() and laptop.memory_gb < h100.memory_gb


# ----- the byte accounting, measured ------------------------------------------------------------------------------

def meta_model(width, depth, batch, in_features=None):
    with torch.device("meta"):
        model = models.ResidualMLP(in_features=in_features or width, width=width, depth=depth)
        x = torch.empty(batch, in_features or width)
        y = torch.zeros(batch, dtype=torch.long)
    return model, x, y


@pytest.mark.parametrize("width, depth, in_features", [(64, 8, None), (256, 4, 3 * 32 * 32)])
def test_a_residual_mlps_parameters_and_saved_activations_are_counted_on_paper(width, depth, in_features):
    model, x, y = meta_model(width, depth, 32, in_features)
    assert plan05.residual_params(width, depth, in_features or width) == sum(p.numel() for p in model.parameters())
    with MemoryTracker() as tracker:
        loss = F.cross_entropy(model(x), y)
        saved = tracker.current
    del loss
    assert 0 <= saved - 32 * plan05.residual_saved(width, depth) <= 8  # and the loss, and nll_loss's total weight


def step_peak(model, x, y, optimizer, k):
    """The peak bytes above what is alive of one training step, its blocks checkpointed k at a time (None: not)."""
    def forward():
        if k is None:
            return model(x)
        h = model.embed(x)
        for i in range(0, len(model.blocks), k):
            h = checkpoint(model.blocks[i:i + k], h, use_reentrant=False)
        return model.head(h)

    with MemoryTracker() as tracker:
        F.cross_entropy(forward(), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return tracker.peak


def measured_peaks(width, depth, batch, ks, *, foreach):
    """Each k's step peak on the meta device, after a first step has made Adam's state (foreach: as on a GPU)."""
    model, x, y = meta_model(width, depth, batch)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
    step_peak(model, x, y, optimizer, None)
    return {k: step_peak(model, x, y, optimizer, k) for k in ks}


@pytest.mark.parametrize("width, depth, batch", [(64, 8, 256), (128, 8, 32), (256, 8, 1024)])
@pytest.mark.parametrize("gpu", [True, False], ids=["foreach Adam (a GPU)", "Adam's loop (a CPU)"])
def test_the_step_peaks_lie_within_the_plans_bounds(width, depth, batch, gpu):
    peaks = measured_peaks(width, depth, batch, (None, 1, 2, depth), foreach=gpu)
    for k, peak in peaks.items():
        low, high = plan05.residual_peak(width, depth, batch, k, gpu=gpu)
        assert low <= peak <= high, (k, low / MiB, peak / MiB, high / MiB)


def cut(sizes, card):
    width, depth, batch = sizes["mlp_width"], sizes["mlp_depth"], sizes["ckpt_batch"]
    peaks = measured_peaks(width, depth, batch, (None, 1), foreach=True)
    regime = next(r for r in plan05.regimes(card, {**plans.plan_for("05", card).sizes, **sizes})
                  if r.name == "checkpointing cuts the step's peak")
    return 1 - peaks[1] / peaks[None], regime


def test_todays_full_sizes_hid_checkpointings_cut_behind_foreach_adam_and_the_plan_said_so():
    """Width 1024 and batch 2048, full mode's sizes before the plan: on a GPU, foreach Adam's step() holds the gradients
    and a model-sized list of temporaries, which outweigh one block's activations at a time: one block at a time cuts
    the step's peak by a fifth, not by the most of it."""
    measured, regime = cut(BEFORE, Card.named("NVIDIA H100 80GB HBM3"))
    assert measured < plan05.CUT and not regime.holds, (measured, regime)


@pytest.mark.parametrize("width, batch", sorted({(p.mlp_width, p.ckpt_batch)
                                                 for p in (plans.plan_for("05", Card.named(n)) for n in CARDS)}))
def test_the_planned_sizes_show_checkpointings_cut_on_a_gpu(width, batch):
    measured, regime = cut(dict(mlp_width=width, mlp_depth=plan05.CKPT_DEPTH, ckpt_batch=batch),
                           Card.named("NVIDIA H100 80GB HBM3"))
    assert regime.holds and measured >= plan05.CUT, (measured, regime)


def test_a_smallcnns_saved_bytes_are_the_lessons_measured_slope():
    """Section 3's slope on the 2026-11-28 H200 (quick mode): SmallCNN(8) saved 216.2 KiB per sample; one sample's
    count also holds BatchNorm's per-channel statistics, which the slope leaves to the intercept."""
    assert plan05.cnn_saved(8) / 1024 == pytest.approx(216.2, abs=0.5)


# ----- the OOM demo as a T4 in full mode --------------------------------------------------------------------------

@pytest.mark.parametrize("cuda_stand_in", ["Tesla T4"], indirect=True)
def test_the_oom_demo_as_a_t4_in_full_mode_stays_inside_the_planned_cap(cuda_stand_in, results_dir, monkeypatch,
                                                                        capsys):
    """The plan's budget for a T4 (1024 MiB on top of what the process holds): the demo's step asks for twice it and
    is refused inside the cap, on the meta device (shapes, no memory: the stand-in counts them all the same)."""
    monkeypatch.setenv("GPULAB_QUICK", "0")
    scope = {"__name__": "__main__", "gpulab": gpulab, "device": torch.device("cpu")}
    run_cell("plans.lesson(", scope)
    run_cell("import contextlib", scope)
    plan = scope["plan"]
    assert plan.oom_mib == 1024 and not plan.quick
    per_sample = plan05.residual_saved(plan.mlp_width, plan.mlp_depth)
    scope.update(device=torch.device("meta"), mlp_width=plan.mlp_width, mlp_depth=plan.mlp_depth,
                 fits={f"ResidualMLP, {plan.mlp_depth} blocks": (per_sample, 0.0)})
    capsys.readouterr()
    run_cell("oom_model = models.ResidualMLP", scope)
    out = capsys.readouterr().out
    assert scope["cap"] == scope["reserved_before"] + 1024 * MiB and scope["held_most"] <= scope["cap"]
    assert scope["during"] - scope["baseline"] > 512 * MiB and scope["after"] == scope["baseline"]
    assert "within its budget of 1024 MiB" in out and "Cap lifted" in out
    assert cuda_stand_in.tracker.budget == cuda_stand_in.card.total_memory  # the whole card again


def test_the_launches_are_counted_from_the_models_step_on_the_meta_device():
    """A ResidualBlock's kernels and the rest of the step's, counted on the meta device (they were typed in: 17 and
    30): a real step on the CPU at another depth launches as many, less the host's reads of Adam's step count."""
    per_block, fixed = plan05.residual_launches()
    model = models.ResidualMLP(in_features=8, width=8, depth=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(2, 8), torch.zeros(2, dtype=torch.long)

    def step():
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert step_launches(step) == 3 * per_block + fixed and per_block >= 10  # LayerNorm, 2 Linear, GELU, the add


def test_the_leak_is_a_derived_size_not_a_regime_that_cannot_fail():
    """Every leak width keeps more than 1 MiB of graph a step, far above the allocator's rounding: said in the leak
    width's why, not checked as a regime that holds by construction."""
    for name in ("Tesla T4", "NVIDIA GeForce RTX 4060 Laptop GPU", "NVIDIA H100 80GB HBM3"):
        plan = plans.plan_for("05", plans.Card.named(name))
        assert not any("leak" in r.name for r in plan.regimes)
        assert f"{plan05.leak_bytes(plan.leak_width, plan.val_batch) / 2**20:.1f} MiB" in plan.why["leak_width"]
    assert plan05.leak_bytes(min(plan05.LEAK_WIDTHS), plan05.VAL_BATCH) > 2**20
