"""Where the memory of a step goes: byte accounting on any device, and allocation timelines drawn offline.

On a GPU, PyTorch's caching allocator counts every byte (``torch.cuda.memory_allocated`` and friends).
A CPU has no such statistics, so ``MemoryTracker`` counts them itself: a dispatch mode that sees every
operator, adds the bytes of each new tensor and subtracts them when the tensor is freed. With a budget it
raises ``BudgetExceeded`` (an out-of-memory error): an emulated, smaller card.

``WorkspaceMeter`` measures, on a GPU, what the allocator holds beyond the tensors: the scratch memory (a
*workspace*) an operator takes during its call and gives back before it returns, as cuDNN's convolutions do.

``snapshot_timeline`` turns a snapshot written by ``torch.cuda.memory._dump_snapshot`` into the same kind
of timeline as ``MemoryTracker.timeline()``, so ``gpulab.plots.memory_timeline`` draws either without a
browser or internet (pytorch.org/memory_viz needs both).
"""

import functools
import math
import numbers
import os
import pickle
import weakref
from pathlib import Path

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import nvml
from .device import get_device, on_gpu, sync

TIMELINE_COLUMNS = ["event", "phase", "action", "op", "bytes", "allocated"]


class BudgetExceeded(torch.OutOfMemoryError):
    """A step needed more memory than the budget allows: out of memory on an emulated, smaller card. ``tracker`` is
    the MemoryTracker whose budget it was."""

    tracker = None


class TrackerError(RuntimeError):
    """A MemoryTracker was used in a way that cannot work; the message says what to do."""


class SnapshotError(ValueError):
    """A memory snapshot file is missing or is not a snapshot; the message says what to do."""


class MemoryTracker(TorchDispatchMode):
    """Counts the bytes of tensors created inside ``with tracker:`` that are still alive.

    ``current`` is what is alive now, ``peak`` the most that was alive at once. Every operator that
    returns new memory (not a view, not an in-place result) is counted, on any device; a weak
    reference to its storage subtracts the bytes when the tensor is freed, even after the block.
    With ``budget`` (bytes), the operator whose result would take ``current`` past it raises BudgetExceeded, and
    its result is dropped uncounted, as the CUDA allocator refuses an allocation past its limit: ``current`` and
    ``peak`` never pass the budget. With ``record=True`` it also keeps every allocation and free, for
    ``timeline()``; ``mark("phase")`` names the part of the step that follows. Tensors made from Python or NumPy
    data (``torch.tensor``, ``torch.from_numpy``) bypass the operators it sees and are not counted. A tracker
    entered again inside its own block counts each tensor once.
    """

    def __init__(self, budget: float | None = None, *, record: bool = False):
        super().__init__()
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
                                   or not 0 < budget < math.inf):
            raise ValueError(f"budget is a positive number of bytes (e.g. 2**30 for 1 GiB), or None for no budget; "
                             f"got {budget!r}")
        self.budget = budget
        self.record = record
        self.current = 0
        self.peak = 0
        self._phase = ""
        self._events: list[tuple[str, str, str, int, int]] = []  # phase, action, op, bytes, allocated after
        self._depth = 0
        self._live: set[int] = set()  # ids of the storages counted and not yet freed

    def __enter__(self):
        self._depth += 1
        return super().__enter__() if self._depth == 1 else self  # nested in itself: counts each tensor once

    def __exit__(self, exc_type, exc_val, exc_tb):
        self._depth -= 1
        return super().__exit__(exc_type, exc_val, exc_tb) if self._depth == 0 else None

    def reset_peak(self) -> None:
        self.peak = self.current

    def mark(self, phase: str) -> None:
        """Name what follows (``"forward"``, ``"backward"``, ...) in the timeline."""
        if not self._depth:
            raise TrackerError(f"mark({phase!r}) outside the tracker: call it inside `with tracker:`, where the step runs")
        self._phase = str(phase)
        self._log("mark", "", 0)

    def timeline(self) -> pd.DataFrame:
        """One row per allocation, free and mark: the phase, the operator, its bytes and the bytes alive after it."""
        if not self.record:
            raise TrackerError("this tracker keeps no timeline: create it with MemoryTracker(record=True)")
        if not self._events:
            raise TrackerError("the tracker has recorded nothing yet: run the step inside `with tracker:` first")
        frame = pd.DataFrame(self._events, columns=TIMELINE_COLUMNS[1:])
        return frame.rename_axis("event").reset_index()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._counted(func, func(*args, **(kwargs or {})))

    def _counted(self, func, out):
        """``out``, what ``func`` returned, with its new storages counted (or refused past the budget)."""
        fresh = self._fresh_storages(func, out)
        asked = self.current + sum(storage.nbytes() for storage in fresh)
        if self.budget is not None and asked > self.budget:
            # Refused, as the CUDA allocator refuses an allocation past its limit: nothing of it is counted, and no
            # reference to it stays in the error's traceback, so it is freed at once.
            del out, fresh
            raise self._over_budget(asked)  # made elsewhere: an error held by this frame would keep it (a cycle)
        for storage in fresh:
            self._count(storage, func)
        return out

    def _over_budget(self, asked: int) -> BudgetExceeded:
        error = BudgetExceeded(f"a step needed {mib(asked)} of tensors, more than the budget of {mib(self.budget)}")
        error.tracker = self
        return error

    def _fresh_storages(self, func, out) -> list:
        """The storages new to the tracker among what an operator returned: not views or in-place results, not empty,
        and not already counted (some operators, such as ``_unsafe_view``, return their input's storage without
        saying so in their schema)."""
        returns = _fresh_returns(func)
        results = (out,) if len(returns) == 1 else (out or ())  # one result (maybe a list), several, or none
        fresh = {}
        for is_fresh, result in zip(returns, results):
            if is_fresh:
                for tensor in (result,) if isinstance(result, torch.Tensor) else tree_leaves(result):
                    if isinstance(tensor, torch.Tensor):
                        storage = tensor.untyped_storage()
                        if id(storage) not in self._live and storage.nbytes():
                            fresh[id(storage)] = storage
        return list(fresh.values())

    def _count(self, storage, func) -> None:
        """Count a storage an operator returned; uncount it when it is freed."""
        nbytes = storage.nbytes()
        self._live.add(id(storage))
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self._log("alloc", func.overloadpacket.__name__, nbytes)
        weakref.finalize(storage, self._free, id(storage), nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.current -= nbytes
        self._log("free", "", nbytes)

    def _log(self, action: str, op: str, nbytes: int) -> None:
        if self.record:
            self._events.append((self._phase, action, op, nbytes, self.current))


@functools.cache  # an operator's schema, read once: the tracker sees every operator of a step
def _fresh_returns(func) -> tuple[bool, ...]:
    """For each return of ``func``: True for a fresh allocation, False for a view or an in-place result."""
    return tuple(r.alias_info is None for r in func._schema.returns)


# ----- what the CUDA allocator holds beyond the tensors ------------------------------------------------


class WorkspaceMeter(TorchDispatchMode):
    """Scratch memory that operators take from the CUDA caching allocator during a call and give back before it returns.

    cuDNN picks an algorithm for each convolution shape, and many need a scratch buffer, a *workspace*, which
    PyTorch allocates from its caching allocator for the duration of the call. No tensor of the program holds it,
    so counting tensors (``MemoryTracker``) misses it; the allocator's peak, and the card, hold it. Inside
    ``with meter:`` each operator's scratch is the allocator's peak during its call above what was allocated both
    before and after it; ``table()`` keeps each operator's largest. The meter resets the allocator's peak statistics
    before every operator, so ``torch.cuda.max_memory_allocated`` says nothing about the block as a whole.

    A CPU has no caching allocator: there the meter sees and counts the operators all the same, and their scratch
    memory is missing (NaN), as ``note`` says.
    """

    def __init__(self, device=None):
        super().__init__()
        self.device = get_device(device)
        self.reads_allocator = on_gpu(self.device)
        self.note = "" if self.reads_allocator else (
            f"{self.device} has no caching allocator: its operators were counted, their scratch memory is not "
            "measured (NaN); a MemoryTracker counts the tensors there")
        self._largest: dict[str, tuple[int, float]] = {}  # operator: (calls, the most scratch of one call)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.reads_allocator:
            self._note(func.overloadpacket.__name__, math.nan)
            return func(*args, **(kwargs or {}))
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)  # the peak from here on is this call's
        out = func(*args, **(kwargs or {}))
        after, peak = torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
        self._note(func.overloadpacket.__name__, peak - max(before, after))
        return out

    def _note(self, op: str, scratch: float) -> None:
        calls, largest = self._largest.get(op, (0, scratch))
        self._largest[op] = (calls + 1, max(largest, scratch))

    def table(self) -> pd.DataFrame:
        """One row per operator that ran: its calls and the most scratch memory one call took, largest first."""
        if not self._largest:
            raise TrackerError("the meter has seen no operator yet: run the step inside `with meter:` first")
        rows = [(op, calls, scratch) for op, (calls, scratch) in self._largest.items()]
        frame = pd.DataFrame(rows, columns=["op", "calls", "scratch_bytes"])
        return frame.sort_values("scratch_bytes", ascending=False, kind="stable").reset_index(drop=True)


def peak_bytes(run, device=None) -> int:
    """The most memory ``run()`` allocated above what was allocated before it: the CUDA allocator's peak on a GPU, a
    ``MemoryTracker``'s on a CPU."""
    device = get_device(device)
    if on_gpu(device):
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    with MemoryTracker() as tracker:
        run()
    return tracker.peak


# ----- snapshots of the CUDA caching allocator --------------------------------------------------------

# How each documented trace action changes the bytes allocated (handed to tensors) and reserved (cudaMalloc'd).
_ALLOCATED = {"alloc": 1, "free_completed": -1}
_RESERVED = {"segment_alloc": 1, "segment_free": -1, "segment_map": 1, "segment_unmap": -1}


def record_history(max_entries: int = 100_000, device=None, *, context: str | None = "all",
                   stacks: str = "python") -> bool:
    """Start recording the CUDA allocator's history: ``torch.cuda.memory._record_memory_history(max_entries=...,
    context=..., stacks=...)``; lesson 05 writes that call out itself.

    ``context`` says which events keep a stack trace ("all": allocs and frees, "alloc": allocs, "state": only what
    is alive at the dump, None: none); ``stacks="python"`` keeps only Python frames. torch's default,
    ``stacks="all"``, also records C++ frames, and symbolizing them can make ``_dump_snapshot`` take minutes.

    True when recording started. Where there is no CUDA device (torch raises there) it says so and returns
    False, so a lesson carries on. Stop with ``torch.cuda.memory._record_memory_history(enabled=None)``.
    """
    device = get_device(device)
    if not on_gpu(device):
        print("No CUDA device here: only the CUDA caching allocator records a memory history. Carrying on without one.")
        return False
    try:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, context=context, stacks=stacks)
    except RuntimeError as err:  # e.g. an allocator backend that keeps no history (cudaMallocAsync)
        print(f"This allocator cannot record a memory history ({err}). Carrying on without one.")
        return False
    return True


def load_snapshot(path: str | Path) -> dict:
    """The snapshot that ``torch.cuda.memory._dump_snapshot(path)`` wrote. It is a pickle, and unpickling
    runs code: load only snapshots you (or someone you trust) recorded."""
    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"no snapshot at {path}: on a GPU, torch.cuda.memory._dump_snapshot({str(path)!r}) writes one")
    try:
        with path.open("rb") as f:
            snapshot = pickle.load(f)
    except Exception as err:  # a file that is not a pickle fails in many ways (EOFError, UnpicklingError, ...)
        raise SnapshotError(f"{path} is not a memory snapshot ({type(err).__name__}): pass the file that "
                            "torch.cuda.memory._dump_snapshot wrote") from None
    _device_traces(snapshot, path)
    return snapshot


def snapshot_timeline(snapshot: dict, device: int | torch.device = 0) -> pd.DataFrame:
    """The allocator's history on ``device`` (a CUDA device's index, or the device: one without an index is the
    current one, as torch reads it) as a timeline: one row per trace entry, with the bytes allocated and reserved
    after it (``MemoryTracker.timeline()``'s columns, plus ``reserved``).

    The trace keeps only the last ``max_entries`` events, so the totals start from the state before the first
    event kept: the state at the snapshot (its segments) minus every change the trace records. The trace counts
    the bytes each tensor asked for (``requested_size``), not the rounded-up block (``size``, which a segment's
    ``allocated_size`` adds up), so the state at the snapshot is counted the same way: see ``live_bytes``.
    """
    traces = _device_traces(snapshot)
    if isinstance(device, torch.device) and on_gpu(device):
        device = device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < len(traces):
        raise SnapshotError(f"device must be one of the snapshot's devices, 0 to {len(traces) - 1}; got {device!r}")
    entries = traces[device]
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    allocated = live_bytes(segments)
    reserved = sum(s.get("total_size", 0) for s in segments)
    allocated -= sum(_ALLOCATED.get(e["action"], 0) * e.get("size", 0) for e in entries)
    reserved -= sum(_RESERVED.get(e["action"], 0) * e.get("size", 0) for e in entries)
    rows = []
    for event, entry in enumerate(entries):
        size = entry.get("size", 0)
        allocated += _ALLOCATED.get(entry["action"], 0) * size
        reserved += _RESERVED.get(entry["action"], 0) * size
        frames = entry.get("frames") or [{}]
        rows.append((event, "", entry["action"], frames[0].get("name", ""), size, allocated, reserved))
    return pd.DataFrame(rows, columns=[*TIMELINE_COLUMNS, "reserved"])


# A block still handed to a tensor: in use, or freed on one stream while another may still use it (its trace has
# free_requested but not yet free_completed, so the timeline still counts it).
_LIVE_STATES = ("active_allocated", "active_awaiting_free")


def live_bytes(segments) -> int:
    """Bytes that tensors asked for and still hold in these snapshot segments: the ``requested_size`` of each live
    block, as the trace's alloc and free entries count them. A block's ``size`` (and a segment's
    ``allocated_size``) is rounded up by the allocator, to 512 bytes or more; a segment without ``blocks`` (an
    older snapshot) counts its ``allocated_size``."""
    total = 0
    for segment in segments:
        if "blocks" not in segment:
            total += segment.get("allocated_size", 0)
            continue
        for block in segment["blocks"]:
            if block.get("state") in _LIVE_STATES:
                total += block.get("requested_size", block.get("size", 0))
    return total


def _device_traces(snapshot, path: Path | None = None) -> list:
    where = f"{path} is" if path else "that is"
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("device_traces"), list):
        raise SnapshotError(f"{where} not a memory snapshot (no device_traces): pass what "
                            "torch.cuda.memory._snapshot() returns or _dump_snapshot wrote")
    if not all(isinstance(t, list) and all(isinstance(e, dict) and "action" in e for e in t)
               for t in snapshot["device_traces"]):
        raise SnapshotError(f"{where} not a memory snapshot (its device_traces are not lists of trace entries)")
    if not any(snapshot["device_traces"]):
        raise SnapshotError(f"{where} a snapshot without a history: call torch.cuda.memory._record_memory_history() "
                            "before the code you want to see, then dump the snapshot")
    return snapshot["device_traces"]


# ----- memory outside PyTorch's allocator ---------------------------------------------------------------


def outside_allocator(device=None) -> tuple[int, str] | None:
    """Bytes of GPU memory this process uses that PyTorch's allocator does not count (the CUDA context,
    libraries' own buffers), and how that was measured; None where there is no CUDA device.

    NVML's count for this process minus ``torch.cuda.memory_reserved``. Where NVML does not list this
    process (in a container it sees other process ids), the whole device's used memory instead, which also
    counts other processes: the text says which.
    """
    device = get_device(device)
    if not on_gpu(device):
        return None
    reserved = torch.cuda.memory_reserved(device)
    used = _nvml_process_bytes(device.index if device.index is not None else torch.cuda.current_device())
    if used is not None:
        return used - reserved, "NVML's memory of this process minus what PyTorch reserved"
    free, total = torch.cuda.mem_get_info(device)
    return total - free - reserved, ("the device's used memory (all processes: NVML does not list this one) "
                                     "minus what PyTorch reserved")


def _nvml_process_bytes(index: int) -> int | None:
    try:
        with nvml.session() as nv:
            processes = nvml.query(nv, nv.nvmlDeviceGetComputeRunningProcesses, nvml.handle_for(nv, index), default=[])
    except nvml.NvmlUnavailable:
        return None
    return next((p.usedGpuMemory for p in processes if p.pid == os.getpid() and p.usedGpuMemory), None)


def mib(nbytes: float) -> str:
    """Bytes as MiB, for messages."""
    return f"{nbytes / 2**20:,.1f} MiB"
