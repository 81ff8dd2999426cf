"""What a piece of code does with tensors, observed while it runs: the evidence behind exercise checks.

``with observe() as seen: fn()`` records the calls that make the host wait for the GPU (reads of a
value such as ``.item()`` or ``print(x)``, explicit ``synchronize()`` calls), the copies it asks for
(``.to``, ``.cuda``, ``.cpu``, ``copy_``: target device, ``non_blocking``), the device every operation
ran on, and the dtype of every matrix product and convolution (what autocast chose). It sees the same
on a CPU, where nothing waits, so a check can tell that a loop *would* stall a GPU without one.
"""

from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that hand a value, text or host data back to Python: each waits for the GPU's queue.
HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__",
                        "__format__", "__repr__", "__str__", "__array__"})
COPY_METHODS = frozenset({"to", "cuda", "cpu", "copy_"})
# Operations whose output shape depends on the values: the host must wait to learn it.
DATA_DEPENDENT = frozenset({"nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim"})
_PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"})


@dataclass(frozen=True)
class Copy:
    """One copy the code asked for: the method, the target device type, and whether it was non-blocking."""

    method: str
    target: str
    non_blocking: bool


@dataclass
class Observed:
    """Everything ``observe()`` saw; read it after the ``with`` block."""

    host_reads: list[str] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    op_devices: Counter = field(default_factory=Counter)
    product_dtypes: Counter = field(default_factory=Counter)

    @property
    def waits(self) -> int:
        """How many times the host waited (or would wait, on a GPU) for queued work."""
        return len(self.host_reads) + len(self.syncs)

    def blocking_copies(self, target: str | None = None) -> list[Copy]:
        """The copies made without ``non_blocking=True`` (to ``target`` only, when given)."""
        return [c for c in self.copies if not c.non_blocking and target in (None, c.target)]


@contextmanager
def observe() -> Iterator[Observed]:
    """Record, while the block runs, what its code does with tensors (see the module's docstring)."""
    seen = Observed()
    with ExitStack() as stack:
        for name, patched in _synchronize_spies(seen).items():
            stack.enter_context(mock.patch(name, patched))
        stack.enter_context(_Methods(seen))
        stack.enter_context(_Operations(seen))
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
            self.seen.copies.append(Copy(name, target, non_blocking))
        return func(*args, **kwargs)


class _Operations(TorchDispatchMode):
    """The operations that really run (after autograd and autocast): their device and, for products, dtype."""

    def __init__(self, seen: Observed):
        super().__init__()
        self.seen = seen

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
        return func(*args, **kwargs)


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
    """Replacements for the explicit synchronise calls: record, then wait where there is a GPU to wait for."""

    def spy(label, original):
        def synchronize(*args, **kwargs):
            seen.syncs.append(label)
            if torch.cuda.is_available():
                return original(*args, **kwargs)
            return None

        return synchronize

    return {
        "torch.cuda.synchronize": spy("torch.cuda.synchronize()", torch.cuda.synchronize),
        "torch.cuda.Event.synchronize": spy("Event.synchronize()", torch.cuda.Event.synchronize),
        "torch.cuda.Stream.synchronize": spy("Stream.synchronize()", torch.cuda.Stream.synchronize),
    }
