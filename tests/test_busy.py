"""A configuration's GPU busy share from a profiler window of its own steps (gpulab.busy), NVML's GPM SM activity
(gpulab.nvml), on real H200 traces and a fake NVML: nothing here needs a GPU."""

import math
import time
from pathlib import Path

import pynvml
import pytest
import torch

from gpulab import busy, nvml, traces

from . import fake_libnvml

H200 = Path(__file__).parent / "data" / "h200" / "06"


def test_the_busy_share_is_kernel_time_over_the_profiled_steps_window():
    """Lesson 06's "fixed" loop on the H200: kernels ran about 2 % of its steps' window."""
    trace = H200 / "06_6_fixes.json.gz"
    measured = busy.Busy.from_trace("all six fixes", trace)
    per_step = traces.gpu_busy(trace)
    assert measured.steps == len(per_step) == 2
    assert measured.kernel_share == pytest.approx(per_step.kernel_ms.sum() / per_step.step_ms.sum())
    assert 0 < measured.kernel_share <= measured.busy_share < 0.05
    assert str(measured).startswith("all six fixes: kernels ran 2.1% of the step window over 2 profiled steps")
    row = measured.row()
    assert row["kernel_busy"] == measured.kernel_share and math.isnan(row["nvml_util"])


@pytest.fixture
def h200():
    """The H200 (GPM offered) in place of libnvidia-ml; yields the fake library, NVML started as gpulab keeps it."""
    with fake_libnvml.installed(fake_libnvml.h200(sm_activity_pct=87.5)) as library:
        yield library


def test_gpm_sm_activity_over_a_span_frees_its_samples(h200):
    nv, handle = nvml.shared(0)
    start = nvml.gpm_sample(nv, handle)
    assert h200.gpm_samples_held == 1
    assert nvml.gpm_sm_activity(nv, handle, start) == 87.5 and h200.gpm_samples_held == 0


def test_the_activity_is_the_spans_between_its_two_samples(h200):
    nv, handle = nvml.shared(0)
    h200.cards[0].sm_activity_pct = 10.0
    start = nvml.gpm_sample(nv, handle)
    h200.cards[0].sm_activity_pct = 63.0  # what the SMs did between the two samples
    assert nvml.gpm_sm_activity(nv, handle, start) == 63.0


def test_a_failed_gpm_reading_still_frees_both_samples(h200):
    nv, handle = nvml.shared(0)
    start = nvml.gpm_sample(nv, handle)
    h200.cards[0].errors["nvmlGpmSampleGet"] = pynvml.NVML_ERROR_GPU_IS_LOST
    assert math.isnan(nvml.gpm_sm_activity(nv, handle, start)) and h200.gpm_samples_held == 0
    assert h200.calls.count("nvmlGpmSampleFree") == 2


def test_a_failed_first_gpm_reading_frees_its_sample(h200):
    nv, handle = nvml.shared(0)
    h200.cards[0].errors["nvmlGpmSampleGet"] = pynvml.NVML_ERROR_GPU_IS_LOST
    assert nvml.gpm_sample(nv, handle) is None and h200.gpm_samples_held == 0


def test_gpm_on_a_gpu_before_hopper_is_unknown():
    with fake_libnvml.installed(fake_libnvml.t4()) as library:
        nv, handle = nvml.shared(0)
        assert nvml.gpm_sample(nv, handle) is None and math.isnan(nvml.gpm_sm_activity(nv, handle, None))
    assert library.gpm_samples_held == 0 and "nvmlGpmSampleAlloc" not in library.calls


def test_gpm_without_it_in_the_driver_or_in_nvidia_ml_py_is_unknown(monkeypatch):
    gpm = ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmSampleFree", "nvmlGpmMetricsGet")
    with fake_libnvml.installed(fake_libnvml.h200(), missing=gpm):  # an older driver
        nv, handle = nvml.shared(0)
        assert nvml.gpm_sample(nv, handle) is None
    for name in gpm:  # an nvidia-ml-py without GPM at all
        monkeypatch.delattr(pynvml, name)
    with fake_libnvml.installed(fake_libnvml.h200()):
        nv, handle = nvml.shared(0)
        assert nvml.gpm_sample(nv, handle) is None and math.isnan(nvml.gpm_sm_activity(nv, handle, None))


# ---------------------------------------------------------------- busy's NVML readings while the step runs unprofiled


def test_nvml_readings_are_utilisation_and_sm_activity_as_fractions(h200, monkeypatch):
    waits = []
    monkeypatch.setattr(busy, "synced_clock", lambda device: waits.append(device))  # no queue to wait for on a CPU
    h200.cards[0].gpu_util_pct = 100
    steps = []
    util, activity = busy._nvml_readings(lambda: steps.append(time.sleep(0.01)), torch.device("cuda", 0), 0.25)
    assert util == 1.0 and activity == 0.875 and steps and waits
    assert h200.gpm_samples_held == 0 and h200.calls.count("nvmlDeviceGetUtilizationRates") >= 1


def test_nvml_readings_without_nvml_or_gpm_are_unknown(monkeypatch):
    monkeypatch.setattr(busy, "synced_clock", lambda device: None)
    with fake_libnvml.absent():
        assert all(math.isnan(v) for v in busy._nvml_readings(lambda: None, torch.device("cuda", 0), 0.0))
    with fake_libnvml.installed(fake_libnvml.t4(gpu_util_pct=40)):
        util, activity = busy._nvml_readings(lambda: time.sleep(0.01), torch.device("cuda", 0), 0.15)
    assert util == 0.4 and math.isnan(activity)
