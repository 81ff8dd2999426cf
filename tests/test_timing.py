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
