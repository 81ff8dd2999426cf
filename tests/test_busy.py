"""A configuration's GPU busy share from a profiler window of its own steps (gpulab.busy), NVML's GPM SM activity
(gpulab.nvml), on real H200 traces and a fake NVML: nothing here needs a GPU."""

import math
import types
from pathlib import Path

import pytest

from gpulab import busy, nvml, traces

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


class FakeGpm:
    """nvidia-ml-py's GPM calls on a GPU that offers them (``supported``) with an SM activity of ``value`` %."""

    class NVMLError(Exception):
        pass

    NVML_GPM_METRICS_GET_VERSION, NVML_GPM_METRIC_SM_UTIL = 1, 2

    def __init__(self, supported=True, value=87.5):
        self.supported, self.value, self.freed, self.samples = supported, value, [], 0

    def nvmlGpmQueryDeviceSupport(self, handle):
        return types.SimpleNamespace(isSupportedDevice=int(self.supported))

    def nvmlGpmSampleAlloc(self):
        self.samples += 1
        return f"sample{self.samples}"

    def nvmlGpmSampleGet(self, handle, sample):
        return sample

    def nvmlGpmSampleFree(self, sample):
        self.freed.append(sample)

    def c_nvmlGpmMetricsGet_t(self):
        metric = types.SimpleNamespace(metricId=None, value=None, nvmlReturn=None)
        return types.SimpleNamespace(version=None, numMetrics=None, sample1=None, sample2=None, metrics=[metric])

    def nvmlGpmMetricsGet(self, request):
        assert request.metrics[0].metricId == self.NVML_GPM_METRIC_SM_UTIL and request.sample1 != request.sample2
        request.metrics[0].value, request.metrics[0].nvmlReturn = self.value, 0
        return request


def test_gpm_sm_activity_over_a_span_frees_its_samples():
    nv = FakeGpm()
    start = nvml.gpm_sample(nv, "gpu0")
    assert nvml.gpm_sm_activity(nv, "gpu0", start) == 87.5 and sorted(nv.freed) == ["sample1", "sample2"]


def test_a_failed_gpm_reading_still_frees_both_samples():
    nv = FakeGpm()
    start = nvml.gpm_sample(nv, "gpu0")

    def fails(handle, sample):
        raise nv.NVMLError("GPU is lost")

    nv.nvmlGpmSampleGet = fails
    assert math.isnan(nvml.gpm_sm_activity(nv, "gpu0", start)) and sorted(nv.freed) == ["sample1", "sample2"]


def test_gpm_on_a_gpu_before_hopper_is_unknown():
    nv = FakeGpm(supported=False)
    assert nvml.gpm_sample(nv, "gpu0") is None and math.isnan(nvml.gpm_sm_activity(nv, "gpu0", None))
    old = types.SimpleNamespace(NVMLError=FakeGpm.NVMLError)  # an nvidia-ml-py without GPM at all
    assert nvml.gpm_sample(old, "gpu0") is None
