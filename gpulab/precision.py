"""Plumbing for the mixed-precision lesson: matmul FLOPs and TFLOP/s, the device's measured peak (the vendor's
datasheet figures are in ``gpulab.datasheets``), which precisions a device runs natively, and checkpoints that keep
the GradScaler's state with the model and the optimizer.

The lesson itself writes ``torch.autocast``, ``torch.amp.GradScaler`` and the TF32 switch in its cells.
"""

import functools
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .device import device_info, get_device, on_gpu
from .mode import by_mode

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
# The dtype of the tensors for each precision: TF32 is a mode of fp32 matmuls, not a dtype.
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

def matmul_flops(m: int, n: int, k: int) -> int:
    """Floating-point operations of an (m×k) @ (k×n) matmul: one multiply and one add per term."""
    return 2 * m * n * k


def tflops(flops: float, seconds: float) -> float:
    """Throughput in TFLOP/s (10^12 floating-point operations per second)."""
    return flops / seconds / 1e12


def matmul_intensity(m: int, n: int, k: int, itemsize: int) -> float:
    """Arithmetic intensity of a matmul, FLOP per byte, if A and B are read and C written once."""
    return matmul_flops(m, n, k) / ((m * k + k * n + m * n) * itemsize)


MAX_PRODUCT_S = 0.25  # matmul_peak tries no larger size once one product would take longer than this


@dataclass(frozen=True)
class Peak:
    """A measured matmul peak (``matmul_peak``): TFLOP/s of the median product at the fastest size ``n``."""

    dtype: str
    n: int
    tflops: float
    best_tflops: float  # the fastest single product at any size
    first_tflops: float  # the first products (up to ten) at the first size, on the clocks as found
    products: int  # products timed at size n
    by_size: dict  # {n: median TFLOP/s} of every size tried


def matmul_peak(dtype: torch.dtype, device=None, sizes=None, warmup_s: float | None = None,
                min_time: float | None = None) -> Peak:
    """The device's matmul peak in ``dtype``, under the current TF32 and reduced-precision settings.

    How it is found: square matrices of random normal numbers (zeros and other special data can run faster
    than real data) at a few sizes (4096, 8192 and 16384 on a GPU; a size is skipped when one product would
    take over a quarter of a second). At each size, ``warmup_s`` seconds of untimed products first (1 s on a
    GPU), long enough for the clocks to ramp up and for cuBLAS to pick its kernel; then products queued back
    to back for ``min_time`` seconds (at least 10), each timed between two CUDA events, so the GPU never
    waits for Python or a synchronisation. The peak is the median product's TFLOP/s at the fastest size;
    ``best_tflops`` is the fastest single product; ``first_tflops``, the first products (up to ten) before
    any warm-up: against ``by_size`` of the first size, it shows how much the warm-up mattered. On a CPU:
    the same with a host clock, and smaller sizes.
    """
    device = get_device(device)
    gpu = on_gpu(device)
    sizes = sizes or by_mode(full=[4096, 8192, 16384] if gpu else [512, 1024, 2048], quick=[128, 256])
    warmup_s = by_mode(full=1.0 if gpu else 0.2, quick=0.01) if warmup_s is None else warmup_s
    min_time = by_mode(full=1.0 if gpu else 0.5, quick=0.02) if min_time is None else min_time
    by_size, counts, best, first = {}, {}, 0.0, None
    for n in sizes:
        flops = matmul_flops(n, n, n)
        if by_size and flops / (by_size[max(by_size)] * 1e12) > MAX_PRODUCT_S:
            break  # too slow at this size: the smaller ones have told us the rate
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        out = torch.empty_like(a)
        product = functools.partial(torch.mm, a, b, out=out)
        start = time.perf_counter()
        seconds = timed_calls(product, 1, device)[0]  # loads cuBLAS' kernel; tells how long one takes
        warm = timed_calls(product, calls_to_fill(0.05, seconds, 1, 10), device)
        first = first or tflops(flops, statistics.median(warm))
        while time.perf_counter() - start < warmup_s:
            warm = timed_calls(product, calls_to_fill(min(0.1, warmup_s), statistics.median(warm), 1, 10_000), device)
        seconds = statistics.median(warm)
        times = timed_calls(product, calls_to_fill(min_time, seconds, 10 if seconds < MAX_PRODUCT_S else 3, 10_000), device)
        by_size[n], counts[n] = tflops(flops, statistics.median(times)), len(times)
        best = max(best, tflops(flops, min(times)))
    n = max(by_size, key=by_size.get)
    return Peak(dtype=str(dtype).removeprefix("torch."), n=n, tflops=by_size[n], best_tflops=best,
                first_tflops=first, products=counts[n], by_size=by_size)


def calls_to_fill(seconds: float, each: float, least: int, most: int) -> int:
    """How many calls of ``each`` seconds fill ``seconds``, within [least, most]."""
    return min(most, max(least, math.ceil(seconds / max(each, 1e-9))))


def timed_calls(product, count: int, device: torch.device) -> list[float]:
    """Seconds of each of ``count`` calls of ``product``, back to back: between CUDA events on a GPU, between readings
    of the host's clock on a CPU.

    The events go on the stream of ``device``, where the products run: recorded on the current device's stream
    instead (``event.record()``), they would time nothing but their own order whenever ``device`` is another GPU.
    On a GPU the products are queued without a wait between them, and the last event is waited for at the end.
    """
    gpu = on_gpu(device)
    stream = torch.cuda.current_stream(device) if gpu else None
    marks = []

    def mark():
        if gpu:  # the GPU reads its clock when it reaches the event, after the products queued before it
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            marks.append(event)
        else:
            marks.append(time.perf_counter())

    mark()
    for _ in range(count):
        product()
        mark()
    if gpu:
        marks[-1].synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in zip(marks, marks[1:])]
    return [end - start for start, end in zip(marks, marks[1:])]


def measured_peak(dtype: torch.dtype, device=None, n: int | None = None) -> tuple[float, int]:
    """(TFLOP/s, n) of ``matmul_peak`` (at size ``n`` only, when given): the practical peak."""
    peak = matmul_peak(dtype, device, sizes=[n] if n else None)
    return peak.tflops, peak.n


@dataclass(frozen=True)
class Support:
    """Whether the lesson runs a precision on a device, and why (or why not)."""

    precision: str
    available: bool
    note: str


def precision_support(compute_capability: tuple[int, int] | None) -> dict[str, Support]:
    """Support of each precision for a CUDA compute capability, or for the CPU (``None``)."""
    if compute_capability is None:
        notes = {
            "fp32": (True, "the CPU's native format"),
            "tf32": (False, "TF32 is a mode of NVIDIA tensor cores (compute capability 8.0+): CUDA only"),
            "fp16": (False, "fp16 with a GradScaler is the recipe for CUDA GPUs: skipped on the CPU"),
            "bf16": (True, "autocast's CPU dtype; fast only on CPUs with bf16 instructions (AVX512-BF16, AMX)"),
        }
    else:
        cc = tuple(compute_capability)
        here = f"this GPU is {cc[0]}.{cc[1]}"
        ampere = cc >= (8, 0)
        notes = {
            "fp32": (True, "CUDA cores (not tensor cores)"),
            "tf32": (ampere, "fp32 matmuls on tensor cores, 10-bit mantissa" if ampere
                     else f"needs compute capability 8.0+ (Ampere); {here}"),
            "fp16": (True, "tensor cores; needs a GradScaler" if cc >= (7, 0)
                     else f"runs, but without tensor cores (they need 7.0+; {here}): usually little speed-up"),
            "bf16": (ampere, "tensor cores; fp32's range, no GradScaler needed" if ampere
                     else f"not native before compute capability 8.0 ({here}): it would be emulated, slowly"),
        }
    return {p: Support(p, *notes[p]) for p in PRECISIONS}


def device_support(device=None) -> dict[str, Support]:
    """precision_support for a device (default: the course's device)."""
    return precision_support(device_info(device).compute_capability)


def save_checkpoint(path, model, optimizer, scaler=None, **extra) -> Path:
    """Save model, optimizer and GradScaler state (and ``extra`` values such as the step) in one file."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    torch.save(state, path)
    return Path(path)


def load_checkpoint(path, model, optimizer, scaler=None, map_location=None) -> dict:
    """Restore what save_checkpoint saved into ``model``, ``optimizer`` and ``scaler``; returns the extras."""
    state = torch.load(path, map_location=map_location, weights_only=True)
    model.load_state_dict(state.pop("model"))
    optimizer.load_state_dict(state.pop("optimizer"))
    scaler_state = state.pop("scaler", None)
    if scaler is not None:
        if not scaler_state and scaler.is_enabled():
            raise ValueError(f"{path} holds no GradScaler state (saved without a scaler, or with a disabled one)")
        scaler.load_state_dict(scaler_state or {})
    return state
