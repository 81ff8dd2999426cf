import time

import pytest
import torch

from gpulab import bench


def test_measures_what_it_runs():
    m = bench(time.sleep, 0.01, repeats=3, warmup=0)
    assert m.runs == 3 and 0.009 < m.median < 0.05
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

    def __call__(self) -> float:
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
