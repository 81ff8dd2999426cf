"""gpulab.nvml and the readers of NVML that no other test runs (a device's PCIe link and driver, the memory outside
PyTorch's allocator, the handle of a renumbered device), through nvidia-ml-py's real wrappers over the fake
libnvidia-ml of tests/fake_libnvml.py; and that fake's own strictness, which is what makes them worth running."""

import ctypes
import os
from ctypes import byref, c_uint, c_ulonglong
from types import SimpleNamespace

import pynvml
import pytest
import torch

from gpulab import device, memory, nvml
from gpulab.device import PcieLink

from . import fake_libnvml

MiB = 2**20


def cuda_sees(monkeypatch, *cards) -> None:
    """torch sees these devices (properties with a PCI bus id, as torch reports them), in its own order."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(cards))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: cards[index])


def on_bus(bus: int, domain: int = 0) -> SimpleNamespace:
    return SimpleNamespace(pci_bus_id=bus, pci_domain_id=domain, pci_device_id=0)


def nvml_name(index: int) -> str:
    """The name NVML gives the GPU that gpulab takes for torch's device ``index``."""
    with nvml.session() as nv:
        return nv.nvmlDeviceGetName(nvml.handle_for(nv, index))


# ---------------------------------------------------------------- which NVML GPU is torch's device


def test_a_renumbered_device_is_found_by_its_pci_bus_id(monkeypatch):
    """CUDA_VISIBLE_DEVICES=1 on a machine with a T4 and an H200: torch's device 0 is NVML's GPU 1."""
    cuda_sees(monkeypatch, on_bus(0x18))
    with fake_libnvml.installed(fake_libnvml.t4(pci_bus_id="00000000:3B:00.0"),
                                fake_libnvml.h200(pci_bus_id="00000000:18:00.0")) as library:
        assert nvml_name(0) == "NVIDIA H200"
    assert "nvmlDeviceGetHandleByPciBusId_v2" in library.calls and "nvmlDeviceGetHandleByIndex_v2" not in library.calls


def test_a_bus_id_in_another_pci_domain_is_written_as_nvml_reads_it(monkeypatch):
    cuda_sees(monkeypatch, on_bus(0x18, domain=0x1))
    with fake_libnvml.installed(fake_libnvml.t4(pci_bus_id="00000000:18:00.0"),
                                fake_libnvml.h200(pci_bus_id="00000001:18:00.0")):
        assert nvml_name(0) == "NVIDIA H200"


def test_without_a_bus_id_the_device_is_nvmls_gpu_of_the_same_index(monkeypatch):
    cuda_sees(monkeypatch, SimpleNamespace(), on_bus(0x99))  # a torch without pci_bus_id; a bus NVML does not list
    with fake_libnvml.installed(fake_libnvml.t4(), fake_libnvml.h200()):
        assert (nvml_name(0), nvml_name(1)) == ("Tesla T4", "NVIDIA H200")


def test_a_device_nvml_does_not_list_is_unavailable_not_an_nvml_error(fake_nvml_card):
    with nvml.session() as nv, pytest.raises(nvml.NvmlUnavailable, match="NVML has no GPU 3: Invalid Argument"):
        nvml.handle_for(nv, 3)
    with pytest.raises(nvml.NvmlUnavailable, match="NVML has no GPU 3"):
        nvml.shared(3)


# ---------------------------------------------------------------- sessions


def test_each_session_is_counted_and_the_last_shutdown_ends_nvml():
    with fake_libnvml.installed() as library:
        with nvml.session() as outer:
            with nvml.session():
                assert library.inits == 2
            assert outer.nvmlDeviceGetCount() == 1  # the inner shutdown left the outer session working
        assert library.inits == 0
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlDeviceGetCount()


def test_available_says_the_driver_or_why_not():
    with fake_libnvml.installed(fake_libnvml.t4()):
        assert nvml.available() == (True, "550.54.15")
    with fake_libnvml.installed(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
        assert nvml.available() == (False, "NVML could not start (Driver Not Loaded)")


# ---------------------------------------------------------------- a device's driver and PCIe link (device._nvml_facts)


def test_device_facts_read_the_driver_and_the_link_now_and_at_best():
    with fake_libnvml.installed(fake_libnvml.h200(pcie_now=(1, 16))):  # a link trained down, as an idle GPU's often is
        assert device._nvml_facts(0) == ("580.159.04", PcieLink(1, 16, 5, 16))
    with fake_libnvml.installed(fake_libnvml.t4()):
        assert device._nvml_facts(0) == ("550.54.15", PcieLink(3, 16, 3, 16))


def test_device_facts_without_a_link_reading_keep_the_driver():
    card = fake_libnvml.h200(errors={"nvmlDeviceGetCurrPcieLinkWidth": pynvml.NVML_ERROR_NOT_SUPPORTED})
    with fake_libnvml.installed(card):
        assert device._nvml_facts(0) == ("580.159.04", None)


def test_device_facts_without_nvml_or_without_that_gpu_are_unknown():
    with fake_libnvml.absent():
        assert device._nvml_facts(0) == (None, None)
    with fake_libnvml.installed(fake_libnvml.h200()):
        assert device._nvml_facts(1) == (None, None)  # an NVMLError once escaped from here


# ---------------------------------------------------------------- memory outside PyTorch's allocator


@pytest.fixture
def torch_reserved(monkeypatch):
    """A CUDA device 0 whose allocator reserved 100 MiB, of 143771 MiB with 2000 MiB in use in all."""
    monkeypatch.setattr(memory, "get_device", lambda device=None: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 100 * MiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: ((143771 - 2000) * MiB, 143771 * MiB))


def test_outside_the_allocator_is_nvmls_memory_of_this_process_less_what_torch_reserved(torch_reserved):
    card = fake_libnvml.h200(processes=[(4242, 9000 * MiB), (os.getpid(), 600 * MiB)])
    with fake_libnvml.installed(card):
        assert memory.outside_allocator() == (500 * MiB, "NVML's memory of this process minus what PyTorch reserved")


@pytest.mark.parametrize("processes", [[(4242, 9000 * MiB)], [(os.getpid(), None)], []],
                         ids=["another pid namespace", "memory not reported", "no process"])
def test_where_nvml_does_not_count_this_process_the_device_is_counted_and_said_so(torch_reserved, processes):
    with fake_libnvml.installed(fake_libnvml.h200(processes=processes)):
        nbytes, how = memory.outside_allocator()
    assert nbytes == 1900 * MiB and how.startswith("the device's used memory (all processes")


def test_outside_the_allocator_without_nvml_counts_the_device(torch_reserved):
    with fake_libnvml.absent():
        assert memory.outside_allocator()[0] == 1900 * MiB


# ---------------------------------------------------------------- the fake is as strict as the C library


def test_a_call_with_the_wrong_arguments_raises_as_ctypes_does(fake_nvml_card):
    with nvml.session():
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        clock = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetClockInfo")
        assert clock(handle, pynvml.NVML_CLOCK_SM, byref(c_uint())) == pynvml.NVML_SUCCESS
        with pytest.raises(TypeError):
            clock(handle, pynvml.NVML_CLOCK_SM)
        with pytest.raises(TypeError):
            clock(handle, pynvml.NVML_CLOCK_SM, byref(c_uint()), 0)
        with pytest.raises(ctypes.ArgumentError):
            clock(handle, pynvml.NVML_CLOCK_SM, byref(c_ulonglong()))  # a pointer to the wrong type
        with pytest.raises(ctypes.ArgumentError):
            pynvml.nvmlDeviceGetUtilizationRates(0)  # an index is not a handle


def test_a_reading_follows_its_arguments_not_only_the_function(fake_nvml_card):
    fake_nvml_card.sm_clock_mhz = 1515
    with nvml.session() as nv:
        handle = nv.nvmlDeviceGetHandleByIndex(0)
        assert nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM) == 1515
        assert nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM) == 3201
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nv.nvmlDeviceGetTemperature(handle, 7)  # not a sensor


def test_a_function_the_library_lacks_fails_as_a_missing_symbol(fake_nvml_card):
    with nvml.session() as nv:
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            nv.nvmlDeviceGetTemperatureV(nv.nvmlDeviceGetHandleByIndex(0), nv.NVML_TEMPERATURE_GPU)


def test_gpm_requests_and_samples_are_checked_as_nvml_checks_them(fake_nvml_card):
    with nvml.session() as nv:
        handle = nv.nvmlDeviceGetHandleByIndex(0)
        first, second = (nv.nvmlGpmSampleGet(handle, nv.nvmlGpmSampleAlloc()) for _ in range(2))
        request = nv.c_nvmlGpmMetricsGet_t()
        request.numMetrics, request.sample1, request.sample2 = 1, first, second
        request.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            nv.nvmlGpmMetricsGet(request)  # no version set
        request.version, request.sample1, request.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, second, first
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nv.nvmlGpmMetricsGet(request)  # the later sample first
        for sample in (first, second):
            nv.nvmlGpmSampleFree(sample)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nv.nvmlGpmSampleFree(first)  # freed twice
