"""Lesson 01 (CUDA basics): timing asynchronous work, sync points, transfers in a loop, bandwidth."""

import math
import numbers
import time
import weakref
from types import SimpleNamespace

import numpy as np
import torch

from ..check import Question, Wrong, expect_close
from ..device import get_device, on_gpu, sync
from .observe import simulated_gpu
from .stand_in import (
    GPU,
    NotJudged,
    StampedSyncs,
    as_on_gpu,
    gpu_run,
    positive,
    ratio_is,
    shape_reads,
    unwaited_reads,
    virtual_clock,
    where,
)

# ---------------------------------------------------------------- q1: time GPU work correctly


def _check_timer(time_ms) -> str:
    if not callable(time_ms):
        raise Wrong("pass your function itself: `q1.check(time_ms)`")
    # On a virtual clock, so the verdict is exact on any machine: 30 ms asleep on the CPU; then a simulated GPU whose
    # queue runs 32 ms of work that took no time to queue (as matrix multiplies do on a real one).
    with virtual_clock(time_ms):
        said = [_judge_timer(*_timed_by_learner(time_ms, lambda: time.sleep(0.03), torch.device("cpu")), 30.0,
                             "on the CPU", gpu=False)]
        with simulated_gpu() as gpu:
            measured = _timed_by_learner(time_ms, lambda: [gpu.launch(0.004) for _ in range(8)], GPU)
            gpu.wait()
        said.append(_judge_timer(*measured, 32.0, "on a simulated GPU", gpu=True))
    if on_gpu():
        said.append(_check_timer_on_the_gpu(time_ms, get_device()))
    return "your timer measured " + ", ".join(said) + "."


def _check_timer_on_the_gpu(time_ms, device: torch.device) -> str:
    """On the course's GPU: work that takes far longer to run than to queue. Only a clock read before the GPU finished
    is judged (it reads a small part of the time): a loaded machine only makes a right answer read more."""
    a = torch.randn(4096, 4096, device=device)
    work = lambda: [a @ a for _ in range(16)]  # queued in microseconds, runs for milliseconds
    work()
    sync(device)
    got, _ = _timed_by_learner(time_ms, work, device)
    sync(device)
    truth_ms = min(_synced_ms(work, device) for _ in range(3))  # measured after the learner's code, never before
    if got < 0.5 * truth_ms:
        raise Wrong(f"on {device} your timer says {got:.3g} ms for work that takes about {truth_ms:.3g} ms: the clock "
                    "stopped when the work was queued. Wait for the GPU (`end.synchronize()` after `end.record()`, or "
                    "`torch.cuda.synchronize()`) before reading the time")
    return f"{got:.3g} ms for about {truth_ms:.3g} ms of work on {device}"


def _synced_ms(work, device: torch.device) -> float:
    start = time.perf_counter()
    work()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def _timed_by_learner(time_ms, work, device) -> tuple[float, int]:
    """``time_ms(work, device)`` as a number, and how many times it called ``work``; or Wrong saying what failed."""
    calls = 0

    def fn():
        nonlocal calls
        calls += 1
        return work()

    try:
        got = time_ms(fn, device)
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
        raise Wrong(f"with device={str(device)!r} your timer raised {type(err).__name__}: {err}"
                    + _timer_failed_hint(err, device)) from None
    number = _number(got)
    if number is None:
        raise Wrong(f"with device={str(device)!r} your timer returned {got!r}: return a number of milliseconds")
    return number, calls


def _timer_failed_hint(err: Exception, device) -> str:
    if device.type == "cpu":
        gpu = any(word in str(err).lower() for word in ("cuda", "nvidia"))
        return " (on the CPU there is no GPU to wait for: use time.perf_counter())" if gpu else ""
    return (" (time the GPU with torch.cuda.Event(enable_timing=True) or torch.cuda.synchronize(), and wait for the "
            "end event before elapsed_time)")


def _judge_timer(got: float, calls: int, truth_ms: float, where: str, gpu: bool) -> str:
    """Raise Wrong unless ``got`` ms, from ``calls`` calls of fn, is the time of work that takes ``truth_ms``."""
    if calls != 1:
        raise Wrong(f"{where} your timer called fn() {calls} times: call it once, and time that one call (no "
                    "warm-up or repeats inside the timer)")
    if math.isclose(got, truth_ms / 1e3, rel_tol=0.05):
        raise Wrong(f"{where} your timer returned {got:.4g} for work that takes {truth_ms:.3g} ms: that is seconds, "
                    "return milliseconds")
    if math.isclose(got, truth_ms * 1e3, rel_tol=0.05):
        raise Wrong(f"{where} your timer returned {got:.4g} for work that takes {truth_ms:.3g} ms: that is "
                    + ("microseconds: `elapsed_time()` is already in milliseconds" if gpu else
                       "microseconds: `time.perf_counter()` is in seconds, × 1e3 gives milliseconds"))
    if got < 0.5 * truth_ms and gpu:
        raise Wrong(f"{where} your timer says {got:.3g} ms, but the work takes {truth_ms:.3g} ms: the clock stopped "
                    "when the work was queued, before the GPU had run it. Wait for the GPU (`end.synchronize()` after "
                    "`end.record()`, or `torch.cuda.synchronize()`) before reading the time")
    if got < 0.5 * truth_ms:
        raise Wrong(f"{where} your timer says {got:.3g} ms for {truth_ms:.3g} ms asleep: read a wall clock, "
                    "`time.perf_counter()`, before and after the call")
    if got > 1.5 * truth_ms:
        raise Wrong(f"{where} your timer says {got:.3g} ms, but one call takes {truth_ms:.3g} ms: time one call of "
                    "fn only")
    return f"{got:.3g} ms for {truth_ms:.3g} ms {where}"


# ---------------------------------------------------------------- q2: which calls wait


# The choices of q2, for `x`, a float32 tensor on the GPU; True where the call makes the CPU wait.
SYNC_CHOICES = {
    "A": ("y = x * 2", False),
    "B": ("s = x.sum()", False),
    "C": ("s = x.sum().item()", True),
    "D": ("h = x.cpu()", True),
    "E": ("print(x)", True),
    "F": ("idx = torch.nonzero(x)", True),
    "G": ("z = torch.where(x > 0, x, 0.0)", False),
    "H": ("pos = x[x > 0]", True),
    "I": ("if x.sum() > 0: ...", True),
}
_WHY = {  # what a choice does, said of the choices a learner got wrong (a missed one by its kind, never its letter)
    "A": "element-wise work only queues more work on the GPU",
    "B": "a reduction returns a tensor on the GPU: nothing comes back to Python",
    "C": "Python needs a number (`.item()`) or a bool (`if` on a tensor)",
    "D": "data copied to the host",
    "E": "text to print, made from the values",
    "F": "a result whose shape depends on the values (`nonzero`, a boolean mask)",
    "G": "element-wise work only queues more work on the GPU",
    "H": "a result whose shape depends on the values (`nonzero`, a boolean mask)",
    "I": "Python needs a number (`.item()`) or a bool (`if` on a tensor)",
}


def _check_sync_points(answer) -> str:
    if isinstance(answer, str):  # "CDE" or "C, D, E"
        answer = [c for c in answer if c.isalpha()]
    if not isinstance(answer, (set, list, tuple, frozenset)):
        raise Wrong(f"answer with a set of letters, e.g. {{'A', 'B'}}, got {type(answer).__name__}")
    chosen = {str(a).strip().upper() for a in answer}
    unknown = sorted(chosen - set(SYNC_CHOICES))
    if unknown:
        raise Wrong(f"{', '.join(unknown)} is not one of the choices {', '.join(SYNC_CHOICES)}")
    right = {k for k, (_, syncs) in SYNC_CHOICES.items() if syncs}
    if chosen != right:
        said = [f"{len(chosen & right)} of your {len(chosen)} choices are right"]
        extra = sorted(chosen - right)
        for why in dict.fromkeys(_WHY[k] for k in extra):
            said.append(f"{', '.join(k for k in extra if _WHY[k] == why)} do(es) not wait: {why}")
        missing = right - chosen
        if missing:
            kinds = "; ".join(dict.fromkeys(_WHY[k] for k in sorted(missing)))
            said.append(f"{len(missing)} call(s) that wait are missing, where the host needs: {kinds}")
        raise Wrong(". ".join(said))
    return "these are the calls that need a value, a shape or text from the GPU, so they wait for it."


# ---------------------------------------------------------------- q3: transfer once, not every step


def _loss_value(step: int) -> float:
    """The loss the check's training step returns at ``step`` (1, 2, ...)."""
    return 2.0 - 0.125 * step


def _losses_with_graphs(device, log: SimpleNamespace):
    """A ``train_step()`` whose losses carry an autograd graph, as a real step's do; ``log`` counts the calls,
    notes a call made with gradients off, and the most graphs of earlier steps alive at a call."""
    weight = torch.ones((), device=device, requires_grad=True)
    graphs = []

    def train_step():
        log.calls += 1
        log.grad_off = log.grad_off or not torch.is_grad_enabled()
        log.graphs_kept = max(log.graphs_kept, sum(ref() is not None for ref in graphs))
        activation = torch.full((64,), _loss_value(log.calls), device=device)  # saved for the backward pass
        graphs.append(weakref.ref(activation))
        return (weight * activation).mean()

    return train_step


def _check_collect(collect_losses) -> str:
    if not callable(collect_losses):
        raise Wrong("pass your function itself: `q3.check(collect_losses)`")
    steps = 12
    log = SimpleNamespace(calls=0, grad_off=False, graphs_kept=0)
    try:
        result = collect_losses(_losses_with_graphs(torch.device("cpu"), log), steps, torch.device("cpu"))
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
        raise Wrong(_collect_failed(str(err), type(err), torch.device("cpu"))) from None
    _judge_collect_log(log, steps)
    _judge_collected(result, steps)
    return _check_collect_on_the_gpu(collect_losses, steps)


def _judge_collect_log(log, steps: int) -> None:
    if log.calls != steps:
        raise Wrong(f"call train_step() once per step: {steps} steps, your function called it {log.calls} times")
    if log.grad_off:
        raise Wrong("your function called train_step() with gradients off (`torch.no_grad()`): a real training step "
                    "could not back-propagate there. Keep the step as it is, and `.detach()` the loss it returns")
    if log.graphs_kept > 1:
        raise Wrong(f"your function kept each step's loss with its autograd graph ({log.graphs_kept} steps' graphs were "
                    "alive at once): every graph keeps its step's activations in memory. Keep `loss.detach()`")


def _judge_collected(result, steps: int) -> None:
    if not isinstance(result, (np.ndarray, list, tuple)) or isinstance(result, (list, tuple)) and any(
            isinstance(v, torch.Tensor) for v in result):
        raise Wrong(f"return the losses as a NumPy array (`.cpu().numpy()`), got {type(result).__name__}")
    got = np.asarray(result, dtype=float).ravel()
    expected = np.array([_loss_value(step) for step in range(1, steps + 1)])  # only now: nothing to find before
    if got.shape != (steps,) or not np.allclose(got, expected):
        raise Wrong(f"expected the {steps} losses in order, {np.round(expected, 3)}, got {np.round(got, 3)}")


def _collect_failed(words: str, kind: type, device: torch.device) -> str:
    if "requires grad" in words:
        return ("your function read losses that still carry their autograd graph (NumPy cannot take them): keep "
                "`loss.detach()`, which also lets each step's graph go")
    return f"with the losses on {device} your function raised {kind.__name__}: {words}"


def _check_collect_on_the_gpu(collect_losses, steps: int) -> str:
    """What the function does with losses on the GPU (or a stand-in for it): its copies to the host and waits."""
    log = SimpleNamespace(calls=0, grad_off=False, graphs_kept=0, waits=[])
    try:
        with gpu_run() as seen:
            seen.syncs = StampedSyncs(seen.copies)
            train_step = _losses_with_graphs(GPU, log)

            def watched_step():
                if log.calls == steps - 1:  # the last step: how often has the host waited so far?
                    log.waits = [*seen.syncs, *shape_reads(seen.host_reads)]
                return train_step()

            collect_losses(watched_step, steps, GPU)
    except NotJudged:
        return f"{steps} losses, right; how your function behaves on a GPU could not be judged on this machine."
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
        raise Wrong(_collect_failed(as_on_gpu(err), type(err), GPU)) from None
    transfers = len(seen.to_host)
    if transfers > 1:
        raise Wrong(f"your function copied losses from the GPU to the host {transfers} times for {steps} steps "
                    f"({seen.to_host_kinds()}), and each copy makes the CPU wait for the GPU. Keep them "
                    "on the device (`torch.stack`, or a tensor on `device`) and transfer once, at the end")
    if len(log.waits) > 1:  # one stray wait costs little; one per step leaves the GPU idle again and again
        raise Wrong(f"your function waited for the GPU {len(log.waits)} times before the last step "
                    f"({', '.join(dict.fromkeys(log.waits))}): each wait leaves the GPU idle. Wait once, at the end")
    if unwaited_reads(seen):
        raise Wrong("your copy to the host was non-blocking (`non_blocking=True`) and nothing waited for it: on a GPU "
                    "the values may not have arrived when they are read. Copy with `.cpu()`, which waits, or call "
                    "`torch.cuda.synchronize()` before reading")
    return f"{steps} losses, {transfers} transfer to the host ({where(GPU)})."


# ---------------------------------------------------------------- q4: bandwidth of a vector add


def _number(value) -> float | None:
    """``value`` as a float, or None when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor, np.generic)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


_COPY_MISTAKES = ((0.5, "a copy reads every byte *and* writes it: count 2 × x.nbytes"),
                  (0.125, "count bytes (`x.nbytes`), not elements, and a copy reads *and* writes them: 2 × x.nbytes"),
                  (0.25, "count bytes (`x.nbytes`, 4 per float32 element), not elements"),
                  (1e9, "that is bytes per second: divide by 1e9 for GB/s"),
                  (1e9 / 2**30, "that is GiB/s: 1 GB is 1e9 bytes, not 2³⁰"),
                  (1e-3, "the times are in seconds: do not divide them by 1000"))
_FRACTION_MISTAKES = ((2 / 3, "x + y reads two arrays and writes one: count 3 × x.nbytes"),
                      (100, "a fraction, not a percentage"))


def _check_bandwidth(x, copy_seconds, add_seconds, copy_gbs, fraction) -> str:
    if not isinstance(x, torch.Tensor):
        raise Wrong(f"pass the input tensor x first, got {type(x).__name__}")
    nbytes = x.numel() * x.element_size()
    copy_s, add_s = positive(copy_seconds, "copy_seconds"), positive(add_seconds, "add_seconds")
    expected_copy = 2 * nbytes / copy_s / 1e9
    for ratio, why in _COPY_MISTAKES:
        if ratio_is(_number(copy_gbs), expected_copy, ratio):
            raise Wrong(f"expected a copy bandwidth of {expected_copy:.4g} GB/s, got {_number(copy_gbs):.4g}: {why}")
    expect_close(copy_gbs, expected_copy, rel=0.02, what="the copy bandwidth", unit="GB/s")
    expected = 3 * nbytes / add_s / 1e9 / _number(copy_gbs)
    inverted = (1 / expected**2, "that is the copy's bandwidth over the add's: divide the add's by the copy's")
    for ratio, why in () if ratio_is(_number(fraction), expected, 1) else (*_FRACTION_MISTAKES, inverted):
        if ratio_is(_number(fraction), expected, ratio, rel=0.01):
            raise Wrong(f"expected a fraction of {expected:.3g}, got {_number(fraction):.3g}: {why}")
    expect_close(fraction, expected, rel=0.02, what="the fraction of copy bandwidth")
    return (f"the vector add moved its bytes at {_number(fraction):.2f}× the speed of this device's measured copy "
            f"({_number(copy_gbs):.4g} GB/s)" + _cache_note(x.device, nbytes) + ".")


def _cache_note(device: torch.device, nbytes: int) -> str:
    """On a GPU, a warning when an array is less than four times the L2 cache: the bytes then came partly from L2,
    so the fraction is not device memory's (an add whose arrays sit in L2 can pass a copy by more than memory allows)."""
    if not on_gpu(device):
        return ""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    if nbytes >= 4 * l2_bytes:
        return ""
    return (f"; but each array is {nbytes / 1e6:.3g} MB, less than four times this GPU's {l2_bytes / 1e6:.0f} MB L2 "
            "cache, so part of these bytes came from L2: for device memory's bandwidth, make the arrays larger")


q1 = Question(
    lesson="01", number=1, title="Time GPU work correctly", checker=_check_timer,
    hint_text="On a GPU, record a `torch.cuda.Event(enable_timing=True)` before and after `fn()`, wait for the end "
              "event (`end.synchronize()`), then `start.elapsed_time(end)` is in milliseconds. On the CPU, "
              "`time.perf_counter()` around the call is right (and is in seconds).",
    solution_text="""
def time_ms(fn, device):
    if gpulab.on_gpu(device):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3
""",
)

q2 = Question(
    lesson="01", number=2, title="Which calls wait for the GPU?", checker=_check_sync_points,
    hint_text="A call waits when Python needs something only the finished GPU work can give: a number, a bool "
              "for an `if`, text to print, data on the CPU, or a shape that depends on the values. On a GPU, "
              "`torch.cuda.set_sync_debug_mode('warn')` warns at each such call.",
    solution_text='sync_points = {"C", "D", "E", "F", "H", "I"}',
)

q3 = Question(
    lesson="01", number=3, title="Transfer once, not every step", checker=_check_collect,
    hint_text="Append `loss.detach()` (a tensor on the device) to a list in the loop, or write it into a tensor "
              "made on `device`; after the loop, `torch.stack(...)` the list and call `.cpu().numpy()` once. A "
              "tensor made without `device=` lives on the host: writing a loss into it is a copy, every step.",
    solution_text="""
def collect_losses(train_step, steps, device):
    losses = [train_step().detach() for _ in range(steps)]
    return torch.stack(losses).cpu().numpy()
""",
)

q4 = Question(
    lesson="01", number=4, title="Bandwidth of a vector add", checker=_check_bandwidth,
    hint_text="Count the bytes that cross the memory bus: a copy reads x and writes out (2 × x.nbytes); x + y "
              "reads x and y and writes out (3 × x.nbytes). GB/s = bytes / seconds / 1e9.",
    solution_text="""
copy_gbs = 2 * x.nbytes / copy_seconds / 1e9
add_gbs = 3 * x.nbytes / add_seconds / 1e9
fraction = add_gbs / copy_gbs
""",
)
