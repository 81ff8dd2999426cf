"""Lesson 11's plan (gpulab/plans/plan11.py): quick mode's sizes kept, the plan's activation predictor lesson 11's own,
FP8 timed only where the card has it (a T4 in full mode says so and measures nothing), and checkpointing raced at a
step that is the GPU's arithmetic."""

import dataclasses
import itertools

import pytest

from gpulab import plans
from gpulab.plans import gpt, plan11

from . import test_lesson11_gpu_path as gpu_path
from .test_lesson11_gpu_path import run

lesson = gpu_path.lesson  # the lesson's fixture, by name in the tests below
CARDS = {name: plans.Card.named(name) for name in ("Tesla T4", "NVIDIA L4", "NVIDIA A100-SXM4-40GB",
                                                     "NVIDIA H100 80GB HBM3")}


def test_quick_mode_keeps_its_sizes():
    for card, amp in [(plans.Card("CPU", None, 2, 0), "bf16"), (CARDS["Tesla T4"], "fp16"),
                      (CARDS["NVIDIA L4"], "bf16")]:
        plan = plans.plan_for("11", card, quick=True)
        assert plan.gpt == gpt.QUICK and plan.memory_batch == 4 and plan.text_bytes == 1_000_000
        assert plan.checkpointing == dict(micro=1, pairs=6) and plan.amp == amp and plan.fp8_here == card.fp8
        assert plan.fp8 == dict(n=[512, 1024, 2048], min_time=0.1, micro=16, pairs=5, lr=6e-4)


def test_the_plans_activation_predictor_is_the_lessons(lesson):
    """The plan sizes lessons 10 and 11 with the predictor lesson 11 writes out: the two agree on every variant, on a
    GPU (softmax's fp32 output kept beside its 16-bit copy) and on a CPU."""
    run(lesson, "def predicted_per_layer")
    for on_gpu in (True, False):
        lesson["on_gpu"] = on_gpu
        for attention, amp, checkpointed, batch in itertools.product(("manual", "sdpa"), (False, True),
                                                                     (False, True), (1, 3)):
            args = (768, 12, 1024, batch, attention, amp, checkpointed)
            assert lesson["predicted_per_layer"](*args) == gpt.activation_bytes_per_layer(*args, gpu=on_gpu), args


def test_fp8_is_timed_only_where_the_card_has_it():
    for name, card in CARDS.items():
        plan = plans.plan_for("11", card)
        names = [r.name for r in plan.regimes]
        if card.fp8:
            assert plan.fp8["n"][0] == 1024 and len(plan.fp8["n"]) >= 4 and plan.fp8_here, name
            assert "FP8 beats bf16 within the crossover's sizes" in names
            assert any(p.name.startswith("FP8's crossover") for p in plan.parts)
        else:
            assert plan.fp8["n"] == [] and not plan.fp8_here and plan.why["fp8"].startswith("no FP8"), name
            assert not any("FP8" in n for n in names) and not any("fp8" in p.name.lower() for p in plan.parts)
            assert "FP8 tensor cores (sm_89+): no FP8 matmul" in str(plan)


def test_a_t4_in_full_mode_says_it_has_no_fp8_and_measures_none(lesson, capsys, results_dir):
    """The FP8 cells with the T4's full-mode plan, the lesson seeing a T4 (sm_75): one line saying why, no row."""
    t4 = CARDS["Tesla T4"]
    lesson.update(plan=plans.plan_for("11", t4), on_gpu=True, capability=(7, 5),
                  info=dataclasses.replace(lesson["info"], name=t4.name, compute_capability=(7, 5)))
    run(lesson, "class Float8Matmul", "fp8_rows = []")
    said = capsys.readouterr().out
    assert "FP8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer" in said and "Tesla T4 is 7.5" in said
    assert lesson["fp8_rows"] == [] and not (results_dir / "11_fp8.csv").exists()


@pytest.mark.parametrize("name", ["Tesla T4", "NVIDIA H100 80GB HBM3"])
def test_checkpointing_races_a_step_that_is_the_gpus_arithmetic(name):
    """On an H100 four sequences of bf16 with SDPA take less GPU time than their launches: the plan races more
    sequences there, so that recomputing the blocks costs time; a T4 needs no more than four."""
    card = CARDS[name]
    plan = plans.plan_for("11", card)
    micro = plan.checkpointing["micro"]
    launches = gpt.launches_s(card, gpt.FULL, "sdpa")
    assert gpt.micro_batch_s(card, gpt.FULL, micro, plan.amp, "sdpa") >= plan11.GPU_BOUND * launches
    assert (micro == 4) == (name == "Tesla T4")
    assert gpt.micro_batch_s(card, gpt.FULL, 4, plan.amp, "sdpa") < plan11.GPU_BOUND * launches or micro == 4
