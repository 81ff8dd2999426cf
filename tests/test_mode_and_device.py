import os

import pytest
import torch

import gpulab
from gpulab.device import DeviceError, PcieLink, device_info, get_device


@pytest.mark.parametrize("flag, expected", [("1", True), ("true", True), ("0", False), ("no", False)])
def test_quick_flag_wins(monkeypatch, flag, expected):
    monkeypatch.setenv("GPULAB_QUICK", flag)
    assert gpulab.quick_mode() is expected
    assert gpulab.by_mode(full="big", quick="small") == ("small" if expected else "big")


def test_ci_means_quick(monkeypatch):
    monkeypatch.delenv("GPULAB_QUICK", raising=False)
    monkeypatch.setenv("CI", "true")
    assert gpulab.quick_mode()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_no_gpu_means_quick_and_cpu(monkeypatch):
    monkeypatch.delenv("GPULAB_QUICK", raising=False)
    monkeypatch.delenv("CI", raising=False)
    assert gpulab.quick_mode()
    assert get_device() == torch.device("cpu")
    with pytest.raises(DeviceError, match="gpulab doctor"):
        get_device("cuda")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "tpu", "mps:0"])
def test_unknown_device_string_is_a_clear_error(spec):
    with pytest.raises(DeviceError, match="cpu"):
        get_device(spec)


def test_cpu_facts():
    info = device_info("cpu")
    assert info.device == "cpu" and info.torch_version == torch.__version__
    assert not info.bf16_native and info.cpu_threads >= 1
    assert "torch / CUDA / cuDNN" in str(info)


def test_pcie_bandwidth_from_generation_and_width():
    link = PcieLink(generation=1, width=16, max_generation=4, max_width=16)
    assert link.max_gbps == pytest.approx(31.5, rel=0.01)
    assert "Gen4 x16" in str(link) and "now Gen1" in str(link)


def test_setup_reports_device_and_mode(capsys, monkeypatch):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    device = gpulab.setup()
    out = capsys.readouterr().out
    assert isinstance(device, torch.device) and "mode: quick" in out and torch.__version__ in out


def test_deprecated_torch_amp_api_is_an_error_in_tests():
    with pytest.raises(FutureWarning, match="deprecated"):
        torch.cuda.amp.GradScaler()


@pytest.mark.gpu
def test_gpu_facts():
    info = device_info("cuda")
    assert info.sm_count > 0 and info.memory_gb > 1 and info.compute_capability >= (3, 0)
    assert info.bf16_native == (info.compute_capability >= (8, 0))


@pytest.mark.parametrize("flag, mode", [("1", "quick"), ("0", "full")])
def test_setup_says_one_mode_and_where_results_go(capsys, monkeypatch, tmp_path, flag, mode):
    monkeypatch.setenv("GPULAB_QUICK", flag)
    monkeypatch.setenv("GPULAB_RESULTS", str(tmp_path / "mine"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpulab.setup()
    out = capsys.readouterr().out
    other = {"quick": "full", "full": "quick"}[mode]
    assert f"mode: {mode}" in out and f"in {mode} mode" in out and other not in out.replace("GPULAB_QUICK", "")
    assert f"Results are written to {tmp_path / 'mine'}" in out


def test_the_one_device_predicate_follows_the_device_and_the_stand_in(course_device):
    played = gpulab.device.STAND_IN is not None
    assert gpulab.on_gpu(course_device) is played and gpulab.on_gpu() is played
    assert gpulab.on_gpu("cuda:1") and gpulab.on_gpu(0) and not gpulab.on_gpu("meta")


def test_device_facts_on_the_cpu_and_on_a_card_the_stand_in_plays(course_device):
    info = device_info(course_device)
    if gpulab.on_gpu(course_device):
        assert (info.name, info.compute_capability, info.sm_count) == ("NVIDIA H200", (9, 0), 132)
        assert info.bf16_native and info.tf32 and info.tensor_cores and info.memory_gb == pytest.approx(150.11)
        assert "tensor cores / TF32 / native bf16  yes / yes / yes" in str(info)
    else:
        assert info.compute_capability is None and "tensor cores" not in str(info)


def test_sync_waits_for_the_gpu_only_where_there_is_one(course_device, monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    gpulab.sync(course_device)
    assert waited == ([course_device] if gpulab.on_gpu(course_device) else [])


def test_under_the_stand_in_nvml_answers_for_the_same_card(cuda_stand_in):
    info = device_info()
    assert info.driver_version == "580.159.04" and str(info.pcie).startswith("Gen5 x16")
    cuda_stand_in.nvml.pcie_now = (4, 8)  # the link now, as NVML reads it: a card that found a slower slot
    device_info.cache_clear()
    assert "now Gen4 x8" in str(device_info().pcie)


def test_setup_quiets_kinetos_error_about_a_missing_gpu_only_where_there_is_none(monkeypatch, capsys):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpulab.setup()
    assert os.environ["KINETO_LOG_LEVEL"] == "5"
    monkeypatch.delenv("KINETO_LOG_LEVEL")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("GPULAB_DEVICE", "cpu")
    gpulab.setup()
    assert "KINETO_LOG_LEVEL" not in os.environ
