import contextlib
import time

import pytest
import torch

import gpulab
from gpulab import bench


def test_measures_what_it_runs():
    m = bench(time.sleep, 0.01, repeats=3, warmup=0)
    assert m.runs == 3 and 0.009 < m.median < 0.5  # a unit or accounting slip, not load
    assert m.iqr >= 0 and "3 runs" in repr(m) and "ms" in repr(m)


def test_autorange_batches_short_calls_and_runs_long_enough():
    x = torch.ones(10)
    start = time.perf_counter()
    m = bench(lambda: x.add(1), min_time=0.1)
    assert time.perf_counter() - start >= 0.1
    assert m.runs >= 5 and m.median < 1e-3
    assert m.rate(10) == pytest.approx(10 / m.median)


def test_thread_count_is_explicit_and_restored():
    before = torch.get_num_threads()
    m = bench(lambda: None, repeats=2, threads=1)
    assert m.threads == 1 and torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [torch.ones(2), 3.0, "x @ y"])
def test_not_callable_is_a_clear_error(bad):
    with pytest.raises(TypeError, match="lambda"):
        bench(bad)


@pytest.mark.parametrize("repeats", [0, -1, 2.5, True])
def test_repeats_must_be_positive(repeats):
    with pytest.raises(ValueError, match="positive"):
        bench(lambda: None, repeats=repeats)


@pytest.mark.gpu
def test_gpu_timing_waits_for_queued_work():
    a = torch.randn(4096, 4096, device="cuda")
    timed = bench(lambda: a @ a, repeats=5)
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    unsynced = (time.perf_counter() - start) / 5
    torch.cuda.synchronize()
    assert timed.median > unsynced  # without synchronisation, only the launch is timed


def test_repeats_means_exactly_that_many_runs_of_one_call():
    calls = []
    m = bench(lambda: calls.append(1), repeats=4, warmup=1)
    assert m.runs == 4 and len(calls) == 5


@pytest.mark.parametrize("kwargs, error, says", [
    ({"min_time": float("nan")}, ValueError, "positive, finite number of seconds"),
    ({"min_time": float("inf")}, ValueError, "positive, finite number of seconds"),
    ({"min_time": 0}, ValueError, "min_time=0.2"),
    ({"min_time": "0.1"}, TypeError, "number of seconds such as min_time=0.2, got str"),
    ({"warmup": 2.5}, ValueError, "whole number >= 0 such as warmup=2"),
    ({"warmup": -1}, ValueError, "warmup=2"),
    ({"warmup": None}, TypeError, "warmup=2"),
    ({"threads": 0}, ValueError, "positive whole number such as threads=1"),
    ({"threads": -3}, ValueError, "threads=1, got -3"),
    ({"threads": "2"}, TypeError, "threads=1"),
    ({"repeats": "5"}, TypeError, "repeats=5"),
    ({"cache": "hot"}, ValueError, "'warm'.*'cold'"),
])
def test_bad_arguments_say_what_to_pass(kwargs, error, says):
    with pytest.raises(error, match=says):
        bench(lambda: None, **kwargs)


class FakeClock:
    """A clock that moves only when read (each reading costs ``read_cost``, as a GPU sync does) or worked."""

    def __init__(self, read_cost: float):
        self.now, self.read_cost = 0.0, read_cost

    def __call__(self, device=None) -> float:  # as timing.synced_clock, which it stands in for
        self.now += self.read_cost / 2
        reading = self.now
        self.now += self.read_cost / 2
        return reading

    def work(self, seconds: float = 1e-6) -> None:
        self.now += seconds


def test_per_call_time_is_exact_even_when_reading_the_clock_costs_50_calls(monkeypatch):
    """Blocks of calls make the clock's own cost (here 50 µs a reading, like a CUDA sync) vanish; so does
    torch.utils.benchmark: the two agree with the truth and each other."""
    from torch.utils.benchmark import Timer

    from gpulab import timing

    clock = FakeClock(read_cost=50e-6)
    monkeypatch.setattr(timing, "synced_clock", clock)
    ours = bench(clock.work).median
    theirs = Timer("work()", globals={"work": clock.work}, timer=clock).blocked_autorange().median
    assert ours == pytest.approx(1e-6, rel=0.01) and ours == pytest.approx(theirs, rel=0.01)


def test_a_slow_function_is_called_no_more_than_needed(monkeypatch):
    from gpulab import timing

    clock, calls = FakeClock(read_cost=0), []
    monkeypatch.setattr(timing, "synced_clock", clock)
    m = bench(lambda: (calls.append(1), clock.work(0.1)), min_time=0.2)
    assert m.runs == 5 and len(calls) == 2 + 5 and m.median == pytest.approx(0.1)


def test_cold_cache_flushes_before_every_call_and_does_not_time_the_flush(monkeypatch):
    from gpulab import timing

    events = []

    def flush():
        events.append("flush")
        time.sleep(0.02)

    monkeypatch.setattr(timing, "_cache_flush", lambda device: flush)
    m = bench(lambda: events.append("call"), warmup=2, repeats=6, cache="cold")
    assert events == ["call"] * 2 + ["flush", "call"] * 6  # two warm-up calls, then a flush before each run
    assert m.runs == 6 and m.cache == "cold" and "cold cache" in repr(m)
    assert m.median < 0.005  # the 20 ms flush is not in the time of the call

    events.clear()
    m = bench(lambda: events.append("call"), warmup=0, min_time=0.05, cache="cold")
    assert events == ["flush", "call"] * m.runs and m.runs >= 5 and m.median < 0.005


def test_warm_is_the_default_and_never_flushes(monkeypatch):
    from gpulab import timing

    monkeypatch.setattr(timing, "_cache_flush", lambda device: pytest.fail("a warm timing flushed the cache"))
    assert bench(lambda: None, repeats=2).cache == "warm"


def test_the_cpu_flush_writes_twice_the_last_level_cache():
    from gpulab import timing

    flush = timing._cache_flush("cpu")
    buffer = flush.__self__
    assert buffer.nbytes == 2 * (timing.cpu_cache_bytes() or 128 * 2**20)
    buffer.fill_(7)
    flush()
    assert int(buffer.max()) == 0  # every byte was written


def test_cache_choice_is_recorded_with_the_measurement(results_dir):
    from gpulab import ResultLog

    row = ResultLog("cold").add_measurement(bench(lambda: None, repeats=2, cache="cold"), n=1)
    assert row["cache"] == "cold"


@pytest.mark.gpu
def test_gpu_cold_timing_times_the_call_not_the_flush():
    from gpulab import timing

    x = torch.randn(1 << 20, device="cuda")
    cold = bench(lambda: x.mul_(1.0), cache="cold", repeats=20)
    flush = bench(timing._cache_flush("cuda:0"), repeats=5)
    assert cold.median < flush.median / 2


# ---- the clock waits for the GPU measured, not the current one ------------------------------------------------


class TwoGpus:
    """torch.cuda as a process with two GPUs sees it, on a CPU: cuda:0 current, only ``used`` with a context;
    ``synced`` lists the device of every synchronize() (None: the current device)."""

    def __init__(self, monkeypatch, used=(0, 1)):
        self.synced, self.recorded, self.held, self.current = [], [], [], 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self.made_current)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: self.held.append(self.current))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.synced.append(_index(device)))
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: index in used, raising=False)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", _index(device)))
        recorded, gpus = self.recorded, self

        class Event:
            def __init__(self, enable_timing=False, **_):
                self.stream = None

            def record(self, stream=None):
                recorded.append(stream or ("stream of", gpus.current))  # no stream: the current device's
                self.stream = stream

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return 1.0

        monkeypatch.setattr(torch.cuda, "Event", Event)

    @contextlib.contextmanager
    def made_current(self, stream):
        """torch.cuda.stream: the stream's device current inside (as torch's setStream does), the one before after."""
        before, self.current = self.current, stream[1]
        try:
            yield
        finally:
            self.current = before


def _index(device):
    if device is None:
        return None
    return device if isinstance(device, int) else torch.device(device).index


def test_synced_clock_waits_for_the_device_it_is_given(monkeypatch):
    from gpulab.timing import synced_clock

    gpus = TwoGpus(monkeypatch)
    synced_clock("cuda:1")
    synced_clock(torch.device("cuda", 1))
    synced_clock(1)
    assert gpus.synced == [1, 1, 1]  # never the current device, cuda:0
    synced_clock("cpu")
    assert gpus.synced == [1, 1, 1]  # a CPU measurement waits for no GPU


def test_synced_clock_without_a_device_waits_for_every_gpu_in_use(monkeypatch):
    """gpulab.compare (and notebooks) read it without a device: then no GPU that holds work is left out, and none
    that this process never touched gets a context."""
    from gpulab.timing import synced_clock

    gpus = TwoGpus(monkeypatch, used=(1,))
    synced_clock()
    assert gpus.synced == [1]
    gpus = TwoGpus(monkeypatch, used=())
    synced_clock()
    assert gpus.synced == []


def test_bench_on_another_gpu_syncs_that_gpu(monkeypatch):
    from gpulab import timing

    gpus = TwoGpus(monkeypatch)
    monkeypatch.setattr(timing.conditions, "snapshot", lambda device=None: timing.conditions.Conditions(0.0, 2))
    m = bench(lambda: None, device="cuda:1", repeats=3, warmup=1)
    assert m.device == "cuda:1" and gpus.synced and set(gpus.synced) == {1}


def test_cold_bench_records_its_events_on_the_measured_gpu(monkeypatch):
    from gpulab import timing

    gpus = TwoGpus(monkeypatch)
    monkeypatch.setattr(timing.conditions, "snapshot", lambda device=None: timing.conditions.Conditions(0.0, 2))
    monkeypatch.setattr(timing, "_cache_flush", lambda device: lambda: None)
    m = bench(lambda: None, device="cuda:1", repeats=3, warmup=0, cache="cold")
    assert m.runs == 3 and m.median == pytest.approx(1e-3)
    assert gpus.recorded == [("stream of", 1)] * 6  # begin and end of each run, on cuda:1's stream
    assert set(gpus.synced) == {1}


def test_a_warm_call_timed_alone_holds_the_measured_gpu_and_times_it_there(monkeypatch):
    """The hold (torch.cuda._sleep, which takes no device) went to the current GPU, cuda:0, while the call and its
    events ran on cuda:1: the events there were not held."""
    from gpulab import timing

    gpus = TwoGpus(monkeypatch)
    monkeypatch.setattr(timing.conditions, "snapshot", lambda device=None: timing.conditions.Conditions(0.0, 2))
    m = bench(lambda: None, device="cuda:1", repeats=3, warmup=0, alone=True)
    assert m.runs == 3 and gpus.held == [1, 1, 1] and gpus.recorded == [("stream of", 1)] * 6
    assert gpus.current == 0  # left as it was


def test_queue_and_run_holds_and_times_the_measured_gpu(monkeypatch):
    from gpulab import timing

    gpus = TwoGpus(monkeypatch)
    split = timing.queue_and_run(lambda: None, calls=4, device="cuda:1")
    assert gpus.held == [1] and gpus.recorded == [("stream of", 1)] * 2 and gpus.current == 0
    assert split.run_s == pytest.approx(1e-3 / 4)


def test_compare_waits_for_every_gpu_in_use_not_only_the_current_one(monkeypatch):
    """gpulab.compare reads synced_clock() without a device: work queued on cuda:1 is waited for all the same."""
    from gpulab import compare

    gpus = TwoGpus(monkeypatch, used=(1,))
    c = compare(lambda: None, lambda: None, pairs=5, number=1, device="cpu")
    assert c.pairs == 5 and gpus.synced and set(gpus.synced) == {1}


def test_a_cold_cache_run_on_the_cpu_and_between_a_gpus_events(course_device, monkeypatch):
    """bench(cache="cold") flushes a buffer twice the last-level cache (the played H200's 60 MiB L2: at least 256 MiB,
    as triton does) and times the call alone, between events on the GPU's stream where there is one."""
    from gpulab import timing

    flushes = []
    real_flush = timing._cache_flush
    monkeypatch.setattr(timing, "_cache_flush", lambda device: flushes.append(real_flush(device)) or flushes[-1])
    recorded = []
    if gpulab.on_gpu(course_device):
        event = torch.cuda.Event
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: recorded.append(kw) or event(**kw))
    m = bench(lambda: None, warmup=1, repeats=3, cache="cold", device=course_device)
    flushed = flushes[0].__self__.numel()
    assert m.runs == 3 and m.cache == "cold"
    assert flushed == (256 * 2**20 if gpulab.on_gpu(course_device) else 2 * (timing.cpu_cache_bytes() or 128 * 2**20))
    assert recorded == ([{"enable_timing": True}] * 6 if gpulab.on_gpu(course_device) else [])
