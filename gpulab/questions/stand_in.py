"""What the checks of lessons 00, 01, 02 and 04 share: running a learner's code on the GPU or, on a machine without one, on a
stand-in for it (``gpu_run``: the meta device plays the GPU, every read back to the host is recorded), so that a
mistake which only shows on a GPU shows here too; a virtual clock (``virtual_clock``) that a timing answer cannot
read around; and the small judgements they all make (``positive``, ``ratio_is``, ``where``).
"""

import io
import numbers
import threading
import time
import timeit
from contextlib import ExitStack, contextmanager, redirect_stdout
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from ..check import Wrong
from ..timing import Measurement
from .observe import DATA_DEPENDENT, observe, simulated_gpu

GPU = torch.device("cuda")


def positive(value, what: str) -> float:
    """``value`` as a positive number (a Measurement counts as its median), else Wrong."""
    if isinstance(value, Measurement):
        value = value.median
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise Wrong(f"{what} should be a positive number, got {value!r}")
    return float(value)


def ratio_is(got, expected: float, ratio: float, rel: float = 0.02) -> bool:
    """Whether the number ``got`` is ``ratio`` times ``expected`` (within ``rel``)."""
    if isinstance(got, bool) or not isinstance(got, numbers.Real) or not expected:
        return False
    return abs(got / expected - ratio) <= rel * ratio


# ---------------------------------------------------------------- a GPU, or a stand-in for one


def simulated() -> bool:
    """Whether ``gpu_run`` plays the GPU (this machine has none). It asks CUDA itself, not ``gpulab.on_gpu``: the
    question is whether tensors can be made on "cuda", which no stand-in for the GPU can answer yes to."""
    return not torch.cuda.is_available()


def on_gpu_side(device_type: str) -> bool:
    """Whether a device type seen while ``gpu_run`` ran is the GPU's (the stand-in keeps its tensors on "meta")."""
    return device_type in ("cuda", "meta")


def _to_meta(value):
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("meta")
    if isinstance(value, str) and value.startswith("cuda"):
        return "meta"
    return value


def _read_on_host(data):
    """``data`` (a tensor, or lists of them) with every meta tensor copied to the host, as a read of it would."""
    if isinstance(data, torch.Tensor) and data.is_meta:
        return data.to("cpu")
    if isinstance(data, (list, tuple)):
        return type(data)(_read_on_host(d) for d in data)
    return data


class _CudaOnMeta(TorchFunctionMode):
    """Tensors sent to "cuda" live on "meta" (shapes and dtypes, no data). Printing one, or building a tensor from
    them, reads them through a copy to the host, as on a GPU; ``observe(fake_meta_reads=True)`` records it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is torch.device:  # a device the code names stays what it says
            return func(*args, **kwargs)
        if name == "cuda":
            non_blocking = bool(kwargs.get("non_blocking")) or any(a is True for a in args[2:])
            return args[0].to("meta", non_blocking=non_blocking)
        if name == "pin_memory":
            return args[0]
        if name in ("__repr__", "__str__") or name in ("tensor", "as_tensor") and args:
            args = (_read_on_host(args[0]), *args[1:])
        return func(*map(_to_meta, args), **{k: _to_meta(v) for k, v in kwargs.items()})


# Errors a GPU raises too (naming "cuda" where the stand-in says "meta").
_GPU_ERRORS = ("to numpy", "same device", "two devices", "expected device")


class NotJudged(Exception):
    """The stand-in for a GPU failed where a GPU would not: what the code does there cannot be judged here."""


@contextmanager
def gpu_run():
    """Run the block on the GPU (hand the code ``GPU``), and yield what ``observe()`` saw.

    Without a GPU, a stand-in: ``torch.cuda`` says there is one (with the simulated queue of ``simulated_gpu``),
    tensors sent to it live on "meta", and reads from it give zeros. The code's prints are dropped there (they would
    show those zeros). Where the stand-in fails and a GPU would not (an operation whose output shape depends on the
    values, say), it raises NotJudged.
    """
    if not simulated():
        with observe() as seen:
            yield seen
        return
    try:
        with simulated_gpu(), _CudaOnMeta(), observe(fake_meta_reads=True) as seen, redirect_stdout(io.StringIO()):
            yield seen
    except Exception as err:
        text = str(err)
        if isinstance(err, NotImplementedError) or "meta" in text.lower() and not any(w in text for w in _GPU_ERRORS):
            raise NotJudged(text) from err
        raise


def shape_reads(host_reads: list) -> list:
    """The reads among ``Observed.host_reads`` that learn an output's shape from the values: each waits for the GPU."""
    return [name for name in host_reads if name in DATA_DEPENDENT or name == "index"]


def as_on_gpu(err: Exception) -> str:
    """The message of an error raised under ``gpu_run``, as a GPU words it."""
    return str(err).replace("meta", "cuda")


class _VirtualClock:
    """Seconds that pass only when the code sleeps (or waits for the simulated GPU): exact on a loaded machine."""

    def __init__(self):
        self.now, self.thread = 1000.0, threading.get_ident()

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        self.now += seconds


@contextmanager
def virtual_clock(*functions):
    """For the block, in this thread, every clock of ``time`` (and ``timeit.default_timer``) reads a virtual clock,
    and ``time.sleep`` advances it (CPU-time clocks stand still); other threads keep the real ones.
    ``simulated_gpu`` runs on it too, and so do ``functions`` that hold a clock of their own (``from time import
    perf_counter``) in their module's globals."""
    clock = _VirtualClock()

    def ours(virtual, real):
        return lambda *args: virtual(*args) if threading.get_ident() == clock.thread else real(*args)

    seconds, nanoseconds = (lambda: clock.now), (lambda: round(clock.now * 1e9))
    fakes = {"perf_counter": seconds, "monotonic": seconds, "time": seconds, "sleep": clock.sleep,
             "perf_counter_ns": nanoseconds, "monotonic_ns": nanoseconds, "time_ns": nanoseconds,
             # CPU-time clocks stand still: a virtual sleep or a simulated GPU uses no CPU (and the real ones would
             # count whatever else this process's threads happen to do)
             "process_time": lambda: 0.0, "process_time_ns": lambda: 0, "thread_time": lambda: 0.0,
             "thread_time_ns": lambda: 0}
    replaced = {getattr(time, name): ours(virtual, getattr(time, name)) for name, virtual in fakes.items()}
    with ExitStack() as stack:
        for name in fakes:
            stack.enter_context(mock.patch.object(time, name, replaced[getattr(time, name)]))
        stack.enter_context(mock.patch.object(timeit, "default_timer", time.perf_counter))
        for namespace in {id(f.__globals__): f.__globals__ for f in functions if hasattr(f, "__globals__")}.values():
            held = {key: fake for key, value in namespace.items() for real, fake in replaced.items() if value is real}
            stack.enter_context(swapped(namespace, held))
        yield clock


@contextmanager
def swapped(namespace: dict, values: dict):
    """``namespace`` with ``values`` in place of its own for the block; only those keys are put back."""
    before = {key: namespace[key] for key in values}
    namespace.update(values)
    try:
        yield
    finally:
        namespace.update(before)


def where(device: torch.device) -> str:
    return "on a simulated GPU (this machine has none)" if device.type == "cuda" and simulated() else f"on {device}"


class StampedSyncs(list):
    """``Observed.syncs``, remembering for each wait how many copies had been asked for before it."""

    def __init__(self, copies: list):
        super().__init__()
        self.copies, self.after = copies, []

    def append(self, item) -> None:
        self.after.append(len(self.copies))
        super().append(item)


def unwaited_reads(seen) -> list:
    """The non-blocking copies from the GPU to the host that no wait followed: their values may not be there."""
    return [c for i, c in enumerate(seen.copies) if c.non_blocking and c.target == "cpu" and on_gpu_side(c.source)
            and not any(n > i for n in seen.syncs.after)]
