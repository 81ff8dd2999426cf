"""Lesson 06's exercise checks: each question accepts the solution it shows and an unusual right answer, calls a
blank answer "not attempted", and rejects plausible wrong answers with a message that names the mistake."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from gpulab import models, traces
from gpulab.check import ____
from gpulab.questions import lesson06
from gpulab.questions.lesson06 import slow_epoch
from gpulab.questions.timed_check import Trial, pack_state

from .conftest import shown_solution

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)


def blank_function(*args, **kwargs):
    raise NotImplementedError


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A real CPU profile of four CNN steps (two recorded, one batch of another shape): (op table, trace path)."""
    path = tmp_path_factory.mktemp("lesson06") / "trace.json"
    model = models.TutorialCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path)), record_shapes=True,
                 acc_events=True) as prof:
        for b in (8, 8, 6, 8):
            with record_function("forward"):
                loss = F.cross_entropy(model(torch.randn(b, 3, 32, 32)), torch.randint(0, 10, (b,)))
            with record_function("backward"):
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()
            prof.step()
    return traces.op_table(prof, group_by_input_shape=True), path


# ----- q1: the operator that dominates ----------------------------------------------------------------

def column_of(ops):
    return "self_device_ms" if (ops["self_device_ms"] > 0).any() else "self_cpu_ms"


def dominant_by_dict(table):
    """Unusual but right: a plain dictionary of sums over the rows."""
    totals = {}
    ops = table[~table["is_range"]]
    for name, t in zip(ops["operator"], ops[column_of(ops)]):
        totals[name] = totals.get(name, 0.0) + t
    return max(totals, key=totals.get)


def largest_row(table):
    ops = table[~table["is_range"]]
    return ops.loc[ops[column_of(ops)].idxmax(), "operator"]


def by_cpu_time(table):
    ops = table[~table["is_range"]]
    return ops.groupby("operator")["self_cpu_ms"].sum().idxmax()


def by_total_time(table):
    ops = table[~table["is_range"]]
    column = "device_total_ms" if (ops["device_total_ms"] > 0).any() else "cpu_total_ms"
    return ops.groupby("operator")[column].sum().idxmax()


def with_ranges(table):
    return table.groupby("operator")[column_of(table)].sum().idxmax()


# ----- q2: the idle fraction of a step ------------------------------------------------------------------

def idle_by_sweep(intervals, start_ms, end_ms):
    """Unusual but right: a sweep over +1/-1 events, counting how many kernels run."""
    edges = sorted([(max(s, start_ms), 1) for s, e in zip(intervals["start_ms"], intervals["end_ms"]) if e > s]
                   + [(min(e, end_ms), -1) for s, e in zip(intervals["start_ms"], intervals["end_ms"]) if e > s])
    idle, running, last = 0.0, 0, start_ms
    for t, change in edges:
        t = min(max(t, start_ms), end_ms)
        if running == 0:
            idle += t - last
        running, last = running + change, t
    return (idle + end_ms - last) / (end_ms - start_ms)


def summed_lengths(intervals, start_ms, end_ms):
    lengths = intervals["end_ms"].clip(upper=end_ms) - intervals["start_ms"].clip(lower=start_ms)
    return 1 - lengths.clip(lower=0).sum() / (end_ms - start_ms)


def not_clipped(intervals, start_ms, end_ms):
    inside = intervals[(intervals["end_ms"] > start_ms) & (intervals["start_ms"] < end_ms)]
    return 1 - traces.busy_ms(inside, -1e18, 1e18) / (end_ms - start_ms)


def busy_instead(intervals, start_ms, end_ms):
    return traces.busy_ms(intervals, start_ms, end_ms) / (end_ms - start_ms)


def as_percentage(intervals, start_ms, end_ms):
    return 100 * (1 - traces.busy_ms(intervals, start_ms, end_ms) / (end_ms - start_ms))


# ----- q3: the slow epoch made fast ---------------------------------------------------------------------

def fast_epoch_standardised_up_front(model, optimizer, images, labels, batch_size):
    """Unusual but right: every image standardised once before the loop, the losses stacked at the end."""
    x_all = images.float() / 255
    x_all = (x_all - x_all.mean(dim=(1, 2, 3), keepdim=True)) / (x_all.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
    losses, hits = [], []
    for start in range(0, len(images), batch_size):
        x, y = x_all[start:start + batch_size], labels[start:start + batch_size]
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        hits.append(logits.argmax(dim=1).eq(y))
    return torch.stack(losses).mean().item(), torch.cat(hits).float().mean().item()


def _batch_standardised(images, start, batch_size):
    x = images[start:start + batch_size].float() / 255
    return (x - x.mean(dim=(1, 2, 3), keepdim=True)) / (x.std(dim=(1, 2, 3), keepdim=True) + 1e-5)


def vectorised_but_item_each_step(model, optimizer, images, labels, batch_size):
    losses, correct = [], 0
    for start in range(0, len(images), batch_size):
        x, y = _batch_standardised(images, start, batch_size), labels[start:start + batch_size]
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        correct += int((logits.argmax(dim=1) == y).sum())
    return sum(losses) / len(losses), correct / len(images)


def accuracy_per_image_on_device(model, optimizer, images, labels, batch_size):
    """No reads back to Python, but the correct predictions still counted one image at a time."""
    total, correct, steps = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
    for start in range(0, len(images), batch_size):
        x, y = _batch_standardised(images, start, batch_size), labels[start:start + batch_size]
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.detach()
        for i in range(len(y)):
            correct += logits[i].argmax() == y[i]
        steps += 1
    return (total / steps).item(), correct.item() / len(images)


def standardised_per_batch(model, optimizer, images, labels, batch_size):
    """Fast, but one mean and std for the whole batch: it trains on other inputs."""
    total, correct, steps = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
    for start in range(0, len(images), batch_size):
        x, y = images[start:start + batch_size].float() / 255, labels[start:start + batch_size]
        x = (x - x.mean()) / (x.std() + 1e-5)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.detach()
        correct += (logits.argmax(dim=1) == y).sum()
        steps += 1
    return (total / steps).item(), correct.item() / len(images)


def accuracy_in_percent(model, optimizer, images, labels, batch_size):
    loss, accuracy = fast_epoch_standardised_up_front(model, optimizer, images, labels, batch_size)
    return loss, 100 * accuracy


def no_zero_grad(model, optimizer, images, labels, batch_size):
    total, correct, steps = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
    for start in range(0, len(images), batch_size):
        x, y = _batch_standardised(images, start, batch_size), labels[start:start + batch_size]
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        total += loss.detach()
        correct += (logits.argmax(dim=1) == y).sum()
        steps += 1
    return (total / steps).item(), correct.item() / len(images)


# ----- q4: what a schedule records ----------------------------------------------------------------------

def recorded_by_cycles(wait, warmup, active, repeat, total):
    """Unusual but right: the active steps of each cycle, cycle after cycle."""
    cycle = wait + warmup + active
    cycles = repeat or total // cycle + 1
    return [s for c in range(cycles) for s in range(c * cycle + wait + warmup, (c + 1) * cycle) if s < total]


def with_warmup(wait, warmup, active, repeat, total):
    cycle = wait + warmup + active
    return [s for s in range(total) if (repeat == 0 or s // cycle < repeat) and s % cycle >= wait]


def counted_from_one(wait, warmup, active, repeat, total):
    return [s + 1 for s in shown_solution(lesson06.q4, "recorded_steps")(wait, warmup, active, repeat, total)]


def ignores_repeat(wait, warmup, active, repeat, total):
    cycle = wait + warmup + active
    return [s for s in range(total) if s % cycle >= wait + warmup]


# ----- the checks ---------------------------------------------------------------------------------------

def right(question, name):
    return shown_solution(question, name, torch=torch, F=F)


@pytest.mark.parametrize("question, answer", [
    (lesson06.q1, lambda: right(lesson06.q1, "dominant_operator")),
    (lesson06.q1, lambda: dominant_by_dict),
    (lesson06.q2, lambda: right(lesson06.q2, "idle_fraction")),
    (lesson06.q2, lambda: idle_by_sweep),
], ids=["q1", "q1-dict", "q2", "q2-sweep"])
def test_right_answers_on_a_real_profile_pass(question, answer, profiled):
    table, path = profiled
    question.check(answer(), table if question is lesson06.q1 else path)
    assert question.last.status == "correct", question.last.message


@pytest.mark.parametrize("question, answer", [
    (lesson06.q3, lambda: right(lesson06.q3, "fast_epoch")),
    (lesson06.q3, lambda: fast_epoch_standardised_up_front),
    (lesson06.q4, lambda: right(lesson06.q4, "recorded_steps")),
    (lesson06.q4, lambda: recorded_by_cycles),
], ids=["q3", "q3-up-front", "q4", "q4-cycles"])
def test_right_answers_pass(question, answer, monkeypatch):
    monkeypatch.setattr(lesson06, "SPEEDUP", 0.5)  # q3's speed decision is tested with injected timings below
    question.check(answer())
    assert question.last.status == "correct", question.last.message


@pytest.mark.parametrize("wrong, says", [
    (largest_row, "sum its rows"),
    (by_cpu_time, "the most CPU time"),
    (by_total_time, "Total time includes"),
    (with_ranges, "record_function range"),
    (lambda table: 3, "dominant operator is"),
])
def test_q1_rejects_plausible_wrong_answers(wrong, says, profiled):
    lesson06.q1.check(wrong, profiled[0])
    assert lesson06.q1.last.status == "wrong"
    assert says in lesson06.q1.last.message


def test_q1_needs_a_table():
    lesson06.q1.check(right(lesson06.q1, "dominant_operator"), "trace.json")
    assert lesson06.q1.last.status == "wrong" and "op_table" in lesson06.q1.last.message


@pytest.mark.parametrize("wrong, says", [
    (summed_lengths, "Overlapping kernels count once"),
    (not_clipped, "Clip each interval"),
    (busy_instead, "busy fraction"),
    (as_percentage, "percentage"),
    (lambda intervals, start_ms, end_ms: "30%", "return a number"),
])
def test_q2_rejects_plausible_wrong_answers(wrong, says, profiled):
    lesson06.q2.check(wrong, profiled[1])
    assert lesson06.q2.last.status == "wrong"
    assert says in lesson06.q2.last.message


def test_q2_says_when_the_trace_is_missing(tmp_path):
    lesson06.q2.check(right(lesson06.q2, "idle_fraction"), tmp_path / "missing.json")
    assert lesson06.q2.last.status == "wrong" and "pass the trace you exported" in lesson06.q2.last.message


def mean_of_batch_accuracies(model, optimizer, images, labels, batch_size):
    total, accuracies, steps = torch.zeros(()), torch.zeros(()), 0
    for start in range(0, len(images), batch_size):
        x, y = _batch_standardised(images, start, batch_size), labels[start:start + batch_size]
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.detach()
        accuracies += (logits.argmax(dim=1) == y).float().mean()
        steps += 1
    return (total / steps).item(), (accuracies / steps).item()


def copies_what_the_check_computed(model, optimizer, images, labels, batch_size):
    """Returns the check's expected result if it can find one in a caller's frame, else does nothing."""
    import sys

    frame = sys._getframe(1)
    while frame:
        for value in frame.f_locals.values():
            if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, float) for v in value):
                return value
        frame = frame.f_back
    return 0.0, 0.0


@pytest.mark.parametrize("wrong, says", [
    (slow_epoch, "read values back to Python"),
    (accuracy_per_image_on_device, "a Python loop over images"),
    (vectorised_but_item_each_step, "read values back to Python"),
    (standardised_per_batch, "trains differently"),
    (no_zero_grad, "trains differently"),
    (accuracy_in_percent, "a percentage?"),
    (mean_of_batch_accuracies, "the mean of the batches' accuracies is not the accuracy"),
    (copies_what_the_check_computed, "trains differently"),
    (42, "pass your function itself"),
])
def test_q3_rejects_plausible_wrong_answers(wrong, says):
    lesson06.q3.check(wrong)
    assert lesson06.q3.last.status == "wrong"
    assert says in lesson06.q3.last.message


class ScriptedDuel:
    """Stands in for gpulab.questions.timed_check.Duel in q3's check: epochs that train right, the answer's seconds scripted."""

    def __init__(self, answer_seconds):
        self.answer_seconds, self.timed = list(answer_seconds), 0

    def __call__(self, task, source, name, **options):
        assert task == "gpulab.questions.lesson06:TASK" and name == "fast_epoch"
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def probe(self, side, name):
        return {"waits": 1, "reads": ["item"], "operations": [400, 400]}

    def pairs(self, seeds):
        report = {"result": [2.3, 0.1], "state": pack_state(torch.nn.Linear(2, 2))}
        pairs = []
        for _ in seeds:
            seconds = self.answer_seconds[self.timed - 1] if self.timed else 1.0  # the first pair warms up
            pairs.append((Trial("baseline", 0, 1.0, [], report), Trial("answer", 0, seconds, [], report)))
            self.timed += 1
        return pairs


def fast_epoch(model, optimizer, images, labels, batch_size):
    return 0.0, 0.0


@pytest.mark.parametrize("answer_seconds, status, pairs", [
    ([0.25] * 7, "correct", 7),  # 4x
    ([0.8] * 7, "wrong", 7),  # 1.25x: clearly below 2x
    ([0.4, 0.6, 0.45, 0.55, 0.48, 0.52, 0.62] + [0.45] * 7, "correct", 14),  # 1.6-2.5x: measured again, then 2.2x
])
def test_q3_judges_the_median_speed_up_and_measures_again_when_too_close(monkeypatch, answer_seconds, status, pairs):
    duel = ScriptedDuel(answer_seconds)
    monkeypatch.setattr(lesson06, "Duel", duel)
    monkeypatch.setattr(lesson06, "loaded_machine", lambda: None)
    lesson06.q3.check(fast_epoch)
    assert lesson06.q3.last.status == status, lesson06.q3.last.message
    assert f"median of {pairs} interleaved pairs" in lesson06.q3.last.message and duel.timed == pairs + 1


def test_q3_says_when_the_machine_was_loaded(monkeypatch):
    monkeypatch.setattr(lesson06, "Duel", ScriptedDuel([0.8] * 7))
    monkeypatch.setattr(lesson06, "loaded_machine", lambda: "the CPU was oversubscribed (load average 4.0 on 2 cores)")
    lesson06.q3.check(fast_epoch)
    assert lesson06.q3.last.status == "wrong" and "oversubscribed" in lesson06.q3.last.message


@pytest.mark.parametrize("wrong, says", [
    (with_warmup, "Warm-up steps"),
    (counted_from_one, "counted from 0"),
    (ignores_repeat, "After `repeat` cycles"),
    (lambda *args: 5, "return a list of step numbers"),
])
def test_q4_rejects_plausible_wrong_answers(wrong, says):
    lesson06.q4.check(wrong)
    assert lesson06.q4.last.status == "wrong"
    assert says in lesson06.q4.last.message


@pytest.mark.parametrize("question, blank", [
    (lesson06.q1, (blank_function, "table")),
    (lesson06.q1, (____, "table")),
    (lesson06.q2, (blank_function, "trace.json")),
    (lesson06.q3, (blank_function,)),
    (lesson06.q3, (____,)),
    (lesson06.q4, (blank_function,)),
])
def test_blank_answers_are_not_attempted(question, blank, profiled):
    table, path = profiled
    question.check(*[{"table": table, "trace.json": path}.get(a, a) if isinstance(a, str) else a for a in blank])
    assert question.last.status == "not attempted"
