"""Lesson 01 (CUDA basics): timing asynchronous work, sync points, transfers in a loop, bandwidth."""

import numbers
import time

import numpy as np
import torch

from ..check import Question, Wrong, expect_close
from ..device import get_device, sync
from ..observe import observe, simulated_gpu
from .lesson00 import _positive


def _check_timer(time_ms) -> str:
    if not callable(time_ms):
        raise Wrong("pass your function itself: `q1.check(time_ms)`")
    here = get_device()
    if here.type == "cuda":
        a = torch.randn(4096, 4096, device=here)
        work = lambda: [a @ a for _ in range(8)]  # queued in microseconds, runs for milliseconds
        work()
        sync(here)
        start = time.perf_counter()
        work()
        sync(here)
        truth_ms = (time.perf_counter() - start) * 1e3
        gpu_ms = _timed_by_learner(time_ms, work, here, sync_after=True)
        where = f"on {here}"
    else:  # no GPU: a simulated one, whose queue runs 32 ms of work that took microseconds to queue
        with simulated_gpu() as gpu:
            truth_ms = 32.0
            gpu_ms = _timed_by_learner(time_ms, lambda: [gpu.launch(0.004) for _ in range(8)], torch.device("cuda"))
            gpu.wait()
        where = "on a simulated GPU (this machine has none)"
    _judge_timer(gpu_ms, truth_ms, where, gpu=True)
    cpu_ms = _timed_by_learner(time_ms, lambda: time.sleep(0.03), torch.device("cpu"))
    _judge_timer(cpu_ms, 30.0, "on the CPU", gpu=False)
    return (f"your timer measured {gpu_ms:.3g} ms for GPU work that takes about {truth_ms:.3g} ms ({where}), and "
            f"{cpu_ms:.3g} ms for 30 ms on the CPU.")


def _timed_by_learner(time_ms, work, device, sync_after=False):
    """``time_ms(work, device)`` as a number, or Wrong that says what failed and where."""
    try:
        got = time_ms(work, device)
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
        hint = ("" if device.type == "cpu" else " (time the GPU with torch.cuda.Event(enable_timing=True) or "
                "torch.cuda.synchronize(), and wait for the end event before elapsed_time)")
        raise Wrong(f"with device={str(device)!r} your timer raised {type(err).__name__}: {err}{hint}") from None
    if sync_after:
        sync(device)
    number = _number(got)
    if number is None:
        raise Wrong(f"with device={str(device)!r} your timer returned {got!r}: return a number of milliseconds")
    return number


def _judge_timer(got: float, truth_ms: float, where: str, gpu: bool) -> None:
    if got < 0.5 * truth_ms:
        seconds = abs(got * 1e3 - truth_ms) <= 0.5 * truth_ms
        if gpu:
            raise Wrong(f"{where} your timer says {got:.3g} ms, but the work takes about {truth_ms:.3g} ms: "
                        + ("that looks like seconds, return milliseconds; or " if seconds else "")
                        + "the clock stopped when the work was queued, before the GPU had run it. Wait for the GPU "
                        "(`end.synchronize()` after `end.record()`, or `torch.cuda.synchronize()`) before reading the "
                        "time")
        raise Wrong(f"{where} your timer returned {got:.4g} for work that takes about {truth_ms:.3g} ms"
                    + (": that looks like seconds. Return milliseconds" if seconds else ""))
    if got > 2 * truth_ms + 5:
        raise Wrong(f"{where} your timer says {got:.3g} ms, but one call takes about {truth_ms:.3g} ms: time one "
                    "call of fn only")


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
        missing, extra = len(right - chosen), len(chosen - right)
        raise Wrong(f"{len(chosen & right)} of your choices are right; {missing} sync point(s) are missing and "
                    f"{extra} of your choices do not make the CPU wait")
    return "these are the calls that need a value, a shape or text from the GPU, so they wait for it."


def _check_collect(collect_losses) -> str:
    if not callable(collect_losses):
        raise Wrong("pass your function itself: `q3.check(collect_losses)`")
    here, steps = get_device(), 12
    values = torch.linspace(2.0, 0.5, steps)
    # The values, on this machine's device; the transfers, on the GPU or, without one, on "meta" standing in for it.
    result, calls, _ = _collect_on(collect_losses, values, here)
    if calls != steps:
        raise Wrong(f"call train_step() once per step: {steps} steps, your function called it {calls} times")
    if not isinstance(result, (np.ndarray, list, tuple)) or isinstance(result, (list, tuple)) and any(
            isinstance(v, torch.Tensor) for v in result):
        raise Wrong(f"return the losses as a NumPy array (`.cpu().numpy()`), got {type(result).__name__}")
    got = np.asarray(result, dtype=float).ravel()
    if got.shape != (steps,) or not np.allclose(got, values.numpy()):
        raise Wrong(f"expected the {steps} losses in order, {np.round(values.numpy(), 3)}, got {np.round(got, 3)}")
    device = here if here.type == "cuda" else torch.device("meta")
    _, _, seen = _collect_on(collect_losses, values, device)
    transfers = len(seen.to_host)
    if transfers > 1:
        raise Wrong(f"your function copied losses from the device to the host {transfers} times for {steps} steps "
                    f"({seen.to_host_kinds()}), and each copy makes the CPU wait for the GPU. Keep them "
                    "on the device (`torch.stack`, or a tensor on `device`) and transfer once, at the end")
    where = f"on {device}" if device.type == "cuda" else "on a stand-in device: this machine has no GPU"
    return f"{steps} losses, {transfers} transfer to the host ({where})."


def _collect_on(collect_losses, values, device):
    """Run ``collect_losses`` with losses on ``device``: (result, calls of train_step, what observe saw)."""
    calls = 0

    def train_step():
        nonlocal calls
        calls += 1
        return values[(calls - 1) % len(values)].to(device)

    try:
        with observe(fake_meta_reads=True) as seen:
            result = collect_losses(train_step, len(values), device)
    except NotImplementedError as err:
        if "meta" in str(err):
            raise Wrong(f"on the check's stand-in device your code failed: {err}") from None
        raise
    except (RuntimeError, TypeError) as err:
        raise Wrong(f"with the losses on {device} your function raised {type(err).__name__}: {err}") from None
    return result, calls, seen


def _number(value) -> float | None:
    """``value`` as a float, or None when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor, np.generic)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _check_bandwidth(x, copy_seconds, add_seconds, copy_gbs, fraction) -> str:
    if not isinstance(x, torch.Tensor):
        raise Wrong(f"pass the input tensor x first, got {type(x).__name__}")
    nbytes = x.numel() * x.element_size()
    copy_s, add_s = _positive(copy_seconds, "copy_seconds"), _positive(add_seconds, "add_seconds")
    expected_copy = 2 * nbytes / copy_s / 1e9
    if _number(copy_gbs) is not None and abs(_number(copy_gbs) / expected_copy - 0.5) < 0.01:
        raise Wrong(f"expected {expected_copy:.4g} GB/s, got {_number(copy_gbs):.4g}: a copy reads every byte "
                    "*and* writes it")
    expect_close(copy_gbs, expected_copy, rel=0.02, what="the copy bandwidth", unit="GB/s")
    expected = 3 * nbytes / add_s / 1e9 / _number(copy_gbs)
    for ratio, why in ((2 / 3, "x + y reads two arrays and writes one"), (100, "a fraction, not a percentage")):
        if _number(fraction) is not None and abs(_number(fraction) / expected / ratio - 1) < 0.01:
            raise Wrong(f"expected a fraction of {expected:.3g}, got {_number(fraction):.3g}: {why}")
    expect_close(fraction, expected, rel=0.02, what="the fraction of copy bandwidth")
    return (f"the vector add moved data at {_number(fraction):.0%} of this device's measured copy bandwidth "
            f"({_number(copy_gbs):.4g} GB/s).")


q1 = Question(
    lesson="01", number=1, title="Time GPU work correctly", checker=_check_timer,
    hint_text="On a GPU, record a `torch.cuda.Event(enable_timing=True)` before and after `fn()`, wait for the end "
              "event (`end.synchronize()`), then `start.elapsed_time(end)` is in milliseconds. On the CPU, "
              "`time.perf_counter()` around the call is right (and is in seconds).",
    solution_text="""
def time_ms(fn, device):
    if device.type == "cuda":
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
    solution_text="sync_points = {'C', 'D', 'E', 'F', 'H', 'I'}",
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
