"""Lesson 01 (CUDA basics): timing asynchronous work, sync points, transfers in a loop, bandwidth."""

import numbers
import time

import numpy as np
import torch

from ..check import Question, Wrong, expect_close
from ..device import get_device, sync
from .lesson00 import _positive


def _check_timer(time_ms) -> str:
    if not callable(time_ms):
        raise Wrong("pass your function itself: `q1.check(time_ms)`")
    here = get_device()
    if here.type == "cuda":
        a = torch.randn(4096, 4096, device=here)
        work = lambda: [a @ a for _ in range(8)]  # queued in microseconds, runs for milliseconds
    else:
        work = lambda: time.sleep(0.03)
    work()
    sync(here)
    start = time.perf_counter()
    work()
    sync(here)
    truth_ms = (time.perf_counter() - start) * 1e3
    got = time_ms(work)
    sync(here)
    got = _number(got)
    if got is None:
        raise Wrong("return a number of milliseconds")
    if got < 0.5 * truth_ms:
        looks_like_seconds = abs(got * 1e3 - truth_ms) <= 0.5 * truth_ms
        if here.type != "cuda" and looks_like_seconds:
            raise Wrong(f"you returned {got:.4g}: that looks like seconds. Return milliseconds")
        units = " (and return milliseconds, not seconds)" if looks_like_seconds else ""
        raise Wrong(f"your timer says {got:.3g} ms, but the work takes about {truth_ms:.3g} ms: the clock stopped "
                    "before the GPU had finished. Synchronise (`torch.cuda.synchronize()`, `end.synchronize()`) "
                    f"before reading the time{units}")
    if got > 2 * truth_ms + 5:
        raise Wrong(f"your timer says {got:.3g} ms, but one call takes about {truth_ms:.3g} ms: time one call only")
    return f"your timer measured {got:.3g} ms for work that takes about {truth_ms:.3g} ms on {here}."


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


class _Counting(torch.Tensor):
    """A tensor that counts the calls that copy it to the host (each one waits for the GPU)."""

    transfers = 0
    _TO_HOST = {"item", "cpu", "numpy", "tolist", "__float__", "__int__", "__bool__", "__array__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in cls._TO_HOST or name == "to" and any(_is_cpu(a) for a in (*args[1:], *kwargs.values())):
            _Counting.transfers += 1
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
            return result.as_subclass(torch.Tensor) if isinstance(result, torch.Tensor) else result
        return super().__torch_function__(func, types, args, kwargs)


def _is_cpu(spec) -> bool:
    return isinstance(spec, str) and spec.startswith("cpu") or isinstance(spec, torch.device) and spec.type == "cpu"


def _check_collect(collect_losses) -> str:
    if not callable(collect_losses):
        raise Wrong("pass your function itself: `q3.check(collect_losses)`")
    here, steps = get_device(), 12
    values = torch.linspace(2.0, 0.5, steps)
    calls = 0

    def train_step():
        nonlocal calls
        calls += 1
        return values[(calls - 1) % steps].to(here).as_subclass(_Counting)

    _Counting.transfers = 0
    result = collect_losses(train_step, steps)
    transfers = _Counting.transfers
    if calls != steps:
        raise Wrong(f"call train_step() once per step: {steps} steps, your function called it {calls} times")
    if not isinstance(result, (np.ndarray, list, tuple)) or isinstance(result, (list, tuple)) and any(
            isinstance(v, torch.Tensor) for v in result):
        raise Wrong(f"return the losses as a NumPy array (`.cpu().numpy()`), got {type(result).__name__}")
    got = np.asarray(result, dtype=float).ravel()
    if got.shape != (steps,) or not np.allclose(got, values.numpy()):
        raise Wrong(f"expected the {steps} losses in order, {np.round(values.numpy(), 3)}, got {np.round(got, 3)}")
    if transfers > 1:
        raise Wrong(f"your function copied losses to the host {transfers} times for {steps} steps, and each copy "
                    "makes the CPU wait for the GPU. Keep them on the device (`torch.stack`) and transfer once")
    return f"{steps} losses, {transfers} transfer to the host."


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
def time_ms(fn):
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
    hint_text="Append `loss.detach()` (a tensor on the device) to a list in the loop; after the loop, "
              "`torch.stack(...)` the list and call `.cpu().numpy()` once.",
    solution_text="""
def collect_losses(train_step, steps):
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
