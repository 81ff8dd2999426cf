"""Timing that is right on a GPU (synchronised, warmed up, repeated) and on a CPU (fixed thread count).

Timed the way ``torch.utils.benchmark.Timer`` times: ``timeit`` loops (the garbage collector off while
they run), a host clock that waits for the GPU, and blocks of back-to-back calls long enough that reading
the clock costs nothing. ``gpulab bench --timers`` (``gpulab.commands.timer_agreement``) shows that the two agree.
"""

import functools
import math
import numbers
import statistics
import time
import timeit
from dataclasses import dataclass
from pathlib import Path

import torch

from . import conditions
from .conditions import Conditions
from .device import device_info, get_device, on_gpu

CACHES = ("warm", "cold")


@dataclass(frozen=True)
class Measurement:
    """Seconds per call of one timed function: one entry of ``times`` per run.

    ``cache`` says whether the calls found the caches warm (back-to-back calls) or cold (a flush before each).
    """

    label: str
    times: tuple[float, ...]
    device: str
    threads: int
    cache: str = "warm"
    conditions: Conditions | None = None  # the machine's state over the runs (load, GPU throttling)

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

    @property
    def caveats(self) -> list[str]:
        """What made the machine unfit to measure while this ran (an oversubscribed CPU, a throttled GPU)."""
        return self.conditions.caveats() if self.conditions else []

    def __repr__(self) -> str:
        caveats = "".join(f"; {c}" for c in self.caveats)
        return (
            f"<Measurement {self.label}: {_human(self.median)} median, IQR {_human(self.iqr)}, "
            f"{self.runs} runs on {self.device}, {self.threads} CPU threads, {self.cache} cache{caveats}>"
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
    cache: str = "warm",
    alone: bool = False,
    **kwargs,
) -> Measurement:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then timed runs.

    By default it runs for about ``min_time`` seconds, at least 5 runs, and calls ``fn`` back to back
    several times per run when one call is too short to time alone. With ``repeats=N``: exactly N runs of
    one call. The clock synchronises the GPU before every reading, so queued work counts.

    ``cache="warm"`` (the default) times calls that follow each other, so data a call just used may still
    sit in the cache (the GPU's L2, the CPU's caches). ``cache="cold"`` writes a buffer larger than that
    cache before every call, untimed, then times that one call alone (between CUDA events on a GPU, as
    ``triton.testing.do_bench`` does): the time of a call whose data comes from memory.

    ``alone=True`` times a warm call alone too: after the same call (its data left in the cache), one call per run,
    between CUDA events queued behind an untimed hold (``torch.cuda._sleep``) on a GPU, so that the events time the
    GPU's work and not its launch (a cold call's flush holds the GPU the same way).
    """
    _check_arguments(fn, repeats, warmup, min_time, threads, cache)
    device = str(get_device(device))
    threads = threads or torch.get_num_threads()
    label = label or getattr(fn, "__name__", "fn")
    stmt = "fn(*args, **kwargs)" if args or kwargs else "fn()"
    # The clock waits for the GPU measured (cuda:1 is not waited for by a synchronize of the current device).
    clock = functools.partial(synced_clock, device)
    timer = timeit.Timer(stmt, timer=clock, globals={"fn": fn, "args": args, "kwargs": kwargs})

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    watch = conditions.Watch(device).start()
    try:
        timer.timeit(warmup)
        if cache == "cold" or alone:
            call = functools.partial(fn, *args, **kwargs)
            before = _cache_flush(device) if cache == "cold" else _held_after(call, device)
            times = _cold_runs(timer, call, before, device, repeats, min_time)
        elif repeats is not None:
            times = [timer.timeit(1) for _ in range(repeats)]
        else:
            times = _warm_runs(timer, min_time)
    finally:
        torch.set_num_threads(previous)
        state = watch.stop()
    return Measurement(label=label, times=tuple(times), device=device, threads=threads, cache=cache, conditions=state)


MIN_RUNS, MAX_RUNS, RUNS_PER_MIN_TIME = 5, 10_000, 20


def synced_clock(device: str | torch.device | int | None = None) -> float:
    """A host clock read only after the GPU's queued work has finished.

    ``device`` is the GPU measured: its queue is waited for, whichever device is current (a bare
    ``torch.cuda.synchronize()`` waits for the current device only, so timing work on ``cuda:1`` from a process
    whose current device is ``cuda:0`` would time only the launches). Without one, every GPU this process has
    used is waited for. A CPU device waits for nothing.
    """
    if device is not None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if on_gpu(device):
            torch.cuda.synchronize(device)
    elif on_gpu():
        for index in used_gpus():
            torch.cuda.synchronize(index)
    return time.perf_counter()


def used_gpus() -> list[int]:
    """The CUDA devices this process has used (those with a CUDA context): the ones that can have work queued.

    Asking creates no context on the others. Where torch cannot tell, the current device.
    """
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:
        return [torch.cuda.current_device()]
    return [index for index in range(torch.cuda.device_count()) if has_context(index)]


def _warm_runs(timer: timeit.Timer, min_time: float) -> list[float]:
    """Seconds per call of runs of back-to-back calls, each run about min_time / 20, for min_time in all."""
    target = min_time / RUNS_PER_MIN_TIME
    per_run, first = _sized_block(timer, target)
    times = [first] if first >= target else []  # a slow function's first timed call is a run already
    while len(times) < MAX_RUNS and (len(times) < MIN_RUNS or sum(times) * per_run < min_time):
        times.append(timer.timeit(per_run) / per_run)
    return times


def calls_per_run(timer: timeit.Timer, target: float) -> int:
    """How many back-to-back calls of ``timer``'s statement last about ``target`` seconds (at least one)."""
    return _sized_block(timer, target)[0]


def _sized_block(timer: timeit.Timer, target: float) -> tuple[int, float]:
    """(calls per run for about ``target`` seconds, seconds of the first single call)."""
    calls, seconds = 1, timer.timeit(1)
    first = seconds
    while seconds < target / 10:  # grow the block tenfold until it lasts long enough to size the runs
        calls *= 10
        seconds = timer.timeit(calls)
    return max(1, math.ceil(calls * target / seconds)), first


def _cold_runs(timer: timeit.Timer, call, flush, device: str, repeats: int | None, min_time: float) -> list[float]:
    """One call per run, each after ``flush()`` (or what else goes first): ``repeats`` runs, or as many as fit in
    about ``min_time``."""
    cuda = on_gpu(device)
    stream = torch.cuda.current_stream(device) if cuda else None  # the measured GPU's stream, not the current GPU's
    times, events, start = [], [], time.perf_counter()
    for run in range(repeats or MAX_RUNS):
        if repeats is None and run >= MIN_RUNS and time.perf_counter() - start >= min_time:
            break
        flush()
        if cuda:  # events on the GPU's stream time the call alone, not the flush queued before it
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            call()
            end.record(stream)
            events.append((begin, end))
        else:
            times.append(timer.timeit(1))
    if cuda:
        torch.cuda.synchronize(device)
        times = [begin.elapsed_time(end) / 1e3 for begin, end in events]
    return times


# About a millisecond at 1.5-2.5 GHz: longer than Python takes to queue two events and a call
HOLD_CYCLES = 2**21
# Above any current GPU's top SM clock: a hold of seconds × HOLD_CLOCK_HZ cycles lasts at least those seconds
HOLD_CLOCK_HZ = 2.5e9


def _held_after(call, device: str):
    """What a warm call timed alone follows: the same call, then on a GPU an untimed hold. ``torch.cuda._sleep``
    (torch/cuda/__init__.py; aten/src/ATen/cuda/Sleep.cu, torch 2.7-2.14) queues one thread spinning for the cycles
    asked on the current stream (of the GPU measured, made current here), touching no memory: the cache keeps what the
    call left there."""

    def before():
        call()
        if on_gpu(device):
            with _on_its_queue(device):
                torch.cuda._sleep(HOLD_CYCLES)

    return before


def _on_its_queue(device: str | torch.device):
    """The GPU measured and its current stream made current, so that the calls that take no device
    (``torch.cuda._sleep``, an event's ``record()``) go to its queue whichever GPU is current. ``torch.cuda.stream``
    makes the stream's device current too and restores both after (torch/cuda/__init__.py ``StreamContext``;
    torch/csrc/cuda/Module.cpp ``THCPModule_setStream_wrap`` sets the device of the stream, torch 2.7-2.14)."""
    return torch.cuda.stream(torch.cuda.current_stream(device))


@dataclass(frozen=True)
class QueueAndRun:
    """One call split in two: the host's seconds to queue it (the clock read without waiting for the GPU) and the
    GPU's own seconds to run it. On a CPU a call has run when it returns: both are its host time."""

    queue_s: float
    run_s: float


def queue_and_run(fn, *, calls: int = 10, device: str | torch.device | None = None) -> QueueAndRun:
    """``fn()`` split into the host's time to queue it and the GPU's time to run it, per call, over ``calls`` calls
    after one untimed call. The queueing is timed from an empty queue without waiting (``calls`` must stay below
    the launch queue's depth); the running between CUDA events queued behind an untimed hold three times as long as
    the queueing took, so that the GPU never waits for Python between the events (the hold and the events on
    ``device``'s queue, whichever GPU is current)."""
    device = get_device(device)
    fn()
    synced_clock(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queue_s = (time.perf_counter() - start) / calls
    if not on_gpu(device):
        return QueueAndRun(queue_s, queue_s)
    synced_clock(device)
    with _on_its_queue(device):
        torch.cuda._sleep(math.ceil(3 * queue_s * calls * HOLD_CLOCK_HZ))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
    end.synchronize()
    return QueueAndRun(queue_s, begin.elapsed_time(end) / 1e3 / calls)


def _cache_flush(device: str):
    """A function that evicts the cache ``bench(cache="cold")`` empties: it writes a buffer twice its size.

    The GPU's L2 (at least 256 MiB written, as triton does), or the CPU's last-level cache (256 MiB where
    the operating system does not say its size).
    """
    if on_gpu(device):
        l2_mb = device_info(device).l2_cache_mb or 0
        nbytes = max(256 * 2**20, int(2 * l2_mb * 1e6))
    else:
        nbytes = 2 * (cpu_cache_bytes() or 128 * 2**20)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer.zero_


def cpu_cache_bytes() -> int | None:
    """The size of the CPU's largest cache in bytes, from Linux's sysfs (None elsewhere)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=None)


def _check_arguments(fn, repeats, warmup, min_time, threads, cache) -> None:
    """One clear error per argument a user can get wrong, saying what to pass instead."""
    if not callable(fn):
        raise TypeError(
            f"bench() needs a function to call, got {type(fn).__name__}; "
            "wrap an expression in a lambda: bench(lambda: a @ b)"
        )
    if repeats is not None:
        _whole_number("repeats", repeats, minimum=1, example="repeats=5")
    _whole_number("warmup", warmup, minimum=0, example="warmup=2")
    if threads is not None:
        _whole_number("threads", threads, minimum=1, example="threads=1")
    if isinstance(min_time, bool) or not isinstance(min_time, numbers.Real):
        raise TypeError(f"min_time must be a number of seconds such as min_time=0.2, got {type(min_time).__name__} "
                        f"{min_time!r}")
    if not (math.isfinite(min_time) and min_time > 0):
        raise ValueError(f"min_time must be a positive, finite number of seconds such as min_time=0.2, got {min_time!r}")
    if cache not in CACHES:
        raise ValueError(f"cache must be 'warm' (calls back to back) or 'cold' (caches flushed before each call), "
                         f"got {cache!r}")


def _whole_number(name: str, value, minimum: int, example: str) -> None:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a whole number such as {example}, got {type(value).__name__} {value!r}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = "a positive whole number" if minimum == 1 else f"a whole number >= {minimum}"
        raise ValueError(f"{name} must be {kind} such as {example}, got {value!r}")
