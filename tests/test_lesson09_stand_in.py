"""Lesson 09's GPU branches run on the CPU playing an NVIDIA H200 (tests/cuda_stand_in.py), in quick mode: the
ceiling search and attention's time and memory against sequence length. The notebook's cells run as written, with the
stand-in's allocator statistics, events and card; what a CPU cannot show (the GPU's kernels, NVML's readings, the
clocks) stays NaN or empty, and a test says so where it matters. These prove the Python around torch's CUDA calls,
never the GPU. (Lessons 10 and 11, the rest of the lesson before the split: their own stand-in tests.)"""

import pandas as pd
import pytest
import torch

from gpulab import flops

from . import test_lesson09_gpu_path as gpu_path
from .test_lesson09_gpu_path import define, run

lesson = gpu_path.lesson  # the lesson's fixture, by name in the tests below


@pytest.fixture
def on_the_stand_in(cuda_stand_in, lesson):
    """The lesson's globals as a GPU's kernel has them: its setup cells ran under the stand-in (an H200's facts)."""
    assert lesson["on_gpu"] and lesson["info"].name == "NVIDIA H200" and lesson["amp_dtype"] == torch.bfloat16
    return lesson


def test_the_ceiling_search_runs_on_a_gpus_path_and_shows_the_burst_and_sustained_rates(on_the_stand_in, monkeypatch,
                                                                                        capsys, results_dir):
    """The ceilings cell as a GPU runs it: the H200's precisions lessons 09 and 10 use (fp32, tf32, bf16: not fp16 or
    fp8), each searched with its clock warm-up, then its burst after a rest, with the card's dense datasheet peaks;
    shapes cut to CPU sizes. The stand-in's NVML (the fake libnvidia-ml) reads the idle H200 at its top clock, far
    under its power limit: each rate has its clock, and no gap is put down to the power limit."""
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
    """The sweep as a GPU runs it: bf16 inputs, the allocator's peak above the inputs (gpulab.memory.peak_bytes on the
    stand-in's statistics), every way at every quick length; written out, memory grows as T², SDPA's as T."""
    scope = on_the_stand_in
    scope.update(runs_here=["flash", "math"])
    define(scope, "def forward_backward", "forward_backward")
    define(scope, "att_dtype = ", "att_dtype")
    scope.update(heads=scope["cfg"].n_head, head_dim=scope["cfg"].n_embd // scope["cfg"].n_head)
    define(scope, "att_dtype = ", "qkv")
    define(scope, "BACKENDS = ", "BACKENDS")
    assert scope["att_dtype"] == torch.bfloat16
    run(scope, "attention_log = gpulab.ResultLog")
    sweep = scope["sweep"]
    assert len(sweep) == 4 * 4 and not sweep.out_of_memory.any() and (sweep.peak_MiB > 0).all()
    longest = sweep[sweep.seq_len == sweep.seq_len.max()].set_index("way").peak_MiB
    shortest = sweep[sweep.seq_len == sweep.seq_len.min()].set_index("way").peak_MiB
    growth = longest / shortest  # T grew 8×
    assert growth["written out"] > 20 and growth["SDPA (PyTorch's choice)"] < 12
    assert len(pd.read_csv(results_dir / "09_attention.csv")) == 16
