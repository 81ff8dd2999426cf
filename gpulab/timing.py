"""Timing that is right on a GPU (synchronised, warmed up, repeated) and on a CPU (fixed thread count)."""

import math
import statistics
import time
from dataclasses import dataclass

import torch

from .device import get_device


@dataclass(frozen=True)
class Measurement:
    """Seconds per call of one timed function: one entry of ``times`` per run."""

    label: str
    times: tuple[float, ...]
    device: str
    threads: int

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def iqr(self) -> float:
        """Spread: the distance between the 25th and 75th percentile."""
        if len(self.times) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return q3 - q1

    @property
    def runs(self) -> int:
        return len(self.times)

    def rate(self, amount: float) -> float:
        """``amount`` per second at the median time (bytes → B/s, samples → samples/s, FLOPs → FLOP/s)."""
        return amount / self.median

    def __repr__(self) -> str:
        return (
            f"<Measurement {self.label}: {_human(self.median)} median, IQR {_human(self.iqr)}, "
            f"{self.runs} runs on {self.device}, {self.threads} CPU threads>"
        )


def _human(seconds: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def bench(
    fn,
    *args,
    label: str | None = None,
    repeats: int | None = None,
    warmup: int = 2,
    min_time: float = 0.2,
    threads: int | None = None,
    device: str | torch.device | None = None,
    **kwargs,
) -> Measurement:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then timed runs.

    By default it runs for about ``min_time`` seconds, at least 5 runs, and calls ``fn`` several times
    per run when one call is too short to time alone. With ``repeats=N``: exactly N runs of one call.
    The clock synchronises the GPU before every reading, so queued work counts.
    """
    if not callable(fn):
        raise TypeError(
            f"bench() needs a function to call, got {type(fn).__name__}; "
            "wrap an expression in a lambda: bench(lambda: a @ b)"
        )
    if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, int) or repeats <= 0):
        raise ValueError(f"repeats must be a positive whole number, got {repeats!r}")
    if warmup < 0 or min_time <= 0:
        raise ValueError(f"warmup must be >= 0 and min_time > 0, got warmup={warmup!r}, min_time={min_time!r}")
    device = str(get_device(device))
    threads = threads or torch.get_num_threads()
    label = label or getattr(fn, "__name__", "fn")
    call = (lambda: fn(*args, **kwargs)) if args or kwargs else fn

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(warmup):
            call()
        if repeats is not None:
            times = [_timed_run(call, 1) for _ in range(repeats)]
        else:
            times = _timed_for(call, min_time)
    finally:
        torch.set_num_threads(previous)
    return Measurement(label=label, times=tuple(times), device=device, threads=threads)


MIN_RUNS, MAX_RUNS = 5, 10_000


def synced_clock() -> float:
    """A host clock read only after all queued GPU work has finished."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed_run(call, calls: int) -> float:
    """Seconds per call over ``calls`` back-to-back calls."""
    start = synced_clock()
    for _ in range(calls):
        call()
    return (synced_clock() - start) / calls


def _timed_for(call, min_time: float) -> list[float]:
    """Runs for ``min_time`` seconds, batching calls so that each run lasts about min_time / 20."""
    first = _timed_run(call, 1)
    calls = max(1, min(1_000_000, math.ceil(min_time / 20 / max(first, 1e-9))))
    times = [first] if calls == 1 else []
    while len(times) < MAX_RUNS and (len(times) < MIN_RUNS or sum(times) * calls < min_time):
        times.append(_timed_run(call, calls))
    return times
