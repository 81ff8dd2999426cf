"""Lesson 03: the shared models, the OOM-safe batch finder (on the CPU, with a memory budget),
gradient accumulation, and the lesson's exercise checks."""

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from gpulab import batch_finder, models
from gpulab.batch_finder import FITS, OUT_OF_MEMORY, OVER_BUDGET, MemoryTracker, find_max_batch
from gpulab.check import ____
from gpulab.questions import lesson03

from .conftest import shown_solution
from .test_lesson00 import stack_walker

KB = 1024


def bytes_step(per_sample: int, fixed: int = 0):
    """A step whose tensors take exactly ``fixed + per_sample * batch`` bytes at their peak."""
    def step(batch_size):
        a = torch.ones(fixed, dtype=torch.uint8) if fixed else None
        b = torch.ones(per_sample * batch_size, dtype=torch.uint8)
        return a, b
    return step


# ----- models ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda s: models.SmallCNN(width=8, seed=s), lambda s: models.WideMLP(width=64, seed=s)])
def test_models_are_seeded_and_leave_the_global_stream_alone(make):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = make(0), make(0), make(1)
    assert torch.equal(torch.rand(1), expected_next)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert a(torch.randn(2, 3, 32, 32)).shape == (2, 10)


# ----- the memory tracker ---------------------------------------------------------------------------

def test_tracker_counts_new_tensors_not_views_and_frees():
    base = torch.ones(1000)
    with MemoryTracker() as tracker:
        view = base[:10].t()  # a view: no new memory
        new = torch.ones(256, dtype=torch.uint8)
        assert tracker.current == 256
        new.add_(1)  # in place: no new memory
        assert tracker.current == 256
    del new, view
    assert tracker.current == 0 and tracker.peak == 256


def test_tracker_counts_every_tensor_of_a_list_result():
    tensors = [torch.ones(100, dtype=torch.uint8) for _ in range(3)]
    with MemoryTracker() as tracker:
        sums = torch._foreach_add(tensors, 1)  # one result: a list of three new tensors
        halves = torch.ones(10, dtype=torch.uint8).split(5)  # the ones are new, the halves are views
    assert tracker.current == 300 + 10
    del sums, halves
    assert tracker.current == 0


def test_tracker_counts_a_training_step():
    model = models.WideMLP(in_features=16, width=64, depth=1)
    with MemoryTracker() as tracker:
        F.cross_entropy(model(torch.randn(32, 16)), torch.randint(0, 10, (32,))).backward()
    grads = sum(p.numel() * 4 for p in model.parameters())
    assert tracker.current == grads  # the gradients stay; the activations are gone
    assert tracker.peak > grads + 32 * 64 * 4


def test_tracker_budget_raises_out_of_memory():
    with pytest.raises(torch.OutOfMemoryError), MemoryTracker(budget=1000) as tracker:
        torch.ones(2000, dtype=torch.uint8)
    assert tracker.current == 0


# ----- the finder: results --------------------------------------------------------------------------

def test_finder_finds_the_exact_largest_batch_within_a_budget():
    result = find_max_batch(bytes_step(per_sample=KB, fixed=4 * KB), budget_bytes=100 * KB)
    assert result.batch_size == 96  # 4 kB + 96 × 1 kB = 100 kB
    assert result.trials[-1].batch_size in (96, 97)
    assert [t.batch_size for t in result.trials[:8]] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert all(t.fits == (t.batch_size <= 96) for t in result.trials)
    assert len(result.trials) <= 2 * math.ceil(math.log2(128)) + 1
    assert result.allocated_before == result.allocated_after == 0


def test_finder_granularity_and_table():
    result = find_max_batch(bytes_step(per_sample=KB), budget_bytes=100 * KB, granularity=8)
    assert result.batch_size == 96 and "within 8" in result.stopped
    table = result.table()
    assert list(table.columns) == ["batch_size", "outcome", "peak_MiB", "seconds"] and len(table) == len(result.trials)
    assert set(table.outcome) == {FITS, OVER_BUDGET}
    assert "largest batch that fits on cpu" in str(result) and "nothing left behind" in str(result)


def test_finder_on_a_real_training_step_respects_the_budget():
    def step(batch_size):
        model = models.SmallCNN(width=4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    budget = 8 * 2**20
    result = find_max_batch(step, budget_bytes=budget, granularity=4)
    fits = [t for t in result.trials if t.fits]
    fails = [t for t in result.trials if not t.fits]
    assert result.batch_size == max(t.batch_size for t in fits)
    assert min(t.batch_size for t in fails) - result.batch_size <= 4
    assert all(t.peak_bytes <= budget for t in fits) and all(t.outcome == OVER_BUDGET for t in fails)
    # a failed trial got as far as the budget let it: the allocation that would pass it was refused, not counted
    assert all(0 < t.peak_bytes <= budget for t in fails)
    assert result.allocated_after == result.allocated_before == 0


def test_finder_never_loops_forever():
    result = find_max_batch(lambda b: None, max_batch=1000)
    assert result.batch_size == 1000 and "max_batch=1000" in result.stopped
    assert [t.batch_size for t in result.trials][-2:] == [512, 1000]
    capped = find_max_batch(bytes_step(per_sample=KB), budget_bytes=100 * KB, max_trials=5)
    assert len(capped.trials) == 5 and capped.batch_size == 16 and "max_trials" in capped.stopped


def test_finder_when_nothing_fits():
    result = find_max_batch(bytes_step(per_sample=KB, fixed=200 * KB), budget_bytes=100 * KB)
    assert result.batch_size is None and "not even batch 1" in result.stopped and len(result.trials) == 1
    below_start = find_max_batch(bytes_step(per_sample=KB), start=256, budget_bytes=100 * KB)
    assert below_start.batch_size == 100  # searches below a start that does not fit


# ----- the finder: recovery after out-of-memory -----------------------------------------------------

def test_finder_frees_what_a_failed_step_held():
    """A real OOM (raised by the step while it holds tensors) and an emulated one (the budget)."""
    def step(batch_size):
        held = [torch.ones(KB * batch_size, dtype=torch.uint8) for _ in range(3)]  # alive in the traceback
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
        return held

    result = find_max_batch(step, budget_bytes=10**9)
    assert result.batch_size == 20
    assert {t.outcome for t in result.trials if not t.fits} == {OUT_OF_MEMORY}
    assert result.allocated_after == result.allocated_before == 0


def test_finder_frees_reference_cycles():
    def step(batch_size):
        cycle = {"tensor": torch.ones(KB * batch_size, dtype=torch.uint8)}
        cycle["self"] = cycle  # freed only by the garbage collector

    result = find_max_batch(step, budget_bytes=3 * KB)
    assert result.batch_size == 3 and result.allocated_after == 0


def test_finder_reports_memory_a_step_keeps():
    kept = []
    result = find_max_batch(lambda b: kept.append(torch.ones(KB, dtype=torch.uint8)), max_batch=4)
    assert result.allocated_after - result.allocated_before == len(kept) * KB
    assert "left behind" in str(result)


@pytest.mark.parametrize("message", ["CUDA out of memory. Tried to allocate 2.00 GiB",
                                     "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_MEMORY",
                                     "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"])
def test_memory_errors_that_are_plain_runtime_errors_count_as_out_of_memory(message):
    def step(batch_size):
        if batch_size > 8:
            raise RuntimeError(message)

    assert find_max_batch(step).batch_size == 8


# ----- the finder: bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("error", [ValueError("mat1 and mat2 shapes cannot be multiplied"),
                                   RuntimeError("Expected all tensors to be on the same device"),
                                   KeyError("labels")])
def test_finder_reraises_other_errors_unchanged(error):
    def step(batch_size):
        if batch_size >= 4:
            raise error

    with pytest.raises(type(error)) as info:
        find_max_batch(step, budget_bytes=10**6)
    assert info.value is error


def test_finder_reraises_a_broken_model_unchanged():
    model = models.WideMLP(in_features=100, width=8, depth=1)  # expects 100 features, gets 3×32×32
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        find_max_batch(lambda b: model(torch.randn(b, 3, 32, 32)), budget_bytes=10**6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(start=0), "start must be a whole number >= 1"),
    (dict(start=2.5), "start must be a whole number"),
    (dict(max_batch=0), "max_batch must be"),
    (dict(start=64, max_batch=32), "below start"),
    (dict(granularity=0), "granularity"),
    (dict(max_trials=0), "max_trials"),
    (dict(budget_bytes=0), "budget_bytes must be a positive number"),
    (dict(budget_bytes=-5), "budget_bytes must be a positive number"),
    (dict(budget_bytes=float("nan")), "budget_bytes must be a positive number"),
    (dict(budget_bytes="1GB"), "budget_bytes must be a positive number"),
])
def test_finder_rejects_bounds_and_budgets_that_make_no_sense(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_max_batch(lambda b: None, **kwargs)


def test_finder_needs_a_function():
    with pytest.raises(TypeError, match="function of the batch size"):
        find_max_batch(128)


@pytest.mark.gpu
def test_finder_on_a_real_gpu_returns_memory_to_where_it_started():
    def step(batch_size):
        torch.ones(batch_size * 2**28, dtype=torch.uint8, device="cuda")  # 256 MiB a sample: a real OOM soon

    result = find_max_batch(step, max_batch=2**12, device="cuda")
    assert result.batch_size is not None and result.batch_size < 2**12
    assert any(t.outcome == OUT_OF_MEMORY for t in result.trials)
    assert result.allocated_after == result.allocated_before
    with pytest.raises(ValueError, match="more than this GPU has"):
        find_max_batch(step, budget_bytes=10**15, device="cuda")


# ----- gradient accumulation (the notebook's recipe) ------------------------------------------------

def accumulated_gradients(model, x, y, k, scale=True):
    """The recipe the lesson teaches: k micro-batches, each loss divided by k, one backward each."""
    model.zero_grad(set_to_none=True)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss = F.cross_entropy(model(xb), yb)
        (loss / k if scale else loss).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_accumulation_equals_the_large_batch(k):
    model = models.WideMLP(in_features=48, width=64, depth=2).double()
    x, y = torch.randn(64, 48, dtype=torch.float64), torch.randint(0, 10, (64,))
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    large = [p.grad.clone() for p in model.parameters()]
    accumulated = accumulated_gradients(model, x, y, k)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(accumulated, large))
    unscaled = accumulated_gradients(model, x, y, k, scale=False)  # the bug: k times too large
    assert all(torch.allclose(u, k * b) for u, b in zip(unscaled, large))
    assert not all(torch.allclose(u, b) for u, b in zip(unscaled, large))


def test_accumulation_is_not_exact_with_batchnorm():
    model = models.SmallCNN(width=4)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    large = torch.cat([p.grad.flatten() for p in model.parameters()])
    accumulated = torch.cat([g.flatten() for g in accumulated_gradients(model, x, y, 4)])
    assert (accumulated - large).abs().max() > 1e-3 * large.abs().max()  # far beyond float32 rounding


# ----- the exercise checks --------------------------------------------------------------------------

def curve():
    return pd.DataFrame({"batch_size": [1, 2, 4, 8, 16], "samples_per_s": [10.0, 19.0, 30.0, 31.0, 33.0]})


def right_knee(curve, gain=0.1):
    rows = curve.sort_values("batch_size")
    sizes, rates = rows["batch_size"].tolist(), rows["samples_per_s"].tolist()
    for i in range(len(sizes) - 1):
        if rates[i + 1] < (1 + gain) * rates[i]:
            return sizes[i]
    return sizes[-1]


right_accumulation = shown_solution(lesson03.q2, "accumulate_gradients", F=F)


right_search = shown_solution(lesson03.q3, "largest_batch", torch=torch)


def naive_search(peak_bytes, budget, max_batch):
    b = 1
    while b <= max_batch:
        try:
            if peak_bytes(b) > budget:
                break
        except torch.OutOfMemoryError:
            break
        b *= 2
    return b // 2


def linear_search(peak_bytes, budget, max_batch):
    b = 0
    while b < max_batch and peak_bytes(b + 1) <= budget:
        b += 1
    return b


def strictly_below(peak_bytes, budget, max_batch):
    return right_search(peak_bytes, budget - 1, max_batch)  # a step that needs exactly the budget fits


def unguarded_search(peak_bytes, budget, max_batch):
    return right_search(lambda b: peak_bytes(b), budget, max_batch * 2)


def divide_by_k(model, x, y, micro_batch):
    chunks = list(zip(x.split(micro_batch), y.split(micro_batch)))
    for xb, yb in chunks:
        (F.cross_entropy(model(xb), yb) / len(chunks)).backward()


def unscaled(model, x, y, micro_batch):
    for xb, yb in zip(x.split(micro_batch), y.split(micro_batch)):
        F.cross_entropy(model(xb), yb).backward()


def zero_inside(model, x, y, micro_batch):
    for xb, yb in zip(x.split(micro_batch), y.split(micro_batch)):
        model.zero_grad()
        (F.cross_entropy(model(xb), yb) * (len(xb) / len(x))).backward()


def full_batch(model, x, y, micro_batch):
    F.cross_entropy(model(x), y).backward()


def stepping(model, x, y, micro_batch):
    right_accumulation(model, x, y, micro_batch)
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def except_exception(peak_bytes, budget, max_batch):
    """The search, but catching every error: a broken model looks like "batch too large"."""
    def guarded(b):
        try:
            return peak_bytes(b)
        except Exception:
            return budget + 1
    return right_search(guarded, budget, max_batch)


def except_runtime_error(peak_bytes, budget, max_batch):
    def guarded(b):
        try:
            return peak_bytes(b)
        except RuntimeError:  # torch.OutOfMemoryError is one, but so is a shape error
            return budget + 1
    return right_search(guarded, budget, max_batch)


def keeps_the_errors(peak_bytes, budget, max_batch):
    """Remembers every failure to report it later: each error's traceback holds the failed step's tensors."""
    errors = []

    def fits(b):
        try:
            return peak_bytes(b) <= budget
        except torch.OutOfMemoryError as err:
            errors.append(err)
            return False

    lo, hi, b = 0, None, 1
    while hi is None:
        if not fits(b):
            hi = b
        elif b == max_batch:
            return b
        else:
            lo, b = b, min(2 * b, max_batch)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def bisect_module_search(peak_bytes, budget, max_batch):
    """Unusual but right: grow by doubling, then let the standard library bisect (with a memo of the trials)."""
    import bisect

    seen = {}

    def fails(b):
        if b not in seen:
            try:
                seen[b] = peak_bytes(b) > budget
            except torch.OutOfMemoryError:
                seen[b] = True
        return seen[b]

    b = 1
    while not fails(b):
        if b == max_batch:
            return b
        b = min(2 * b, max_batch)
    low = b // 2 if b > 1 else 0  # the last batch that fitted (0: none)
    return low + bisect.bisect_left(range(low + 1, b + 1), True, key=fails)


def knee_of_the_lesson(curve, gain=0.1):
    """The lesson's definition (90% of the best), not the one the question asks for."""
    best = curve["samples_per_s"].max()
    return int(curve.loc[curve["samples_per_s"] >= 0.9 * best, "batch_size"].min())


def knee_unsorted(curve, gain=0.1):
    sizes, rates = curve["batch_size"].tolist(), curve["samples_per_s"].tolist()
    for i in range(len(sizes) - 1):
        if rates[i + 1] < (1 + gain) * rates[i]:
            return sizes[i]
    return sizes[-1]


def knee_one_too_far(curve, gain=0.1):
    rows = curve.sort_values("batch_size")
    sizes, rates = rows["batch_size"].tolist(), rows["samples_per_s"].tolist()
    for i in range(len(sizes) - 1):
        if rates[i + 1] < (1 + gain) * rates[i]:
            return sizes[i + 1]
    return sizes[-1]


def knee_with_pandas(curve, gain=0.1):
    """Unusual but right: vectorised, returning a numpy integer."""
    rows = curve.sort_values("batch_size").reset_index(drop=True)
    flat = rows["samples_per_s"].shift(-1) < (1 + gain) * rows["samples_per_s"]
    return rows["batch_size"][flat].iloc[0] if flat.any() else rows["batch_size"].iloc[-1]


def accumulate_with_sums(model, x, y, micro_batch):
    """Unusual but right: sum the losses of each micro-batch, divide by the whole batch."""
    for xb, yb in zip(x.split(micro_batch), y.split(micro_batch)):
        (F.cross_entropy(model(xb), yb, reduction="sum") / len(x)).backward()


def knee_fixed_gain(curve, gain=0.1):
    return right_knee(curve)  # the gain argument ignored


def knee_at_most_gain(curve, gain=0.1):
    rows = curve.sort_values("batch_size")
    sizes, rates = rows["batch_size"].tolist(), rows["samples_per_s"].tolist()
    return next((sizes[i] for i in range(len(sizes) - 1) if rates[i + 1] <= (1 + gain) * rates[i]), sizes[-1])


def knee_position(curve, gain=0.1):
    return sorted(curve["batch_size"]).index(right_knee(curve, gain))


def accumulate_with_chunk(model, x, y, micro_batch):
    """Plausible but wrong: as many chunks as micro-batches, but chunk() cuts equal pieces, not micro_batch samples."""
    k = -(-len(x) // micro_batch)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (F.cross_entropy(model(xb), yb) * (len(xb) / len(x))).backward()


def accumulate_summed_losses(model, x, y, micro_batch):
    """Plausible but wrong: sums the losses and calls backward() once, so every micro-batch's graph is alive."""
    total = sum(F.cross_entropy(model(xb), yb) * (len(xb) / len(x)) for xb, yb in zip(x.split(micro_batch),
                                                                                        y.split(micro_batch)))
    total.backward()


def accumulate_summed_reduction(model, x, y, micro_batch):
    for xb, yb in zip(x.split(micro_batch), y.split(micro_batch)):
        F.cross_entropy(model(xb), yb, reduction="sum").backward()


def accumulate_by_index(model, x, y, micro_batch):
    """Unusual but right: slices by hand, zero_grad first, a retained graph that is never needed."""
    model.zero_grad(set_to_none=True)
    for start in range(0, len(x), micro_batch):
        xb, yb = x[start:start + micro_batch], y[start:start + micro_batch]
        (F.cross_entropy(model(xb), yb) * xb.shape[0] / x.shape[0]).backward(retain_graph=True)


def search_returns_the_failure(peak_bytes, budget, max_batch):
    """Plausible but wrong: bisects right, then returns the first batch that failed."""
    lo, hi = 0, None

    def fits(b):
        try:
            return peak_bytes(b) <= budget
        except torch.OutOfMemoryError:
            return False

    b = 1
    while hi is None:
        if not fits(b):
            hi = b
        elif b == max_batch:
            return b
        else:
            lo, b = b, min(2 * b, max_batch)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return hi


def search_none_when_nothing_fits(peak_bytes, budget, max_batch):
    return right_search(peak_bytes, budget, max_batch) or None


def plain_bisection(peak_bytes, budget, max_batch):
    """Unusual but right: bisect over 1..max_batch at once, without doubling first."""
    lo, hi = 0, max_batch + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            fits = peak_bytes(mid) <= budget
        except torch.OutOfMemoryError:
            fits = False
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo


def blank_function(*args, **kwargs):
    raise NotImplementedError


@pytest.mark.parametrize("question, right", [
    (lesson03.q1, (right_knee, curve())),
    (lesson03.q1, (knee_with_pandas, curve())),
    (lesson03.q2, (right_accumulation,)),
    (lesson03.q2, (accumulate_with_sums,)),
    (lesson03.q3, (right_search,)),
    (lesson03.q2, (accumulate_by_index,)),
    (lesson03.q3, (bisect_module_search,)),
    (lesson03.q3, (plain_bisection,)),
    (lesson03.q4, (0.4,)),
    (lesson03.q4, (torch.tensor(0.05) * 8,)),
    (lesson03.q4, (0.05 * 512 / 64,)),
])
def test_right_answers_pass(question, right):
    question.check(*right)
    assert question.last.status == "correct", question.last.message


@pytest.mark.parametrize("question, wrong, says", [
    (lesson03.q1, (lambda c, gain=0.1: int(c.batch_size[c.samples_per_s.idxmax()]), curve()), "peaks"),
    (lesson03.q1, (lambda c, gain=0.1: right_knee(c, gain) * 2, curve()), "the knee is batch"),
    (lesson03.q1, (right_knee, "not a frame"), "DataFrame"),
    (lesson03.q1, (knee_of_the_lesson, curve()), "the lesson's knee"),
    (lesson03.q1, (knee_unsorted, curve()), "sort them by batch size"),
    (lesson03.q1, (knee_one_too_far, curve()), "the batch after the knee"),
    (lesson03.q1, (knee_fixed_gain, curve()), "Use the `gain` you are given"),
    (lesson03.q1, (knee_at_most_gain, curve()), "must gain *less* than `gain`"),
    (lesson03.q1, (knee_position, curve()), "return its batch size"),
    (lesson03.q2, (divide_by_k,), "share of the batch"),
    (lesson03.q2, (unscaled,), "too large"),
    (lesson03.q2, (zero_inside,), "without clearing"),
    (lesson03.q2, (full_batch,), "micro-batches of at most"),
    (lesson03.q2, (stepping,), "weights changed"),
    (lesson03.q2, (accumulate_with_chunk,), "`x.chunk(k)` cuts k equal pieces"),
    (lesson03.q2, (accumulate_summed_losses,), "Call backward() inside the loop"),
    (lesson03.q2, (accumulate_summed_reduction,), "must be divided by len(x)"),
    (lesson03.q3, (naive_search,), "power of two"),
    (lesson03.q3, (linear_search,), "measurements"),
    (lesson03.q3, (unguarded_search,), "called with"),
    (lesson03.q3, (strictly_below,), "largest batch"),
    (lesson03.q3, (except_exception,), "Catch only `torch.OutOfMemoryError`"),
    (lesson03.q3, (except_runtime_error,), "Catch only `torch.OutOfMemoryError`"),
    (lesson03.q3, (keeps_the_errors,), "still alive"),
    (lesson03.q3, (search_returns_the_failure,), "does not fit (return the last batch that fitted"),
    (lesson03.q3, (search_none_when_nothing_fits,), "return 0, not None"),
    (lesson03.q4, (0.05,), "effective batch"),
    (lesson03.q4, (0.05 * 64,), "not the micro-batch size"),
    (lesson03.q4, (0.05 * 8**0.5,), "square-root rule"),
    (lesson03.q4, (0.05 / 8,), "not down"),
    (lesson03.q4, (0.3,), "learning rate"),
    (lesson03.q4, ("0.4",), "should be a number"),
])
def test_plausible_wrong_answers_are_rejected(question, wrong, says):
    question.check(*wrong)
    assert question.last.status == "wrong"
    assert says in question.last.message


@pytest.mark.parametrize("question, blank", [
    (lesson03.q1, (blank_function, curve())),
    (lesson03.q2, (blank_function,)),
    (lesson03.q3, (blank_function,)),
    (lesson03.q4, (____,)),
])
def test_blank_answers_are_not_attempted(question, blank):
    question.check(*blank)
    assert question.last.status == "not attempted"


def test_stack_walking_answers_find_no_expected_value():
    def knee_walker(found, curve, gain=0.1):
        return found[0]

    def accumulation_walker(found, model, x, y, micro_batch):
        unscaled(model, x, y, micro_batch)  # the micro-batches right, the gradients not
        for p, g in zip(model.parameters(), found[0]):
            p.grad = g.clone()

    def search_walker(found, peak_bytes, budget, max_batch):
        return found[0]

    walkers = [  # (question, the walker, its arguments besides itself)
        (lesson03.q1, stack_walker(knee_walker, lambda curve, gain=0.1: -1, lambda v: isinstance(v, int)), (curve(),)),
        (lesson03.q2, stack_walker(accumulation_walker, unscaled, lambda v: isinstance(v, list) and v and
                                   all(isinstance(g, torch.Tensor) for g in v)), ()),
        (lesson03.q3, stack_walker(search_walker, lambda *args: -1, lambda v: isinstance(v, int)), ()),
    ]
    for question, walker, args in walkers:
        question.check(walker, *args)
        assert question.last.status == "wrong" and walker.calls and walker.found == [], question.name


def test_the_check_uses_the_learners_own_curve():
    lesson03.q1.check(right_knee, curve())
    assert "batch 4" in lesson03.q1.last.message


def test_batch_finder_module_exports():
    assert batch_finder.is_out_of_memory(batch_finder.BudgetExceeded("x"))
    assert not batch_finder.is_out_of_memory(ValueError("out of memory"))
