"""Lesson 09's plan (gpulab/plans/plan09.py) and the GPT's predictors it shares with lessons 10 and 11
(gpulab/plans/gpt.py): quick mode's sizes kept, the H100's sizes those the lesson had, a smaller card's first run and
attention sweep cut to its memory, the predictors against FlopCounterMode, the model's parameters and the H200's full
run; and the lesson's backends table, as a T4 and an H200, finding the backends the plan says each card runs."""

import pandas as pd
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gpulab import plans, text
from gpulab.plans import gpt, plan09

from . import test_lesson09_gpu_path as gpu_path
from .conftest import ROOT
from .test_lesson09_gpu_path import run

lesson = gpu_path.lesson  # the lesson's fixture, by name in the test below

T4, H100, H200 = (plans.Card.named(name) for name in ("Tesla T4", "NVIDIA H100 80GB HBM3", "NVIDIA H200"))
LAPTOP = plans.Card.named("NVIDIA GeForce RTX 4060 Laptop GPU")
FIRST_RUN = ROOT / "tests" / "data" / "lesson09" / "2026-11-28-h200" / "09_first_run.csv"


def test_quick_mode_keeps_its_sizes_and_the_precision_follows_the_card():
    for card, amp in [(plans.Card("CPU", None, 2, 0), "bf16"), (T4, "fp16"), (H200, "bf16")]:
        plan = plans.plan_for("09", card, quick=True)
        assert plan.gpt == dict(seq_len=64, n_layer=2, n_head=4, n_embd=64) and plan.amp == amp
        assert plan.first_run == dict(text_bytes=1_000_000, micro=4, steps=64, stretch=16, lr=2e-3, val_batches=4)
        assert plan.attention == dict(batch=4, lengths=[64, 128, 256, 512], sweep_batch=2, min_time=0.03)


def test_an_h100_gets_the_sizes_the_lesson_had():
    plan = plans.plan_for("09", H100)
    assert plan.gpt == dict(seq_len=1024, n_layer=8, n_head=12, n_embd=768)
    assert plan.first_run == dict(text_bytes=None, micro=8, steps=60, stretch=20, lr=6e-4, val_batches=8)
    assert plan.attention == dict(batch=8, lengths=[512, 1024, 2048, 4096, 8192], sweep_batch=4, min_time=0.1)


def test_a_smaller_card_runs_the_same_gpt_within_its_memory():
    """The laptop's 8 GB cannot hold the first run at 8 sequences (attention written out in fp32); a T4's cannot hold
    SDPA's math kernel at T = 4096: each plan stops below, and its sizes say so."""
    laptop, t4 = plans.plan_for("09", LAPTOP), plans.plan_for("09", T4)
    assert gpt.training_gb(gpt.FULL, 8, "manual", amp=False) > LAPTOP.usable_gb() and laptop.first_run["micro"] == 4
    assert laptop.gpt == t4.gpt == gpt.FULL
    assert plan09.sweep_gb(4096) > T4.usable_gb() >= plan09.sweep_gb(2048)
    assert t4.attention["lengths"] == [512, 1024, 2048] and t4.amp == "fp16"
    assert plan09.forced(T4) == ["memory-efficient", "math"] and set(plan09.forced(H200)) == {
        "flash", "cuDNN", "memory-efficient", "math"}


def test_the_gpts_flops_and_parameters_are_what_the_model_counts():
    """gpt.flops_per_token against FlopCounterMode over a training step of text.GPT on the meta device, and
    gpt.parameters against the model's own (the tied matrix once)."""
    for size in (gpt.FULL, gpt.QUICK):
        with torch.device("meta"):
            model = text.GPT(text.GPTConfig(**size))
            idx = torch.zeros(1, size["seq_len"], dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            model(idx, idx).backward()
        assert gpt.flops_per_token(size) == counter.get_total_flops() / size["seq_len"]
        assert gpt.parameters(size) == sum(p.numel() for p in model.parameters())


def test_the_step_predictor_gives_the_h200s_full_first_run():
    """Its shares come from the H200's run of 2026-11-28: the first run's step (8 × 1024 tokens in fp32, attention
    written out) predicted within 2 % of the 100.9 ms measured."""
    row = pd.read_csv(FIRST_RUN).iloc[-1]
    assert row.device_name == "NVIDIA H200" and not row.quick and int(row.micro_batch) == 8
    predicted = gpt.step_s(H200, gpt.FULL, 8, 1, "fp32", "manual")
    assert predicted == pytest.approx(row.step_s, rel=0.02)


# PyTorch's choice in the lesson's precision (fp16 on a T4, bf16 from sm80): cuDNN first on an H200 with this torch's
# cuDNN (tests/stand_in_architecture.py prefers_cudnn), flash on an L4 (sm89), memory-efficient on a T4 (sm75)
CHOSEN = {"Tesla T4": "efficient", "NVIDIA L4": "flash", "NVIDIA H200": "cudnn"}


@pytest.mark.parametrize("cuda_stand_in", ["Tesla T4", "NVIDIA L4", "NVIDIA H200"], indirect=True)
def test_the_backends_table_as_each_card_finds_the_backends_the_plan_says_it_runs(cuda_stand_in, lesson):
    """As a T4 the cell stopped with NoDeviceEvents (the stand-in's trace has no GPU kernels; its operators are the
    evidence now); flash and cuDNN are refused there with torch's own reason, the card's sm 7.5 (the table cut it off
    after torch's title line), memory-efficient and math run. The L4 runs the lesson's sm89 rules (flash in bf16)."""
    card = plans.Card.named(cuda_stand_in.card.name)
    assert lesson["on_gpu"] and lesson["plan"].amp == card.amp_precision
    run(lesson, "att_dtype = ")
    assert set(cuda_stand_in.attention) == {CHOSEN[card.name]}
    run(lesson, "BACKENDS = ")
    assert set(lesson["runs_here"]) == set(plan09.forced(card))
    table = next(d for d in lesson["displayed"] if isinstance(d, pd.DataFrame)).set_index("forced")
    refused = {b for b in ("flash", "cuDNN") if table.loc[b, "evidence"].startswith("cannot run here")}
    assert refused == ({"flash", "cuDNN"} if card.name == "Tesla T4" else set())
    for backend in refused:
        why = table.loc[backend, "evidence"]
        assert why.lower().startswith(f"cannot run here: {backend.lower()}") and why.endswith("a sm 7.5 gpu.")
        assert "not used because" not in why and "runtime disabled" not in why and "Triggered internally" not in why
