import json

import pytest
import torch

from gpulab import doctor
from gpulab.commands import cli
from gpulab.doctor import Finding, Severity


def test_exit_status_is_the_worst_severity():
    assert doctor.exit_status([]) == 0
    assert doctor.exit_status([Finding("a", Severity.OK, ""), Finding("b", Severity.WARNING, "")]) == 1
    assert doctor.exit_status([Finding("a", Severity.ERROR, ""), Finding("b", Severity.WARNING, "")]) == 2


def test_every_problem_comes_with_a_fix():
    for finding in doctor.diagnose():
        assert finding.severity == Severity.OK or finding.fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less diagnosis")
def test_missing_gpu_is_an_error_with_a_fix(capsys):
    status = cli.main(["doctor"])
    out = capsys.readouterr().out
    assert status == 2
    assert "[FAIL] GPU visible to torch" in out and "fix:" in out and "quick mode" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less diagnosis")
def test_json_output_parses(capsys):
    status = cli.main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == status == 2
    assert any(f["severity"] == "error" and f["check"] == "GPU visible to torch" for f in report["findings"])


def test_hidden_gpus_are_named(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    finding = doctor._no_gpu(driver_cuda=(12, 4))
    assert "CUDA_VISIBLE_DEVICES" in finding.summary and finding.severity == Severity.ERROR


def test_driver_older_than_torch_is_named(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    finding = doctor._no_gpu(driver_cuda=(11, 8))
    assert "driver supports at most CUDA 11.8" in finding.summary and "update the NVIDIA driver" in finding.fix


def test_cpu_only_build_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    finding = doctor._torch_build()
    assert finding.severity == Severity.ERROR and "CPU-only" in finding.summary and "index-url" in finding.fix


def test_launch_blocking_is_a_warning(monkeypatch):
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    assert doctor._launch_blocking().severity == Severity.WARNING


@pytest.mark.gpu
def test_gpu_machine_has_no_error(capsys):
    assert cli.main(["doctor"]) in (0, 1)
    assert "tensor on GPU" in capsys.readouterr().out


# ---- on a GPU: the checks that use it, run on the CUDA stand-in (tensor and convolution on the CPU playing an H200) ---


def test_on_a_gpu_doctor_uses_it_and_reads_its_nvml(cuda_stand_in, fake_nvml_card, capsys):
    """The GPU path of `gpulab doctor`, which no test ran (the 2026-11-28 audit): the driver against torch's CUDA, a
    tensor and a convolution on the GPU, and the card's NVML health. Making the tensor and running the convolution
    ask the real CUDA runtime on a GPU (GPU-only); the stand-in runs them on the CPU, as the course's device."""
    fake_nvml_card.processes = [(4242, 3 * 10**9)]
    findings = {f.check: f for f in doctor.diagnose()}
    assert "GPU visible to torch" not in findings
    assert findings["driver vs torch"].severity == Severity.OK
    assert findings["tensor on GPU"].severity == Severity.OK and "(NVIDIA H200)" in findings["tensor on GPU"].summary
    assert findings["cuDNN"].severity == Severity.OK and "a convolution ran" in findings["cuDNN"].summary
    assert findings["NVML"].severity == Severity.OK and "580.159.04" in findings["NVML"].summary
    assert findings["GPU 0 (NVIDIA H200) other processes"].severity == Severity.WARNING
    assert cli.main(["doctor"]) == 1  # the other process costs speed: a warning, not a failure
    assert "The GPU works, but fix the warnings above" in capsys.readouterr().out


def test_on_a_gpu_without_nvml_the_fix_is_the_driver_utilities_not_pip(cuda_stand_in):
    from . import fake_libnvml

    with fake_libnvml.absent():
        (finding,) = [f for f in doctor.diagnose() if f.check == "NVML"]
    assert finding.severity == Severity.WARNING and "container" in finding.fix and "pip install" not in finding.fix


def test_the_course_device_does_not_change_what_doctor_examines(monkeypatch):
    monkeypatch.setenv("GPULAB_DEVICE", "cpu")  # the course told to use the CPU: the machine may still have a GPU
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert doctor.machine_device() == expected
