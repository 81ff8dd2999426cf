"""Lesson 11's activation memory run on the CPU playing an NVIDIA H200 (tests/cuda_stand_in.py), in quick mode: the
memory alive after the forward pass read from torch.cuda.memory_allocated (the stand-in's tracker). This proves the
Python around torch's CUDA calls, never the GPU."""

import pandas as pd
import pytest

from . import test_lesson11_gpu_path as gpu_path
from .test_lesson11_gpu_path import run

lesson = gpu_path.lesson  # the lesson's fixture, by name in the test below


def test_the_activation_memory_is_measured_on_a_gpus_path_with_the_allocators_statistics(cuda_stand_in, lesson,
                                                                                         results_dir):
    """The memory cell as a GPU runs it, for 1, 2 and 3 blocks; the fp32 ways agree with the prediction per layer."""
    assert lesson["on_gpu"] and lesson["info"].name == "NVIDIA H200"
    run(lesson, "def predicted_per_layer")
    memory = lesson["memory"].set_index("variant")
    assert len(memory) == 5 and (memory.measured_MiB > 0).all()
    for fp32 in ("written out, fp32", "SDPA, fp32", "SDPA, fp32, checkpointed"):
        assert memory.loc[fp32, "ratio"] == pytest.approx(1.0, abs=0.15), fp32
    assert pd.read_csv(results_dir / "11_activation_memory.csv").ratio.notna().all()
