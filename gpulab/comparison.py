"""One way to compare two timings: interleaved pairs, the median ratio with its interval, and a verdict that
says "within noise" when the interval does not support one.

A speed-up is a ratio of two noisy numbers. ``compare(a, b)`` warms both up, then times them in pairs and
alternates which of the two goes first (AB, BA, AB, ...), so that a machine that slows down or speeds up
during the comparison slows both alike. Each pair gives one ratio; the speed-up is their median, and its
interval is the distribution-free confidence interval of a median (order statistics, as in the sign test):
it assumes nothing about the shape of the noise. ``Comparison.of(a_times, b_times)`` judges pairs measured
elsewhere (a training run's epochs, whole processes).

    >>> c = compare(lambda: a @ b, lambda: a.half() @ b.half(), labels=("fp32", "fp16"))
    >>> print(c)        # fp16 vs fp32: 3.1× faster (90 % interval 3.0–3.2×, 8 interleaved pairs)
    >>> c.verdict       # "faster", "slower" or "within noise"
"""

import math
import statistics
import timeit
from dataclasses import dataclass, replace

import torch

from . import conditions
from .conditions import Conditions
from .device import get_device
from .timing import calls_per_run, synced_clock

FASTER, SLOWER, WITHIN_NOISE = "faster", "slower", "within noise"
MIN_PAIRS, MAX_PAIRS = 6, 200


@dataclass(frozen=True)
class Comparison:
    """Paired seconds of a ``baseline`` and a ``candidate``; how many times faster the candidate is.

    ``min_effect`` is the smallest change that counts (0.02: 2 %), ``confidence`` the level of the interval
    the verdict is read from. ``conditions`` is the machine's state over the pairs (``compare`` watches it);
    ``caveats`` say what it did that matters (load, power limit), with any notes the caller adds.
    """

    baseline: str
    candidate: str
    baseline_times: tuple[float, ...]
    candidate_times: tuple[float, ...]
    min_effect: float = 0.02
    confidence: float = 0.9
    caveats: tuple[str, ...] = ()
    baseline_warmup: tuple[float, ...] = ()  # seconds of each warm-up call (compilation, caches, workers starting)
    candidate_warmup: tuple[float, ...] = ()
    conditions: Conditions | None = None

    @classmethod
    def of(cls, baseline_times, candidate_times, *, labels=("baseline", "candidate"), min_effect: float = 0.02,
           confidence: float = 0.9, caveats=(), conditions: Conditions | None = None) -> "Comparison":
        """A comparison of pairs measured elsewhere: ``baseline_times[i]`` and ``candidate_times[i]`` were taken
        side by side (seconds, or any cost where less is better); ``conditions``, the machine's state meanwhile
        (a ``conditions.Watch`` over the pairs), adds its caveats to ``caveats``."""
        a, b = tuple(map(float, baseline_times)), tuple(map(float, candidate_times))
        if len(a) != len(b) or not a:
            raise ValueError(f"a comparison needs pairs: got {len(a)} baseline and {len(b)} candidate times")
        if not all(t > 0 and math.isfinite(t) for t in a + b):
            raise ValueError("every time of a comparison must be a positive, finite number of seconds")
        caveats = tuple(dict.fromkeys([*caveats, *(conditions.caveats() if conditions else [])]))
        return cls(str(labels[0]), str(labels[1]), a, b, min_effect, confidence, caveats, conditions=conditions)

    @property
    def pairs(self) -> int:
        return len(self.baseline_times)

    @property
    def ratios(self) -> list[float]:
        """One speed-up per pair: the baseline's time over the candidate's (above 1: the candidate is faster)."""
        return [a / b for a, b in zip(self.baseline_times, self.candidate_times)]

    @property
    def speedup(self) -> float:
        """The median of the pairs' ratios."""
        return statistics.median(self.ratios)

    @property
    def interval(self) -> tuple[float, float]:
        """The confidence interval of the median ratio (see ``median_interval``)."""
        low, high, _ = median_interval(self.ratios, self.confidence)
        return low, high

    @property
    def achieved_confidence(self) -> float:
        """The interval's real coverage: at least ``confidence`` once there are enough pairs (5 for 90 %)."""
        return median_interval(self.ratios, self.confidence)[2]

    @property
    def verdict(self) -> str:
        """"faster" or "slower" when the whole interval lies beyond ``min_effect``, else "within noise"."""
        low, high = self.interval
        if self.achieved_confidence < self.confidence:
            return WITHIN_NOISE
        if low > 1 + self.min_effect:
            return FASTER
        if high < 1 / (1 + self.min_effect):
            return SLOWER
        return WITHIN_NOISE

    def reaches(self, needed: float) -> bool | None:
        """Whether the speed-up reaches ``needed``: True when the whole interval does, False when none of it
        does, None when the interval straddles it (measure more pairs before deciding)."""
        low, high = self.interval
        if low >= needed:
            return True
        if high < needed:
            return False
        return None

    def errorbar(self) -> tuple[float, float]:
        """(below, above) the median: the interval as matplotlib's ``xerr``/``yerr`` wants it."""
        low, high = self.interval
        return self.speedup - low, high - self.speedup

    @property
    def advice(self) -> str:
        """What to do before trusting the verdict ("rerun on a quiet machine ..."), "" when nothing."""
        return self.conditions.advice() if self.conditions else ""

    def row(self) -> dict:
        """The comparison as a results row: speed-up, interval, pairs, verdict, and the machine's state over the
        pairs (its clocks, throttling and load, with the caveats) where it was watched."""
        low, high = self.interval
        row = {"speedup": self.speedup, "speedup_low": low, "speedup_high": high, "pairs": self.pairs,
               "verdict": self.verdict}
        if self.conditions is not None:
            row.update(self.conditions.row())
        if self.caveats:
            row["caveat"] = "; ".join(self.caveats)
        return row

    def __str__(self) -> str:
        low, high = self.interval
        said = {FASTER: "faster", SLOWER: "slower", WITHIN_NOISE: "within noise"}[self.verdict]
        text = (f"{self.candidate} vs {self.baseline}: {self.speedup:.2f}×, {said} ({self.achieved_confidence:.0%} interval "
                f"{low:.2f}–{high:.2f}×, {self.pairs} interleaved pairs)")
        return text + "".join(f"; {caveat}" for caveat in self.caveats)


def median_interval(values, confidence: float = 0.9) -> tuple[float, float, float]:
    """(low, high, coverage): the distribution-free confidence interval of the median of ``values``.

    The interval between the k-th smallest and the k-th largest value covers the true median with probability
    1 − 2·P(Binomial(n, ½) < k), whatever the distribution. The narrowest such interval with at least
    ``confidence`` is returned; with too few values for that, the whole range and its lower coverage.
    """
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no values: the median of nothing has no interval")
    k, coverage = 1, _coverage(n, 1)
    while k + 1 <= (n + 1) // 2 and _coverage(n, k + 1) >= confidence:
        k += 1
        coverage = _coverage(n, k)
    return ordered[k - 1], ordered[n - k], coverage


def _coverage(n: int, k: int) -> float:
    below = sum(math.comb(n, i) for i in range(k)) / 2**n
    return max(0.0, 1 - 2 * below)


def compare(baseline, candidate, *, labels=None, pairs: int | None = None, number: int | None = None,
            min_time: float = 1.0, warmup: int = 1, threads: int | None = None, device=None, min_effect: float = 0.02,
            confidence: float = 0.9) -> Comparison:
    """Time ``baseline()`` and ``candidate()`` interleaved; how many times faster the candidate is.

    Both are called ``warmup`` times first, each call timed on its own (``Comparison.baseline_warmup``: what a
    first call costs). Each pair then times a block of back-to-back calls of each, in alternating order: blocks
    long enough that reading the clock costs nothing, or ``number`` calls each (``number=1``: one call per run,
    e.g. one epoch of a training generator, with exactly ``warmup + pairs`` calls of each). With ``pairs=N``,
    exactly N pairs; by default as many as fit in about ``min_time`` seconds, at least 6. The clock waits for
    the GPU.
    """
    labels = labels or (_name(baseline, "baseline"), _name(candidate, "candidate"))
    for name, value in (("pairs", pairs), ("number", number)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive whole number such as {name}=8, got {value!r}")
    if not (callable(baseline) and callable(candidate)):
        raise TypeError("compare() needs two functions to call; wrap expressions in lambdas: "
                        "compare(lambda: a @ b, lambda: a.half() @ b.half())")
    device = get_device(device)
    threads = threads or torch.get_num_threads()
    # the clock waits for every GPU this process has used: a and b may queue work on any of them
    timers = [timeit.Timer("fn()", timer=synced_clock, globals={"fn": fn}) for fn in (baseline, candidate)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    watch = conditions.Watch(device).start()
    try:
        warm = [tuple(timer.timeit(1) for _ in range(warmup)) for timer in timers]
        target = min_time / (2 * (pairs or MIN_PAIRS * 2))
        calls = [number] * 2 if number else [calls_per_run(timer, target) for timer in timers]
        times, spent = ([], []), 0.0
        while len(times[0]) < (pairs or MAX_PAIRS):
            if pairs is None and len(times[0]) >= MIN_PAIRS and spent >= min_time:
                break
            for which in (0, 1) if len(times[0]) % 2 == 0 else (1, 0):
                seconds = timers[which].timeit(calls[which])
                times[which].append(seconds / calls[which])
                spent += seconds
    finally:
        torch.set_num_threads(previous)
        state = watch.stop()
    comparison = Comparison.of(*times, labels=labels, min_effect=min_effect, confidence=confidence, conditions=state)
    return replace(comparison, baseline_warmup=warm[0], candidate_warmup=warm[1])


def _name(fn, default: str) -> str:
    name = getattr(fn, "__name__", default)
    return default if name == "<lambda>" else name
