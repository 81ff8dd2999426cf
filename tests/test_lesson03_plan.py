"""Lesson 03's plan (gpulab/plans/plan03.py): quick mode's sizes as before, full mode's from the card; its step model
read from the H100's shipped rows, its knee an upper estimate of the knees the H100 measured, the searches' batches as
find_max_batch tries them, the sizes derived to hold a demonstration (accumulation below the knee, the searches'
out-of-memory error) checked against what they promise, and each regime able to say NO."""

import dataclasses
import math

import nbformat
import pytest

from gpulab import plans
from gpulab.batch_finder import find_max_batch
from gpulab.plans import plan03
from gpulab.results import reference

from .conftest import ROOT

T4, H100, H200 = (plans.Card.named(n) for n in ("Tesla T4", "NVIDIA H100 80GB HBM3", "NVIDIA H200"))
QUICK_BEFORE = dict(cnn_width=16, mlp_width=1024, batch_sizes=[4, 8, 16, 32, 64, 128], repeats=3, warmup=1,
                    compare_min_time=0.2, compare_pairs=5, budget_mib=64, search_max_batch=2**12, granularity=8,
                    effective_batch=64, accumulation_steps=[1, 2, 4], input_features=32, n_train=100_000, n_test=4096,
                    student_width=128, train_seconds=1.0, convergence_batches=[16, 64, 256, 1024, 4096],
                    base_lr=0.004)


def test_quick_mode_keeps_the_sizes_the_lesson_had_on_every_card():
    for card in (plans.Card("CPU", None, 2, 0), T4, H200):
        plan = plans.plan_for("03", card, quick=True)
        assert {k: plan.sizes[k] for k in QUICK_BEFORE} == QUICK_BEFORE and plan.cap_gb is None


def test_the_lesson_reads_every_size_from_its_plan():
    nb = nbformat.read(ROOT / "notebooks" / "03_batching.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "by_mode" not in code and "quick_mode" not in code
    read = {name for name in plan03.QUICK if f"plan.{name}" in code}
    assert read == set(plan03.QUICK), set(plan03.QUICK) - read  # every size the plan gives, the lesson reads


def test_the_step_model_gives_back_the_h100_rows_it_was_read_from():
    rows = reference("03_throughput").query("device_name == @plan03.MEASURED_ON")
    for name in ("SmallCNN", "WideMLP"):
        step, measured = plan03.Step.of(H100, name), rows[rows.model == name].set_index("batch_size").median_s
        for batch in (measured.index.min(), measured.index.max()):  # the two ends it is read from: c, and c + b·s
            assert step.seconds(batch) == pytest.approx(measured[batch], rel=0.02)
        # between them the affine model is as slow as the H100 was or slower (its launches overlap the GPU's work),
        # within the small batches' noise: an upper estimate of each step
        assert all(step.seconds(b) >= 0.95 * t for b, t in measured.items())
        assert step.seconds(256) > 1.2 * measured[256]  # where the overlap hides the most


def test_the_knee_is_an_upper_estimate_of_the_knees_the_h100_measured():
    rows = reference("03_throughput").query("device_name == @plan03.MEASURED_ON")
    for name in ("SmallCNN", "WideMLP"):
        curve = rows[rows.model == name]
        best = curve.samples_per_s.max()
        measured = curve.loc[curve.samples_per_s >= 0.9 * best, "batch_size"].min()  # the lesson's definition
        estimate = plan03.Step.of(H100, name).knee
        assert measured <= estimate <= 4 * measured, (name, measured, estimate)


def test_a_slower_card_has_its_knee_at_a_smaller_batch_and_a_shorter_sweep():
    for name in ("SmallCNN", "WideMLP"):
        assert plan03.Step.of(T4, name).knee < plan03.Step.of(H100, name).knee / 3
    t4, h100 = plans.plan_for("03", T4), plans.plan_for("03", H100)
    assert t4.batch_sizes[-1] < h100.batch_sizes[-1] and t4.cap_gb < h100.cap_gb
    assert t4.batch_sizes[0] == h100.batch_sizes[0] == 8
    assert "tf32" not in str(t4.parts) and "tf32" in str(h100.parts)  # a T4 measures no TF32 ceiling


@pytest.mark.parametrize("fill, max_batch, granularity", [(136, 4096, 8), (4123, 16384, 64), (37_525, 131_072, 64),
                                                          (5000, 4096, 64)])
def test_the_planned_trials_are_those_find_max_batch_tries(fill, max_batch, granularity):
    search = find_max_batch(lambda b: None if b <= fill else _out_of_memory(), max_batch=max_batch,
                            granularity=granularity)
    assert plan03.search_batches(fill, max_batch, granularity) == [t.batch_size for t in search.trials]


def _out_of_memory():
    import torch

    raise torch.OutOfMemoryError("CUDA out of memory (planned)")


def test_the_searches_cap_is_the_usable_memory_or_what_a_trial_fills_in_its_time(monkeypatch):
    assert plans.plan_for("03", H200).cap_gb == pytest.approx(H200.usable_gb(), abs=0.05)
    monkeypatch.setattr(plan03, "TRIAL_S", 0.1)  # a card too slow to fill its memory in a trial's time
    plan = plans.plan_for("03", H200)
    step = plan03.Step.of(H200, "SmallCNN")
    assert plan.cap_gb < H200.usable_gb() and plan.cap_gb == pytest.approx(step.memory_gb(step.batch_within(0.1)),
                                                                         abs=0.1)
    assert all(r.holds for r in plan.regimes)


def test_each_regime_says_no_where_it_does_not_hold(monkeypatch):
    monkeypatch.setattr(plan03, "STEP_S", 0.005)  # no step past 5 ms: the sweep stops before the H100's knees
    monkeypatch.setattr(plan03, "MIN_UPDATES", 10**5)  # more updates than the longest runs make
    plan = plans.plan_for("03", H100)
    assert {r.name for r in plan.regimes if not r.holds} == {r.name for r in plan.regimes}
    assert plan.train_seconds == plan03.MAX_SECONDS


def test_the_minutes_are_the_parts_and_within_the_lessons_target_on_every_card():
    for name in ("Tesla T4", "NVIDIA L4", "NVIDIA GeForce RTX 4060 Laptop GPU", "NVIDIA A100-SXM4-40GB",
                 "NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        plan = plans.plan_for("03", plans.Card.named(name))
        assert plan.minutes == pytest.approx(sum(p.seconds for p in plan.parts) / 60)
        assert math.isfinite(plan.minutes) and plan.minutes <= plan.target_minutes
        assert plan.batch_sizes == sorted(plan.batch_sizes) and plan.search_max_batch > plan.batch_sizes[-1]


def test_full_mode_without_a_gpu_searches_within_the_budget(monkeypatch, results_dir, capsys):
    """GPULAB_QUICK=0 on a CPU plans as an H100, and the searches still need a budget: a CPU has no out-of-memory
    error to catch, and no allocator to cap."""
    from .lesson_cells import Cells

    monkeypatch.setenv("GPULAB_QUICK", "0")
    monkeypatch.delenv("CI", raising=False)
    scope = Cells("03_batching.ipynb").run({"__name__": "__main__"}, "device = gpulab.setup()", "plans.lesson(",
                                           "from gpulab import batch_finder", "def trial(")
    assert scope["plan"].cap_gb and not scope["on_gpu"]
    assert scope["budget"] == 64 * 2**20 and scope["count"] == "tensors"
    assert "Searching within a budget of 64 MiB" in capsys.readouterr().out


CARDS = ("Tesla T4", "NVIDIA L4", "NVIDIA GeForce RTX 4060 Laptop GPU", "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3",
         "NVIDIA H200")


def test_accumulations_micro_batches_lie_below_the_knee_the_h100_measured_and_their_batch_past_it():
    """The H100's shipped rows: SmallCNN at 90 % of its best samples/s from batch 1024 (256: 72 %). Sized from the
    knee's upper estimate (2,872) the effective batch was 8192, whose micro-batches of 1024 cost about 8 %."""
    rows = reference("03_throughput").query("device_name == @plan03.MEASURED_ON and model == 'SmallCNN'")
    knee = rows.loc[rows.samples_per_s >= 0.9 * rows.samples_per_s.max(), "batch_size"].min()
    plan = plans.plan_for("03", H100)
    smallest = plan.effective_batch // plan.accumulation_steps[-1]
    assert smallest < knee <= plan.effective_batch, (smallest, knee, plan.effective_batch)
    ratio = knee / plan03.Step.of(H100, "SmallCNN").knee_at_least  # the H100's knee over its lower bound: 3.2
    for name in CARDS:  # on every card: micro-batches at most the knee's lower bound, their batch past the H100's ratio
        card = plans.Card.named(name)
        plan, bound = plans.plan_for("03", card), plan03.Step.of(card, "SmallCNN").knee_at_least
        assert plan.effective_batch // plan.accumulation_steps[-1] <= bound and plan.effective_batch >= ratio * bound


@pytest.mark.parametrize("name", CARDS)
def test_the_searches_meet_an_out_of_memory_error_even_if_a_sample_held_half_the_bytes_predicted(name):
    card = plans.Card.named(name)
    plan, cnn = plans.plan_for("03", card), plan03.Step.of(card, "SmallCNN")
    for step in (cnn, dataclasses.replace(cnn, sample_bytes=cnn.sample_bytes / 2)):
        fill = step.batch_within_gb(plan.cap_gb)
        trials = plan03.search_batches(fill, plan.search_max_batch, plan.granularity)
        assert max(trials) > fill, (fill, plan.search_max_batch)  # a trial past the cap: out of memory
