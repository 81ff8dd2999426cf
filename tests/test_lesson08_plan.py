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
    (plan08.Rates; the GPU's at ``share`` of it) on a fake clock, which also advances by the evaluations and a first
    compile; the losses are the same for every configuration, so each step is judged as training the same job."""

    def __init__(self, card, job, amp, compile_s, share=1.0):
        self.now, self.job, self.compile_s = 0.0, job, compile_s
        self.rates = plan08.Rates.planned(card, job, amp).slower(share)

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


def played_path(monkeypatch, card, job, budget_s, compile_s, amp, share=1.0):
    played = PlayedRates(card, job, amp, compile_s, share)
    data = capstone.ImageData(torch.zeros(job.n_train, 3, 32, 32, dtype=torch.uint8),
                              torch.zeros(job.n_train, dtype=torch.long), torch.zeros(0), torch.zeros(job.n_test))
    base = dict(pipeline="per-sample", batch=job.batch, lr=job.lr, sync_each_step=True, amp=False,
                channels_last=False, fused=False, compile=None, cuda_graph=False)
    races = capstone_races.Races(None, None, data, job, base, budget_s=budget_s, compile_s=compile_s,
                                 planned_rates=plan08.Rates.planned(card, job, amp), device=torch.device("cpu"))
    races.budget = racing.Budget(budget_s, clock=lambda: played.now).pause()
    played.install(monkeypatch, races)
    monkeypatch.setattr(capstone_races.Races, "not_captured", lambda self, options: None)  # a GPU that captures
    steps = [(name, options, None) for name, options in plan08.steps(job, amp)]
    races.measure_noise(steps)
    played.now += 600.0  # the learner reads the plan for ten minutes: no budget spent
    path = races.run_path(steps)
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


@pytest.mark.parametrize("share, seeds, refused", [(plan08.SLOWER, 2, []), (0.5, 2, []), (0.4, 1, []),
                                                   (0.3, 1, ["torch.compile"])])
def test_on_a_t4_the_path_races_every_step_that_fits_at_rates_below_the_plans(monkeypatch, capsys, share, seeds,
                                                                              refused):
    """A T4 reaches less of its peak than the H100 its planned rates are scaled from. Played with its GPU at ``share``
    of them: at plan08.SLOWER (the plan's regime) the noise's two seeds and all seven races fit; the second seed trains
    only where the races still fit after it (below half the rates, they come first); further down, a race that would
    not end in the time left is refused, saying so, the others still race, and the clock stops within the budget."""
    plan = plans.plan_for("08", T4)
    path, played = played_path(monkeypatch, T4, plan.job, plan.budget_s, plan.compile_s, plan.amp, share)
    names = [name for name, _ in plan08.steps(plan.job, plan.amp)]
    steps = {row["step"]: row for row in path.rows}
    assert [row["step"] for row in path.rows[:7]] == names
    assert [name for name in names if not steps[name].get("verdict")] == refused
    assert all(steps[name]["note"].startswith("not raced: planned") for name in refused)
    assert capsys.readouterr().out.count("seed 2 of the job not trained") == 2 - seeds
    assert played.now - 600.0 <= plan.budget_s


def test_a_race_is_planned_as_the_plan_prices_it(monkeypatch):
    """The plan's regime and the lesson's refusals price a race alike (plan08.race_seconds): both sides and another
    seed's round at the rate of the configuration raced, its compile and both runs' evaluations. At the plan's own
    rates, each race the lesson plans before it starts is the plan's."""
    plan = plans.plan_for("08", T4)
    planned = []
    refused = capstone_races.Races.refused
    monkeypatch.setattr(capstone_races.Races, "refused", lambda self, name, options: (
        planned.append((name, self.planned(name, options))), refused(self, name, options))[1])
    monkeypatch.setattr(plan08.Rates, "planned", classmethod(lambda cls, card, job, amp: plan.rates))
    played_path(monkeypatch, T4, plan.job, plan.budget_s, plan.compile_s, plan.amp)
    races = [(name.removeprefix("race: "), s) for name, s in plan08.path_seconds(plan08.steps(plan.job, plan.amp),
                                                                                 plan.rates.of, plan.job,
                                                                                 plan.compile_s)[1:]]
    assert [name for name, _ in planned[:7]] == [name for name, _ in races]
    assert [s for _, s in planned[:3]] == pytest.approx([s for _, s in races[:3]], rel=1e-6)


def test_a_retried_compile_is_planned_on_the_hosts_cores_as_the_first_one():
    """A step's torch.compile tried again was planned at 10 s on any host, while the first compile on a T4's 2 cores
    was planned at 70.7 s: the retry is scaled by the host's cores as the first compile is (and as lessons 06 and 10
    scale theirs), and the lesson's races plan it with the plan's number."""
    t4, h200 = plans.plan_for("08", T4), plans.plan_for("08", H200)
    assert h200.compile_again_s == plan08.COMPILE_AGAIN_S and h200.compile_s == plan08.COMPILE_S  # 16 cores
    assert t4.compile_again_s == round(plan08.COMPILE_AGAIN_S * math.sqrt(16 / 2), 1) == 28.3
    job = t4.job
    data = capstone.ImageData(torch.zeros(job.n_train, 3, 32, 32, dtype=torch.uint8),
                              torch.zeros(job.n_train, dtype=torch.long), torch.zeros(0), torch.zeros(0))
    races = capstone_races.Races(None, None, data, job, {}, compile_s=t4.compile_s, compile_again_s=t4.compile_again_s,
                                 device=torch.device("cpu"))
    kept = {"pipeline": "device", "fused": True}
    races.rates = {capstone_races.key(capstone_races.DEVICE_JOB): math.inf, capstone_races.key(kept): math.inf}
    races.path = racing.Path(races.race, judge=lambda raced: None, current=("fused SGD", kept))
    assert races.planned("torch.compile", {"compile": "default"}) == t4.compile_s
    assert races.planned("torch.compile (again)", {"compile": "default"}) == t4.compile_again_s


def test_the_old_sizes_on_a_t4_race_one_step_of_seven(monkeypatch):
    """The same clock with the sizes lesson 08 had before its plan (the full job, float32 noise, 135 s for the noise and
    the races): the noise spends the budget and every step after the first is refused, as the issue found."""
    path, _ = played_path(monkeypatch, T4, capstone.FULL_SIZES, 135.0, plan08.COMPILE_S, "fp16")
    notes = [row["note"] for row in path.rows]
    assert notes[0] == "kept" and all(note.startswith("not raced") for note in notes[1:]) and len(notes) == 7
