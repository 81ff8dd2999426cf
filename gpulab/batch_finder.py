"""The largest batch that fits: an out-of-memory-safe search that cleans up after every failure.

``find_max_batch(step)`` calls ``step(batch_size)`` (one full training step that builds what it needs)
with growing batch sizes until one runs out of memory, then bisects between the last batch that fit
and the first that failed. After a failure it drops the error (whose traceback holds the failed step's
tensors), collects garbage and empties the CUDA cache, so allocated memory returns to where it started.

A memory budget stops the search below the card's size, for shared GPUs, and makes the search work on
the CPU: there is no allocator to run out of there, so a ``gpulab.memory.MemoryTracker`` counts the bytes of the
tensors a step creates and raises ``BudgetExceeded`` (an out-of-memory error) when they pass the budget.

What a search counts decides its answer, so two searches compare only when they count the same way:
``count="allocator"`` (on CUDA, the default) counts the caching allocator's bytes, which also hold the scratch
memory libraries take during a call (cuDNN's convolution workspaces) and so are what runs out on the card;
``count="tensors"`` counts the bytes of the step's tensors alone, on any device, as an emulated card does.
"""

import gc
import math
import os
import time
from dataclasses import dataclass

import pandas as pd
import torch

from .device import get_device, on_gpu
from .memory import BudgetExceeded, MemoryTracker

FITS, OUT_OF_MEMORY, OVER_BUDGET = "fits", "out of memory", "over budget"
ALLOCATOR, TENSORS = "allocator", "tensors"  # what a search counts: the CUDA allocator's bytes, or the tensors'

# Memory failures that surface as a plain RuntimeError rather than torch.OutOfMemoryError.
OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDNN_STATUS_NOT_ENOUGH_MEMORY",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
)


def is_out_of_memory(err: BaseException) -> bool:
    """True when ``err`` means "not enough memory" (as opposed to a bug in the step)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in OOM_MESSAGES)


@dataclass(frozen=True)
class Trial:
    """One call of the step: its batch size, what happened, its peak memory and how long it took."""

    batch_size: int
    outcome: str  # FITS, OUT_OF_MEMORY or OVER_BUDGET
    peak_bytes: int  # the most bytes above the search's start, counted as the search counts, up to the end or failure
    seconds: float

    @property
    def fits(self) -> bool:
        return self.outcome == FITS


@dataclass(frozen=True)
class BatchSearch:
    """What ``find_max_batch`` found, how, and whether memory returned to where it started."""

    batch_size: int | None  # the largest batch that fitted (None: not even the smallest tried)
    trials: tuple[Trial, ...]
    stopped: str  # why the search ended
    device: str
    budget_bytes: float | None
    count: str  # ALLOCATOR or TENSORS: what the peaks, the budget and the bytes before and after count
    allocated_before: int  # bytes allocated when the search started (counting tensors: tracked tensors, so 0)
    # ... and after it finished: equal unless the step keeps tensors alive, or made a one-time allocation
    # (cuBLAS keeps a workspace from the first matrix multiply of a process on)
    allocated_after: int

    def table(self) -> pd.DataFrame:
        """One row per trial, in the order they ran."""
        return pd.DataFrame(
            {
                "batch_size": t.batch_size,
                "outcome": t.outcome,
                "peak_MiB": round(t.peak_bytes / 2**20, 1),
                "seconds": round(t.seconds, 3),
            }
            for t in self.trials
        ).rename_axis("trial")

    def __str__(self) -> str:
        budget = f", budget {_mib(self.budget_bytes)}" if self.budget_bytes is not None else ""
        counted = "the allocator's bytes" if self.count == ALLOCATOR else "the bytes of tensors"
        leaked = self.allocated_after - self.allocated_before
        return (
            f"largest batch that fits on {self.device}{budget}, counting {counted}: {self.batch_size} ({self.stopped}; "
            f"{len(self.trials)} trials, {sum(t.seconds for t in self.trials):.2f} s)\n"
            f"allocated before the search {_mib(self.allocated_before)}, after {_mib(self.allocated_after)}"
            f" ({'nothing left behind' if leaked == 0 else f'{_mib(leaked)} left behind'})\n"
            f"{self.table().to_string()}"
        )


def find_max_batch(
    step,
    *,
    start: int = 1,
    max_batch: int = 2**16,
    budget_bytes: float | None = None,
    granularity: int = 1,
    max_trials: int = 40,
    device: str | torch.device | None = None,
    count: str | None = None,
) -> BatchSearch:
    """The largest batch size up to ``max_batch`` for which ``step(batch_size)`` fits in memory.

    Doubles from ``start`` until a step runs out of memory (or past ``budget_bytes`` above what was
    allocated when the search began), then bisects down to ``granularity`` (below ``start`` if even
    that fails). At most ``max_trials`` calls. ``step`` should build everything it needs (model,
    optimizer, batch) and keep nothing, so that every byte is counted and freed again. Errors other
    than running out of memory propagate unchanged.

    ``count`` says what is counted: ``"allocator"`` (CUDA only, its default there), the caching allocator's bytes,
    whose peak is checked against the budget after each step (a step may pass it briefly) and includes the
    scratch memory libraries take during a call, such as cuDNN's workspaces; ``"tensors"`` (the default
    elsewhere), the bytes of the tensors the step creates, which a MemoryTracker stops as soon as they pass the
    budget. Searches compare only when they count the same way.
    """
    if not callable(step):
        raise TypeError(f"step must be a function of the batch size, got {type(step).__name__}")
    device = get_device(device)
    count = _check_count(count, device)
    _check_bounds(start, max_batch, granularity, max_trials)
    _check_budget(budget_bytes, device)
    meter = _Meter(device, budget_bytes, count)
    before = meter.allocated()
    trials: list[Trial] = []

    def fits(batch_size: int) -> bool:
        trials.append(meter.trial(step, batch_size))
        return trials[-1].fits

    fit, fail = 0, None  # the largest batch that fitted and the smallest that failed, so far
    batch = start
    while fail is None and len(trials) < max_trials:  # grow: double until a failure or max_batch
        if fits(batch):
            fit = batch
            if batch == max_batch:
                break
            batch = min(2 * batch, max_batch)
        else:
            fail = batch
    while fail is not None and fail - fit > granularity and len(trials) < max_trials:  # bisect
        middle = fit + max(granularity, (fail - fit) // 2 // granularity * granularity)
        if fits(middle):
            fit = middle
        else:
            fail = middle

    if fail is None and fit == max_batch:
        stopped = f"every batch up to max_batch={max_batch} fits"
    elif fail is not None and fail - fit <= granularity:
        stopped = f"not even batch {fail} fits" if fit == 0 else f"found to within {granularity}"
    else:
        stopped = f"stopped after max_trials={max_trials}"
    meter.clean_up()
    return BatchSearch(
        batch_size=fit or None,
        trials=tuple(trials),
        stopped=stopped,
        device=str(device),
        budget_bytes=budget_bytes,
        count=count,
        allocated_before=before,
        allocated_after=meter.allocated(),
    )


class _Meter:
    """Runs trials and measures their memory: the CUDA allocator's statistics, or a MemoryTracker's count of tensors."""

    def __init__(self, device: torch.device, budget: float | None, count: str):
        self.device, self.budget = device, budget
        self.cuda = on_gpu(device)
        self.tracker = MemoryTracker(budget) if count == TENSORS else None
        self.start = self.allocated()

    def allocated(self) -> int:
        return self.tracker.current if self.tracker is not None else torch.cuda.memory_allocated(self.device)

    def trial(self, step, batch_size: int) -> Trial:
        began = time.perf_counter()
        try:
            self._run(step, batch_size)
            outcome = OVER_BUDGET if self.budget is not None and self._peak() > self.budget else FITS
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            # over the search's own budget, or out of the device's memory (an emulated card's is a BudgetExceeded too)
            mine = isinstance(err, BudgetExceeded) and self.tracker is not None and err.tracker is self.tracker
            outcome = OVER_BUDGET if mine else OUT_OF_MEMORY
        # Here the error is gone, and with it the traceback that kept the failed step's tensors alive.
        peak = self._peak()
        self.clean_up(empty_cache=outcome != FITS)
        return Trial(batch_size, outcome, peak, time.perf_counter() - began)

    def _run(self, step, batch_size: int) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.tracker is not None:
            self.tracker.reset_peak()
            with self.tracker:
                step(batch_size)
        else:
            step(batch_size)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _peak(self) -> int:
        peak = self.tracker.peak if self.tracker is not None else torch.cuda.max_memory_allocated(self.device)
        return peak - self.start

    def clean_up(self, empty_cache: bool = True) -> None:
        """Free what the last trial left: objects in reference cycles wait for the garbage collector;
        after a failure, cached CUDA blocks go back to the driver."""
        if self.allocated() > self.start:
            gc.collect()
        if self.cuda and empty_cache:
            torch.cuda.empty_cache()


def _check_bounds(start, max_batch, granularity, max_trials) -> None:
    for name, value in (("start", start), ("max_batch", max_batch), ("granularity", granularity),
                        ("max_trials", max_trials)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if max_batch < start:
        raise ValueError(f"max_batch ({max_batch}) is below start ({start}): there is nothing to search")


def _check_count(count, device: torch.device) -> str:
    """What the search counts: ``count``, or by default the allocator on CUDA and the tensors elsewhere."""
    if count is None:
        return ALLOCATOR if on_gpu(device) else TENSORS
    if count not in (ALLOCATOR, TENSORS):
        raise ValueError(f"count is {ALLOCATOR!r} or {TENSORS!r} (or None for the device's default), got {count!r}")
    if count == ALLOCATOR and not on_gpu(device):
        raise ValueError(f"count={ALLOCATOR!r} needs a CUDA device: {device} has no caching allocator to count; "
                         f"count={TENSORS!r} counts the bytes of the step's tensors there")
    return count


def _check_budget(budget, device: torch.device) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"budget_bytes must be a positive number of bytes (or None for the whole card), got {budget!r}")
    total = _memory_of(device)
    if total is None or budget <= total:
        return
    if on_gpu(device):
        raise ValueError(f"budget_bytes ({_mib(budget)}) is more than this GPU has ({_mib(total)}, "
                         f"{torch.cuda.get_device_name(device)}); leave it out (None) to search up to the whole card")
    raise ValueError(f"budget_bytes ({_mib(budget)}) is more than this machine has ({_mib(total)} of RAM): the search "
                     "could run out of memory for real before the budget stopped it (on Linux the OOM killer may end "
                     "the process); give a smaller budget")


def _memory_of(device: torch.device) -> int | None:
    """The bytes a budget on ``device`` must fit in: the GPU's memory (``total_memory`` of torch's device properties),
    or this machine's RAM where the OS says (``sysconf``; None elsewhere)."""
    if on_gpu(device):
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or the OS does not say
        return None


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"
