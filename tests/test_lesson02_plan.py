"""Lesson 02's plan (gpulab/plans/plan02.py): the input pipeline's workload chosen so that the naive pipeline starves
each card's GPU (issue 38: ResNet-50 at 128² in fp32 is a T4's own bottleneck), its FLOPs and memory as a real step
counts them, its rates read from the shipped runs, quick mode's sizes kept, every size of the lesson the plan's, and
the lesson saying from its own numbers whether the GPU starved and what more workers can buy."""

import math

import nbformat
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import torchvision

from gpulab import flops, plans
from gpulab.comparison import Comparison
from gpulab.memory import MemoryTracker
from gpulab.plans import plan02
from gpulab.timing import Measurement
from gpulab.transfers import MiB

from .conftest import ROOT
from .test_lesson02_busy import run

T4, H100 = plans.Card.named("Tesla T4"), plans.Card.named("NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("model, crop", [("resnet18", 96), ("squeezenet1_1", 128)])
def test_the_planned_flops_are_what_flopcountermode_counts_at_that_crop(model, crop):
    with torch.device("meta"):
        net = getattr(torchvision.models, model)(num_classes=10)
        x, y = torch.empty(2, 3, crop, crop), torch.zeros(2, dtype=torch.long)
    counted = flops.training_flops(net, x, y, F.cross_entropy).total / 2
    assert plan02.network(model, crop).flops == counted


def test_the_workloads_are_tried_heaviest_first():
    work = [plan02.network(model, crop).flops for model, crop in plan02.WORKLOADS]
    assert work == sorted(work, reverse=True)


def test_the_planned_memory_bounds_a_measured_training_step():
    """The tensors a float32 step of SqueezeNet makes at its peak on the CPU (MemoryTracker counts them as the
    allocator would; the gradients of the step before are alive during the forward) against the plan's, less the
    weights, momentum and data set the tracker does not see: at or above the measurement, and within three times it."""
    torch.manual_seed(0)
    model = torchvision.models.squeezenet1_1(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(plan02.BATCH, 3, 64, 64), torch.randint(0, 10, (plan02.BATCH,))

    def step():
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()
    with MemoryTracker() as tracker:
        step()
    pipe = plan02.Pipeline.of(H100, "squeezenet1_1", 64)
    unseen = 8 * pipe.net.params + plan02.BATCH * plan02.BATCHES_PER_EPOCH * 3 * pipe.image_size**2
    predicted = pipe.memory_gb * 1e9 - unseen
    assert tracker.peak <= predicted <= 3 * tracker.peak, (tracker.peak, predicted)


def test_the_rates_come_from_the_shipped_runs():
    """The naive pipeline's cost an image and the bytes the step moves beyond its arithmetic: the H100's rows of lesson
    02's loader sweep (ResNet-50 at 224², 0 workers 158.8 images/s, data on the device 1,695), and the H200's 1.72 ms
    at 32²; pageable copies at the H100 VM's 9.23 GB/s (02_transfer_bandwidth, 256 MiB)."""
    crop, image_s, moved = plan02._anchors()
    assert crop == 224 and image_s == pytest.approx(1 / 158.80855 - 1 / 1694.99159)
    net = plan02.network("resnet50", 224)
    rest_s = 1 / 1694.99159 - net.flops / (H100.tflops("tf32") * 1e12)
    assert moved == pytest.approx(rest_s * H100.copy_gbs * 1e9 / net.activation_bytes)
    assert plan02.image_s(32) == pytest.approx(1.72e-3) and plan02.image_s(224) == pytest.approx(image_s)
    assert plan02.Pipeline.of(H100, "resnet50", 224).gpu_rate == pytest.approx(1694.99159)  # its own anchor back
    assert plan02.pageable_gbs() == pytest.approx(9.225779, rel=1e-6)


def test_a_cuda_core_cards_step_is_mostly_its_arithmetic_at_its_fp32_rate():
    """The H100's ResNet-50 step reached 11.4 % of its TF32 tensor cores' rate; applied to a T4's fp32 CUDA cores that
    share made the step 8.8× its arithmetic (91 images/s at 128²). The rest of the step is memory traffic, at the T4's
    bandwidth: the step is about twice its arithmetic there, and on tensor-core cards several times it."""
    t4 = plan02.Pipeline.of(T4, "resnet50", 128)
    assert t4.precision == "fp32" and t4.arithmetic_s <= t4.step_s <= 3 * t4.arithmetic_s
    h100 = plan02.Pipeline.of(H100, "resnet50", 128)
    assert h100.precision == "tf32" and h100.step_s > 5 * h100.arithmetic_s


def test_on_a_t4_todays_resnet50_at_128_is_not_starved_and_the_plan_starves_it():
    """Issue 38: ResNet-50 in fp32 at 128² trains on a T4 about as fast as one core augments its images, so the naive
    pipeline does not starve it. The plan takes a lighter workload there (ResNet-18 at 128²), which the T4 trains
    several times faster than one core feeds it; with 2 vCPUs the workers cannot feed it either, and the plan says the
    GPU's pipeline does."""
    today = plan02.Pipeline.of(T4, "resnet50", 128)
    assert not plan02.starving(today).holds and today.gpu_rate < plan02.STARVE * today.naive_rate
    plan = plans.plan_for("02", T4)
    assert (plan.model, plan.crop) == ("resnet18", 128)
    starve, feed = plan.regimes[:2]
    assert starve.holds and feed.holds and "more workers cannot feed it" in feed.detail
    assert "CUDA cores: the FLOPs at its fp32 rate" in starve.detail
    pipe = plan02.Pipeline.of(T4, plan.model, plan.crop)
    assert pipe.gpu_rate >= plan02.STARVE * pipe.naive_rate and pipe.host_rate < pipe.gpu_rate


def test_with_enough_cores_the_workers_feed_the_card_and_an_h100_keeps_todays_workload():
    assert plans.plan_for("02", plans.Card.named("Tesla T4", cpus=16)).regimes[1].detail.startswith("the loader's workers")
    plan = plans.plan_for("02", H100)
    assert (plan.model, plan.image_size, plan.crop, plan.batch_size) == ("resnet50", 160, 128, 64)
    assert plan.workers == [0, 2, 8, 15] and plan.copy_bytes == 64 * MiB


def test_a_card_that_no_workload_starves_gets_the_lightest_and_is_told_so(monkeypatch):
    monkeypatch.setattr(plan02, "STARVE", math.inf)
    plan = plans.plan_for("02", T4)
    assert (plan.model, plan.crop) == plan02.WORKLOADS[-1] and not plan.regimes[0].holds


def test_quick_mode_keeps_todays_sizes():
    for card in (plans.Card("CPU", None, 2, 0), T4):
        plan = plans.plan_for("02", card, quick=True)
        assert plan.sizes == dict(
            compare_min_time=0.2, compare_pairs=5, copy_bytes=16 * MiB, sweep_min_time=0.05,
            prefetch_batch_bytes=4 * MiB, prefetch_batches=4, hazard_floats=2**20, hazard_side=1024, hazard_matmuls=5,
            model="squeezenet1_1", image_size=48, crop=32, batch_size=8, batches_per_epoch=3, step_repeats=3,
            busy_steps=3, min_steady=3, workers=[0, 2], nvml_seconds=0.2)
        assert math.isnan(plan.minutes)


def test_every_size_the_lesson_uses_is_the_plans():
    """Today's lesson chose its sizes with by_mode(full=..., quick=...), fixed for an H100."""
    path = next((ROOT / "notebooks").glob("02_*.ipynb"))
    source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    assert "by_mode" not in source and "quick_mode" not in source
    unread = [name for name in plan02.QUICK if f"plan.{name}" not in source]
    assert not unread, unread


# ---- what the lesson says from its own numbers ------------------------------------------------------------------

def said(capsys, naive, ceiling, *, cores=16, sample_s=1e-3, device_speedup=1.0):
    """Lesson 02's verdict cell on a GPU, with the sweep's rates, one sample's cost and the on-device comparison
    injected (a ratio of 1.0: the tuned loader feeds the GPU)."""
    tuned = "tuned"
    scope = {"loader_results": pd.DataFrame({"config": ["0 workers", tuned], "samples_per_s": [naive, naive]}),
             "ceiling": ceiling, "one_sample": Measurement("one augmented sample", (sample_s,) * 3, "cpu", 1),
             "cores": cores, "on_gpu": True, "nvml_ok": False, "nvml_note": "not sampled in this test", "tuned": tuned,
             "loader_cmp": {f"data already on the device, against {tuned}": Comparison.of(
                 [device_speedup] * 5, [1.0] * 5, labels=(tuned, "data already on the device"))}}
    run(scope, "Highest steady rate measured")
    return capsys.readouterr().out


def test_the_lesson_says_whether_the_naive_pipeline_starved_the_gpu(capsys):
    assert "With num_workers=0 it trained 300 samples/s, 10% of that rate (one run each): the GPU waited" in said(
        capsys, 300.0, 3000.0)
    assert "here the model, not the pipeline, set the pace" in said(capsys, 2900.0, 3000.0)


def test_on_two_cores_the_lesson_says_what_more_workers_can_buy(capsys):
    """A Colab T4: two vCPUs augment at most twice what one feeds, and the model trains faster than that."""
    out = said(capsys, 330.0, 1800.0, cores=2, sample_s=3e-3, device_speedup=2.0)
    assert ("the 1 of its 2 cores left to workers (one trains) augment at most 333 samples/s, 1× what one core "
            "feeds, and the model trains at 1800") in out
    assert "More workers cannot buy more cores" in out


def test_the_cores_the_lesson_says_can_augment_are_those_left_after_the_training_process(capsys):
    """3.6 cores of augmentation needed on 4: all 4 would augment 2,000 samples/s, more than the 1,800 the model
    trains at, which the lesson printed as what the CPU cannot reach; the 3 left to workers augment 1,500."""
    out = said(capsys, 500.0, 1800.0, cores=4, sample_s=2e-3, device_speedup=2.0)
    assert "the 3 of its 4 cores left to workers (one trains) augment at most 1500 samples/s" in out
    assert "2000 samples/s" not in out


def test_the_plan_counts_the_cores_left_after_the_training_process():
    pipe = plan02.Pipeline.of(plans.Card.named("Tesla T4", cpus=4), "resnet18", 128)
    assert pipe.host_rate == pytest.approx(3 / pipe.image_s) and pipe.loader_rate(8) == min(pipe.host_rate, pipe.gpu_rate)
    assert "3 of the host's 4 cores (one trains)" in plan02.feeding(pipe).detail


def test_the_hazards_queue_is_a_derived_size_not_a_regime_that_cannot_fail():
    """hazard_matmuls is ceil(HOLD_S / one product's time): a regime 'the queue lasts HOLD_S' held by construction.
    The size says why; the lesson prints whether the copy had finished when its read began."""
    for card in (T4, H100):
        plan = plans.plan_for("02", card)
        assert not any("hazard" in r.name for r in plan.regimes)
        assert "the lesson prints whether it had" in plan.why["hazard_matmuls"]
        assert plan.hazard_matmuls * plan02.matmul_s(card, plan02.HAZARD_SIDE) >= plan02.HOLD_S


def test_the_plans_launches_leave_out_views_and_host_reads():
    """ResNet-50's forward and backward dispatch 731 operators; its views launch no kernel."""
    assert plan02.network("resnet50", 128).ops < 731
