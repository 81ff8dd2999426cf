"""What a piece of code does with tensors, observed while it runs: the evidence behind exercise checks.

``with observe() as seen: fn()`` records the calls that make the host wait for the GPU (reads of a
value such as ``.item()`` or ``print(x)``, explicit ``synchronize()`` calls), the copies it asks for
(``.to``, ``.cuda``, ``.cpu``, ``copy_``: target device, ``non_blocking``), the device every operation
ran on, and the dtype of every matrix product and convolution (what autocast chose). It sees the same
on a CPU, where nothing waits, so a check can tell that a loop *would* stall a GPU without one.

A GPU can be stood in for on a machine without one in two ways. ``observe(fake_meta_reads=True)``
lets the "meta" device play the GPU: code runs on meta tensors, every transfer back to the host is
recorded in ``to_host`` and reads as zeros instead of failing. ``simulated_gpu()`` plays a GPU's
queue and clock: work queued with ``gpu.launch(seconds)`` (or ``torch.cuda._sleep(cycles)``) returns at once
and "runs" in real time, and ``torch.cuda.synchronize()``, CUDA events and streams wait for it, so a timer
that does not synchronise measures the wrong thing there exactly as it does on a GPU.
"""

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..device import on_gpu

# Tensor methods that hand a value, text or host data back to Python: each waits for the GPU's queue.
HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__",
                        "__format__", "__repr__", "__str__", "__array__"})
COPY_METHODS = frozenset({"to", "cuda", "cpu", "copy_"})
# Operations whose output shape depends on the values: the host must wait to learn it.
DATA_DEPENDENT = frozenset({"nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim"})
_PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"})
_TO_HOST_WORDS = {"_local_scalar_dense": "a Python number (`.item()`, `float()`, `if tensor`)",
                  "_to_copy": "a copy to the CPU (`.cpu()`, `.to('cpu')`)",
                  "copy_": "a copy into a tensor on the host"}


@dataclass(frozen=True)
class Copy:
    """One copy the code asked for: the method, the target device type, whether it was non-blocking, the source's."""

    method: str
    target: str
    non_blocking: bool
    source: str = ""


@dataclass
class Observed:
    """Everything ``observe()`` saw; read it after the ``with`` block."""

    host_reads: list[str] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    op_devices: Counter = field(default_factory=Counter)
    product_dtypes: Counter = field(default_factory=Counter)
    product_devices: Counter = field(default_factory=Counter)
    to_host: list[str] = field(default_factory=list)  # operations that brought data from a device to the host

    @property
    def waits(self) -> int:
        """How many times the host waited (or would wait, on a GPU) for queued work."""
        return len(self.host_reads) + len(self.syncs)

    def to_host_kinds(self) -> str:
        """The kinds of transfers in ``to_host``, in words (for messages to learners)."""
        kinds = dict.fromkeys(_TO_HOST_WORDS.get(name, f"`{name}` writing into a host tensor") for name in self.to_host)
        return "; ".join(kinds)

    def blocking_copies(self, target: str | None = None) -> list[Copy]:
        """The copies made without ``non_blocking=True`` (to ``target`` only, when given)."""
        return [c for c in self.copies if not c.non_blocking and target in (None, c.target)]


@contextmanager
def observe(fake_meta_reads: bool = False) -> Iterator[Observed]:
    """Record, while the block runs, what its code does with tensors (see the module's docstring).

    With ``fake_meta_reads``, meta tensors read back to the host give zeros instead of raising.
    """
    seen = Observed()
    with ExitStack() as stack:
        for name, patched in _synchronize_spies(seen).items():
            stack.enter_context(mock.patch(name, patched))
        stack.enter_context(_Methods(seen))
        stack.enter_context(_Operations(seen, fake_meta_reads))
        yield seen


class _Methods(TorchFunctionMode):
    """Tensor methods as the code calls them: host reads and copies (before PyTorch resolves them)."""

    def __init__(self, seen: Observed):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.seen.host_reads.append(name)
        target = _target(name, args, kwargs) if name in COPY_METHODS and args and isinstance(args[0], torch.Tensor) else None
        if target:
            non_blocking = bool(kwargs.get("non_blocking")) or any(a is True for a in args[2:])
            source = args[1] if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) else args[0]
            self.seen.copies.append(Copy(name, target, non_blocking, source.device.type))
        return func(*args, **kwargs)


class _Operations(TorchDispatchMode):
    """The operations that really run (after autograd and autocast): their device and, for products, dtype."""

    def __init__(self, seen: Observed, fake_meta_reads: bool = False):
        super().__init__()
        self.seen = seen
        self.fake_meta_reads = fake_meta_reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        name = func.overloadpacket.__name__
        if name in DATA_DEPENDENT or name == "index" and _has_mask(args):
            self.seen.host_reads.append(name)
        if tensors:
            self.seen.op_devices[tensors[0].device.type] += 1
            if name in _PRODUCTS:
                self.seen.product_dtypes[tensors[0].dtype] += 1
                self.seen.product_devices[tensors[0].device.type] += 1
        source = _to_host_from(name, tensors, kwargs)
        if source:
            self.seen.to_host.append(name)
            if source == "meta" and self.fake_meta_reads:
                return _zeros_for(name, args, kwargs)
        return func(*args, **kwargs)


def _to_host_from(name: str, tensors: list, kwargs: dict) -> str | None:
    """The device an operation brings data from to the host (None when it does not): a scalar read,
    a copy to the CPU, or an operation writing into a host tensor from a device tensor."""
    if not tensors:
        return None
    first = tensors[0].device.type
    if name == "_local_scalar_dense":
        return first if first != "cpu" else None
    if name == "_to_copy":
        target = kwargs.get("device")
        return first if first != "cpu" and target is not None and torch.device(target).type == "cpu" else None
    if first == "cpu":
        return next((t.device.type for t in tensors[1:] if t.device.type != "cpu"), None)
    return None


def _zeros_for(name: str, args: tuple, kwargs: dict):
    """What a read of a meta tensor gives under ``fake_meta_reads``: zeros of the right type and shape."""
    if name == "_local_scalar_dense":
        dtype = args[0].dtype
        return False if dtype == torch.bool else 0 if not dtype.is_floating_point and not dtype.is_complex else 0.0
    if name == "_to_copy":
        return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
    return args[0].zero_()  # an operation writing into a host tensor: it holds zeros afterwards


def _has_mask(args: tuple) -> bool:
    """``x[mask]``: a boolean index, whose number of True values the host must learn."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _target(name: str, args: tuple, kwargs: dict) -> str | None:
    """The device type a copy method sends its tensor to (None for ``.to(dtype)``, which names no device)."""
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        return "cuda"
    if name == "copy_":
        return args[0].device.type
    for spec in (kwargs.get("device"), *args[1:]):
        if isinstance(spec, torch.Tensor):
            return spec.device.type
        if isinstance(spec, (str, torch.device)) and not isinstance(spec, bool):
            try:
                return torch.device(spec).type
            except RuntimeError:
                continue
    return None


def _synchronize_spies(seen: Observed) -> dict:
    """Replacements for the explicit synchronise calls: record, then wait where there is a GPU to wait for: the CUDA
    runtime's (a real GPU, or ``simulated_gpu``'s queue), whichever device the course chose (``gpu_run`` runs a
    learner's code on the GPU even where ``$GPULAB_DEVICE`` is the CPU), or the tests' CUDA stand-in."""

    def spy(label, original):
        def synchronize(*args, **kwargs):
            seen.syncs.append(label)
            if torch.cuda.is_available() or on_gpu():
                return original(*args, **kwargs)
            return None

        return synchronize

    return {
        "torch.cuda.synchronize": spy("torch.cuda.synchronize()", torch.cuda.synchronize),
        "torch.cuda.Event.synchronize": spy("Event.synchronize()", torch.cuda.Event.synchronize),
        "torch.cuda.Stream.synchronize": spy("Stream.synchronize()", torch.cuda.Stream.synchronize),
    }


class SimulatedGpu:
    """A GPU's queue played on the host: ``launch(seconds)`` queues work and returns at once; the work
    "runs" item after item in real time, and waiting calls sleep until the queue reaches them. Its clock runs at
    ``clock_hz`` (an H200's top SM clock), which turns ``torch.cuda._sleep``'s cycles into seconds."""

    clock_hz = 1.98e9

    def __init__(self):
        self.busy_until = time.perf_counter()
        self.launched = 0

    def launch(self, seconds: float) -> None:
        """Queue ``seconds`` of work behind what is already queued."""
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds
        self.launched += 1

    def wait(self, until: float | None = None) -> None:
        """Sleep until the queue has run everything (or up to the time ``until``)."""
        delay = (self.busy_until if until is None else until) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


@contextmanager
def simulated_gpu() -> Iterator[SimulatedGpu]:
    """For the block: ``torch.cuda`` reports a GPU whose queue is a ``SimulatedGpu``.

    ``torch.cuda.synchronize()``, ``Event`` (``record``, ``synchronize``, ``query``, ``elapsed_time`` in ms,
    refused until both events have completed, as CUDA does), ``Stream``, ``current_stream()``,
    ``torch.cuda.stream(...)`` and ``torch.cuda._sleep(cycles)`` (a kernel that spins for ``cycles`` clocks:
    aten/src/ATen/cuda/Sleep.cu) work on it. Tensors cannot be put on it: only timing code runs here.
    """
    gpu = SimulatedGpu()

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False, **_):
            self.enable_timing, self.at = enable_timing, None

        def record(self, stream=None):
            self.at = max(time.perf_counter(), gpu.busy_until)

        def query(self):
            return self.at is None or time.perf_counter() >= self.at

        def synchronize(self):
            if self.at is not None:
                gpu.wait(self.at)

        def wait(self, stream=None):
            pass

        def elapsed_time(self, end):
            if not (self.enable_timing and end.enable_timing):
                raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
            if self.at is None or end.at is None or not (self.query() and end.query()):
                raise RuntimeError("CUDA error: device not ready (the events have not completed: synchronize first)")
            return (end.at - self.at) * 1e3

    class Stream:
        def __init__(self, device=None, priority=0, **_):
            pass

        def synchronize(self):
            gpu.wait()

        def query(self):
            return time.perf_counter() >= gpu.busy_until

        def wait_stream(self, stream):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            event = event or Event()
            event.record()
            return event

    stream = Stream()
    patches = {
        "torch.cuda.is_available": lambda: True,
        "torch.cuda.synchronize": lambda device=None: gpu.wait(),
        "torch.cuda.Event": Event,
        "torch.cuda.Stream": Stream,
        "torch.cuda.current_stream": lambda device=None: stream,
        "torch.cuda.default_stream": lambda device=None: stream,
        "torch.cuda.stream": lambda s=None: nullcontext(),
        "torch.cuda._sleep": lambda cycles: gpu.launch(cycles / gpu.clock_hz),
    }
    with ExitStack() as stack:
        for name, patched in patches.items():
            stack.enter_context(mock.patch(name, patched))
        yield gpu
