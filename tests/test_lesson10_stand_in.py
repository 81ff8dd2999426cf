"""Lesson 10's GPU branch that the waterfall's tests do not reach, run on the CPU playing an NVIDIA H200
(tests/cuda_stand_in.py), in quick mode: each end's GPU busy share (the 2026-11-28 H200 run crashed in busy.measure
there, then lesson 09's cell 36). These prove the Python around torch's CUDA calls, never the GPU."""

import types

import pandas as pd
import pytest

from gpulab import step_races

from . import test_lesson10_gpu_path as gpu_path
from .test_lesson10_gpu_path import run

lesson, waterfall = gpu_path.lesson, gpu_path.waterfall  # the lesson's fixtures, by name in the tests below


@pytest.fixture
def waterfall_on_the_stand_in(cuda_stand_in, waterfall):
    assert waterfall["on_gpu"]
    return waterfall


def test_each_ends_gpu_busy_share_is_measured_on_a_gpus_path(waterfall_on_the_stand_in, capsys, results_dir):
    """The busy cell as a GPU runs it: the naive and the final configuration's own training steps profiled with
    busy.measure, three each, and logged; the kernel share is a GPU's (NaN here, with the note saying why), NVML's
    readings NaN without NVML."""
    scope = waterfall_on_the_stand_in
    scope["STEP_BASE"] = {**scope["STEP_BASE"], "accum": 1}  # one micro-batch a step: the steps, not their size, matter
    run_steps = scope["run_steps"]
    final = types.SimpleNamespace(steps=(step_races.session(run_steps, {})[0],
                                         step_races.session(run_steps, {"attention": "sdpa"})[0]))
    meter = step_races.Meter(1e9, scope["ceilings"], scope["step_precision"],
                             step_races.Reference("fp32", 100.0, "the fp32 ceiling measured here"))
    scope.update(final=final, final_name="SDPA", meter=meter, naive_u=meter({}, 0.05),
                 final_u=meter({"attention": "sdpa"}, 0.03))
    run(scope, "busy_log = gpulab.ResultLog")
    said = capsys.readouterr().out
    assert "naive fp32: 3 profiled steps of " in said and "SDPA (final): 3 profiled steps" in said
    assert "Kernel share: from the profiler trace of these steps" in said
    rows = pd.read_csv(results_dir / "10_gpu_busy.csv")
    assert list(rows.config) == ["naive fp32", "SDPA (final)"] and (rows.busy_steps == 3).all()
    assert rows.kernel_busy.isna().all() and rows.mfu_vs_reference.tolist() == pytest.approx([2e-4, 1e-3 / 3], rel=1e-6)
