"""Lesson 09's GPU branches run on the CPU playing an NVIDIA H200 (tests/cuda_stand_in.py), in quick mode: the
ceiling search (cell 15), attention's time and memory against sequence length (cell 23), each end's GPU busy share
(cell 36: the 2026-11-28 H200 run crashed in busy.measure there) and the activation memory (cell 49). The notebook's
cells run as written, with the stand-in's allocator statistics, events and card; what a CPU cannot show (the GPU's
kernels, NVML's readings, the clocks) stays NaN or empty, and a test says so where it matters. These prove the Python
around torch's CUDA calls, never the GPU."""

import types

import pandas as pd
import pytest
import torch

from gpulab import flops

from . import test_lesson09_gpu_path as gpu_path
from .test_lesson09_gpu_path import define, run

lesson, waterfall = gpu_path.lesson, gpu_path.waterfall  # the lesson's fixtures, by name in the tests below


@pytest.fixture
def on_the_stand_in(cuda_stand_in, lesson):
    """The lesson's globals as a GPU's kernel has them: its setup cells ran under the stand-in (an H200's facts)."""
    assert lesson["on_gpu"] and lesson["info"].name == "NVIDIA H200" and lesson["amp_dtype"] == torch.bfloat16
    return lesson


@pytest.fixture
def waterfall_on_the_stand_in(cuda_stand_in, waterfall):
    assert waterfall["on_gpu"]
    return waterfall


def test_the_ceiling_search_runs_on_a_gpus_path_and_shows_the_burst_and_sustained_rates(on_the_stand_in, monkeypatch,
                                                                                        capsys, results_dir):
    """Cell 15 as a GPU runs it: the H200's precisions this lesson uses (fp32, tf32, bf16: not fp16 or fp8), each
    searched with its clock warm-up, then its burst after a rest, with the card's dense datasheet peaks; shapes cut to
    CPU sizes. The stand-in's NVML (the fake libnvidia-ml) reads the idle H200 at its top clock, far under its power
    limit: each rate has its clock, and no gap is put down to the power limit."""
    monkeypatch.setattr(flops, "search_shapes", lambda device=None: [(32, 32, 32), (64, 64, 64)])
    flops._MEASURED.clear()
    run(on_the_stand_in, "ceiling_log = gpulab.ResultLog")
    flops._MEASURED.clear()
    table = next(d for d in on_the_stand_in["displayed"] if isinstance(d, pd.DataFrame)).set_index("precision")
    assert list(table.index) == ["fp32", "tf32", "bf16"]
    assert table.loc["bf16", "datasheet (dense)"] == 989.5 and table.loc["fp32", "datasheet (dense)"] == 67.0
    assert (table.ceiling == table[["burst", "sustained"]].max(axis=1)).all() and (table.ceiling > 0).all()
    said = capsys.readouterr().out
    assert (table["burst: SM clock (MHz)"] == "1980 MHz of 1980").all()
    assert said.count("no power limit held the clocks down, and the ceiling is the faster of the two") == 3
    assert "Dense peaks of the H200 SXM" in said
    rows = pd.read_csv(results_dir / "09_ceilings.csv")
    assert list(rows.precision) == ["fp32", "tf32", "bf16"] and rows.burst_tflops.gt(0).all()


def test_attention_against_sequence_length_runs_on_a_gpus_path_with_the_allocators_peaks(on_the_stand_in,
                                                                                          results_dir):
    """Cell 23 as a GPU runs it: bf16 inputs, the allocator's peak above the inputs (the stand-in's statistics),
    every way at every quick length; written out, memory grows as T², SDPA's as T."""
    scope = on_the_stand_in
    scope.update(cfg=scope["GPTConfig"](**scope["SIZE"]), runs_here=["flash", "math"])
    define(scope, "def forward_backward", "forward_backward")
    define(scope, "att_dtype = ", "att_dtype")
    scope.update(heads=scope["cfg"].n_head, head_dim=scope["cfg"].n_embd // scope["cfg"].n_head)
    define(scope, "att_dtype = ", "qkv")
    define(scope, "BACKENDS = ", "BACKENDS")
    assert scope["att_dtype"] == torch.bfloat16
    run(scope, "def peak_bytes")
    sweep = scope["sweep"]
    assert len(sweep) == 4 * 4 and not sweep.out_of_memory.any() and (sweep.peak_MiB > 0).all()
    longest = sweep[sweep.seq_len == sweep.seq_len.max()].set_index("way").peak_MiB
    shortest = sweep[sweep.seq_len == sweep.seq_len.min()].set_index("way").peak_MiB
    growth = longest / shortest  # T grew 8×
    assert growth["written out"] > 20 and growth["SDPA (PyTorch's choice)"] < 12
    assert len(pd.read_csv(results_dir / "09_attention.csv")) == 16


def test_each_ends_gpu_busy_share_is_measured_on_a_gpus_path(waterfall_on_the_stand_in, capsys, results_dir):
    """Cell 36 as a GPU runs it (the H200 run of 2026-11-28 crashed in busy.measure there): the naive and the final
    configuration's own training steps profiled with busy.measure, three each, and logged; the kernel share is a GPU's
    (NaN here, with the note saying why), NVML's readings NaN without NVML."""
    scope = waterfall_on_the_stand_in
    scope["STEP_BASE"] = {**scope["STEP_BASE"], "accum": 1}  # one micro-batch a step: the steps, not their size, matter
    final = types.SimpleNamespace(steps=(scope["session"]({})[0], scope["session"]({"attention": "sdpa"})[0]))
    scope.update(final=final, final_name="SDPA", naive_u=scope["utilisation"]({}, 0.05),
                 final_u=scope["utilisation"]({"attention": "sdpa"}, 0.03), reference="the fp32 ceiling measured here",
                 against_reference=lambda u: u.against(100.0))
    run(scope, "busy_log = gpulab.ResultLog")
    said = capsys.readouterr().out
    assert "naive fp32: 3 profiled steps of " in said and "SDPA (final): 3 profiled steps" in said
    assert "Kernel share: from the profiler trace of these steps" in said
    rows = pd.read_csv(results_dir / "09_gpu_busy.csv")
    assert list(rows.config) == ["naive fp32", "SDPA (final)"] and (rows.busy_steps == 3).all()
    assert rows.kernel_busy.isna().all() and rows.mfu_vs_reference.tolist() == pytest.approx([0.0, 0.0], abs=1e-3)


def test_the_activation_memory_is_measured_on_a_gpus_path_with_the_allocators_statistics(on_the_stand_in,
                                                                                         results_dir):
    """Cell 49 as a GPU runs it: the memory alive after the forward pass read from torch.cuda.memory_allocated (the
    stand-in's tracker), for 1, 2 and 3 blocks; the fp32 ways agree with the prediction per layer."""
    scope = on_the_stand_in
    scope.update(cfg=scope["GPTConfig"](**scope["SIZE"]), train_tokens=gpu_path.text.python_source(max_bytes=200_000))
    run(scope, "def predicted_per_layer")
    memory = scope["memory"].set_index("variant")
    assert len(memory) == 5 and (memory.measured_MiB > 0).all()
    for fp32 in ("written out, fp32", "SDPA, fp32", "SDPA, fp32, checkpointed"):
        assert memory.loc[fp32, "ratio"] == pytest.approx(1.0, abs=0.15), fp32
    assert pd.read_csv(results_dir / "09_activation_memory.csv").ratio.notna().all()
