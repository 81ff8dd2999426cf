"""gpulab.comparison: interleaved pairs, the median's distribution-free interval, and verdicts, tested with injected
timings (a fake clock), never with real ones."""

import math

import pytest

from gpulab import comparison
from gpulab.comparison import FASTER, SLOWER, WITHIN_NOISE, Comparison, compare, median_interval


@pytest.mark.parametrize("n, k, coverage", [(5, 1, 1 - 2 / 32), (8, 2, 1 - 2 * 9 / 256), (10, 2, 1 - 2 * 11 / 1024),
                                            (20, 6, 1 - 2 * sum(math.comb(20, i) for i in range(6)) / 2**20)])
def test_the_interval_is_the_narrowest_order_statistics_pair_with_90_percent(n, k, coverage):
    values = list(range(1, n + 1))
    low, high, achieved = median_interval(values[::-1], 0.9)  # order does not matter
    assert (low, high) == (k, n + 1 - k)
    assert achieved == pytest.approx(coverage) and achieved >= 0.9


def test_too_few_values_give_the_whole_range_and_say_its_lower_coverage():
    assert median_interval([3.0, 1.0, 2.0], 0.9) == (1.0, 3.0, 0.75)
    assert median_interval([2.0], 0.9) == (2.0, 2.0, 0.0)
    with pytest.raises(ValueError, match="no values"):
        median_interval([])


def test_a_clear_speed_up_is_faster_and_a_clear_slow_down_slower():
    a = [10.0, 11.0, 9.5, 10.2, 10.8, 9.9, 10.1]
    faster = Comparison.of(a, [t / 2 for t in a], labels=("old", "new"))
    assert faster.speedup == pytest.approx(2.0) and faster.verdict == FASTER
    assert "new vs old: 2.00×, faster" in str(faster) and "7 interleaved pairs" in str(faster)
    slower = Comparison.of(a, [t * 1.5 for t in a])
    assert slower.verdict == SLOWER and slower.speedup == pytest.approx(1 / 1.5)


def test_a_spread_that_crosses_one_is_within_noise_however_large_the_median():
    ratios = [1.6, 1.5, 0.9, 1.7, 1.4, 1.55]  # the median says 1.5x, one pair says slower
    c = Comparison.of(ratios, [1.0] * 6)
    assert c.speedup == pytest.approx(1.525) and c.verdict == WITHIN_NOISE and "within noise" in str(c)


def test_a_real_but_negligible_change_is_within_noise():
    c = Comparison.of([1.01] * 8, [1.0] * 8, min_effect=0.02)
    assert c.interval == (pytest.approx(1.01), pytest.approx(1.01)) and c.verdict == WITHIN_NOISE
    assert Comparison.of([1.05] * 8, [1.0] * 8, min_effect=0.02).verdict == FASTER


def test_few_pairs_never_give_a_verdict_even_when_they_agree():
    assert Comparison.of([2.0] * 4, [1.0] * 4).verdict == WITHIN_NOISE  # 87.5 % < 90 %
    assert Comparison.of([2.0] * 5, [1.0] * 5).verdict == FASTER


def test_reaches_is_unsure_while_the_interval_straddles_the_threshold():
    c = Comparison.of([1.3, 1.5, 1.45, 1.6, 1.38, 1.42], [1.0] * 6)
    assert c.reaches(1.2) is True and c.reaches(2.0) is False and c.reaches(1.44) is None


def test_bad_pairs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="needs pairs"):
        Comparison.of([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive, finite"):
        Comparison.of([1.0, 0.0], [1.0, 1.0])


class FakeClock:
    """A clock that only moves when a timed function says it took time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def spend(self, seconds):
        self.now += seconds


def test_compare_alternates_the_order_and_measures_each_pair(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(comparison, "synced_clock", clock)
    calls = []
    slow_times = iter([3e-3, 3e-3, 3.3e-3, 2.7e-3] + [3e-3] * 100)

    def slow():
        calls.append("A")
        clock.spend(next(slow_times))

    def fast():
        calls.append("B")
        clock.spend(1e-3)

    c = compare(slow, fast, pairs=4, warmup=1, min_time=1e-6)
    assert c.pairs == 4 and c.baseline == "slow" and c.candidate == "fast"
    timed = calls[-8:]
    assert timed == ["A", "B", "B", "A", "A", "B", "B", "A"]  # AB BA AB BA: neither is always first
    assert sorted(c.ratios) == pytest.approx([2.7, 3.0, 3.0, 3.3])


def test_compare_runs_at_least_the_minimum_of_pairs_by_default(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(comparison, "synced_clock", clock)
    c = compare(lambda: clock.spend(0.2), lambda: clock.spend(0.1), min_time=0.01, labels=("a", "b"))
    assert c.pairs == comparison.MIN_PAIRS and c.verdict == FASTER and c.speedup == pytest.approx(2.0)


def test_compare_refuses_what_it_cannot_call():
    with pytest.raises(TypeError, match="two functions"):
        compare(1, lambda: None)
    with pytest.raises(ValueError, match="pairs must be"):
        compare(lambda: None, lambda: None, pairs=0)
    with pytest.raises(ValueError, match="number must be"):
        compare(lambda: None, lambda: None, number=0.5)


def test_one_call_per_run_makes_exactly_warmup_plus_pairs_calls_and_times_the_warmup(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(comparison, "synced_clock", clock)
    epochs = {"a": iter([5.0, 1.0, 1.1, 0.9, 1.0, 1.0, 1.0]), "b": iter([9.0] + [0.5] * 6)}  # first epochs: start-up
    c = compare(lambda: clock.spend(next(epochs["a"])), lambda: clock.spend(next(epochs["b"])), number=1, warmup=1,
                pairs=6, labels=("a", "b"))
    assert c.pairs == 6 and c.baseline_warmup == (5.0,) and c.candidate_warmup == (9.0,)
    assert c.speedup == pytest.approx(2.0) and c.verdict == FASTER  # start-up is not in the pairs
    with pytest.raises(StopIteration):  # every epoch of both was used, none more
        next(epochs["a"])
