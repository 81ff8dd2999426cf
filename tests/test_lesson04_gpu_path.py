"""Lesson 04's GPU path on this CPU under the CUDA stand-in (tests/cuda_stand_in.py), in quick mode: as an H200, the
four precisions a Hopper card runs, the memory roof beyond the L2 cache, the card's datasheet entry, the GPU's own
texts, a toy model's speed-ups without MFU; as a T4, fp16 with a GradScaler and no bf16 or TF32; and
gpulab.precision's timing of products on every device. The ceiling search is the H200's (its sizes are a GPU's:
seconds there, far longer here), given as the 2026-11-28 run measured it; the timings are fake, the work runs: a
stand-in proves the Python around torch's calls, never the GPU."""

import dataclasses

import matplotlib.pyplot as plt
import pytest
import torch

import gpulab
from gpulab import Comparison, datasheets, flops, precision
from gpulab.timing import Measurement

from .test_mfu_lessons_03_04 import run, trained04

ALL = ["fp32", "tf32", "fp16", "bf16"]
H200_CEILINGS = {"fp32": 50.26, "tf32": 339.4, "fp16": 646.8, "bf16": 666.9}  # TFLOP/s, the 2026-11-28 smoke run's


@pytest.fixture
def on_the_stand_in(monkeypatch, results_dir):
    """Quick mode, figures not shown; bench answers 5 ms, compare calls each side once and answers 2× faster,
    flops.ceiling(s) answer the H200's ceilings with their dense datasheet peaks."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    before = torch.get_float32_matmul_precision()
    benched = []

    def bench(fn, *args, label=None, **kwargs):
        benched.append(label)
        return Measurement(label, (0.005,) * 3, "cpu", 1)

    def compare(baseline, candidate, *, labels, **kwargs):
        baseline(), candidate()
        return Comparison.of([0.002] * 5, [0.001] * 5, labels=labels)

    def ceiling(p, device=None, **options):
        return flops.Ceiling(p, H200_CEILINGS[p], (2048, 2048, 2048), datasheet_tflops=datasheets.peak("NVIDIA H200", p))

    monkeypatch.setattr(gpulab, "bench", bench)
    monkeypatch.setattr(gpulab, "compare", compare)
    monkeypatch.setattr(flops, "ceiling", ceiling)
    monkeypatch.setattr(flops, "ceilings", lambda precisions=None, device=None, **o: {p: ceiling(p) for p in precisions})
    yield benched
    torch.set_float32_matmul_precision(before)
    plt.close("all")


def test_lesson_04_runs_its_gpu_path_on_the_stand_in(cuda_stand_in, on_the_stand_in, capsys):
    scope = run({"gpulab": gpulab, "device": torch.device("cpu")}, "04", 'plans.lesson("04")',
                "from gpulab import flops, plots, precision, tasks")
    assert scope["precisions"] == ALL  # compute capability 9.0: TF32, fp16 and bf16 beside fp32
    scope["display"] = lambda *args: None
    run(scope, "04", "device copy", "precision.matmul_table(", "no precision was faster than fp32", "n8, low = ")
    said = capsys.readouterr().out
    assert scope["plan"].copy_elements * 4 == 2**30  # the memory roof: 1 GiB, far beyond the L2, on a GPU in every mode
    assert "NVIDIA H200 is the 'H200 SXM' entry of gpulab.datasheets" in said
    assert scope["table"]["dense datasheet peak"].to_dict() == {p: datasheets.peak("NVIDIA H200", p) for p in ALL}
    assert "On a CPU there are no tensor cores" not in said  # the GPU's texts, not the CPU's
    assert "At n = 128, tf32 is the fastest precision here, beyond the noise" in said  # 2× each, tf32 first
    assert scope["low"] == "bf16"  # n against n - 1 in bf16, native here

    scope["plan"] = dataclasses.replace(scope["plan"], sizes={**scope["plan"].sizes, "steps": 5})
    run(scope, "04", "def train_step(", "curves, models, runs, trained", 'ResultLog("04_training_precision")',
        "named = {p: f", "precision.support_table()")
    said = capsys.readouterr().out
    shown = scope["steps_shown"]
    assert list(shown.index) == ALL and scope["mfu"] is None  # a toy model: speed-ups, no MFU
    for p in ALL:  # each step at its median in the pairs: fp32 at 2 ms, the others at 1 ms
        assert f"  {p}: {shown.loc[p, 'ms per step (pairs)']:.3g} ms per step" in said
    assert shown.loc["fp32", "ms per step (pairs)"] == pytest.approx(2.0)
    assert "This GPU (NVIDIA H200): torch.cuda.is_bf16_supported() = True" in said
    assert (shown["peak_mb"] > 0).all()


@pytest.mark.parametrize("cuda_stand_in", ["Tesla T4"], indirect=True)
def test_a_t4_trains_in_fp16_with_a_gradscaler_and_skips_bf16_and_tf32(cuda_stand_in, on_the_stand_in, monkeypatch,
                                                                      capsys):
    """sm_75: fp16 tensor cores, no native bf16 (torch.cuda.is_bf16_supported() still says True: emulation), no TF32.
    The plan chooses from the card, in quick mode too."""
    scope = trained04(monkeypatch)
    assert scope["precisions"] == ["fp32", "fp16"] == scope["plan"].precisions
    assert {p: scaler.is_enabled() for p, (_, _, scaler) in scope["runs"].items()} == {"fp32": False, "fp16": True}
    printed = capsys.readouterr().out
    assert "bf16: skipped here (not native before compute capability 8.0 (this GPU is 7.5)" in printed
    assert "native bf16 (sm_80+): 16-bit runs in fp16 (training with a GradScaler)" in printed  # the plan says so
    run(scope, "04", "device copy", "n8, low = ")
    assert sorted(set(scope["matmuls"]["precision"].dropna())) == ["fp16", "fp32"]  # swept: no bf16, no TF32
    assert scope["low"] == "fp16"  # n against n - 1 in fp16


def test_timed_calls_times_each_product_on_every_device(course_device):
    """precision.timed_calls: the products back to back, timed between events on a GPU (the stand-in's, on the host
    clock) and by the host's clock on a CPU; one time per product."""
    done = []
    times = precision.timed_calls(lambda: done.append(torch.ones(64, 64) @ torch.ones(64, 64)), 4, course_device)
    assert len(done) == len(times) == 4 and all(t > 0 for t in times)


def test_matmul_peak_finds_a_peak_on_every_device(course_device, monkeypatch):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    peak = precision.matmul_peak(torch.float32, course_device, sizes=[32, 64], warmup_s=0.0, min_time=0.01)
    assert peak.n in (32, 64) and peak.tflops > 0 and set(peak.by_size) == {32, 64}
    assert dataclasses.asdict(peak)["products"] >= 10
