"""Choosing the device and the facts about it that explain its speed."""

import os
import platform
from dataclasses import asdict, dataclass, field
from functools import cache

import torch

from . import nvml

# Usable bandwidth of one PCIe lane in one direction, GB/s, after line encoding.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


class DeviceError(ValueError):
    """A device was asked for that does not exist here."""


# The card a test's CUDA stand-in plays on this CPU (tests/cuda_stand_in.py sets it; nothing else does).
STAND_IN: str | None = None


def get_device(spec: str | torch.device | None = None) -> torch.device:
    """The device to use: ``spec`` if given (checked), else ``$GPULAB_DEVICE``, else CUDA if present, else CPU."""
    spec = spec if spec is not None else os.environ.get("GPULAB_DEVICE") or (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise DeviceError(f"unknown device {spec!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"{spec!r} was asked for but torch sees no CUDA GPU here; run `gpulab doctor` to see why"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"{spec!r} does not exist: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return torch.device("cuda", device.index or 0)
    if device.type != "cpu":
        raise DeviceError(f"device type {device.type!r} is not covered by this course: use 'cpu' or 'cuda'")
    return device


def on_gpu(device: str | torch.device | int | None = None) -> bool:
    """Whether work on ``device`` (default: the course's device; an int is a CUDA index) runs on a CUDA GPU: the one
    question the package and the lessons ask before a call only a GPU has (events, streams, allocator statistics,
    NVML, CUDA graphs). Under a test's CUDA stand-in the CPU answers yes, so that the code around those calls runs on
    a CPU too (the stand-in proves that code, never the GPU)."""
    if device is None:
        device = get_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return device.type == "cuda" or (STAND_IN is not None and device.type == "cpu")


def sync(device: str | torch.device | None = None) -> None:
    """Wait until all queued work on ``device`` has finished (a no-op on the CPU)."""
    device = torch.device(device) if device is not None else get_device()
    if on_gpu(device):
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class PcieLink:
    """The PCIe link between host and GPU, from NVML."""

    generation: int
    width: int
    max_generation: int
    max_width: int

    @property
    def max_gbps(self) -> float:
        """Theoretical one-direction bandwidth of the link at its best generation and width, GB/s."""
        return PCIE_LANE_GBPS.get(self.max_generation, float("nan")) * self.max_width

    def __str__(self) -> str:
        now = f"now Gen{self.generation} x{self.width}"
        return f"Gen{self.max_generation} x{self.max_width} ({self.max_gbps:.1f} GB/s per direction; {now})"


@dataclass(frozen=True)
class DeviceInfo:
    """What a lesson needs to know about the device it runs on."""

    device: str
    name: str
    torch_version: str
    cuda_version: str | None = None
    cudnn_version: int | None = None
    driver_version: str | None = None
    compute_capability: tuple[int, int] | None = None
    memory_gb: float | None = None
    sm_count: int | None = None
    l2_cache_mb: float | None = None
    bf16_native: bool = False
    tf32: bool = False
    tensor_cores: bool = False
    pcie: PcieLink | None = None
    cpu_threads: int = field(default_factory=torch.get_num_threads)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        rows = {
            "device": f"{self.device} ({self.name})",
            "compute capability": ".".join(map(str, self.compute_capability)) if self.compute_capability else None,
            "memory": f"{self.memory_gb:.1f} GB" if self.memory_gb else None,
            "SMs": self.sm_count,
            "L2 cache": f"{self.l2_cache_mb:.0f} MB" if self.l2_cache_mb else None,
            "tensor cores / TF32 / native bf16": (
                f"{_yes(self.tensor_cores)} / {_yes(self.tf32)} / {_yes(self.bf16_native)}"
                if self.compute_capability else None
            ),
            "PCIe link": self.pcie,
            "torch / CUDA / cuDNN": f"{self.torch_version} / {self.cuda_version} / {self.cudnn_version}",
            "driver": self.driver_version,
            "CPU threads": self.cpu_threads,
        }
        width = max(map(len, rows))
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows.items() if v is not None)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


@cache
def device_info(device: str | torch.device | None = None) -> DeviceInfo:
    """Facts about ``device`` (default: the course's device)."""
    device = get_device(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    common = dict(torch_version=torch.__version__, cuda_version=torch.version.cuda, cudnn_version=cudnn)
    if not on_gpu(device):
        return DeviceInfo(device="cpu", name=_cpu_name(), **common)
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    driver, pcie = _nvml_facts(device.index or 0)
    return DeviceInfo(
        device=str(device),
        name=props.name,
        driver_version=driver,
        compute_capability=cc,
        memory_gb=props.total_memory / 1e9,
        sm_count=props.multi_processor_count,
        l2_cache_mb=getattr(props, "L2_cache_size", 0) / 1e6 or None,
        bf16_native=cc >= (8, 0),
        tf32=cc >= (8, 0),
        tensor_cores=cc >= (7, 0),
        pcie=pcie,
        **common,
    )


def _cpu_name() -> str:
    """The processor's model name where the OS tells it (Linux), else its architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _nvml_facts(index: int) -> tuple[str | None, PcieLink | None]:
    try:
        with nvml.session() as nv:
            h = nvml.handle_for(nv, index)
            driver = nvml.query(nv, nv.nvmlSystemGetDriverVersion)
            link = [
                nvml.query(nv, f, h)
                for f in (
                    nv.nvmlDeviceGetCurrPcieLinkGeneration,
                    nv.nvmlDeviceGetCurrPcieLinkWidth,
                    nv.nvmlDeviceGetMaxPcieLinkGeneration,
                    nv.nvmlDeviceGetMaxPcieLinkWidth,
                )
            ]
    except nvml.NvmlUnavailable:
        return None, None
    driver = driver.decode() if isinstance(driver, bytes) else driver
    return driver, PcieLink(*link) if None not in link else None
