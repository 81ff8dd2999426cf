"""Lesson 08's workload: a network with arithmetic to spare (its FLOPs counted and checked against the formula), a
task that needs several epochs and that each broken step a learner could write fails on, and a summary whose every
number comes from the one final race. Quick mode, on the CPU; trainings with fixed seeds (deterministic here)."""

import math
import types

import pytest
import torch
import torch.nn.functional as F

import gpulab
from gpulab import busy, capstone, capstone_races, flops, racing
from gpulab.comparison import Comparison
from gpulab.models import SpeedrunNet

from .test_mfu_lessons_03_04 import code, run

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)

FULL_WIDTHS = (64, 256, 512, 1024)
SEEDS = (0, 1)


def test_the_full_mode_network_does_7_gflop_per_training_image_as_the_formula_says():
    """Every convolution (2·9·C_in·C_out per output pixel) and the classifier, forward and backward (three times
    the forward, less the first convolution's input gradient, which nothing needs), counted by FlopCounterMode."""
    model = SpeedrunNet(FULL_WIDTHS)
    x, y = torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)
    counted = flops.training_flops(model, x, y, loss_fn=F.cross_entropy).total / 2
    stem, *blocks = FULL_WIDTHS
    convs, size, c_in = [(3, stem, 32)], 32, stem
    for c_out in blocks:  # a block: a convolution at its input size, a 2x2 max-pool, a convolution at half that size
        convs += [(c_in, c_out, size), (c_out, c_out, size // 2)]
        size, c_in = size // 2, c_out
    forward = [2 * 9 * a * b * s * s for a, b, s in convs] + [2 * FULL_WIDTHS[-1] * 10]
    assert counted == 3 * sum(forward) - forward[0] == pytest.approx(7.25e9, rel=0.01)
    assert capstone.SIZES.widths != FULL_WIDTHS  # quick mode's network is narrower (this suite runs quick)


def fast_train(data, seed, *, batch=None, lr=None, shuffled_labels=False, normalise=True):
    """Lesson 08's fast job on the CPU (data on the device, crops and flips a whole batch at a time, the recipe's
    schedule), with the broken steps a learner could write switched on; the trained model."""
    batch, lr = batch or capstone.SIZES.batch, lr or capstone.SIZES.lr
    torch.manual_seed(seed)
    model = SpeedrunNet(capstone.SIZES.widths, seed=seed)
    images, labels = F.pad(data.train_images, (4, 4, 4, 4)), data.train_labels
    if shuffled_labels:  # the images shuffled on their own: each label now belongs to another image
        images = images[torch.randperm(len(images))]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=capstone.MOMENTUM, nesterov=True,
                                weight_decay=capstone.WEIGHT_DECAY)
    n, epochs, step = len(labels), capstone.SIZES.epochs, 0
    for _ in range(epochs):
        for index in torch.randperm(n)[: n // batch * batch].view(-1, batch):
            x = augment(images[index])
            x = capstone.normalize(x, data.mean, data.std) if normalise else x.float()
            for group in optimizer.param_groups:
                group["lr"] = capstone.lr_at(step, epochs * (n // batch), lr)
            loss = F.cross_entropy(model(x), labels[index], label_smoothing=capstone.LABEL_SMOOTHING)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
    return model


def augment(padded):
    """A random 32×32 crop of each (already padded) image and a random flip, a whole batch at once."""
    b, pixels = len(padded), torch.arange(32)
    dy, dx = torch.randint(0, 9, (2, b, 1))
    cols = torch.where(torch.rand(b, 1) < 0.5, 31 - pixels, pixels) + dx
    return padded[torch.arange(b)[:, None, None, None], torch.arange(3)[None, :, None, None],
                  (pixels + dy)[:, None, :, None], cols[:, None, None, :]]


def accuracy(model, data, images=None):
    images = data.test_images if images is None else images
    return capstone.evaluate(model, images, data.test_labels, "cpu", mean=data.mean, std=data.std)


@pytest.fixture(scope="module")
def task():
    """Quick mode's data of each seed, and the healthy fast job's test accuracy on it."""
    datasets = {seed: capstone.make_dataset(capstone.SIZES.n_train, capstone.SIZES.n_test, seed=seed) for seed in SEEDS}
    models = {seed: fast_train(datasets[seed], seed) for seed in SEEDS}
    return datasets, models, mean(accuracy(models[s], datasets[s]) for s in SEEDS)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def test_the_naive_job_learns_the_task_over_several_epochs():
    data = capstone.make_dataset(capstone.SIZES.n_train, capstone.SIZES.n_test, seed=0)
    after = {}
    for epochs in (1, capstone.SIZES.epochs):
        torch.manual_seed(0)
        model = SpeedrunNet(capstone.SIZES.widths)
        losses = capstone.slow_train(model, data, epochs=epochs, device="cpu")
        assert len(losses) == epochs * (capstone.SIZES.n_train // capstone.SIZES.batch)
        after[epochs] = accuracy(model, data)
    assert after[capstone.SIZES.epochs] > 0.8 and after[capstone.SIZES.epochs] - after[1] > 0.1, after  # chance: 0.1


def test_the_fast_job_keeps_the_naive_jobs_accuracy(task):
    _, _, healthy = task
    assert healthy > 0.85


@pytest.mark.parametrize("broken", [dict(shuffled_labels=True), dict(normalise=False),
                                    dict(batch=capstone.SIZES.larger * capstone.SIZES.batch)],
                         ids=["labels shuffled against images", "normalisation forgotten",
                              "larger batch, learning rate not rescaled"])
def test_each_broken_step_a_learner_could_write_loses_at_least_5_points(task, broken):
    """Each model is evaluated as the lesson and the check evaluate it (capstone.evaluate normalises its input): a
    training loop that forgot the normalisation learned on other inputs than those it is judged on."""
    datasets, _, healthy = task
    lost = mean(accuracy(fast_train(datasets[s], s, **broken), datasets[s]) for s in SEEDS)
    assert healthy - lost >= 0.05, (healthy, lost)


def test_the_learning_rate_rule_is_what_saves_a_larger_batch(task):
    """The same larger batch with its learning rate rescaled (the linear rule) does far better than without: the
    loss above is the rule's, not the batch's alone."""
    datasets, _, _ = task
    big = capstone.SIZES.larger * capstone.SIZES.batch
    rescaled = mean(accuracy(fast_train(datasets[s], s, batch=big, lr=capstone.SIZES.larger * capstone.SIZES.lr),
                             datasets[s]) for s in SEEDS)
    unscaled = mean(accuracy(fast_train(datasets[s], s, batch=big), datasets[s]) for s in SEEDS)
    assert rescaled - unscaled >= 0.05, (rescaled, unscaled)


def test_augmentation_applied_to_the_test_set_makes_the_accuracy_lower_and_a_moving_target(task):
    """Crops and flips at evaluation: on this task they cost a few points (about 1-6 over six seeds, not the 5 of
    the other broken steps), and the same weights no longer give the same accuracy twice."""
    datasets, models, healthy = task
    torch.manual_seed(0)
    first = {s: accuracy(models[s], datasets[s], augment(F.pad(datasets[s].test_images, (4, 4, 4, 4)))) for s in SEEDS}
    second = {s: accuracy(models[s], datasets[s], augment(F.pad(datasets[s].test_images, (4, 4, 4, 4)))) for s in SEEDS}
    assert mean(first.values()) < healthy and first != second


# ----- the notebook: the summary takes every number from the final race --------------------------------------------

def fake_run(label, seconds, accuracy_after):
    rounds = capstone.SIZES.epochs * capstone.SIZES.rounds
    acc = tuple(accuracy_after if (k + 1) % capstone.SIZES.rounds == 0 else math.nan for k in range(rounds))
    return racing.Run(label, (2.0 * seconds,) + (seconds,) * (rounds - 1), acc, 512)


def test_the_summary_takes_the_naive_job_from_the_first_race_and_the_optimised_one_from_the_race_that_kept_it(
        monkeypatch, results_dir):
    """On the H200 the summary mixed rows (the baseline's busy share was another row's; 39.5x in the table beside
    54.1x in the text). The naive job trains once, in the first race: the summary takes its numbers from that run,
    the optimised configuration's from the race that kept it, the busy shares from windows of the same two
    configurations (the lesson's cell measures them), and races nothing more."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    first = racing.Race(Comparison.of([1.0] * 8, [0.5] * 8, labels=("naive job", "data on the GPU")),
                        fake_run("naive job", 1.0, 0.91), fake_run("data on the GPU", 0.5, 0.92))
    last = racing.Race(Comparison.of([0.5] * 8, [0.125] * 8, labels=("data on the GPU", "fused SGD")),
                       fake_run("data on the GPU", 0.5, 0.92), fake_run("fused SGD", 0.125, 0.93))
    rows = [{"step": "data on the GPU", "kept": True, "vs_previous": 2.0},
            {"step": "fused SGD", "kept": True, "vs_previous": 4.0}]
    races = capstone_races.Races(None, None, capstone.make_dataset(8, 8), capstone.SIZES, {},
                                 log=gpulab.ResultLog("08_capstone"), device=torch.device("cpu"))
    races.path = types.SimpleNamespace(current=("fused SGD", {"pipeline": "device", "fused": True}), rows=rows,
                                       results={"data on the GPU": first, "fused SGD": last})
    races.race = lambda *sides: pytest.fail("the summary races nothing")
    races.judge = types.SimpleNamespace(target=0.88)
    measured = {"naive job": busy.Busy("naive job", 5, 10.0, 0.11, 0.12, 0.5, 0.05),
                "optimised": busy.Busy("optimised", 5, 2.0, 0.97, 0.98, 1.0, 0.85)}
    summary = races.summary(measured["naive job"], measured["optimised"], 1e7, {"fp32": flops.Ceiling("fp32", 0.05)})
    assert summary.loc["samples/s (steady)"].tolist() == [512.0, 4096.0]
    assert summary.loc["seconds to the target"].tolist() == [first.baseline.time_to(0.88), last.candidate.time_to(0.88)]
    assert summary.loc[f"test accuracy after {capstone.SIZES.epochs} epochs"].tolist() == [0.91, 0.93]
    assert summary.loc["GPU busy: kernels (trace)"].tolist() == [0.11, 0.97]
    assert summary.loc["of achievable (measured ceiling)"].tolist() == pytest.approx(
        [512 * 1e7 / 0.05e12, 4096 * 1e7 / 0.05e12])
    row = races.log.frame().iloc[-1]
    assert row["speedup"] == 8.0 and row["speedup_of_kept_steps"] == 8.0  # 4096/512, and 2 x 4
    assert row["kernel_busy"] == 0.97 and row["samples_per_s"] == 4096.0 and row["naive_samples_per_s"] == 512.0


def test_the_path_never_retries_a_step_over_a_later_kept_one():
    """The H200's "torch.compile (again)" replaced the kept reduce-overhead with default: the lesson's path goes through
    racing.Path (capstone_races.Races.run_path), whose test shows the retry refused (tests/test_racing.py)."""
    assert "races.run_path(STEPS)" in code("08", "races.run_path(")
    races = capstone_races.Races(None, None, capstone.make_dataset(8, 8), capstone.SIZES, {})
    races.run_path([])
    assert isinstance(races.path, racing.Path) and races.path.rows == []


def test_each_step_that_did_not_help_is_explained_from_the_trace_of_the_configuration_it_was_raced_on(monkeypatch,
                                                                                                        capsys):
    """Each dropped step reads the busy share of the configuration kept before it (measured once, the ends of the path
    reused), and says which side set the pace in words true of any step: a sync removed on a CPU-bound configuration
    was told 'making the GPU's work faster cannot show'."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    rows = [{"step": "data on the GPU", "kept": True},
            {"step": "channels_last + autocast", "kept": False, "note": racing.SLOWER_HERE, "vs_previous": 0.9},
            {"step": "no per-step sync", "kept": False, "note": racing.WITHIN_NOISE, "vs_previous": 1.0},
            {"step": "fused SGD", "kept": True},
            {"step": "no per-step sync (again)", "kept": False, "note": racing.WITHIN_NOISE, "vs_previous": 1.01}]
    kept = {"data on the GPU": {"pipeline": "device"}, "fused SGD": {"pipeline": "device", "fused": True}}
    path = types.SimpleNamespace(rows=rows, options_of=kept.get)
    profiled = []
    monkeypatch.setattr(busy, "measure", lambda step, label, **kw: profiled.append((label, step)) or busy.Busy(
        label, 10, 5.0, 0.3))
    races = capstone_races.Races(None, None, capstone.make_dataset(8, 8), capstone.SIZES, {})
    races.path = path
    scope = {"races": races, "torch": torch, "final": "fused SGD", "busy_naive": busy.Busy("naive job", 20, 9.0, 0.1),
             "busy_final": busy.Busy("optimised", 20, 1.0, 0.95), "one_step_of": lambda options: options}
    capsys.readouterr()
    run(scope, "08", "races.explain_dropped(")
    assert profiled == [("data on the GPU", {"pipeline": "device"})]  # once, for both steps raced on it
    lines = capsys.readouterr().out.splitlines()
    cpu = ("raced on 'data on the GPU', whose GPU ran kernels 30% of each step: the CPU set the pace: a step shows only "
           "as far as it shortens the CPU's part (data, launches, waits)")
    assert lines == [f"channels_last + autocast: slower here (0.90×) — {cpu}", f"no per-step sync: within noise (1.00×) — {cpu}",
                     "no per-step sync (again): within noise (1.01×) — raced on 'fused SGD', whose GPU ran kernels 95% "
                     "of each step: the GPU set the pace: a step shows only as far as it shortens the kernels"]
