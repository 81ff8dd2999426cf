"""Lesson 08's GPU branches, run in quick mode on this CPU playing an NVIDIA H200 and a Tesla T4 (tests/cuda_stand_in.py:
it proves the Python around torch.cuda's calls, never the GPU). Every step of the path races here, on a job shrunk to a
few steps: mixed precision with channels_last (bf16 on the H200; fp16 with a GradScaler on the T4), the larger batch,
no per-step sync, fused SGD, torch.compile (its call made, inductor left out: it compiles for minutes on a CPU); the
whole-step CUDA graph runs its warm-up on a side stream and restores the weights, the momentum and the loss scale,
then stops at ``torch.cuda.CUDAGraph``, which only a GPU has: its row says so, nothing is raced. Then the figures, the
summary with ``busy.measure`` of both ends of the path (the 2026-11-28 H200 run crashed there) and the explanation of
each step that did not help."""

import functools
import math
from dataclasses import replace

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

import gpulab
from gpulab import capstone, datasheets, flops, plans, racing
from gpulab.models import SpeedrunNet

from .cuda_stand_in import GpuOnly, installed
from .test_mfu_lessons_03_04 import run

TINY = capstone.Sizes((4, 8, 16, 32), 128, 64, 2, 2, 16, 0.05, 2)  # 2 epochs of 8 steps, 2 rounds an epoch
SETUP = ("USE_CIFAR10 = False", "probe = SpeedrunNet", "def train_naive", "BASE = dict(", "def job(", "def captured(",
         "STEPS = [")
GRAPH_STEP = dict(pipeline="device", channels_last=True, amp=True, cuda_graph=True, fused=True, sync_each_step=False)


@pytest.fixture(params=["NVIDIA H200", "Tesla T4"])
def lesson(request, monkeypatch, results_dir):
    """Lesson 08 up to its steps, on the stand-in playing the card, its plan's job shrunk; torch.compile records its
    call and returns the model; the matmul ceilings are the card's datasheet (a GPU-sized product takes minutes on a
    CPU); every GradScaler made is kept."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *a, **k: None)
    compiled, scalers = [], []
    monkeypatch.setattr(torch, "compile", lambda model, **options: compiled.append(options) or model)
    card = request.param
    monkeypatch.setattr(flops, "ceilings", lambda precisions, device=None, **kw: {
        p: flops.Ceiling(p, 0.7 * datasheets.peak(card, p), datasheet_tflops=datasheets.peak(card, p))
        for p in precisions})
    scaler_class = torch.amp.GradScaler

    def keeping(*args, **kwargs):
        scalers.append(scaler_class(*args, **kwargs))
        return scalers[-1]

    monkeypatch.setattr(torch.amp, "GradScaler", keeping)
    with installed(card):
        plan = plans.plan_for("08", plans.Card.here(quick=True), quick=True)
        plan = replace(plan, sizes={**plan.sizes, "job": TINY})
        scope = run({"device": torch.device("cpu"), "gpulab": gpulab, "display": lambda *a: None, "plan": plan}, "08",
                    *SETUP)
        scope.update(compiled=compiled, scalers=scalers, card=card)
        yield scope
    torch.set_float32_matmul_precision("highest")
    plt.close("all")


def test_the_lessons_gpu_branches_run_on_the_stand_in_up_to_the_graph_capture_and_on_to_the_summary(lesson):
    t4 = lesson["card"] == "Tesla T4"
    assert lesson["on_gpu"] and lesson["info"].name == lesson["card"]
    assert lesson["amp_dtype"] == (torch.float16 if t4 else torch.bfloat16)
    assert torch.get_float32_matmul_precision() == "high"
    assert [not_here for *_, not_here in lesson["STEPS"]] == [None] * 7  # every step races on a GPU, a T4's included

    # the whole-step CUDA graph: warm-up on a side stream, the weights and the loss scale restored, then the capture
    model = SpeedrunNet(TINY.widths).to(lesson["device"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(GpuOnly, match="CUDAGraph"):
        lesson["job"](model, lesson["data"], 0, **GRAPH_STEP)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the warm-up's steps undone
    scaler = lesson["scalers"][-1]
    assert scaler.is_enabled() == t4  # fp16 only: bf16 needs no loss scale
    if t4:
        assert scaler.get_scale() == 2.0**16 and scaler.state_dict()["_growth_tracker"] == 0  # as a fresh scaler's

    run(lesson, "08", "log = gpulab.ResultLog(", "races.run_path(", "races.loss_figure()", "races.waterfall(",
        "final, final_options = path.current", "races.explain_dropped(")
    rows = pd.DataFrame(lesson["path"].rows).set_index("step")
    raced = [step for step, _, _ in lesson["STEPS"][:6]]
    assert rows.loc[raced, "verdict"].notna().all()
    amp = "float16" if t4 else "bfloat16"
    assert rows.loc[raced, "judged_on"].to_dict() == {
        "data on the GPU": "losses", f"channels_last + autocast {amp}": "accuracy", "batch 32, lr ×2": "accuracy",
        "no per-step sync": "losses", "fused SGD": "losses", "torch.compile": "losses"}
    assert rows.loc["data on the GPU", "loss_gap"] == 0.0  # the same batches, the same float32 arithmetic here
    assert {"mode": "default"} in lesson["compiled"]
    assert rows.loc["whole step in a CUDA graph", "note"] == (
        "not raced: capturing the step failed here (torch.cuda.CUDAGraph (capture and replay) needs a real GPU: the "
        "CUDA stand-in runs the code around it, never this call)")

    # the summary: busy.measure profiled both ends of the path (CPU activity here: no kernels, said so)
    for measured in (lesson["busy_naive"], lesson["busy_final"]):
        assert measured.steps == 3 and measured.step_ms > 0 and math.isnan(measured.kernel_share)
        assert "no GPU kernels" in measured.note
    summary = lesson["summary"]
    assert summary.loc["samples/s (steady)", "naive job"] == lesson["path"].results["data on the GPU"].baseline.samples_per_s
    mfu = summary.loc["MFU (dense datasheet peak)"]
    assert (mfu > 0).all() and (mfu < 1).all()  # over the card's dense peak (fp16 on the T4), a share
    logged = pd.read_csv(lesson["log"].path)
    assert logged.step.tolist()[:7] == [s for s, *_ in lesson["STEPS"]] and logged.step.iloc[-1] == "optimised vs naive"
    assert isinstance(lesson["judge"].spread, racing.SeedSpread) and len(lesson["judge"].spread.accuracies) == 3


def test_the_speed_targets_use_the_peak_of_the_precision_the_card_trains_in(lesson):
    """Issue 38: the 40 % MFU row of this GPU needed a bf16 peak, so a T4 got none. Its row now uses fp16's."""
    targets = lesson["capstone_races"].speed_targets(7e9, lesson["plan"].amp, lesson["device"])
    mine = targets.loc[f"this GPU ({lesson['card']})"]
    assert mine["precision"] == lesson["plan"].amp
    assert mine["dense peak (TFLOP/s)"] == datasheets.peak(lesson["card"], lesson["plan"].amp)


@pytest.mark.parametrize("lesson", ["Tesla T4"], indirect=True)  # fp16 with a GradScaler: the T4's branch
def test_fused_sgd_under_a_gradscaler_that_skips_its_first_steps_trains_as_the_plain_optimizer(lesson, monkeypatch):
    """fp16's first steps overflow and the GradScaler skips them. Fused SGD makes its momentum with empty_like on its
    first step and writes it in the kernel, which a skipped step never runs (torch/optim/sgd.py, _fused_sgd: torch
    2.6 to 2.14): the next step read unwritten memory and the weights blew up (1e36 on this CPU). The lesson makes the
    momentum zero up front: fused SGD then trains as the plain optimizer does. (Deterministic mode fills memory made
    by torch.empty* with NaN, torch.utils.deterministic.fill_uninitialized_memory: a read of it cannot pass by luck.)"""
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**20))
    batches = [(torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(i)), torch.randint(0, 10, (16,)))
               for i in range(12)]
    trained = []
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    torch.use_deterministic_algorithms(True)
    try:
        for fused in (False, True):
            model = SpeedrunNet(TINY.widths)
            _, step, _ = lesson["job"](model, lesson["data"], 0, amp=True, fused=fused)
            losses = [step(x, y) for x, y in batches]
            trained.append(model)
            assert all(torch.isfinite(loss) for loss in losses), (fused, losses)
    finally:
        torch.use_deterministic_algorithms(False)
    plain, fused = trained
    assert 2.0**10 < lesson["scalers"][-1].get_scale() < 2.0**20  # the first steps overflowed and were skipped
    assert not torch.equal(plain.net[0].weight, SpeedrunNet(TINY.widths).net[0].weight)  # and the later ones trained
    for (name, a), b in zip(plain.state_dict().items(), fused.state_dict().values()):
        assert torch.isfinite(b.float()).all() and torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-5), name


@pytest.mark.gpu
def test_on_a_gpu_the_captured_fp16_step_replays_the_eager_losses_and_skips_an_overflowed_update(monkeypatch,
                                                                                                   results_dir):
    """The T4's branch on a real GPU (the course's H100 and H200 train in bf16, so no lesson run reaches it): lesson
    08's whole step in fp16, with a GradScaler and fused SGD, captured in a CUDA graph. Replayed, it gives the losses
    the same step gives eagerly from the same weights and batches. With a loss scale so large that every gradient
    overflows, a replay skips the update on the device (fused SGD reads the scaler's overflow flag: torch/optim/sgd.py,
    _fused_sgd) and the captured update halves the scale (torch/amp/grad_scaler.py, update)."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    plan = plans.plan_for("08", plans.Card.here(quick=True), quick=True)
    plan = replace(plan, sizes={**plan.sizes, "job": TINY, "amp": "fp16"})
    lesson = run({"device": torch.device("cuda"), "gpulab": gpulab, "plan": plan}, "08", "USE_CIFAR10 = False",
                 "def train_naive", "BASE = dict(", "def job(", "def captured(")
    scalers = []
    scaler_class = torch.amp.GradScaler

    def trained(cuda_graph: bool, steps: int, **scaler_options):
        monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: scalers.append(scaler_class(
            *a, **{**k, **scaler_options})) or scalers[-1])
        torch.manual_seed(0)
        model = SpeedrunNet(TINY.widths, seed=0).to(lesson["device"])
        batches, step, set_lr = lesson["job"](model, lesson["data"], 0, **{**GRAPH_STEP, "cuda_graph": cuda_graph})
        before = [p.detach().clone() for p in model.parameters()]
        losses = []
        for _, (x, y) in zip(range(steps), batches(0)):
            set_lr(TINY.lr)
            losses.append(step(x, y).item())
        return losses, before, list(model.parameters())

    try:
        assert lesson["amp_dtype"] == torch.float16
        eager, _, _ = trained(False, 6)
        replayed, _, _ = trained(True, 6)
        assert scalers[-1].is_enabled() and all(math.isfinite(loss) for loss in replayed)
        assert replayed[0] == pytest.approx(eager[0], rel=1e-3)  # the same weights, momentum and scale as eager's
        assert replayed == pytest.approx(eager, rel=2e-2)
        _, before, after = trained(True, 1, init_scale=2.0**40)  # fp16 gradients overflow at this scale
        assert all(torch.equal(a, b) for a, b in zip(before, after))  # the update was skipped on the device
        assert scalers[-1].get_scale() == 2.0**39  # the captured update backed the scale off once
    finally:
        torch.set_float32_matmul_precision("highest")
