"""`gpulab doctor`'s NVML finding: its severity and its fix follow from what was found. The course's first GPU run
printed, on a machine without a driver, NVML "ok" while "not reachable", with the advice to install nvidia-ml-py,
which was installed."""

import os
import sys

import pynvml
import pytest
import torch

from gpulab import doctor
from gpulab.doctor import Severity

from . import fake_libnvml


def nvml_finding() -> doctor.Finding:
    (finding,) = [f for f in doctor._nvml_findings() if f.check == "NVML"]
    return finding


@pytest.fixture
def no_nvml_library():
    """nvidia-ml-py importable, NVML's library not (as on this CI machine, and in a container without the driver's
    utility libraries): loading libnvidia-ml.so.1 fails, and NVML's own error is the reason."""
    with fake_libnvml.absent():
        yield


def test_an_ok_finding_never_advises_a_fix():
    for finding in doctor.diagnose():
        assert finding.severity != Severity.OK or not finding.fix, finding


def test_a_missing_module_is_a_warning_whose_fix_installs_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails, as where nvidia-ml-py is not installed
    finding = nvml_finding()
    assert finding.severity == Severity.WARNING
    assert finding.fix == "pip install nvidia-ml-py" and "not installed" in finding.summary


@pytest.mark.parametrize("gpu", [True, False])
def test_an_installed_module_without_nvml_is_never_told_to_install_it(monkeypatch, no_nvml_library, gpu):
    pytest.importorskip("pynvml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    finding = nvml_finding()
    assert finding.severity == Severity.WARNING
    assert "pip install" not in finding.fix and "NVIDIA driver" in finding.fix
    assert "is installed" in finding.summary and "NVML Shared Library Not Found" in finding.summary
    assert ("container" in finding.fix) == gpu  # torch reaches the GPU: the driver is there, its NVML library is not
    assert "no NVIDIA driver on this machine?" not in finding.summary  # not a guess that torch's GPU contradicts


def test_nvml_that_answers_is_ok_with_its_driver():
    with fake_libnvml.installed(fake_libnvml.h200()):  # the H200's driver, 580.159.04
        finding = nvml_finding()
    assert finding.severity == Severity.OK and not finding.fix
    assert "580.159.04" in finding.summary and "1 GPU(s)" in finding.summary


def test_each_gpus_clocks_throttling_and_other_processes_are_read_through_nvml():
    card = fake_libnvml.h200(sm_clock_mhz=1515, temp_c=64, reasons=fake_libnvml.SW_POWER_CAP,
                             processes=[(os.getpid(), 2**30), (4242, 3 * 10**9), (4343, None)])
    with fake_libnvml.installed(card):
        findings = {f.check: f for f in doctor._nvml_findings()}
    assert findings["GPU 0 (NVIDIA H200) clocks"].summary == "SM clock 1515 of 1980 MHz, 64 °C"
    throttling = findings["GPU 0 (NVIDIA H200) throttling"]
    assert throttling.severity == Severity.WARNING and throttling.summary == "clocks held back: power cap reached"
    others = findings["GPU 0 (NVIDIA H200) other processes"]
    assert others.summary == "2 other process(es) use this GPU (pids 4242, 4343; 3.0 GB)"  # 4343's memory: unknown


def test_a_gpu_without_throttling_or_other_processes_is_ok():
    with fake_libnvml.installed(fake_libnvml.t4(processes=[(os.getpid(), 2**30)])):
        findings = {f.check: f for f in doctor._nvml_findings()}
    assert findings["GPU 0 (Tesla T4) throttling"].summary == "no thermal or power throttling"
    assert findings["GPU 0 (Tesla T4) other processes"].summary == "no other process is using it"


@pytest.mark.parametrize("card, cuda", [(fake_libnvml.h200(), (13, 0)), (fake_libnvml.t4(), (12, 4))])
def test_the_newest_cuda_the_driver_supports(card, cuda):
    with fake_libnvml.installed(card):
        assert doctor._driver_cuda_version() == cuda
    with fake_libnvml.absent():
        assert doctor._driver_cuda_version() is None


def test_a_gpu_nvml_refuses_is_a_warning_and_the_others_are_still_read():
    refused = fake_libnvml.h200(errors={"nvmlDeviceGetHandleByIndex_v2": pynvml.NVML_ERROR_NO_PERMISSION})
    with fake_libnvml.installed(refused, fake_libnvml.t4(pci_bus_id="00000000:00:07.0")):
        findings = {f.check: f for f in doctor._nvml_findings()}
    assert findings["GPU 0"].severity == Severity.WARNING and "refused" in findings["GPU 0"].summary
    assert findings["GPU 1 (Tesla T4) throttling"].summary == "no thermal or power throttling"


def test_an_older_driver_answers_the_throttle_reasons_by_their_former_name():
    card = fake_libnvml.t4(reasons=fake_libnvml.SW_POWER_CAP)
    with fake_libnvml.installed(card, missing=("nvmlDeviceGetCurrentClocksEventReasons",)):
        findings = {f.check: f for f in doctor._nvml_findings()}
    assert findings["GPU 0 (Tesla T4) throttling"].summary == "clocks held back: power cap reached"


def test_readings_a_gpu_does_not_support_are_said_unknown():
    unsupported = dict.fromkeys(("nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo"), pynvml.NVML_ERROR_NOT_SUPPORTED)
    with fake_libnvml.installed(fake_libnvml.t4(errors=unsupported)):
        findings = {f.check: f for f in doctor._nvml_findings()}
    assert findings["GPU 0 (Tesla T4) clocks"].summary == "SM clock unknown of 1590 MHz, temperature unknown"
