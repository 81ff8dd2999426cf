"""Two training configurations raced epoch by epoch, and the keep-or-drop loop of an optimisation path.

A speed-up measured from two runs one after the other shares no noise between them: a load spike during one decides
the verdict. ``race`` trains two configurations side by side instead, a round (part of an epoch) of each in turn (A
then B, B then A, ...), each round timed on a clock that waits for the GPU; after every epoch it measures each model's
test accuracy, untimed, so that each run has a time to a target accuracy (as the speedruns measure: training time
only) beside its steady samples per second. The first round is start-up (cuDNN's search, compilation, capture).

``Path`` is the loop of a waterfall: each step races the configuration kept so far and is kept when it is faster
beyond the noise and keeps the job's quality (``SameJob``: lesson 08's judge, losses for a step that changes no
arithmetic and accuracy against the seeds' spread for one that does; lesson 10 compares training losses); a step
dropped for its speed is tried once more at the end when a later step was kept (a change can pay only once another
bottleneck is gone), unless a later kept step has set the same switch (retrying it would undo that step). ``Budget``
plans each race's seconds before it starts and refuses one that would not end in the time left.

The techniques themselves are written out in the lesson's cells; this module only decides and records.
"""

import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from .comparison import Comparison
from .conditions import Watch
from .device import get_device
from .timing import synced_clock

nan = math.nan


@dataclass(frozen=True)
class Run:
    """One side of a race: the seconds of each round (the first with start-up), the test accuracy after it (NaN
    where it was not evaluated) and what the round returned (``losses``: its training losses, step by step)."""

    label: str
    seconds: tuple[float, ...]
    accuracy: tuple[float, ...]
    samples_per_round: int
    losses: tuple = ()

    @property
    def steady_s(self) -> float:
        """The median round after the first."""
        return statistics.median(self.seconds[1:]) if len(self.seconds) > 1 else self.seconds[0]

    @property
    def startup_s(self) -> float:
        """How much longer the first round took than a steady one."""
        return max(self.seconds[0] - self.steady_s, 0.0)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_round / self.steady_s

    @property
    def final_accuracy(self) -> float:
        """The last accuracy measured."""
        return next((a for a in reversed(self.accuracy) if a == a), nan)

    def rounds_to(self, target: float) -> int | None:
        """The round (1-based) after which the accuracy was first seen at ``target`` or above; None if never."""
        return next((i + 1 for i, a in enumerate(self.accuracy) if a >= target), None)

    def time_to(self, target: float) -> float:
        """Training seconds (start-up included, evaluation not) until the accuracy was first seen at ``target``; NaN
        if it never was."""
        rounds = self.rounds_to(target)
        return sum(self.seconds[:rounds]) if rounds else nan


@dataclass(frozen=True)
class Race:
    """Two runs raced side by side, and the candidate's steady speed-up over the baseline (``comparison``).

    ``same_arithmetic``: the candidate computes what the baseline does, only elsewhere or otherwise scheduled (data
    placement, syncs, fused kernels, compilation, graphs), so that from the same seed it must give the same losses;
    ``other_seed``: the baseline's configuration from another seed, its first round's losses (what a different
    training looks like), the yardstick of that comparison."""

    comparison: Comparison
    baseline: Run
    candidate: Run
    same_arithmetic: bool = False
    other_seed: tuple = ()


def race(baseline, candidate, *, rounds: int, samples_per_round: int, labels=("baseline", "candidate"),
         evaluate: tuple[Callable[[], float], Callable[[], float]] | None = None, evaluate_every: int = 1,
         device=None, same_arithmetic: bool = False, other_seed: Sequence[float] = ()) -> Race:
    """Train ``baseline`` and ``candidate`` (iterators: ``next()`` trains one round, a fixed number of samples) for
    ``rounds`` rounds each, in alternating order, each round timed on a clock that waits for the GPU; after every
    ``evaluate_every``-th round (an epoch), ``evaluate[i]()`` (the test accuracy of that side's model) is called
    outside the timing. The comparison's pairs are the rounds after the first (start-up), and it carries the
    machine's state over the race. Rounds shorter than an epoch give a verdict within few epochs: a median's
    interval needs five pairs or more. What each ``next()`` returns (the round's training losses) is kept in the
    runs' ``losses``; ``same_arithmetic`` and ``other_seed`` go into the ``Race`` for its judge."""
    if rounds < 2:
        raise ValueError(f"a race needs at least 2 rounds (the first is start-up), got {rounds!r}")
    device = get_device(device)
    sides, seconds, accuracy, returned = (baseline, candidate), ([], []), ([], []), ([], [])
    with Watch(device) as watch:
        for k in range(rounds):
            for which in (0, 1) if k % 2 == 0 else (1, 0):
                start = synced_clock(device)
                out = next(sides[which])
                seconds[which].append(synced_clock(device) - start)
                returned[which].append(out)
                evaluated = evaluate and (k + 1) % evaluate_every == 0
                accuracy[which].append(evaluate[which]() if evaluated else nan)
    runs = [Run(label, tuple(s), tuple(a), samples_per_round, tuple(r))
            for label, s, a, r in zip(labels, seconds, accuracy, returned)]
    comparison = Comparison.of(runs[0].seconds[1:], runs[1].seconds[1:], labels=labels, conditions=watch.conditions)
    return Race(comparison, *runs, same_arithmetic=same_arithmetic, other_seed=tuple(other_seed))


def alone(run, *, rounds: int, samples_per_round: int, label: str = "", evaluate: Callable[[], float] | None = None,
          evaluate_every: int = 1, device=None) -> Run:
    """Train one configuration (``run``: ``next()`` trains a round) for ``rounds`` rounds, each timed as ``race`` times
    its sides, with ``evaluate()`` after every ``evaluate_every``-th round, untimed: a run that needs no rival (another
    seed of a configuration, for the spread of its accuracy or what its first round's losses look like)."""
    device = get_device(device)
    seconds, accuracy, returned = [], [], []
    for k in range(rounds):
        start = synced_clock(device)
        returned.append(next(run))
        seconds.append(synced_clock(device) - start)
        accuracy.append(evaluate() if evaluate and (k + 1) % evaluate_every == 0 else nan)
    return Run(label, tuple(seconds), tuple(accuracy), samples_per_round, tuple(returned))


KEPT, SLOWER_HERE, WITHIN_NOISE, MISSED_TARGET = "kept", "slower here", "within noise", "missed the target"
LOSSES_DIFFER = "losses differ"


def steps_of(rounds) -> list[float]:
    """The step losses of ``rounds`` (what a run's rounds returned: a sequence of step losses each, or one number)."""
    return [float(x) for r in rounds for x in (r if isinstance(r, Sequence) else [r])]


def loss_gap(a, b, steps: int | None = None) -> float:
    """How far two runs' first training losses lie apart: the mean absolute difference, step by step, of the first
    ``steps`` losses of their first rounds (all of the first round where None; ``a`` and ``b``: each run's rounds, as
    ``Run.losses``); NaN if either has none."""
    pairs = list(zip(steps_of(a[:1])[:steps], steps_of(b[:1])[:steps]))
    return statistics.fmean(abs(x - y) for x, y in pairs) if pairs else nan


# Student's t, one-sided 95 %, by degrees of freedom: the bound below which a new run falls 5 % of the time
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}


@dataclass(frozen=True)
class SeedSpread:
    """The job's final test accuracy from a few seeds of one configuration: its mean, its standard deviation and the
    margin below the mean that a new run of the same training falls under only 5 % of the time (Student's t
    prediction bound, t·s·√(1 + 1/n): few seeds, so a wide margin)."""

    accuracies: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.accuracies)

    @property
    def sd(self) -> float:
        return statistics.stdev(self.accuracies) if len(self.accuracies) > 1 else nan

    @property
    def margin(self) -> float:
        n = len(self.accuracies)
        return T95.get(n - 1, 1.645) * self.sd * math.sqrt(1 + 1 / n) if n > 1 else nan

    @property
    def floor(self) -> float:
        """The accuracy a run of the same training reaches 95 % of the time: the mean less the margin, and never below
        0 (a margin wider than the mean bounds nothing)."""
        return max(self.mean - self.margin, 0.0)

    def __str__(self) -> str:
        shown = ", ".join(f"{a:.1%}" for a in self.accuracies)
        unbounded = ": the seeds lie too far apart to bound a run's accuracy" if self.margin > self.mean else ""
        return (f"{len(self.accuracies)} seeds: {shown}; mean {self.mean:.1%}, standard deviation "
                f"{self.sd * 100:.2g} points, margin {self.margin * 100:.2g} points (floor {self.floor:.1%}{unbounded})")


@dataclass
class SameJob:
    """Lesson 08's judge: whether a candidate still trains the job.

    A step that changes no arithmetic (``Race.same_arithmetic``) trains the same network on the same images in the same
    order, so from the same seed its losses follow the kept configuration's: over the first ``steps`` steps (training
    amplifies rounding's differences as it goes) their gap (``loss_gap``) must stay within ``share`` of the gap another
    seed shows (``Race.other_seed``), the tolerance of that race; its one-seed accuracy decides nothing (it varies as
    much as a seed's). A step that changes the numerics
    (precision, batch and learning rate) must reach the floor of the seeds' spread: ``spread`` holds the accuracies of
    ``seeds`` (other seeds of the starting job, measured before the path) and the first race's baseline; ``target``
    is that floor, the accuracy the time to target is measured to."""

    seeds: tuple[float, ...] = ()
    share: float = 0.1
    steps: int | None = None
    spread: SeedSpread | None = None
    baseline: Run | None = None

    @property
    def target(self) -> float:
        return self.spread.floor if self.spread else nan

    def tolerance(self, raced: Race) -> float:
        """``share`` of the loss gap between the baseline and another seed of its configuration."""
        return self.share * loss_gap(raced.baseline.losses, raced.other_seed, self.steps)

    def __call__(self, raced: Race) -> str | None:
        """None when the candidate trains the job, else why it was not kept."""
        if self.spread is None:
            self.baseline, self.spread = raced.baseline, SeedSpread((raced.baseline.final_accuracy, *self.seeds))
        if raced.same_arithmetic:
            gap = loss_gap(raced.baseline.losses, raced.candidate.losses, self.steps)
            return None if gap <= self.tolerance(raced) else LOSSES_DIFFER  # False for a NaN gap too
        return None if raced.candidate.final_accuracy >= self.target else MISSED_TARGET

    def row(self, raced: Race, options: dict | None = None) -> dict:
        """The columns of a step's row: the candidate's speed, start-up, time to the target, accuracy, and for a step
        that changes no arithmetic its loss gap and that race's tolerance."""
        run = raced.candidate
        same = raced.same_arithmetic
        return {"samples_per_s": run.samples_per_s, "startup_s": run.startup_s,
                "time_to_target_s": run.time_to(self.target), "accuracy": run.final_accuracy,
                "judged_on": "losses" if same else "accuracy",
                "loss_gap": loss_gap(raced.baseline.losses, run.losses, self.steps) if same else nan,
                "loss_tolerance": self.tolerance(raced) if same else nan}


@dataclass
class Budget:
    """The seconds a path may spend racing, from its start: each race's seconds are planned before it starts (the
    images of each side over the rate measured so far, plus start-up such as compilation), and a race that would not
    end within the budget is refused, so that the whole run ends in time by construction.

    A budget shared by several cells (a lesson's noise, then its races) is ``pause()``-d between them and spent only
    inside ``spending()`` blocks: a learner reading between the cells spends none of it. ``clock`` reads the time."""

    seconds: float = math.inf
    started: float | None = None  # the clock's reading at the start (default: when the budget is made)
    clock: Callable[[], float] = time.perf_counter
    paused_s: float = 0.0  # seconds between spending() blocks, not counted
    _paused_at: float | None = None

    def __post_init__(self):
        if self.started is None:
            self.started = self.clock()

    def left(self) -> float:
        now = self.clock() if self._paused_at is None else self._paused_at
        return self.seconds - (now - self.started - self.paused_s)

    def pause(self) -> "Budget":
        """Stop counting (until ``resume()``, or inside ``spending()``)."""
        if self._paused_at is None:
            self._paused_at = self.clock()
        return self

    def resume(self) -> None:
        if self._paused_at is not None:
            self.paused_s += self.clock() - self._paused_at
            self._paused_at = None

    @contextmanager
    def spending(self):
        """Count the time inside the block; a paused budget is paused again after it."""
        paused = self._paused_at is not None
        self.resume()
        try:
            yield self
        finally:
            if paused:
                self.pause()

    def refuses(self, planned_s: float) -> str | None:
        """Why a race planned to take ``planned_s`` seconds is not started (None: it fits in what is left)."""
        left = self.left()
        if planned_s <= left:
            return None
        return f"not raced: planned {planned_s:.0f} s, {max(left, 0):.0f} s of the lesson's budget left"


def planned_seconds(images: Sequence[int], rates: Sequence[float], startup_s: float = 0.0) -> float:
    """A race's training seconds before it starts: each side's ``images`` over its ``rates`` (images/s), plus
    ``startup_s``."""
    return sum(n / r for n, r in zip(images, rates)) + startup_s


@dataclass
class Path:
    """The keep-or-drop loop of an optimisation waterfall (lessons 06, 08 and 10).

    ``run(current, candidate)`` races two configurations, ``(name, options)`` each; the result has a ``comparison``
    (the candidate's speed-up). ``judge(result)`` says whether the candidate kept the job's quality: None when it
    did, else the note that says why not ("missed the target", "losses differ"). A step is kept when the candidate is
    faster beyond the noise and ``judge`` has nothing against it. ``row(result, options)`` gives the step's measured
    columns (``options``: the candidate's whole configuration).
    ``rows`` holds one row per step (and per retry), ``results`` each race's result by step, ``current`` the
    configuration kept so far (its options may be None: the starting job, written out apart). ``log(row, result)``,
    where given, is called as each verdict is given (``result``: None for a step that did not run), so that a run cut
    off keeps every verdict it gave; ``running`` names the step being raced now (None between steps)."""

    run: Callable[[tuple, tuple], object]
    judge: Callable[[object], str | None]
    row: Callable[[object, dict], dict] = lambda result, options: {}
    current: tuple = ("baseline", None)
    log: Callable[[dict, object], None] | None = None
    running: str | None = None
    rows: list = field(default_factory=list)
    results: dict = field(default_factory=dict)
    _dropped: list = field(default_factory=list)  # (name, options, kept steps since): steps dropped for their speed
    _set_by: dict = field(default_factory=dict)  # option -> the kept step that set it
    _kept: dict = field(default_factory=dict)  # kept step -> its whole configuration's options

    def options_of(self, name: str) -> dict | None:
        """The options of the configuration kept at step ``name`` (the starting one's for its own name)."""
        return self._kept.get(name, self.current[1] if name == self.current[0] else None)

    def step(self, name: str, options: dict, not_here: str | None = None) -> dict:
        """Race ``name`` (the kept configuration with ``options`` switched on) against the kept configuration;
        ``not_here`` names why it cannot run on this machine (the row says so, nothing runs)."""
        if not_here:
            return self._add({"step": name, "kept": False, "note": not_here}, None)
        row = self._try(name, options)
        if row["note"] in (SLOWER_HERE, WITHIN_NOISE):
            self._dropped.append((name, options, len(self._kept_names())))
        return row

    def again(self, not_here: Callable[[str, dict], str | None] | None = None) -> list[dict]:
        """Each step dropped for its speed, tried once more where a step was kept after it and no kept step has set
        the same switch since (retrying would undo it). ``not_here(name, options)``, where given, names why a retry
        cannot run now (a time budget): the row says so, nothing runs."""
        rows = []
        for name, options, kept_before in self._dropped:
            later = self._kept_names()[kept_before:]
            undone = {key: self._set_by[key] for key in options if self._set_by.get(key) in later}
            if not later:
                continue
            if undone:
                rows.append(self._add({"step": f"{name} (again)", "kept": False,
                                       "note": f"not retried: {', '.join(sorted(set(undone.values())))} set "
                                               f"{', '.join(sorted(undone))} since"}, None))
                continue
            refused = not_here(f"{name} (again)", options) if not_here else None
            if refused:
                rows.append(self._add({"step": f"{name} (again)", "kept": False, "note": refused}, None))
                continue
            rows.append(self._try(f"{name} (again)", options))
        return rows

    def _try(self, name: str, options: dict) -> dict:
        candidate = (name, {**(self.current[1] or {}), **options})
        self.running = name
        result = self.results[name] = self.run(self.current, candidate)
        self.running = None
        c, missed = result.comparison, self.judge(result)
        kept = c.verdict == "faster" and missed is None
        note = KEPT if kept else missed or (WITHIN_NOISE if c.verdict == "within noise" else SLOWER_HERE)
        low, high = c.interval
        row = {"step": name, **self.row(result, candidate[1]), "vs_previous": c.speedup, "low": low, "high": high,
               "kept": kept, "verdict": c.verdict, "note": note, "caveat": "; ".join(c.caveats)}
        if kept:
            self.current = candidate
            self._kept[name] = candidate[1]
            self._set_by.update(dict.fromkeys(options, name))
        return self._add(row, result)

    def _kept_names(self) -> list[str]:
        return [r["step"] for r in self.rows if r.get("kept")]

    def _add(self, row: dict, result) -> dict:
        self.rows.append(row)
        if self.log:
            self.log(row, result)
        return row
