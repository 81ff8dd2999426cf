"""The seconds the course's timers take for a call of known length, and the length of the calls lessons time: the
plans' arithmetic, written once. Each mirrors the timer's own rule (``gpulab.bench``, ``gpulab.compare``)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .card import Card

MIN_RUNS, MIN_PAIRS = 5, 6  # gpulab.bench times at least 5 runs; gpulab.compare at least 6 pairs by default


def bench_s(call_s: float, *, min_time: float = 0.2, warmup: int = 2, repeats: int | None = None) -> float:
    """How long ``gpulab.bench`` runs for a call of ``call_s`` seconds: its untimed warm-up calls, then runs for
    ``min_time`` seconds and at least ``MIN_RUNS`` calls (or exactly ``repeats``)."""
    timed = repeats * call_s if repeats is not None else max(min_time, MIN_RUNS * call_s)
    return warmup * call_s + timed


def compare_s(a_s: float, b_s: float, *, min_time: float = 1.0, warmup: int = 1, pairs: int | None = None) -> float:
    """How long ``gpulab.compare`` runs for two calls of ``a_s`` and ``b_s`` seconds: the warm-up calls of each, then
    interleaved pairs for ``min_time`` seconds, at least ``MIN_PAIRS`` of them (or exactly ``pairs``)."""
    pair = a_s + b_s
    timed = pairs * pair if pairs is not None else max(min_time, MIN_PAIRS * pair)
    return warmup * pair + timed


def matmul_s(card: Card, n: int, precision: str = "fp32", *, m: int | None = None, k: int | None = None) -> float:
    """One (m×k)·(k×n) matrix product (n×n·n×n by default) on ``card`` at its achievable rate, with its launch."""
    m, k = m or n, k or n
    return 2 * m * n * k / (card.tflops(precision) * 1e12) + card.launch_s


def cpu_matmul_s(card: Card, n: int) -> float:
    """One n×n fp32 matrix product on the host's CPU cores."""
    return 2 * n**3 / (card.cpu_tflops * 1e12)


class Launches(TorchDispatchMode):
    """Counts the kernels a block would launch on a GPU, about: the aten operators it dispatches (on the meta device,
    or on tiny CPU tensors), less views (no kernel) and reads of a host scalar (``.item()`` of an optimizer's step
    count, which torch keeps on the CPU: torch/optim/optimizer.py, ``_get_value``, 2.7 to 2.14)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not (func.is_view or func.overloadpacket is torch.ops.aten._local_scalar_dense)
        return func(*args, **(kwargs or {}))


def step_launches(step) -> int:
    """The kernels ``step()``, a training step, launches after its first call (an optimizer makes its state there)."""
    step()
    with Launches() as launches:
        step()
    return launches.count
