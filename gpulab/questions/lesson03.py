"""Lesson 03, batching: the knee of a throughput curve, gradient accumulation, a budgeted batch search,
and the learning-rate scaling rule."""

import math
import weakref

import pandas as pd
import torch
import torch.nn.functional as F

from ..check import Question, Wrong, expect_close
from ..models import WideMLP

# ----- q1: the knee of a measured throughput curve -------------------------------------------------


def knee_by_gain(curve: pd.DataFrame, gain: float = 0.1) -> int:
    """The smallest batch size after which the next one gains less than ``gain`` in samples/s."""
    rows = curve.sort_values("batch_size")
    sizes, rates = rows["batch_size"].tolist(), rows["samples_per_s"].tolist()
    for i in range(len(sizes) - 1):
        if rates[i + 1] < (1 + gain) * rates[i]:
            return int(sizes[i])
    return int(sizes[-1])


def _curve(rates: dict) -> pd.DataFrame:
    return pd.DataFrame({"batch_size": list(rates), "samples_per_s": list(rates.values())})


_SATURATING = _curve({b: 1000 * b / (b + 32) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)})
_KNEE_CASES = [  # (curve, gain)
    (_SATURATING, 0.1),
    (_SATURATING.sample(frac=1, random_state=0), 0.1),  # rows in any order
    (_SATURATING[::-1], 0.1),  # largest batch first
    (_SATURATING, 0.5),
    (_curve({1: 100, 2: 180, 4: 185, 8: 300, 16: 310}), 0.1),  # a dip: the first flat step is the knee
    (_curve({1: 10, 2: 20, 4: 40, 8: 80}), 0.1),  # not saturated yet: the largest batch measured
    (_curve({1: 100, 2: 150, 4: 160}), 0.5),  # exactly the gain asked for is not "less than" it
    (_curve({8: 100}), 0.1),  # one batch size measured
]


def _check_knee(knee, curve) -> str:
    if not callable(knee):
        raise Wrong(f"pass your function itself, `q1.check(knee, curve)`, not {type(knee).__name__}")
    if not isinstance(curve, pd.DataFrame) or not {"batch_size", "samples_per_s"} <= set(curve.columns):
        raise Wrong("pass the measured curve as the second argument: a DataFrame with batch_size and samples_per_s")
    answers = [knee(case.copy(), gain=gain) for case, gain in _KNEE_CASES]
    for (case, gain), got in zip(_KNEE_CASES, answers):
        expected = knee_by_gain(case, gain)
        if got != expected:
            points = ", ".join(f"{b}: {r:.0f}" for b, r in sorted(zip(case.batch_size, case.samples_per_s)))
            raise Wrong(f"for the curve {{{points}}} (batch: samples/s) with gain={gain}, the knee is batch "
                        f"{expected}; your function returned {got}.{_knee_hint(answers)}")
    mine = knee(curve.copy())
    if mine != knee_by_gain(curve):
        raise Wrong(f"on your measured curve the knee is batch {knee_by_gain(curve)}, your function returned {mine}")
    return f"the knee of your measured curve is at batch {mine}."


def _in_given_order(curve: pd.DataFrame, gain: float) -> int:
    sizes, rates = curve["batch_size"].tolist(), curve["samples_per_s"].tolist()
    return next((sizes[i] for i in range(len(sizes) - 1) if rates[i + 1] < (1 + gain) * rates[i]), sizes[-1])


def _one_too_far(curve: pd.DataFrame, gain: float) -> int:
    sizes = sorted(curve["batch_size"])
    knee = knee_by_gain(curve, gain)
    return sizes[min(sizes.index(knee) + 1, len(sizes) - 1)]


def _ninety_percent(curve: pd.DataFrame, gain: float) -> int:
    return int(curve.loc[curve["samples_per_s"] >= 0.9 * curve["samples_per_s"].max(), "batch_size"].min())


def _peak(curve: pd.DataFrame, gain: float) -> int:
    return int(curve["batch_size"][curve["samples_per_s"].idxmax()])


def _fixed_gain(curve: pd.DataFrame, gain: float) -> int:
    return knee_by_gain(curve, 0.1)


def _at_most_gain(curve: pd.DataFrame, gain: float) -> int:
    rows = curve.sort_values("batch_size")
    sizes, rates = rows["batch_size"].tolist(), rows["samples_per_s"].tolist()
    return next((sizes[i] for i in range(len(sizes) - 1) if rates[i + 1] <= (1 + gain) * rates[i]), sizes[-1])


def _position(curve: pd.DataFrame, gain: float) -> int:
    return sorted(curve["batch_size"]).index(knee_by_gain(curve, gain))


_KNEE_MISTAKES = (  # what a wrong knee function may have done, recognised by its answers on every case
    (_in_given_order, " Some curves come with their rows in any order: sort them by batch size first."),
    (_one_too_far, " That is the batch after the knee: return the batch *before* the step that gains too little."),
    (_ninety_percent, " That is the lesson's knee (the first batch reaching 90% of the best throughput); this question "
                      "asks for the first batch after which the *next* one gains less than `gain`."),
    (_peak, " That is where throughput peaks, not where it stops growing."),
    (_fixed_gain, " Use the `gain` you are given, not a fixed 10%."),
    (_at_most_gain, " A step that gains exactly `gain` is not flat yet: the next batch must gain *less* than `gain`."),
    (_position, " That is the knee's position in the sorted curve: return its batch size."),
)


def _knee_hint(answers: list) -> str:
    for mistake, hint in _KNEE_MISTAKES:
        if all(got == mistake(case, gain) for (case, gain), got in zip(_KNEE_CASES, answers)):
            return hint
    return ""


# ----- q2: gradient accumulation that matches one large batch ---------------------------------------


def _check_accumulation(accumulate_gradients) -> str:
    if not callable(accumulate_gradients):
        raise Wrong("pass your function itself: `q2.check(accumulate_gradients)`")
    for batch, micro in ((12, 4), (10, 4), (9, 4)):
        _check_one_accumulation(accumulate_gradients, batch, micro)
    return "your accumulated gradients equal the large batch's, with equal and with unequal micro-batches."


def _accumulation_inputs(batch: int):
    """A model (float64) and a batch of ``batch`` samples, the same every call."""
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 20, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return WideMLP(in_features=20, width=32, depth=2, seed=3).double(), x, y


class _MicroBatches:
    """What a model ran on: the size of each forward pass, and whether one began before the last one's backward."""

    def __init__(self, model: torch.nn.Module):
        self.sizes, self.pending, self.overlapped = [], 0, False
        self.handle = model.register_forward_hook(self._forward)

    def _forward(self, module, args, output) -> None:
        self.overlapped = self.overlapped or self.pending > 0
        self.sizes.append(args[0].shape[0])
        if output.requires_grad:
            self.pending += 1
            output.register_hook(self._backward)

    def _backward(self, grad) -> None:
        self.pending -= 1


def _check_one_accumulation(accumulate_gradients, batch: int, micro: int) -> None:
    model, x, y = _accumulation_inputs(batch)
    seen = _MicroBatches(model)
    try:
        accumulate_gradients(model, x, y, micro)
    finally:
        seen.handle.remove()
    counts = [len(part) for part in torch.arange(batch).split(micro)]
    if sorted(seen.sizes, reverse=True) != counts:
        chunked = sorted(seen.sizes, reverse=True) == [len(p) for p in torch.arange(batch).chunk(len(seen.sizes))]
        raise Wrong(f"a batch of {batch} in micro-batches of at most {micro} should run the model on {counts} "
                    f"samples, but it ran on {seen.sizes}" + (": `x.chunk(k)` cuts k equal pieces, "
                    "`x.split(micro_batch)` pieces of micro_batch samples" if chunked and len(seen.sizes) > 1 else ""))
    if seen.overlapped:
        raise Wrong("a micro-batch's forward pass ran before the previous one's backward(): all their activations were "
                    "alive at once, which is what accumulation avoids. Call backward() inside the loop, once per "
                    "micro-batch")
    reference, _, _ = _accumulation_inputs(batch)  # the same weights, to compare with; made only now
    if any(not torch.equal(w, p) for w, p in zip(reference.parameters(), model.parameters())):
        raise Wrong("the weights changed: only accumulate the gradients, leave optimizer.step() to the caller")
    grads = [p.grad for p in model.parameters()]
    if any(g is None for g in grads):
        raise Wrong("some parameters have no gradient: call loss.backward() for every micro-batch")
    F.cross_entropy(reference(x), y).backward()
    _judge_accumulated(grads, [p.grad for p in reference.parameters()], counts)


def _judge_accumulated(grads, expected, counts: list) -> None:
    batch, k = sum(counts), len(counts)
    if all(torch.allclose(g, e) for g, e in zip(grads, expected)):
        return
    for factor, why in ((k, f"{k}× too large: each micro-batch's mean loss must be scaled down before backward(), "
                            "since backward() adds gradients up"),
                        (batch, f"{batch}× too large: a summed loss (`reduction='sum'`) must be divided by len(x)")):
        if all(torch.allclose(g, factor * e) for g, e in zip(grads, expected)):
            raise Wrong(f"your gradients are {why}")
    if len(set(counts)) > 1:
        raise Wrong(f"with micro-batches of {counts} samples the gradients differ from the large batch's: weight each "
                    "micro-batch's mean loss by its share of the batch (len(xb) / len(x)); dividing by the number "
                    "of micro-batches is only right when they are all the same size")
    raise Wrong("the accumulated gradients differ from the large batch's: backward() every micro-batch without "
                "clearing .grad in between, each loss scaled by the micro-batch's share of the batch")


# ----- q3: a batch search that respects a memory budget ---------------------------------------------


# (what, a fresh peak_bytes(b), budget, max_batch): the answers are worked out only after the learner's search.
_SEARCH_CASES = [
    ("1 kB + 300 B per sample", lambda: (lambda b: 1000 + 300 * b), 100_000, 4096),
    ("1 kB + 300 B per sample, max_batch=200", lambda: (lambda b: 1000 + 300 * b), 100_000, 200),
    ("a card that runs out of memory above batch 77", lambda: _Card(77), 10**12, 4096),
    ("a model that needs more than the budget even at batch 1", lambda: (lambda b: 10_000 + b), 5_000, 1024),
    ("max_batch=1", lambda: (lambda b: b), 100, 1),
]


def _check_search(largest_batch) -> str:
    if not callable(largest_batch):
        raise Wrong("pass your function itself: `q3.check(largest_batch)`")
    for what, make_peak, budget, max_batch in _SEARCH_CASES:
        got, calls = _run_search(largest_batch, what, make_peak(), budget, max_batch)
        _judge_search(what, make_peak, budget, max_batch, got, calls)
    _check_bug_surfaces(largest_batch)
    return ("your search finds the exact largest batch within the budget, stops at max_batch, survives OOM, lets "
            "the failed step's memory go, and lets a bug surface.")


def _run_search(largest_batch, what: str, peak, budget: int, max_batch: int):
    """``largest_batch`` on ``peak``: (its answer, the batch sizes it tried); Wrong when an error escapes it."""
    calls = []

    def peak_bytes(batch_size):
        calls.append(batch_size)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= max_batch:
            raise ValueError(f"batch sizes are whole numbers from 1 to max_batch={max_batch}")
        if isinstance(peak, _Card) and peak.held():
            raise _StillHeld
        return peak(batch_size)

    try:
        return largest_batch(peak_bytes, budget, max_batch), calls
    except torch.OutOfMemoryError:
        raise Wrong(f"({what}) your search let torch.OutOfMemoryError escape: catch it, a batch that does not "
                    "fit on the card counts as a failure") from None
    except _StillHeld:
        raise Wrong(f"({what}) a trial started while the tensors of a failed one were still alive: something kept "
                    "the out-of-memory error, whose traceback holds the failed step's tensors. Catch it and let "
                    "it go (no `errors.append(err)`, no `last_error = err`)") from None
    except ValueError:
        if not _bad_calls(calls, max_batch):
            raise
        return None, calls


def _fits(peak, budget: int, batch: int) -> bool:
    try:
        return peak(batch) <= budget
    except torch.OutOfMemoryError:
        return False


def _largest_fit(make_peak, budget: int, max_batch: int) -> int:
    """The answer: the largest batch from 1 to max_batch that fits, or 0 (memory grows with the batch)."""
    lo, hi = 0, max_batch + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(make_peak(), budget, mid) else (lo, mid)
    return lo


def _judge_search(what: str, make_peak, budget: int, max_batch: int, got, calls: list) -> None:
    bad = _bad_calls(calls, max_batch)
    if bad:
        raise Wrong(f"({what}) peak_bytes was called with {bad[0]!r}: batch sizes are whole numbers "
                    f"from 1 to max_batch={max_batch}")
    answer = _largest_fit(make_peak, budget, max_batch)
    if got != answer:
        if got is None and answer == 0:
            why = ": return 0, not None, when not even batch 1 fits"
        elif isinstance(got, int) and 1 <= got <= max_batch and not _fits(make_peak(), budget, got):
            why = f": batch {got} does not fit (return the last batch that fitted, not the first that failed)"
        elif isinstance(got, int) and got > 1 and got & (got - 1) == 0:
            why = " (a power of two: after the first failure, bisect between the last fit and it)"
        else:
            why = ""
        raise Wrong(f"({what}, budget {budget:,} B) the largest batch that fits is {answer}, your search "
                    f"returned {got!r}{why}; it tried {calls}")
    limit = 2 * math.ceil(math.log2(max_batch)) + 2
    if len(calls) > limit:
        raise Wrong(f"({what}) your search needed {len(calls)} measurements; doubling then bisecting needs at "
                    f"most {limit} for max_batch={max_batch}")


class _ModelBug(RuntimeError):
    """A step that fails for a reason other than memory (a shape error from batch 64 on)."""


class _StillHeld(Exception):
    """Raised by the check's peak_bytes when a failed trial's tensors are still alive."""


def _check_bug_surfaces(largest_batch) -> None:
    bug = _ModelBug("mat1 and mat2 shapes cannot be multiplied (64x3072 and 100x64)")

    def peak_bytes(batch_size):
        if batch_size >= 64:
            raise bug
        return 1000 + 300 * batch_size

    try:
        got = largest_batch(peak_bytes, 100_000, 4096)
    except RuntimeError as err:
        if err is bug or bug in (err.__cause__, err.__context__):
            return
        raise
    raise Wrong(f"(a step with a bug from batch 64 on: RuntimeError: {bug}) your search returned {got!r} instead of "
                "letting the error through. Catch only `torch.OutOfMemoryError`: `except RuntimeError` or `except "
                "Exception` turns a broken model into a \"batch too large\"")


def _bad_calls(calls: list, max_batch: int) -> list:
    return [b for b in calls if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= max_batch]


class _Card:
    """An emulated card that runs out of memory above ``largest``; a failed step holds a tensor until it is freed."""

    def __init__(self, largest: int):
        self.largest = largest
        self.failed: list[weakref.ref] = []

    def __call__(self, batch_size: int) -> int:
        if batch_size > self.largest:
            activations = torch.empty(1000 * batch_size, dtype=torch.uint8)  # alive in the error's traceback
            self.failed.append(weakref.ref(activations))
            raise torch.OutOfMemoryError(f"emulated card: batch {batch_size} does not fit ({activations.nbytes} B)")
        return 1000 * batch_size

    def held(self) -> bool:
        return any(ref() is not None for ref in self.failed)


# ----- q4: the learning-rate scaling rule with accumulation -----------------------------------------


def _check_lr(lr) -> str:
    value = float(lr) if hasattr(lr, "__float__") and not isinstance(lr, bool) else None
    known = {  # plausible wrong answers, and what each one did
        0.05: "that is the micro-batch's learning rate: with 8 accumulated micro-batches per optimizer step the "
              "effective batch is 8 × 64 = 512, so the rule scales the learning rate by 8",
        0.05 / 8: "the learning rate goes up with the effective batch, not down: 8 micro-batches of 64 make a batch "
                  "of 512, 8× larger",
        0.05 * 8**0.5: "that is the square-root rule (a starting point for Adam); the linear scaling rule for SGD "
                       "multiplies by the factor itself, 8",
        0.05 * 64: "the factor is how much the batch grew (512 / 64 = 8), not the micro-batch size",
        0.05 * 512: "the factor is how much the batch grew (512 / 64 = 8), not the effective batch size",
    }
    for wrong, why in known.items():
        if value is not None and math.isclose(value, wrong, rel_tol=0.01):
            raise Wrong(why)
    return expect_close(lr, 0.05 * 8, rel=0.01, what="the learning rate")


q1 = Question(
    lesson="03", number=1, title="find the knee",
    checker=_check_knee,
    hint_text="Sort the rows by `batch_size`, then walk through neighbours: the first row whose next "
              "`samples_per_s` is below `(1 + gain)` times its own is the knee. No such row: the last batch size.",
    solution_text="""
def knee(curve, gain=0.1):
    rows = curve.sort_values("batch_size")
    sizes, rates = rows["batch_size"].tolist(), rows["samples_per_s"].tolist()
    for i in range(len(sizes) - 1):
        if rates[i + 1] < (1 + gain) * rates[i]:
            return sizes[i]
    return sizes[-1]
""",
)

q2 = Question(
    lesson="03", number=2, title="accumulate like a large batch",
    checker=_check_accumulation,
    hint_text="`x.split(micro_batch)` gives micro-batches of at most `micro_batch` samples. `F.cross_entropy` "
              "returns the mean over a micro-batch; multiply it by `len(xb) / len(x)` before `backward()`, and "
              "never clear `.grad` inside the loop.",
    solution_text="""
def accumulate_gradients(model, x, y, micro_batch):
    for xb, yb in zip(x.split(micro_batch), y.split(micro_batch)):
        loss = F.cross_entropy(model(xb), yb) * (len(xb) / len(x))
        loss.backward()
""",
)

q3 = Question(
    lesson="03", number=3, title="a search within a budget",
    checker=_check_search,
    hint_text="Write `fits(b)`: `peak_bytes(b) <= budget`, and False when it raises `torch.OutOfMemoryError`. "
              "Double b from 1 (never past `max_batch`) until it does not fit, keeping the last fit `lo` and the "
              "first failure `hi`; then bisect: `mid = (lo + hi) // 2` until `hi - lo == 1`.",
    solution_text="""
def largest_batch(peak_bytes, budget, max_batch):
    def fits(b):
        try:
            return peak_bytes(b) <= budget
        except torch.OutOfMemoryError:
            return False

    lo, hi, b = 0, None, 1
    while hi is None:              # grow: 1, 2, 4, ... (never past max_batch)
        if not fits(b):
            hi = b
        elif b == max_batch:
            return b
        else:
            lo, b = b, min(2 * b, max_batch)
    while hi - lo > 1:             # bisect between the last fit and the first failure
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
""",
)

q4 = Question(
    lesson="03", number=4, title="the learning rate of an accumulated batch",
    checker=_check_lr,
    hint_text="The linear scaling rule multiplies the learning rate by the factor the *effective* batch grew by. "
              "What is the effective batch of 8 accumulated micro-batches of 64?",
    solution_text="lr = 0.05 * (8 * 64) / 64   # 0.4: the effective batch is 512, eight times 64",
)
