"""Lesson 06, profiling: the operator that dominates a profile, a step's idle fraction, a slow loop made fast,
and which steps a profiler schedule records."""

import copy
import math
import numbers
import secrets

import pandas as pd
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerAction, schedule

from .. import traces
from ..check import Question, Wrong
from ..comparison import Comparison
from ..device import get_device, sync
from ..mode import by_mode
from ..models import WideMLP
from .observe import observe
from .portable import left_blank, source_of
from .timed_check import Duel, loaded_machine, pack_state, unpack_state

# ----- q1: the operator that dominates a profile -----------------------------------------------------


def dominant_operator(table: pd.DataFrame) -> str:
    """The operator (not a range) with the most self time on the device, summed over its rows; self CPU
    time when the profile has no device time."""
    ops = table[~table["is_range"]]
    column = "self_device_ms" if (ops["self_device_ms"] > 0).any() else "self_cpu_ms"
    return ops.groupby("operator")[column].sum().idxmax()


def _table(rows) -> pd.DataFrame:
    """An op_table-like frame from (operator, is_range, self_cpu_ms, self_device_ms, device_total_ms) rows."""
    frame = pd.DataFrame(rows, columns=["operator", "is_range", "self_cpu_ms", "self_device_ms", "device_total_ms"])
    return frame.assign(input_shapes="", calls=1, cpu_total_ms=frame["self_cpu_ms"], self_cpu_mem_mb=0.0,
                        self_device_mem_mb=0.0)


_PROFILES = {
    "a profile grouped by input shape": _table([
        ("ProfilerStep*", True, 3.0, 0.0, 40.0),
        ("aten::cudnn_convolution", False, 0.3, 4.0, 4.0),
        ("aten::cudnn_convolution", False, 0.3, 4.0, 4.0),
        ("aten::addmm", False, 0.2, 9.0, 9.0),
        ("aten::cudnn_convolution", False, 0.3, 4.0, 4.0),
    ]),
    "a CPU-only profile with record_function ranges": _table([
        ("data", True, 50.0, 0.0, 0.0),
        ("aten::copy_", False, 20.0, 0.0, 0.0),
        ("forward", True, 4.0, 0.0, 0.0),
        ("aten::mul", False, 15.0, 0.0, 0.0),
    ]),
    "a GPU profile where the CPU waits in .item()": _table([
        ("aten::_local_scalar_dense", False, 30.0, 0.0, 0.0),
        ("aten::addmm", False, 2.0, 8.0, 8.0),
        ("aten::cudnn_convolution", False, 1.0, 10.0, 10.0),
    ]),
    "a profile with wrapper operators": _table([
        ("aten::linear", False, 0.5, 0.0, 20.0),
        ("aten::addmm", False, 0.6, 12.0, 12.0),
        ("aten::relu", False, 0.3, 3.0, 3.0),
        ("aten::convolution", False, 0.2, 0.0, 11.0),
        ("aten::cudnn_convolution", False, 0.2, 11.0, 11.0),
    ]),
}


def _why_wrong(table: pd.DataFrame, got) -> str:
    """The likely mistake behind ``got`` on ``table`` (or "")."""
    ops = table[~table["is_range"]]
    device = (ops["self_device_ms"] > 0).any()
    if got in set(table.loc[table["is_range"], "operator"]):
        return f" {got!r} is a record_function range (is_range), not an operator: leave the ranges out."
    if device and got == ops.groupby("operator")["self_cpu_ms"].sum().idxmax():
        return " That one has the most CPU time; this profile has device time, and the GPU's time is what matters."
    if device and got == ops.groupby("operator")["device_total_ms"].sum().idxmax():
        return " Total time includes the operators it calls (a wrapper's children): use self time."
    if got == ops.loc[ops["self_device_ms" if device else "self_cpu_ms"].idxmax(), "operator"]:
        return " That is the largest single row: an operator appears once per input shape, so sum its rows."
    return ""


def _check_dominant(dominant, table) -> str:
    if not callable(dominant):
        raise Wrong(f"pass your function itself, `q1.check(dominant_operator, table)`, not {type(dominant).__name__}")
    if not isinstance(table, pd.DataFrame) or "is_range" not in table.columns:
        raise Wrong("pass the profile's table as the second argument: `traces.op_table(prof, group_by_input_shape=True)`")
    for what, case in _PROFILES.items():
        expected, got = dominant_operator(case), dominant(case.copy())
        if got != expected:
            raise Wrong(f"for {what} the dominant operator is {expected!r}; your function returned {got!r}."
                        + _why_wrong(case, got))
    expected, got = dominant_operator(table), dominant(table.copy())
    if got != expected:
        raise Wrong(f"on your own profile the dominant operator is {expected!r}, your function returned {got!r}."
                    + _why_wrong(table, got))
    ops = table[~table["is_range"]]
    column = "self_device_ms" if (ops["self_device_ms"] > 0).any() else "self_cpu_ms"
    share = ops.loc[ops["operator"] == got, column].sum() / ops[column].sum()
    return f"on your profile {got} has {share:.0%} of the operators' {column.replace('_ms', '').replace('_', ' ')} time."


# ----- q2: the idle fraction of a step ------------------------------------------------------------


_INTERVAL_CASES = [  # (what, intervals, start_ms, end_ms)
    ("two kernels overlapping on two streams", [(0, 4), (2, 6)], 0, 10),
    ("kernels that start before the step or end after it", [(-2, 1), (9, 12)], 0, 10),
    ("a step with no kernels", [], 0, 10),
    ("unsorted kernels, one inside another", [(5, 6), (1, 8), (2, 3)], 0, 10),
    ("back-to-back kernels filling the step", [(0, 2), (2, 4)], 0, 4),
    ("a window that does not start at 0", [(12, 13), (14, 16)], 10, 20),
]


def _intervals(pairs) -> pd.DataFrame:
    return pd.DataFrame(pairs, columns=["start_ms", "end_ms"], dtype=float)


def _fraction(value, call: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise Wrong(f"{call} returned {value!r}: return a number, the idle fraction of the window")
    return float(value)


def _summed_idle(intervals: pd.DataFrame, start_ms: float, end_ms: float) -> float:
    """The idle fraction a learner gets by adding up the clipped lengths (overlaps counted twice)."""
    lengths = intervals["end_ms"].clip(upper=end_ms) - intervals["start_ms"].clip(lower=start_ms)
    return 1 - lengths.clip(lower=0).sum() / (end_ms - start_ms)


def _compare_idle(got: float, expected: float, call: str, what: str, summed: float) -> None:
    if math.isclose(got, expected, abs_tol=1e-6):
        return
    hint = ""
    if math.isclose(got, 1 - expected, abs_tol=1e-6):
        hint = " That is the busy fraction: idle is the rest of the window."
    elif math.isclose(got, 100 * expected, abs_tol=1e-4):
        hint = " That is a percentage: return a fraction between 0 and 1."
    elif got < 0 or math.isclose(got, summed, abs_tol=1e-6):
        hint = " Overlapping kernels count once: take the union of the intervals, not the sum of their lengths."
    elif got < expected - 1e-6:
        hint = " Clip each interval to the window: only the part inside [start_ms, end_ms] counts."
    raise Wrong(f"for {what}, {call} = {got:.4g}; the idle fraction is {expected:.4g}.{hint}")


def _check_idle(idle_fraction, trace) -> str:
    if not callable(idle_fraction):
        raise Wrong("pass your function itself: `q2.check(idle_fraction, trace_path)`")
    for what, pairs, start, end in _INTERVAL_CASES:
        intervals = _intervals(pairs)
        expected = 1 - traces.busy_ms(intervals, start, end) / (end - start)
        call = f"idle_fraction(<{len(pairs)} intervals>, {start}, {end})"
        got = _fraction(idle_fraction(intervals.copy(), start, end), call)
        _compare_idle(got, expected, call, what, _summed_idle(intervals, start, end))
    try:
        frame = traces.events(trace)
        windows = traces.steps(trace)
    except traces.TraceError as err:
        raise Wrong(f"pass the trace you exported as the second argument ({err})") from None
    on_gpu = (frame["kind"] == "kernel").any()
    busy = frame[frame["kind"] == "kernel"] if on_gpu else frame[frame["cat"] == "cpu_op"]
    what = "kernels" if on_gpu else "CPU operators (this trace has no GPU kernels)"
    fractions = []
    for step in windows.itertuples():
        expected = 1 - traces.busy_ms(busy, step.start_ms, step.end_ms) / (step.end_ms - step.start_ms)
        call = f"idle_fraction(<{what}>, {step.start_ms:.3f}, {step.end_ms:.3f})"
        got = _fraction(idle_fraction(busy[["start_ms", "end_ms"]].copy(), step.start_ms, step.end_ms), call)
        _compare_idle(got, expected, call, f"step {step.step} of your trace",
                      _summed_idle(busy, step.start_ms, step.end_ms))
        fractions.append(got)
    return (f"your function agrees with gpulab's on every test case and on the {len(fractions)} steps of your trace: "
            f"idle between {min(fractions):.0%} and {max(fractions):.0%} of each step, measured on {what}.")


# ----- q3: a slow epoch made fast -----------------------------------------------------------------


def slow_epoch(model, optimizer, images, labels, batch_size):
    """One epoch over uint8 images: returns (mean loss, accuracy). Correct, and slow in three ways."""
    losses, correct = [], 0
    for start in range(0, len(images), batch_size):
        x = images[start:start + batch_size].float() / 255
        y = labels[start:start + batch_size]
        for i in range(len(x)):                       # standardise one image at a time
            x[i] = (x[i] - x[i].mean()) / (x[i].std() + 1e-5)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())                    # a Python number every step: waits for the GPU
        for i in range(len(y)):                       # and one per image
            correct += int(logits[i].argmax() == y[i])
    return sum(losses) / len(losses), correct / len(images)


BATCH = 64
# Images per epoch: not a multiple of the batch, so that the last batch is partial (4 images) and the mean of the
# batches' accuracies differs from the accuracy over all images.
N_IMAGES = by_mode(full=4100, quick=1540)


def _problem(device, n: int, size: int = 8, seed: int = 0):
    """``n`` uint8 thumbnails (3×size×size) with labels, and a small MLP for them, on ``device``."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator).to(device)
    labels = torch.randint(0, 10, (n,), generator=generator).to(device)
    model = WideMLP(in_features=3 * size * size, width=32, depth=1, seed=seed).to(device)
    return images, labels, model


def _fresh(model):
    twin = copy.deepcopy(model)
    return twin, torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)


def _pair(value, what: str) -> tuple[float, float]:
    try:
        loss, accuracy = value
        return float(loss), float(accuracy)
    except (TypeError, ValueError, RuntimeError):
        raise Wrong(f"{what} returned {value!r}: return (mean loss, accuracy), two numbers, like slow_epoch") from None


class EpochTask:
    """What the timed check's processes run (``gpulab.questions.timed_check``): one epoch on a new problem per seed, and a
    probe of what an epoch does (reads back to Python, tensor operations as the batch grows)."""

    baseline = staticmethod(slow_epoch)

    @staticmethod
    def namespace() -> dict:
        return {"__name__": "__answer__"}

    @staticmethod
    def warm_up() -> None:
        images, labels, model = _problem(get_device(), n=BATCH)
        slow_epoch(*_fresh(model), images, labels, BATCH)

    @staticmethod
    def trial(epoch, seed: int, events) -> dict:
        device = get_device()
        images, labels, model = _problem(device, n=N_IMAGES, seed=seed)
        model, optimizer = _fresh(model)
        result = epoch(model, optimizer, images, labels, BATCH)
        sync(device)
        events.done()
        return {"result": [float(v) for v in _pair(result, "your fast_epoch")], "state": pack_state(model)}

    @staticmethod
    def probe(epoch, name: str) -> dict:
        images, labels, model = _problem(get_device(), n=N_IMAGES)
        with observe() as seen:
            epoch(*_fresh(model), images, labels, BATCH)
        return {"waits": seen.waits, "reads": list(dict.fromkeys(seen.host_reads + seen.syncs)),
                "operations": [_operations(epoch, model, batch) for batch in (BATCH // 2, BATCH)]}


TASK = EpochTask()
# The shown solution reached 2.8-3.6× on a 2-core CPU running two other busy processes (medians of 14 pairs), 4× on
# a quiet one; a loop over images left in, 1.9-2.3× (those are rejected apart, by counting operations).
SPEEDUP = 2.0
PAIRS = by_mode(full=5, quick=7)  # interleaved pairs of epochs, after one pair to warm up


def _check_fast(fast_epoch) -> str:
    if not callable(fast_epoch):
        raise Wrong("pass your function itself: `q3.check(fast_epoch)`")
    if left_blank(fast_epoch):
        raise NotImplementedError
    seeds = [secrets.randbelow(2**31) for _ in range(1 + 2 * PAIRS)]  # a new problem every call
    with Duel(f"{__name__}:TASK", source_of(fast_epoch), fast_epoch.__name__) as duel:
        _verified(duel.pairs(seeds[:1]))  # the same training as slow_epoch's; also the warm-up
        seen = duel.probe("answer", "behaviour")
        _judge_behaviour(seen)
        pairs = _verified(duel.pairs(seeds[1:1 + PAIRS]))
        if speed(pairs).reaches(SPEEDUP) is None:  # too close to call: measure as many again
            pairs += _verified(duel.pairs(seeds[1 + PAIRS:]))
    return judge_speed(speed(pairs), get_device(), seen["waits"], math.ceil(N_IMAGES / BATCH), loaded_machine())


def _judge_behaviour(seen: dict) -> None:
    """Raise Wrong when an epoch reads back to Python every step or loops over images in Python."""
    steps = math.ceil(N_IMAGES / BATCH)
    if seen["waits"] > 4:
        raise Wrong(f"your epoch read values back to Python {seen['waits']} times in {steps} steps "
                    f"({', '.join(seen['reads'])}); on a GPU each read waits for all queued work. Keep the loss sum and "
                    "the correct count on the device and read them once, after the loop")
    small, large = seen["operations"]
    if large > 1.25 * small:
        raise Wrong(f"your epoch ran {small:,} tensor operations for 8 batches of {BATCH // 2} images and {large:,} for "
                    f"8 batches of {BATCH}: work that grows with the images, not the batches, is a Python loop over "
                    "images. Do each step's work for the whole batch at once")


def _operations(epoch, model, batch: int) -> int:
    """How many tensor operations ``epoch`` runs for 8 batches of ``batch`` images."""
    images, labels, _ = _problem(get_device(), n=8 * batch)
    with observe() as seen:
        epoch(*_fresh(model), images, labels, batch)
    return sum(seen.op_devices.values())


def _same_training(got, expected, got_state, expected_state, n: int) -> None:
    """Raise Wrong unless an epoch's (loss, accuracy) and weights match slow_epoch's on the same problem."""
    same_weights = all(torch.allclose(got_state[k], expected_state[k], rtol=1e-3, atol=1e-5) for k in expected_state)
    if not math.isclose(got[0], expected[0], rel_tol=1e-3) or not same_weights:
        raise Wrong(f"your epoch trains differently from slow_epoch (mean loss {got[0]:.5g} instead of {expected[0]:.5g}"
                    f"{'' if same_weights else ', different weights afterwards'}): standardise each image on its own "
                    "(mean and std over its channels and pixels), clear the gradients every step, change only the speed")
    if not math.isclose(got[1], expected[1], abs_tol=0.5 / n):
        scale = " (a percentage? return a fraction)" if math.isclose(got[1], 100 * expected[1], rel_tol=1e-3) else ""
        raise Wrong(f"your accuracy is {got[1]:.4g}, slow_epoch's is {expected[1]:.4g}{scale}: count the correct "
                    "predictions of every image and divide by the number of images (the last batch is smaller: the "
                    "mean of the batches' accuracies is not the accuracy)")


def _verified(pairs):
    """The pairs, each answer's epoch checked against the baseline's on the same problem (computed in the baseline's
    own process: the answer never sees it)."""
    for baseline, answer in pairs:
        _same_training(answer.report["result"], baseline.report["result"], unpack_state(answer.report["state"]),
                       unpack_state(baseline.report["state"]), N_IMAGES)
    return pairs


def speed(pairs) -> Comparison:
    return Comparison.of([b.seconds for b, _ in pairs], [a.seconds for _, a in pairs],
                         labels=("slow_epoch", "your fast_epoch"))


def judge_speed(comparison: Comparison, device, waits: int, steps: int, caveat: str | None = None) -> str:
    """Pass when the median speed-up of the interleaved epochs reaches SPEEDUP."""
    said = (f"{comparison.speedup:.2f}× as fast as slow_epoch on {device} (median of {comparison.pairs} interleaved "
            f"pairs of epochs, {min(comparison.ratios):.2f}–{max(comparison.ratios):.2f}×)")
    note = f" Note: {caveat}." if caveat else ""
    if comparison.speedup < SPEEDUP:
        raise Wrong(f"your epoch is right, and {said}; it needs to be at least {SPEEDUP:g}× faster. Look for the "
                    f"Python loops over images that are left.{note}")
    return f"same losses and weights as slow_epoch, {waits} read(s) back to Python in {steps} steps, and {said}.{note}"


# ----- q4: which steps a profiler schedule records ----------------------------------------------------


_SCHEDULES = [(1, 1, 2, 2, 12), (2, 1, 3, 1, 10), (0, 1, 1, 0, 7), (1, 2, 3, 0, 20), (3, 1, 2, 1, 4)]


def _recorded(wait, warmup, active, repeat, total) -> list[int]:
    plan = schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)
    return [s for s in range(total) if plan(s) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)]


def _profiler_on(wait, warmup, active, repeat, total) -> list[int]:
    """The steps during which the profiler runs: warm-up and active ones."""
    cycle = wait + warmup + active
    return [s for s in range(total) if (repeat == 0 or s // cycle < repeat) and s % cycle >= wait]


def _check_schedule(recorded_steps) -> str:
    if not callable(recorded_steps):
        raise Wrong("pass your function itself: `q4.check(recorded_steps)`")
    for args in _SCHEDULES:
        expected = _recorded(*args)
        got = recorded_steps(*args)
        call = "recorded_steps(wait={}, warmup={}, active={}, repeat={}, total={})".format(*args)
        try:
            got = [int(s) for s in got]
        except (TypeError, ValueError):
            raise Wrong(f"{call} returned {got!r}: return a list of step numbers") from None
        if got == expected:
            continue
        wait, warmup, active, repeat, total = args
        hint = ""
        if got == [s + 1 for s in expected]:
            hint = " Steps are counted from 0: prof.step() has been called s times when step s runs."
        elif set(expected) < set(got) and set(got) - set(expected) <= set(_profiler_on(wait, warmup, active, repeat, total)):
            hint = " Warm-up steps run the profiler but their events are thrown away: they are not recorded."
        elif set(expected) < set(got):
            hint = " After `repeat` cycles the schedule stops recording (repeat=0 means: until the loop ends)."
        raise Wrong(f"{call} should be {expected}, got {got}.{hint}")
    example = _recorded(1, 1, 2, 2, 12)
    return f"e.g. schedule(wait=1, warmup=1, active=2, repeat=2) over 12 steps records steps {example}."


# ----- the questions ------------------------------------------------------------------------------

q1 = Question(
    lesson="06", number=1, title="the operator that dominates", checker=_check_dominant,
    hint_text="Leave out the rows where `is_range` is True, pick `self_device_ms` if any row has device time (else "
              "`self_cpu_ms`), sum that column per operator with `groupby('operator')`, and return the `idxmax()`.",
    solution_text="""
def dominant_operator(table):
    ops = table[~table["is_range"]]
    column = "self_device_ms" if (ops["self_device_ms"] > 0).any() else "self_cpu_ms"
    return ops.groupby("operator")[column].sum().idxmax()
""",
)

q2 = Question(
    lesson="06", number=2, title="the idle fraction of a step", checker=_check_idle,
    hint_text="Clip every interval to [start_ms, end_ms], sort by start, and walk through them keeping the end of "
              "the covered stretch so far: only the part of an interval beyond it adds busy time. Idle = 1 - busy / "
              "(end_ms - start_ms).",
    solution_text="""
def idle_fraction(intervals, start_ms, end_ms):
    busy, reach = 0.0, start_ms
    for s, e in sorted(zip(intervals["start_ms"], intervals["end_ms"])):
        s, e = max(s, reach), min(e, end_ms)
        if e > s:
            busy += e - s
            reach = e
    return 1 - busy / (end_ms - start_ms)
""",
)

q3 = Question(
    lesson="06", number=3, title="make the slow epoch fast", checker=_check_fast,
    hint_text="Three fixes: standardise the whole batch at once with `mean`/`std` over `dim=(1, 2, 3)` and "
              "`keepdim=True`; add `loss.detach()` to a tensor on the device instead of calling `.item()`; count the "
              "correct predictions with `(logits.argmax(dim=1) == y).sum()`. Read both numbers once, after the loop.",
    solution_text="""
def fast_epoch(model, optimizer, images, labels, batch_size):
    total_loss = torch.zeros((), device=images.device)
    correct = torch.zeros((), device=images.device, dtype=torch.long)
    steps = 0
    for start in range(0, len(images), batch_size):
        x = images[start:start + batch_size].float() / 255
        y = labels[start:start + batch_size]
        x = (x - x.mean(dim=(1, 2, 3), keepdim=True)) / (x.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total_loss += loss.detach()
        correct += (logits.argmax(dim=1) == y).sum()
        steps += 1
    return (total_loss / steps).item(), correct.item() / len(images)
""",
)

q4 = Question(
    lesson="06", number=4, title="what a schedule records", checker=_check_schedule,
    hint_text="A cycle is wait + warmup + active steps; within a cycle, step s (counted from 0) is recorded when "
              "wait + warmup <= s % cycle. Only the first `repeat` cycles count (repeat=0: all of them).",
    solution_text="""
def recorded_steps(wait, warmup, active, repeat, total):
    cycle = wait + warmup + active
    return [s for s in range(total)
            if (repeat == 0 or s // cycle < repeat) and s % cycle >= wait + warmup]
""",
)
