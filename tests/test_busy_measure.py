"""busy.measure runs the same steps on every device: the profiler with one recorded cycle, the export, the load and
the per-step parsing run here on the CPU (the 2026-11-28 H200 run crashed in them), and only the readings a CPU cannot
give (kernel time, NVML) are missing, said so in the result."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from gpulab import busy, traces


def a_step():
    model, x = torch.nn.Linear(16, 16), torch.randn(8, 16)
    return lambda: model(x).sum().backward()


def test_on_a_cpu_the_steps_are_profiled_and_parsed_and_what_is_missing_is_named(tmp_path):
    calls = []
    step = a_step()
    measured = busy.measure(lambda: calls.append(step()), label="cpu run", device="cpu", steps=3, warmup=2,
                            keep_trace=tmp_path / "busy.json.gz")
    assert len(calls) == 2 + 1 + 3  # warm-up, the profiler's warm-up step, the recorded steps
    assert measured.steps == 3 and measured.step_ms > 0
    assert len(traces.steps(tmp_path / "busy.json.gz")) == 3
    assert math.isnan(measured.kernel_share) and math.isnan(measured.nvml_util)
    assert "no GPU kernels" in measured.note and "NVML" in measured.note
    assert str(measured).startswith("cpu run: 3 profiled steps of ") and "GPU busy not measured" in str(measured)


@pytest.mark.parametrize("repeat, recorded", [(0, 0), (1, 3)])
def test_torchs_schedule_exports_the_recorded_steps_after_the_block_only_with_one_cycle(tmp_path, repeat, recorded):
    """What the crash rested on, in torch itself: with repeat=0 a new, empty cycle has started when the block ends,
    and an export after it holds no step; busy.measure's schedule records one cycle."""
    step, path = a_step(), tmp_path / "trace.json"
    with profile(activities=[ProfilerActivity.CPU], acc_events=True,
                 schedule=schedule(wait=0, warmup=1, active=3, repeat=repeat)) as p:
        for _ in range(4):
            step()
            p.step()
    p.export_chrome_trace(str(path))
    marks = [e for e in traces.load_trace(path)["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep")]
    assert len(marks) == recorded
    assert busy.one_cycle(3)(3).name == "RECORD_AND_SAVE" and busy.one_cycle(3)(4).name == "NONE"


def test_the_profiler_records_kernels_only_where_a_gpu_runs_the_work():
    assert busy.activities("cpu") == [ProfilerActivity.CPU]



def test_under_the_cuda_stand_in_the_gpu_branch_reads_nvml_over_unprofiled_steps(cuda_stand_in):
    """On a GPU, measure reads NVML's utilisation and GPM's SM activity over about a second of unprofiled steps after
    the trace: that branch runs here, through nvidia-ml-py's real wrappers (the values are the fake card's)."""
    cuda_stand_in.nvml.gpu_util_pct, cuda_stand_in.nvml.sm_activity_pct = 87, 61.5
    measured = busy.measure(a_step(), label="played", steps=2, warmup=1, nvml_seconds=0.25)
    assert measured.steps == 2 and math.isnan(measured.kernel_share)
    assert measured.nvml_util == 0.87 and measured.sm_activity == 0.615
    assert "no GPU kernels" in measured.note and "NVML" not in measured.note
    assert str(measured).startswith("played: 2 profiled steps of ")
