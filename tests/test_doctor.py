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
