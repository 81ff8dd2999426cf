"""`gpulab doctor`'s NVML finding: its severity and its fix follow from what was found. The course's first GPU run
printed, on a machine without a driver, NVML "ok" while "not reachable", with the advice to install nvidia-ml-py,
which was installed."""

import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from gpulab import doctor, nvml
from gpulab.doctor import Severity


def nvml_finding() -> doctor.Finding:
    (finding,) = [f for f in doctor._nvml_findings() if f.check == "NVML"]
    return finding


@pytest.fixture
def no_nvml_library(monkeypatch):
    """nvidia-ml-py importable, NVML's library not (as on this CI machine, and in a container without the driver's
    utility libraries): nvml.session raises what nvml.py raises there, with NVML's own error as its reason."""
    @contextmanager
    def session():
        raise nvml.NvmlUnavailable("NVML could not start (NVML Shared Library Not Found)",
                                   "NVML Shared Library Not Found")
        yield

    monkeypatch.setattr(nvml, "session", session)


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


def test_nvml_that_answers_is_ok_with_its_driver(monkeypatch):
    class NVMLError(Exception):
        pass

    fake = SimpleNamespace(NVMLError=NVMLError, nvmlDeviceGetCount=lambda: 0,
                           nvmlSystemGetDriverVersion=lambda: b"580.159.04")  # the H200's driver

    @contextmanager
    def session():
        yield fake

    monkeypatch.setattr(nvml, "session", session)
    finding = nvml_finding()
    assert finding.severity == Severity.OK and not finding.fix
    assert "580.159.04" in finding.summary and "0 GPU(s)" in finding.summary
