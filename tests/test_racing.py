"""Racing two training configurations epoch by epoch (gpulab.racing.race) and the keep-or-drop path of a waterfall
(gpulab.racing.Path), on a fake clock: every decision is tested with injected epoch times, none with real ones."""

import math
import types

import pytest

from gpulab import racing
from gpulab.comparison import Comparison
from gpulab.racing import MISSED_TARGET, Path, Race, Run


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self, device=None):
        return self.now


def epochs_of(clock, seconds, log, name):
    """A training run whose next() 'trains' an epoch of ``seconds[i]`` on the fake clock."""
    for s in seconds:
        log.append(name)
        clock.now += s
        yield


def test_a_race_alternates_the_sides_and_leaves_start_up_and_evaluation_out(monkeypatch):
    clock, log = FakeClock(), []
    monkeypatch.setattr(racing, "synced_clock", clock)
    a = epochs_of(clock, [5.0, 2.0, 2.0, 2.0], log, "a")
    b = epochs_of(clock, [9.0, 1.0, 1.0, 1.0], log, "b")
    accuracy = {"a": iter([0.7, 0.85]), "b": iter([0.75, 0.9])}

    def evaluate(side):
        def measure():
            clock.now += 100.0  # evaluation takes time, which no round may count
            return next(accuracy[side])
        return measure

    raced = racing.race(a, b, rounds=4, samples_per_round=1000, labels=("a", "b"),
                        evaluate=(evaluate("a"), evaluate("b")), evaluate_every=2, device="cpu")
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a"]  # AB, BA, AB, BA
    assert raced.baseline.seconds == (5.0, 2.0, 2.0, 2.0) and raced.candidate.seconds == (9.0, 1.0, 1.0, 1.0)
    assert raced.comparison.baseline_times == (2.0, 2.0, 2.0) and raced.comparison.speedup == 2.0
    assert raced.candidate.startup_s == 8.0 and raced.candidate.samples_per_s == 1000.0
    assert math.isnan(raced.candidate.accuracy[0]) and raced.candidate.accuracy[1::2] == (0.75, 0.9)  # every 2nd
    assert raced.candidate.time_to(0.9) == 12.0 and raced.candidate.rounds_to(0.9) == 4  # no evaluation counted
    assert raced.candidate.time_to(0.75) == 10.0 and math.isnan(raced.baseline.time_to(0.9))
    assert raced.candidate.final_accuracy == 0.9 and raced.comparison.conditions is not None


def test_a_race_needs_a_round_beyond_start_up():
    with pytest.raises(ValueError, match="at least 2 rounds"):
        racing.race(iter([]), iter([]), rounds=1, samples_per_round=1, device="cpu")


def raced(speedup: float, accuracy: float, noisy: bool = False) -> Race:
    """A race whose candidate is ``speedup`` times faster (all five pairs alike, or spread across 1 when noisy)."""
    base = (1.0,) * 5
    ratios = (0.8, 0.9, 1.0, 1.1, 1.3) if noisy else (speedup,) * 5
    cand = tuple(1.0 / r for r in ratios)
    c = Comparison.of(base, cand, labels=("kept", "candidate"))
    rising = (0.5, 0.8, min(0.9, accuracy), accuracy, accuracy, accuracy)
    return Race(c, Run("kept", (2.0, *base), (0.9,) * 6, 100), Run("candidate", (2.0, *cand), rising, 100))


class Reaches:
    """A judge for these tests: the candidate's last accuracy must reach ``value``."""

    def __init__(self, value: float):
        self.value = value

    def __call__(self, raced: Race) -> str | None:
        return None if raced.candidate.final_accuracy >= self.value else MISSED_TARGET

    def row(self, raced: Race, options: dict | None = None) -> dict:
        return {"samples_per_s": raced.candidate.samples_per_s, "time_to_target_s": raced.candidate.time_to(self.value)}


def scripted(outcomes):
    """A Path.run that answers each race from ``outcomes`` (by the candidate's name) and records what it raced."""
    raced_pairs = []

    def run(current, candidate):
        raced_pairs.append((current, candidate))
        return outcomes[candidate[0]]
    return run, raced_pairs


def test_a_step_is_kept_when_faster_beyond_the_noise_and_on_target():
    run, pairs = scripted({"fast": raced(2.0, 0.95), "noisy": raced(1.0, 0.95, noisy=True),
                           "slow": raced(0.5, 0.95), "broken": raced(3.0, 0.60)})
    target = Reaches(0.9)
    path = Path(run, judge=target, row=target.row, current=("naive", {"a": 0}))
    notes = [path.step(name, {name: 1})["note"] for name in ("fast", "noisy", "slow", "broken")]
    assert notes == ["kept", "within noise", "slower here", "missed the target"]
    assert path.current == ("fast", {"a": 0, "fast": 1})
    assert [candidate[1] for _, candidate in pairs] == [  # each step on top of what was kept before it
        {"a": 0, "fast": 1}, {"a": 0, "fast": 1, "noisy": 1}, {"a": 0, "fast": 1, "slow": 1},
        {"a": 0, "fast": 1, "broken": 1}]
    row = path.rows[0]
    assert row["vs_previous"] == 2.0 and row["samples_per_s"] == 200.0
    assert row["time_to_target_s"] == 3.0  # 2 s of start-up, two epochs of 0.5


def test_the_path_keeps_each_race_and_the_options_of_each_kept_configuration():
    run, pairs = scripted({"fast": raced(2.0, 0.95), "broken": raced(3.0, 0.84)})
    path = Path(run, judge=Reaches(0.85), current=("naive job", None))
    path.step("fast", {"fast": 1})
    assert pairs[0] == (("naive job", None), ("fast", {"fast": 1}))
    assert path.step("broken", {"broken": 1})["note"] == "missed the target"
    assert path.options_of("fast") == {"fast": 1} and path.options_of("naive job") is None
    assert path.results["fast"] is run(None, ("fast", None))


def test_a_step_that_cannot_run_here_is_a_row_that_says_why_and_races_nothing():
    run, pairs = scripted({})
    path = Path(run, judge=Reaches(0.9))
    row = path.step("CUDA graphs", {"graph": True}, not_here="CUDA only")
    assert row == {"step": "CUDA graphs", "kept": False, "note": "CUDA only"} and pairs == []


def test_a_dropped_step_is_retried_once_after_a_later_step_is_kept():
    run, pairs = scripted({"no sync": raced(1.0, 0.95, noisy=True), "data on the GPU": raced(3.0, 0.95),
                           "no sync (again)": raced(1.5, 0.95), "slow": raced(0.5, 0.95)})
    path = Path(run, judge=Reaches(0.9))
    path.step("no sync", {"sync": False})
    path.step("data on the GPU", {"data": "gpu"})
    again = path.again()
    assert [r["step"] for r in again] == ["no sync (again)"] and again[0]["kept"]
    assert path.current[1] == {"data": "gpu", "sync": False}


def test_a_dropped_step_is_not_retried_where_it_would_undo_a_later_kept_step():
    """Lesson 08 on the H200 retried "torch.compile" (compile="default") after "CUDA graphs" (compile="reduce-overhead")
    was kept: the retry raced the kept step minus its CUDA graphs."""
    run, pairs = scripted({"torch.compile": raced(0.9, 0.95, noisy=True), "CUDA graphs": raced(1.3, 0.95)})
    path = Path(run, judge=Reaches(0.9))
    path.step("torch.compile", {"compile": "default"})
    path.step("CUDA graphs", {"compile": "reduce-overhead"})
    again = path.again()
    assert len(pairs) == 2 and path.current[1] == {"compile": "reduce-overhead"}
    assert again == [{"step": "torch.compile (again)", "kept": False,
                      "note": "not retried: CUDA graphs set compile since"}]


def test_nothing_is_retried_when_nothing_was_kept_after_it_or_when_it_missed_the_target():
    run, pairs = scripted({"a": raced(1.0, 0.95, noisy=True), "b": raced(5.0, 0.5)})
    path = Path(run, judge=Reaches(0.9))
    path.step("a", {"a": 1})
    path.step("b", {"b": 1})  # fast, but below the target: dropped for its accuracy, never retried
    assert path.again() == [] and len(pairs) == 2


def test_any_judge_of_quality_decides_with_the_speed_up():
    """Lesson 09 keeps a step when its training losses match the configuration before it."""
    same = types.SimpleNamespace(comparison=raced(2.0, 0.9).comparison, loss_gap=0.01)
    differs = types.SimpleNamespace(comparison=raced(2.0, 0.9).comparison, loss_gap=0.5)
    run, _ = scripted({"same": same, "differs": differs})
    path = Path(run, judge=lambda r: None if r.loss_gap < 0.05 else "loss differs",
                row=lambda r, options: {"loss_gap": r.loss_gap, **options}, current=("naive fp32", {}))
    assert path.step("same", {"a": 1})["note"] == "kept" and path.rows[0]["loss_gap"] == 0.01 == path.rows[0]["a"] * 0.01
    assert path.step("differs", {"b": 1})["note"] == "loss differs" and path.current[0] == "same"


def test_each_verdict_is_logged_as_it_is_given_so_a_run_cut_off_keeps_what_it_decided():
    """The 2026-11-28 H200 run was stopped inside both lessons' waterfalls, which logged their rows after the loop:
    every verdict was lost. Path logs each row when its verdict is given, and names the step racing now."""
    logged, seen_running = [], []

    def run(current, candidate):
        seen_running.append(path.running)
        if candidate[0] == "hangs":
            raise KeyboardInterrupt  # the verification's time limit stops the kernel here
        return {"fast": raced(2.0, 0.95), "slow": raced(0.5, 0.95)}[candidate[0]]

    target = Reaches(0.9)
    path = Path(run, judge=target, row=target.row, current=("naive", None), log=lambda row, result: logged.append(
        (row["step"], row["note"], result is not None)))
    path.step("fast", {"fast": 1})
    path.step("CUDA graphs", {"graph": 1}, not_here="CUDA only")
    path.step("slow", {"slow": 1})
    with pytest.raises(KeyboardInterrupt):
        path.step("hangs", {"hangs": 1})
    assert logged == [("fast", "kept", True), ("CUDA graphs", "CUDA only", False), ("slow", "slower here", True)]
    assert seen_running == ["fast", "slow", "hangs"] and path.running == "hangs"
