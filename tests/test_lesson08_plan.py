"""Lesson 08's plan (gpulab/plans/plan08.py): the job sized from the card, its FLOPs and memory predicted as a real
step counts them, quick mode's sizes kept, the lesson's steps the plan's, and on a T4 (issue 38) every one of the
seven steps raced within the budget: the noise and the races played on a clock that advances as the plan's rates
say, the old sizes refusing all but the first race on the same clock."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from gpulab import capstone, capstone_races, flops, plans, racing
from gpulab.comparison import Comparison
from gpulab.memory import MemoryTracker
from gpulab.models import SpeedrunNet
from gpulab.plans import plan08

from .test_mfu_lessons_03_04 import code

T4, H200 = plans.Card.named("Tesla T4"), plans.Card.named("NVIDIA H200")


@pytest.mark.parametrize("widths", [(64, 256, 512, 1024), (16, 64, 128, 256), (4, 8, 16, 32)])
def test_the_planned_flops_are_what_flopcountermode_counts(widths):
    model = SpeedrunNet(widths)
    counted = flops.training_flops(model, torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long),
                                   loss_fn=F.cross_entropy).total / 2
    assert plan08.training_flops(widths) == counted


def test_the_planned_memory_bounds_a_measured_training_step():
    """The activations a float32 step keeps (MemoryTracker counts every tensor made on the CPU as the allocator would),
    against the plan's: at or above the measurement, and within twice it."""
    widths, batch = (16, 64, 128, 256), 32
    model = SpeedrunNet(widths)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()  # the momentum buffers and gradients exist: the peak above them is the step's activations
    with MemoryTracker() as tracker:
        step()
    job = replace(capstone.FULL_SIZES, widths=widths, n_train=0, batch=batch, larger=1)
    states = 2 * 3 * 4 * sum(p.numel() for p in model.parameters())  # the plan's two jobs' weights, grads, momentum
    predicted = plan08.memory_gb(job) * 1e9 - states
    assert tracker.peak <= predicted <= 2 * tracker.peak, (tracker.peak, predicted)


def test_quick_mode_keeps_its_sizes_and_its_precision_follows_the_card():
    cpu = plans.Card("CPU", None, 2, 0)
    for card, amp in [(cpu, "bf16"), (T4, "fp16"), (H200, "bf16")]:
        plan = plans.plan_for("08", card, quick=True)
        assert plan.job == capstone.QUICK_SIZES == capstone.Sizes((4, 8, 16, 32), 1536, 1024, 3, 3, 64, 0.05, 2)
        assert plan.amp == amp and math.isinf(plan.budget_s) and math.isnan(plan.minutes)


def test_a_t4_gets_a_narrower_network_than_an_h200_because_the_full_one_would_leave_its_naive_job_gpu_bound():
    """The full network in float32 on a T4's CUDA cores takes longer per image than the per-sample pipeline: the data
    step would have nothing to win. The plan says so of those sizes, and picks a narrower network there."""
    full = replace(capstone.FULL_SIZES, n_train=plan08.IMAGES[-1])
    rates = plan08.Rates.planned(T4, full, "fp16")
    regimes = {r.name: r for r in plan08.regimes(T4, full, rates, [("noise", 0.0)], 1e9)}
    assert not regimes["the input pipeline sets the naive job's pace"].holds
    t4, h200 = plans.plan_for("08", T4), plans.plan_for("08", H200)
    assert t4.job.widths < h200.job.widths == capstone.FULL_SIZES.widths
    assert t4.amp == "fp16" and "fp16 autocast, with a GradScaler" in t4.why["amp"]


@pytest.mark.parametrize("card_name", ["Tesla T4", "NVIDIA H200"])
def test_the_lessons_steps_on_a_gpu_are_the_plans(card_name):
    plan = plans.plan_for("08", plans.Card.named(card_name))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[plan.amp]
    scope = {"sizes": plan.job, "n_train": plan.job.n_train, "on_gpu": True, "quick_mode": lambda: False,
             "torch": torch, "amp_dtype": dtype}
    exec(compile(code("08", "STEPS = ["), "<lesson 08: STEPS>", "exec"), scope)
    assert [(name, options) for name, options, _ in scope["STEPS"]] == plan08.steps(plan.job, plan.amp)
    assert [not_here for *_, not_here in scope["STEPS"]] == [None] * 7  # every step races on a GPU, a T4's included


# ----- the noise and the path on a clock that advances as the plan's rates say ------------------------------------

class PlayedRates:
    """``racing.alone`` and ``racing.race`` replaced: each round takes its images over the configuration's planned rate
    (plan08.Rates) on a fake clock, which also advances by the evaluations and a first compile; the losses are the
    same for every configuration, so each step is judged as training the same job."""

    def __init__(self, card, job, amp, compile_s):
        self.now, self.rates, self.job, self.compile_s = 0.0, plan08.Rates.planned(card, job, amp), job, compile_s

    def run(self, options, rounds, label="") -> racing.Run:
        images = replace(self.job, batch=(options or {}).get("batch", self.job.batch)).images_per_round
        per_round = images / self.rates.of(options)
        evaluations = rounds // self.job.rounds * self.job.n_test / (3 * self.rates.device)
        self.now += rounds * per_round + evaluations
        return racing.Run(label, (per_round,) * rounds, (0.9,) * rounds, images, ((2.0, 1.9, 1.8),) * rounds)

    def install(self, monkeypatch, races):
        monkeypatch.setattr(races, "session", lambda options, seed=0: (options, lambda: 0.9))

        def alone(options, *, rounds, label="", **kw):
            return self.run(options, rounds, label)

        def race(a, b, *, rounds, labels, same_arithmetic, other_seed, **kw):
            self.now += self.compile_s if b.get("compile") and not (a or {}).get("compile") else 0.0
            base, candidate = self.run(a, rounds, labels[0]), self.run(b, rounds, labels[1])
            comparison = Comparison.of(base.seconds[1:], candidate.seconds[1:], labels=labels)
            return racing.Race(comparison, base, candidate, same_arithmetic=same_arithmetic, other_seed=other_seed)

        monkeypatch.setattr(racing, "alone", alone)
        monkeypatch.setattr(racing, "race", race)


def played_path(monkeypatch, card, job, budget_s, compile_s, amp):
    played = PlayedRates(card, job, amp, compile_s)
    data = capstone.ImageData(torch.zeros(job.n_train, 3, 32, 32, dtype=torch.uint8),
                              torch.zeros(job.n_train, dtype=torch.long), torch.zeros(0), torch.zeros(job.n_test))
    base = dict(pipeline="per-sample", batch=job.batch, lr=job.lr, sync_each_step=True, amp=False,
                channels_last=False, fused=False, compile=None, cuda_graph=False)
    races = capstone_races.Races(None, None, data, job, base, budget_s=budget_s, compile_s=compile_s,
                                 device=torch.device("cpu"))
    races.budget = racing.Budget(budget_s, clock=lambda: played.now).pause()
    played.install(monkeypatch, races)
    monkeypatch.setattr(capstone_races.Races, "not_captured", lambda self, options: None)  # a GPU that captures
    races.measure_noise()
    played.now += 600.0  # the learner reads the plan for ten minutes: no budget spent
    path = races.run_path([(name, options, None) for name, options in plan08.steps(job, amp)])
    return path, played


def test_on_a_t4s_plan_every_step_races_within_the_budget(monkeypatch):
    """Issue 38: the two noise seeds trained the full job before the races (about 6 minutes on a T4), so the 135 s
    budget was spent before the first race and every later step was refused: 1 of 7 raced. On the T4's plan, played at
    its own rates, all seven race, and the noise and races end within the budget."""
    plan = plans.plan_for("08", T4)
    path, played = played_path(monkeypatch, T4, plan.job, plan.budget_s, plan.compile_s, plan.amp)
    steps = path.rows[:7]
    assert [row["step"] for row in steps] == [name for name, _ in plan08.steps(plan.job, plan.amp)]
    assert all(row.get("verdict") for row in steps), steps  # raced: a verdict, not "not raced"
    assert [row["kept"] for row in steps[:2]] == [True, True]  # the data on the GPU and fp16: faster at the plan's rates
    assert played.now - 600.0 <= plan.budget_s


def test_the_old_sizes_on_a_t4_race_one_step_of_seven(monkeypatch):
    """The same clock with the sizes lesson 08 had before its plan (the full job, float32 noise, 135 s for the noise and
    the races): the noise spends the budget and every step after the first is refused, as the issue found."""
    path, _ = played_path(monkeypatch, T4, capstone.FULL_SIZES, 135.0, plan08.COMPILE_S, "fp16")
    notes = [row["note"] for row in path.rows]
    assert notes[0] == "kept" and all(note.startswith("not raced") for note in notes[1:]) and len(notes) == 7
