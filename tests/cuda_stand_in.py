"""A CPU that plays a named CUDA GPU, so that the course's GPU branches run in the CPU's tests (PyTorch's
device-generic pattern: one test, run on the CPU and on this stand-in).

It proves the Python around torch's CUDA calls: which calls the code makes, in which order, with which arguments, and
what it does with their answers. It never proves the GPU: kernels run on the CPU, events read the host clock, the
allocator's statistics count the tensors made while it is installed (``gpulab.memory.MemoryTracker``), and the card's
properties are its datasheet's. What no CPU can run (CUDA graph capture, real overlap, NVML's real values, ...) is
listed in ``tests/test_gpu_only_surface.py``: the next GPU run confirms it.

While installed:
- ``gpulab.device.on_gpu`` answers yes for the CPU (``gpulab.device.STAND_IN`` names the card); tensors stay on the CPU
  and ``torch.cuda.is_available()`` keeps saying what the machine has;
- ``torch.cuda`` answers the calls the course makes as that card would: ``Event`` on the host clock, ``Stream``,
  ``stream``, ``current_stream`` and ``default_stream`` (a CPU runs each operation as it is called: there is no queue),
  ``synchronize``, the card's ``get_device_properties``/``get_device_name``/``get_device_capability``,
  ``is_bf16_supported`` (as torch answers on that architecture: True on a T4, which emulates bf16, False there with
  ``including_emulation=False``), ``device_count`` 1 (with a CUDA context: ``torch._C._cuda_hasPrimaryContext``), the
  allocator's statistics and ``mem_get_info`` from the tracker (with ``set_per_process_memory_fraction`` as its
  budget: beyond it, an OutOfMemoryError), ``memory_summary`` (of those statistics), ``set_sync_debug_mode``,
  ``_sleep`` (a spin kernel: nothing to hold on a CPU);
- ``Tensor.pin_memory`` copies, as pinning does, and ``is_pinned`` says so (so do ``torch.empty``, ``zeros`` and
  ``ones`` with ``pin_memory=True``); ``record_stream`` takes a stream; a ``DataLoader`` with ``pin_memory=True``
  warns and pins nothing (it asks ``torch.accelerator``, which the stand-in leaves as the machine has it);
- what torch does by the card's architecture outside ``torch.cuda`` (``tests/stand_in_architecture.py``):
  ``F.scaled_dot_product_attention`` takes the backend the card would take (cuDNN on an H100 or H200 with torch's
  recent cuDNN, flash on an L4), or refuses as torch refuses there (a T4 has no flash or cuDNN attention), then runs
  the CPU's own kernel (``StandIn.attention`` counts the card's choices);
  ``torch.backends.cuda.can_use_*_attention`` answer for the card; ``torch._scaled_mm`` raises below sm_89 as torch
  does, and runs where the card has FP8 (on the CPU where this torch has a CPU kernel, else GpuOnly); products and
  convolutions in fp16 or bf16 sum in fp32 and round once, as tensor cores do (the allocator's tracker
  computes them so, ``TensorCoreTracker``: the CPU's own fp16 kernels are a hundred times slower than its fp32 ones);
- NVML answers for the same card through nvidia-ml-py's real wrappers (``tests/fake_libnvml.py``; ``StandIn.nvml`` is
  that card, whose readings a test sets);
- ``torch.cuda.CUDAGraph``, ``torch.cuda.graph`` and the memory history raise ``GpuOnly``: a CPU cannot capture or
  replay a graph, and a test must not pretend it did.

    with installed("NVIDIA H200") as gpu:   # in a test (the fixture ``cuda_stand_in``)
        ...
    install("NVIDIA H200")                  # in a notebook kernel: until the process ends
"""

import functools
import threading
import time
import weakref
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from unittest import mock

import torch
from torch.utils._device import _device_constructors

import gpulab.device
from gpulab import nvml
from gpulab.memory import MemoryTracker

from . import fake_libnvml, stand_in_architecture

SEGMENT = 2 * 2**20  # the caching allocator reserves memory in segments of 2 MiB (large blocks)


class GpuOnly(RuntimeError):
    """A call only a real GPU can answer (graph capture, the allocator's history), made under the stand-in."""


@dataclass(frozen=True)
class Card:
    """The device properties torch reports for one card (``torch.cuda.get_device_properties``)."""

    name: str
    major: int
    minor: int
    total_memory: int  # bytes, as CUDA reports them (NVML's total is larger: the driver keeps some)
    multi_processor_count: int
    L2_cache_size: int  # bytes
    pci_bus_id: int = 0  # 00000000:00:06.0, as on the 2026-11-28 H200: NVML finds the card by this address
    pci_domain_id: int = 0
    pci_device_id: int = 6
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    max_threads_per_multi_processor: int = 2048
    warp_size: int = 32
    gcnArchName: str = "NVIDIA CUDA"
    memory_clock_rate: int = 0  # kHz, and bits: device memory's theoretical bandwidth (an older torch lacks both)
    memory_bus_width: int = 0


CARDS = {card.name: card for card in (
    # torch's total_memory as lesson 00 printed it on 2026-11-28 (150.1 GB); 132 SMs, 60 MiB of L2 ("63 MB"); its
    # memory as lesson 01 printed it there: a 6016-bit bus at 3.20 GHz, 4814 GB/s
    Card("NVIDIA H200", 9, 0, 150_110_000_000, 132, 60 * 2**20, memory_clock_rate=3_201_000, memory_bus_width=6016),
    Card("NVIDIA H100 80GB HBM3", 9, 0, 84_930_000_000, 132, 50 * 2**20, memory_clock_rate=2_619_000,
         memory_bus_width=5120),
    # Colab's T4 as torch printed it in a public notebook (total_memory=15095MB, pci_device_id=4, L2_cache_size=4MB);
    # a public deviceQuery of a T4: 1024 threads per SM, a 256-bit bus at 5001 MHz (320 GB/s)
    Card("Tesla T4", 7, 5, 15095 * 2**20, 40, 4 * 2**20, pci_device_id=4, max_threads_per_multi_processor=1024,
         memory_clock_rate=5_001_000, memory_bus_width=256),
    # A public deviceQuery of an L4 (driver 525.105.17): 23612293120 bytes, 58 SMs, 48 MiB of L2, 1536 threads per SM,
    # a 192-bit bus at 6251 MHz (300 GB/s), at PCI 00:03.0
    Card("NVIDIA L4", 8, 9, 23_612_293_120, 58, 48 * 2**20, pci_device_id=3, max_threads_per_multi_processor=1536,
         memory_clock_rate=6_251_000, memory_bus_width=192),
    # CUDA's total for this laptop card was not found in public sources: the datasheet's 8 GiB (a real card reports a
    # few hundred MiB less, as the L4 and T4 do). AD107: 24 SMs, 32 MB of L2, 1536 threads per SM, 128-bit GDDR6 at
    # 16 Gbps (CUDA's memory clock is half the data rate: 8001 MHz, 256 GB/s); a laptop's GPU at PCI 01:00.0
    Card("NVIDIA GeForce RTX 4060 Laptop GPU", 8, 9, 8 * 2**30, 24, 32 * 2**20, pci_bus_id=1, pci_device_id=0,
         max_threads_per_multi_processor=1536, memory_clock_rate=8_001_000, memory_bus_width=128),
    # A public deviceQuery of an A100-SXM4-40GB: 42298834944 bytes, 108 SMs, 40 MiB of L2, 2048 threads per SM, a
    # 5120-bit HBM2 bus at 1215 MHz (1555 GB/s)
    Card("NVIDIA A100-SXM4-40GB", 8, 0, 42_298_834_944, 108, 40 * 2**20, memory_clock_rate=1_215_000,
         memory_bus_width=5120),
)}


NVML_CARDS = {"NVIDIA H200": fake_libnvml.h200, "NVIDIA H100 80GB HBM3": fake_libnvml.h100, "Tesla T4": fake_libnvml.t4,
              "NVIDIA L4": fake_libnvml.l4, "NVIDIA GeForce RTX 4060 Laptop GPU": fake_libnvml.rtx_4060_laptop,
              "NVIDIA A100-SXM4-40GB": fake_libnvml.a100_40gb}


class HostEvent:
    """``torch.cuda.Event`` on the host clock: ``record`` reads it; ``elapsed_time`` is in milliseconds, and raises
    as torch does for an event not recorded or made without ``enable_timing``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing, self.at = enable_timing, None

    def record(self, stream=None) -> None:
        _check_stream(stream)
        self.at = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.at - self.at) * 1e3

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        _check_stream(stream)


class HostStream:
    """``torch.cuda.Stream``: a CPU runs each operation as it is called, so every wait is already over."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device, self.priority = torch.device("cpu"), priority

    def wait_stream(self, stream) -> None:
        _check_stream(stream)

    def wait_event(self, event) -> None:
        if not isinstance(event, HostEvent):
            raise TypeError(f"wait_event() takes a torch.cuda.Event, got {type(event).__name__}")

    def record_event(self, event=None) -> HostEvent:
        event = event or HostEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _check_stream(stream) -> None:
    if stream is not None and not isinstance(stream, HostStream):
        raise TypeError(f"expected a torch.cuda.Stream, got {type(stream).__name__}")


@dataclass
class StandIn:
    """The installed stand-in: the card it plays and what its allocator has counted."""

    card: Card
    nvml: object = None  # the card the fake libnvidia-ml plays (tests/fake_libnvml.py)
    tracker: MemoryTracker = field(default_factory=stand_in_architecture.TensorCoreTracker)  # and its tensor cores
    reserved: int = 0
    reserved_peak: int = 0
    sync_debug_mode: int = 0
    default: HostStream = field(default_factory=HostStream)
    attention: Counter = field(default_factory=Counter)  # SDPA backend -> calls the card chose it for
    _current: threading.local = field(default_factory=threading.local)
    _pinned: dict = field(default_factory=dict)  # id -> weak reference, of the tensors pin_memory made

    # ---- streams
    def current_stream(self, device=None) -> HostStream:
        return getattr(self._current, "stream", self.default)

    @contextmanager
    def stream(self, stream):
        _check_stream(stream)
        before = self.current_stream()
        self._current.stream = stream or before
        try:
            yield
        finally:
            self._current.stream = before

    # ---- the caching allocator, counted by the tracker
    def allocated(self, device=None) -> int:
        return self.tracker.current

    def reserved_now(self, device=None) -> int:
        self.reserved = max(self.reserved, _segments(self.tracker.current))
        # the most reserved at once: at least the segments of the most allocated at once since the last reset
        self.reserved_peak = max(self.reserved_peak, self.reserved, _segments(self.tracker.peak))
        return self.reserved

    def reserved_most(self, device=None) -> int:
        self.reserved_now()
        return self.reserved_peak

    def reset_peak(self, device=None) -> None:
        self.tracker.reset_peak()
        self.reserved_peak = self.reserved_now()

    def empty_cache(self) -> None:
        self.reserved = _segments(self.tracker.current)

    def stats(self, device=None) -> dict:
        reserved = self.reserved_now()
        return {"allocated_bytes.all.current": self.tracker.current, "allocated_bytes.all.peak": self.tracker.peak,
                "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": self.reserved_peak,
                "active_bytes.all.current": self.tracker.current, "num_alloc_retries": 0, "num_ooms": 0,
                "num_device_alloc": 0, "num_device_free": 0}

    def summary(self, device=None, abbreviated: bool = False) -> str:
        """``torch.cuda.memory_summary``'s table (torch/cuda/memory.py), of the counters the stand-in keeps."""
        stats, rows = self.stats(), []
        for key, name in (("allocated_bytes", "Allocated memory"), ("reserved_bytes", "GPU reserved memory")):
            current, peak = (stats[f"{key}.all.{when}"] // 1024 for when in ("current", "peak"))
            rows.append(f"| {name:<21} | {current:6d} KiB | {peak:6d} KiB |")
        title = f"| PyTorch CUDA memory summary, device ID 0 (the CUDA stand-in: {self.card.name}) |"
        return "\n".join(["=" * 75, title, *rows, "=" * 75]) + "\n"

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.card.total_memory - self.reserved_now(), self.card.total_memory

    def set_memory_fraction(self, fraction: float, device=None) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.tracker.budget = fraction * self.card.total_memory

    # ---- pinned host memory
    def pin_memory(self, tensor: torch.Tensor, device=None) -> torch.Tensor:
        if self.is_pinned(tensor):
            return tensor
        pinned = tensor.clone()
        key = id(pinned)
        self._pinned[key] = weakref.ref(pinned, lambda _: self._pinned.pop(key, None))
        return pinned

    def is_pinned(self, tensor: torch.Tensor, device=None) -> bool:
        held = self._pinned.get(id(tensor))
        return held is not None and held() is tensor


def _segments(nbytes: int) -> int:
    return -(-nbytes // SEGMENT) * SEGMENT


def _has_context(index: int) -> bool:
    """``torch._C._cuda_hasPrimaryContext``: the one device played has one; another index is refused, as by torch."""
    if not 0 <= index < 1:
        raise RuntimeError(f"hasPrimaryContext expects a valid device index, but got device_index={index}")
    return True


def _pinning(factory, gpu: StandIn):
    """``torch.<factory>(..., pin_memory=True)`` as a GPU's torch makes it: the tensor, in pinned host memory (here
    a copy that ``is_pinned``); without ``pin_memory`` the factory itself (torch/_torch_docs.py: the factories'
    ``pin_memory`` argument)."""

    @functools.wraps(factory)
    def make(*args, pin_memory: bool = False, **kwargs):
        tensor = factory(*args, **kwargs)
        return gpu.pin_memory(tensor) if pin_memory else tensor
    return make


def _refusal(what: str) -> GpuOnly:
    return GpuOnly(f"{what} needs a real GPU: the CUDA stand-in runs the code around it, never this call")


def _gpu_only(what: str):
    def refuse(*args, **kwargs):
        raise _refusal(what)
    return refuse


def _patches(gpu: StandIn) -> dict:
    """``torch.cuda``'s attributes the stand-in replaces, and what with."""
    card = gpu.card
    properties = SimpleNamespace(**asdict(card))
    return {
        "Event": HostEvent, "Stream": HostStream, "stream": gpu.stream, "current_stream": gpu.current_stream,
        "default_stream": lambda device=None: gpu.default, "synchronize": lambda device=None: None,
        "device_count": lambda: 1, "current_device": lambda: 0, "set_device": lambda device: None,
        "get_device_properties": lambda device=None: properties, "get_device_name": lambda device=None: card.name,
        "get_device_capability": lambda device=None: (card.major, card.minor),
        "is_bf16_supported": stand_in_architecture.is_bf16_supported(card),
        "memory_allocated": gpu.allocated, "max_memory_allocated": lambda device=None: gpu.tracker.peak,
        "memory_reserved": gpu.reserved_now, "max_memory_reserved": gpu.reserved_most,
        "reset_peak_memory_stats": gpu.reset_peak, "empty_cache": gpu.empty_cache, "memory_stats": gpu.stats,
        "mem_get_info": gpu.mem_get_info, "set_per_process_memory_fraction": gpu.set_memory_fraction,
        "memory_summary": gpu.summary,
        "memory_snapshot": lambda: [], "get_allocator_backend": lambda: "native",
        "set_sync_debug_mode": lambda mode: setattr(gpu, "sync_debug_mode", mode),
        "get_sync_debug_mode": lambda: gpu.sync_debug_mode,
        # torch.cuda._sleep(cycles) queues a kernel that spins for `cycles` clocks (torch/cuda/__init__.py,
        # aten/src/ATen/cuda/Sleep.cu) and returns: a CPU has no queue to hold, so it returns at once
        "_sleep": lambda cycles: None,
        # torch.cuda.is_current_stream_capturing() (torch/cuda/graphs.py) is False outside a capture, and the
        # stand-in never captures (CUDAGraph and graph raise GpuOnly)
        "is_current_stream_capturing": lambda: False,
        "CUDAGraph": _gpu_only("torch.cuda.CUDAGraph (capture and replay)"),
        "graph": _gpu_only("torch.cuda.graph (capture)"),
        "make_graphed_callables": _gpu_only("torch.cuda.make_graphed_callables"),
    }


def _torch_patches(gpu: StandIn) -> list[tuple[object, str, object]]:
    """What torch answers by the card's architecture outside ``torch.cuda`` (tests/stand_in_architecture.py): SDPA's
    choice of backend, the backends' checks, FP8 matmuls."""
    arch, card = stand_in_architecture, gpu.card
    patches = [(torch.nn.functional, "scaled_dot_product_attention",
                arch.attention(torch.nn.functional.scaled_dot_product_attention, card, gpu.attention)),
               (torch, "_scaled_mm", arch.scaled_mm(torch._scaled_mm, card, _refusal))]
    for backend in ("flash", "efficient", "cudnn"):  # torch.backends.cuda.can_use_*_attention, in 2.6 and 2.14
        patches.append((torch.backends.cuda, f"can_use_{backend}_attention", arch.can_use(backend, card)))
    return patches


def answered() -> set[str]:
    """The names in ``torch.cuda`` the stand-in answers (or refuses with GpuOnly)."""
    return set(_patches(StandIn(CARDS["NVIDIA H200"])))


@contextmanager
def installed(card: str = "NVIDIA H200"):
    """The stand-in playing ``card`` for the block; yields the ``StandIn``."""
    gpu = StandIn(CARDS[card])
    with ExitStack() as stack:
        for name, value in _patches(gpu).items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value, create=True))
        for owner, name, value in _torch_patches(gpu):
            stack.enter_context(mock.patch.object(owner, name, value))
        # which devices have a CUDA context (gpulab.timing.used_gpus): the one the stand-in plays
        stack.enter_context(mock.patch.object(torch._C, "_cuda_hasPrimaryContext", _has_context, create=True))
        for name, value in {"_record_memory_history": _gpu_only("the allocator's history"),
                            "_snapshot": _gpu_only("the allocator's snapshot"),
                            "_dump_snapshot": _gpu_only("the allocator's snapshot")}.items():
            stack.enter_context(mock.patch.object(torch.cuda.memory, name, value))
        stack.enter_context(mock.patch.object(torch.Tensor, "pin_memory", lambda t, device=None: gpu.pin_memory(t)))
        # `with torch.device("meta"):` gives the factories its device where torch.utils._device's cached set of them
        # holds the real ones (the wrappers call them): made before they are wrapped, or never while they are
        _device_constructors()
        for factory in ("empty", "zeros", "ones"):
            stack.enter_context(mock.patch.object(torch, factory, _pinning(getattr(torch, factory), gpu)))
        stack.enter_context(mock.patch.object(torch.Tensor, "is_pinned", lambda t, device=None: gpu.is_pinned(t)))
        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream", lambda tensor, stream: _check_stream(stream)))
        stack.enter_context(mock.patch.object(gpulab.device, "STAND_IN", card))
        stack.callback(_forget_device_facts)
        _forget_device_facts()
        address = f"{gpu.card.pci_domain_id:08X}:{gpu.card.pci_bus_id:02X}:{gpu.card.pci_device_id:02X}.0"
        gpu.nvml = stack.enter_context(fake_libnvml.installed(NVML_CARDS[card](pci_bus_id=address))).cards[0]
        stack.enter_context(gpu.tracker)
        yield gpu


def _forget_device_facts() -> None:
    """Facts cached about the device and NVML sessions belong to whichever device was there when they were read."""
    gpulab.device.device_info.cache_clear()
    nvml.close_shared()


_kept = []


def install(card: str = "NVIDIA H200") -> StandIn:
    """The stand-in playing ``card`` until this process ends (a notebook kernel's first cell)."""
    stack = ExitStack()
    gpu = stack.enter_context(installed(card))
    _kept.append(stack)
    return gpu

