"""Lesson 08's GPU branches, run in quick mode on this CPU playing an NVIDIA H200 (tests/cuda_stand_in.py: it proves
the Python around torch.cuda's calls, never the GPU). Every step of the path races here, on a job shrunk to a few
steps: bf16 autocast with channels_last, the larger batch, no per-step sync, fused SGD, torch.compile (its call made,
inductor left out: it compiles for minutes on a CPU); the whole-step CUDA graph runs its warm-up on a side stream and
restores the weights, then stops at ``torch.cuda.CUDAGraph``, which only a GPU has (the step is named GPU-only);
then the figures, the summary with ``busy.measure`` of both ends of the path (the 2026-11-28 H200 run crashed there,
cell 15) and the explanation of each step that did not help."""

import math

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

import gpulab
from gpulab import capstone, datasheets, flops, racing
from gpulab.models import SpeedrunNet

from .cuda_stand_in import GpuOnly
from .test_mfu_lessons_03_04 import run

TINY = capstone.Sizes((4, 8, 16, 32), 128, 64, 2, 2, 16, 0.05, 2)  # 2 epochs of 8 steps, 2 rounds an epoch


@pytest.fixture
def lesson(cuda_stand_in, monkeypatch, results_dir):
    """Lesson 08 up to its steps, on the stand-in, the job shrunk; torch.compile records its call and returns the
    model; the matmul ceilings are an H200's datasheet (a GPU-sized product takes minutes on a CPU)."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *a, **k: None)
    monkeypatch.setattr(capstone, "SIZES", TINY)
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **options: compiled.append(options) or model)
    monkeypatch.setattr(flops, "ceilings", lambda precisions, device=None, **kw: {
        p: flops.Ceiling(p, 0.7 * datasheets.peak("NVIDIA H200", p), datasheet_tflops=datasheets.peak("NVIDIA H200", p))
        for p in precisions})
    scope = run({"device": torch.device("cpu"), "gpulab": gpulab, "display": lambda *a: None}, "08",
                "USE_CIFAR10 = False", "probe = SpeedrunNet", "def train_naive", "def session(", "BASE = dict(",
                "STEPS = [")
    scope["compiled"] = compiled
    yield scope
    torch.set_float32_matmul_precision("highest")
    plt.close("all")


def test_the_lessons_gpu_branches_run_on_the_stand_in_up_to_the_graph_capture_and_on_to_the_summary(lesson):
    assert lesson["on_gpu"] and lesson["amp_dtype"] == torch.bfloat16 and lesson["info"].name == "NVIDIA H200"
    assert torch.get_float32_matmul_precision() == "high"
    assert [not_here for *_, not_here in lesson["STEPS"]] == [None] * 7  # every step races on a GPU

    # the whole-step CUDA graph: warm-up on a side stream, the weights restored, then the capture only a GPU has
    model = SpeedrunNet(TINY.widths).to(lesson["device"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph_step = dict(pipeline="device", channels_last=True, amp=True, cuda_graph=True, fused=True, sync_each_step=False)
    with pytest.raises(GpuOnly, match="CUDAGraph"):
        lesson["job"](model, lesson["data"], 0, **graph_step)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the warm-up's steps undone
    name, options, _ = lesson["STEPS"][-1]
    lesson["STEPS"][-1] = (name, options, "GPU only: the CUDA stand-in cannot capture a graph")

    run(lesson, "08", "for seed in capstone.NOISE_SEEDS", "path = racing.Path(", "first = path.results", "plots.waterfall(",
        "final, final_options = path.current", "def why(row)")
    rows = pd.DataFrame(lesson["path"].rows).set_index("step")
    raced = [step for step, _, not_here in lesson["STEPS"] if not not_here]
    assert rows.loc[raced, "verdict"].notna().all() and len(raced) == 6
    judged = rows.loc[raced, "judged_on"].to_dict()
    assert judged == {"data on the GPU": "losses", "channels_last + autocast bfloat16": "accuracy",
                      "batch 32, lr ×2": "accuracy", "no per-step sync": "losses", "fused SGD": "losses",
                      "torch.compile": "losses"}
    assert rows.loc["data on the GPU", "loss_gap"] == 0.0  # the same batches, the same float32 arithmetic here
    assert {"mode": "default"} in lesson["compiled"]
    assert rows.loc["whole step in a CUDA graph", "note"].startswith("GPU only")

    # the summary: busy.measure profiled both ends of the path (CPU activity here: no kernels, said so)
    for measured in (lesson["busy_naive"], lesson["busy_final"]):
        assert measured.steps == 3 and measured.step_ms > 0 and math.isnan(measured.kernel_share)
        assert "no GPU kernels" in measured.note
    summary = lesson["summary"]
    assert summary.loc["samples/s (steady)", "naive job"] == lesson["path"].results["data on the GPU"].baseline.samples_per_s
    mfu = summary.loc["MFU (dense datasheet peak)"]
    assert (mfu > 0).all() and (mfu < 1).all()  # over the H200's dense peak, a share
    logged = pd.read_csv(lesson["log"].path)
    assert logged.step.tolist()[:7] == [s for s, *_ in lesson["STEPS"]] and logged.step.iloc[-1] == "optimised vs naive"
    assert isinstance(lesson["judge"].spread, racing.SeedSpread) and len(lesson["judge"].spread.accuracies) == 3
