"""Lesson 10's plan (gpulab/plans/plan10.py): the waterfall sized from the card, quick mode's sizes kept, the lesson's
steps the plan's, the races and the head-to-head inside one budget (issue 38: lesson 09's waterfall, now lesson 10's,
raced through racing.Path without one), and a race the card's memory cannot hold not raced, with one line saying why.
The races are played on a clock that advances as the plan's step times say; nothing times a real step."""

import contextlib
import dataclasses
import math
import types

import pytest
import torch

from gpulab import Comparison, flops, plans, racing, step_races
from gpulab.plans import gpt, plan10

from .lesson_cells import Cells

LESSON = Cells("10_gpt_made_fast.ipynb")
T4, H100, H200 = (plans.Card.named(name) for name in ("Tesla T4", "NVIDIA H100 80GB HBM3", "NVIDIA H200"))
CPU = plans.Card("CPU", None, 2, 0)


def test_quick_mode_keeps_its_sizes_and_the_precision_follows_the_card():
    for card, amp in [(CPU, "bf16"), (T4, "fp16"), (H200, "bf16")]:
        plan = plans.plan_for("10", card, quick=True)
        assert plan.gpt == dict(seq_len=64, n_layer=2, n_head=4, n_embd=64) and plan.text_bytes == 1_000_000
        assert plan.waterfall == dict(micro=1, accum=4, pairs=5, lr=2e-3, busy_steps=3)
        assert plan.breaks_min_time == 0.1 and math.isinf(plan.budget_s) and plan.amp == amp
    assert math.isinf(plans.plan_for("10", CPU, quick=True).usable_gb)
    assert plans.plan_for("10", T4, quick=True).usable_gb == T4.usable_gb()


def test_an_h100_keeps_the_waterfalls_sizes_and_a_t4_races_fewer_tokens_a_step():
    h100, t4 = plans.plan_for("10", H100), plans.plan_for("10", T4)
    assert h100.gpt == t4.gpt == gpt.FULL and (h100.waterfall["micro"], h100.waterfall["accum"]) == (4, 8)
    assert t4.waterfall["micro"] * t4.waterfall["accum"] < 4 * 8 and t4.amp == "fp16"
    assert "fp16 autocast, with a GradScaler" in t4.why["amp"]
    assert 0 < t4.budget_s < 60 * t4.target_minutes


@pytest.mark.parametrize("card", [T4, H200], ids=["T4", "H200"])
def test_the_lessons_steps_on_a_gpu_are_the_plans(card):
    plan = plans.plan_for("10", card)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[plan.amp]
    scope = {"WATERFALL": plan.waterfall, "on_gpu": True, "quick_mode": lambda: False, "amp_dtype": dtype,
             "info": types.SimpleNamespace(tf32=card.tf32)}
    LESSON.define(scope, "def run_steps", "STEP_BASE")
    LESSON.define(scope, "cpu_quick = ", "cpu_quick", "larger", "STEPS")
    w, steps = plan.waterfall, scope["STEPS"]
    assert [(name, options) for name, options, not_here in steps if not not_here] == plan10.steps(
        card, w["micro"], w["accum"], plan.amp)
    assert {name: not_here for name, _, not_here in steps if not_here} == (
        {} if card.tf32 else {"TF32": "needs an Ampere or newer GPU"})
    assert scope["STEP_BASE"] == dict(plan10.BASE, micro=w["micro"], accum=w["accum"])


# ----- the waterfall on a clock that advances as the plan's step times say ------------------------------------------

class PlayedRaces:
    """``step_races.race`` replaced: each race advances a fake clock by ``plan10.race_s`` of both sides' predicted
    steps (``slower`` times the plan's) and the compiles it starts with; a step ``within_noise`` names runs as fast as
    the configuration before it, every other faster: by the plan's prediction, or a tenth where it predicts nothing."""

    def __init__(self, card, plan, slower=1.0, within_noise=()):
        self.card, self.plan, self.slower, self.within_noise = card, plan, slower, set(within_noise)
        self.now, self.compiled, self.raced = 0.0, False, []
        self.base = dict(plan10.BASE, micro=plan.waterfall["micro"], accum=plan.waterfall["accum"])

    def step_s(self, options: dict) -> float:
        return self.slower * plan10.config_step_s(self.card, {**self.base, **options}, self.plan.amp)

    def __call__(self, current, candidate) -> step_races.Race:
        (name_a, a), (name_b, b) = current, candidate
        self.raced.append(name_b)
        ta = self.step_s(a)
        tb = ta if name_b in self.within_noise else min(self.step_s(b), 0.9 * ta)
        self.now += plan10.race_s(ta, tb, self.plan.waterfall["pairs"]) + plan10.startup_s(
            a, b, self.compiled, self.plan.compile_s, self.plan.compile_again_s)
        self.compiled = self.compiled or bool(a.get("compile") or b.get("compile"))
        pairs = self.plan.waterfall["pairs"]
        comparison = Comparison.of([ta * (1 + 0.001 * i) for i in range(pairs)],
                                   [tb * (1 - 0.001 * i) for i in range(pairs)], labels=(name_a, name_b))
        return step_races.Race(dataclasses.replace(comparison, candidate_warmup=(tb,)), 1e-3, (4.2, 4.2),
                               (1.0, 1.0), ("a step", "a step"))


def played(card, plan, *, limits=True, **played_options):
    """Lesson 10's waterfall, its steps the plan's, raced on the played clock, then its head-to-head race; the budget
    (``limits``: the plan's, as the lesson sets it) reads the same clock."""
    races = PlayedRaces(card, plan, **played_options)
    ceilings = {p: flops.Ceiling(p, card.tflops(p)) for p in ("fp32", "tf32", plan.amp) if card.tflops(p)}
    meter = step_races.Meter(1e9, ceilings, lambda o: plan10.precision({**races.base, **o}, plan.amp),
                             step_races.Reference(plan.amp, card.sheet.tflops[plan.amp], "the 16-bit peak"))
    chosen = step_races.Limits()
    if limits:
        chosen = step_races.Limits.of(plan, races.base)
        chosen.budget = racing.Budget(plan.budget_s, clock=lambda: races.now).pause()
    waterfall = step_races.Waterfall(races, meter, tokens_per_step=1, log="10_waterfall", limits=chosen,
                                     pairs=plan.waterfall["pairs"])
    w = plan.waterfall
    for name, options in plan10.steps(card, w["micro"], w["accum"], plan.amp):
        races.now += 120.0  # a learner reading between the steps spends none of the budget
        waterfall.step(name, options)
    races.now += 600.0
    waterfall.race_ends()
    return waterfall, races


def spent(races, steps) -> float:
    """The played clock's seconds inside the races: its reading less the reading pauses added."""
    return races.now - 120.0 * steps - 600.0


def test_on_each_cards_plan_every_step_and_the_head_to_head_race_within_the_budget(results_dir):
    for card in (T4, H100):
        plan = plans.plan_for("10", card)
        waterfall, races = played(card, plan)
        steps = plan10.steps(card, plan.waterfall["micro"], plan.waterfall["accum"], plan.amp)
        assert races.raced == [name for name, _ in steps] + [f"{steps[-1][0]} (final)"], card.name
        assert all(row.get("verdict") == "faster" for row in waterfall.path.rows)
        assert spent(races, len(steps)) <= plan.budget_s, card.name


def test_on_a_t4_slower_than_planned_the_budget_stops_the_late_races_and_the_head_to_head_still_fits(results_dir,
                                                                                                    capsys):
    """Issue 38: the waterfall raced through racing.Path without a budget (about 12 minutes on a T4, estimated). At a
    third of the plan's rates, without a budget (as the lesson was) its races run past the budget; with it, the late
    steps are refused with one line each, and the races and the head-to-head end within it."""
    plan = plans.plan_for("10", T4)
    _, unlimited = played(T4, plan, limits=False, slower=3.0)
    steps = len(plan10.steps(T4, plan.waterfall["micro"], plan.waterfall["accum"], plan.amp))
    assert spent(unlimited, steps) > plan.budget_s
    waterfall, races = played(T4, plan, slower=3.0)
    refused = [row for row in waterfall.path.rows if row["note"].startswith("not raced: planned")]
    assert refused and "for the head-to-head after it" in refused[0]["note"]
    assert races.raced[-1].endswith("(final)") and spent(races, steps) <= plan.budget_s
    assert "racing autocast float16: planned" not in capsys.readouterr().out  # the first race always runs, unplanned


# ----- the micro-batch race's guard against running out of memory ----------------------------------------------------

def test_the_predictor_gives_the_issues_13_gb_for_fp16_without_sdpa_at_micro_batch_16():
    """Issue 38: lesson 09's own predictor gives about 13 GB of activations for the larger micro-batch (16 × 1024) in
    fp16 with attention written out: most of a T4's 15 GB."""
    T, L, heads, d = gpt.size_of(gpt.FULL)
    activations = L * gpt.activation_bytes_per_layer(d, heads, T, 16, "manual", amp=True) / 1e9
    assert 12.5 < activations < 14.0
    assert plan10.race_gb(gpt.FULL, dict(plan10.BASE, micro=16, amp=True)) > T4.usable_gb()
    assert plan10.race_gb(gpt.FULL, dict(plan10.BASE, micro=16, amp=True, attention="sdpa")) <= T4.usable_gb()


@pytest.mark.parametrize("sdpa_kept", [True, False])
def test_a_larger_micro_batch_that_would_not_fit_is_not_raced_and_says_why(results_dir, sdpa_kept):
    """A T4 given the H100's sizes (4 × 8, so 16 × 2 for the larger micro-batch): with SDPA kept the larger micro-batch
    races; with SDPA not faster here, attention written out in fp16 at 16 sequences would not fit, and its row says so
    in one line, nothing raced."""
    plan = dataclasses.replace(plans.plan_for("10", T4), sizes={**plans.plan_for("10", T4).sizes,
                                                               "waterfall": plans.plan_for("10", H100).waterfall,
                                                               "budget_s": math.inf})
    waterfall, races = played(T4, plan, within_noise=() if sdpa_kept else ("SDPA",))
    row = next(r for r in waterfall.path.rows if r["step"] == "micro-batch 16 × 2")
    if sdpa_kept:
        assert "micro-batch 16 × 2" in races.raced and row["kept"]
    else:
        assert "micro-batch 16 × 2" not in races.raced and not row["kept"]
        need = plan10.race_gb(gpt.FULL, dict(plan10.BASE, micro=16, accum=2, amp=True))
        assert row["note"] == (f"not raced: two runs of it need about {need:.1f} GB (predicted), more than the "
                               f"{T4.usable_gb():.1f} GB this card's plan fills")


def measured_peak(size: dict, attention: str, batch: int) -> int:
    """The most a second fp32 training step of text.GPT allocates on the CPU (a MemoryTracker counts every tensor as the
    allocator would), above the weights and AdamW's moments made by the first."""
    from gpulab import text
    from gpulab.memory import MemoryTracker

    model = text.GPT(text.GPTConfig(**size, attention=attention))
    optimizer = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, text.VOCAB, (batch, size["seq_len"]), generator=torch.Generator().manual_seed(0))
    for tracked in (False, True):
        with MemoryTracker() if tracked else contextlib.nullcontext() as tracker:
            optimizer.zero_grad(set_to_none=True)
            model(idx, idx).backward()
            optimizer.step()
    return tracker.peak


def test_the_planned_memory_bounds_a_measured_training_step():
    """gpt.training_gb against a step's peak, written out and fused, fp32: at or above it, and within twice it."""
    size = dict(seq_len=128, n_layer=2, n_head=4, n_embd=64)
    for attention in ("manual", "sdpa"):
        held = 12 * gpt.parameters(size)  # weights and moments, alive before the tracker
        predicted = gpt.training_gb(size, 4, attention, amp=False) * 1e9 - held
        peak = measured_peak(size, attention, 4)
        assert peak <= predicted <= 2 * peak, (attention, peak, predicted)
