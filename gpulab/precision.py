"""Plumbing for the mixed-precision lesson: matmul FLOPs and TFLOP/s, the device's measured peak (the vendor's
datasheet figures are in ``gpulab.datasheets``), which precisions a device runs natively, checkpoints that keep
the GradScaler's state with the model and the optimizer, and the lesson's tables: the matmuls beside the datasheet
(``matmul_table``, ``roofline``), the training steps beside their pairs and, where it means something, their MFU
beside each precision's dense peak (``step_table``, with ``flops.StepMFU``).

The lesson itself writes ``torch.autocast``, ``torch.amp.GradScaler`` and the TF32 switch in its cells.
"""

import functools
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from . import datasheets
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


# ---- lesson 04's tables: the matmuls beside the datasheet, the training steps beside their pairs and peaks ----------

def peak_fields(ceiling, swept: dict) -> dict:
    """The row of a precision's measured peak: ``ceiling`` (``flops.ceiling``'s search), or the sweep's fastest
    product where it was faster (``swept``: {n: its Measurement}); with its shape and the GPU's state while it ran."""
    p = ceiling.precision
    rate = {n: tflops(matmul_flops(n, n, n), m.median) for n, m in swept.items()}
    best = max(rate, key=rate.get)
    if rate[best] > ceiling.tflops:  # the fastest matmul measured is the practical peak
        return dict(precision=p, m=best, n=best, k=best, tflops=rate[best], conditions=swept[best].conditions)
    m, n, k = ceiling.shape
    return dict(precision=p, m=m, n=n, k=k, tflops=ceiling.tflops, conditions=ceiling.conditions)


def paired_medians(comparisons: dict, alone: dict) -> dict:
    """Each precision's median seconds in the interleaved pairs of ``comparisons`` ({precision: its comparison against
    fp32}): fp32's over its side of every pair, each other precision's over its own pairs; ``alone`` ({precision:
    seconds}) for a precision compared with nothing (fp32, when it is the only one). Shown beside the speed-ups, these
    are the times the verdicts come from (a time benched apart could say the opposite)."""
    paired = {"fp32": [t for c in comparisons.values() for t in c.baseline_times]}
    paired.update({p: c.candidate_times for p, c in comparisons.items()})
    return {p: statistics.median(paired[p]) if paired.get(p) else seconds for p, seconds in alone.items()}


def roofline(frame, title: str):
    """The roofline of one machine's rows of ``04_matmul_precision``: the sweep, its measured peaks (dashed), the dense
    datasheet peaks of that machine's card (dotted; none for a CPU) and the copy's memory roof."""
    from . import plots  # matplotlib, loaded when a figure is drawn

    peaks = frame[frame["kind"] == "peak"].set_index("precision")["tflops"].to_dict()
    name = frame["device_name"].iloc[0]
    return plots.roofline(frame[frame["kind"] == "matmul"], peaks=peaks,
                          datasheet={p: datasheets.peak(name, p) for p in peaks}, bandwidth_gbs=frame["gbs"].max(),
                          title=title)


def matmul_table(matmuls, over_fp32: dict, gpu_name: str | None):
    """Each precision at the sweep's largest size: its TFLOP/s in the interleaved pairs its speed-up over fp32 comes from,
    its measured peak, the dense datasheet peak of ``gpu_name``'s card (None: a CPU, no datasheet), and the speed-up with
    its interval and verdict."""
    sweep = matmuls[matmuls["kind"] == "matmul"].astype({"n": int})
    n = sweep["n"].max()
    precisions = list(dict.fromkeys(sweep["precision"]))
    alone = sweep[sweep["n"] == n].set_index("precision")["median_s"].to_dict()
    largest = pd.Series({p: tflops(matmul_flops(n, n, n), s) for p, s in paired_medians(over_fp32, alone).items()})
    peaks = matmuls[matmuls["kind"] == "peak"].set_index("precision")["tflops"]
    sheet = datasheets.find(gpu_name) if gpu_name else None
    datasheet = pd.Series({p: sheet.tflops.get(p) if sheet else None for p in precisions}, dtype=float)
    table = pd.DataFrame({f"TFLOP/s at n={n} (pairs)": largest, "measured peak": peaks,
                          "of measured peak": largest / peaks, "dense datasheet peak": datasheet,
                          "measured peak of datasheet": peaks / datasheet}).loc[precisions]
    speedups = pd.DataFrame({p: c.row() for p, c in over_fp32.items()}, index=SPEEDUP_COLUMNS).T
    return table.join(speedups.rename(columns=lambda c: c.replace("speedup", "over fp32")))


SPEEDUP_COLUMNS = ["speedup", "speedup_low", "speedup_high", "verdict"]


def datasheet_note(table, gpu_name: str | None) -> str:
    """Which datasheet entry ``table``'s dense peaks are, with its source; a measured peak above it, said so."""
    sheet = datasheets.find(gpu_name) if gpu_name else None
    if sheet is None:
        return f"No datasheet figures for {gpu_name or 'a CPU'} in gpulab.datasheets: measured peaks only."
    note = (f"{gpu_name} is the '{sheet.name}' entry of gpulab.datasheets, dense peaks in TFLOP/s: "
            + ", ".join(f"{p} {v:g}" for p, v in sheet.tflops.items()) + f" (source: {sheet.source}).")
    above = table.index[table["measured peak of datasheet"] > 1].tolist()
    if above:
        note += (f"\nMeasured above the datasheet's dense peak in {', '.join(above)}: that entry is not this card's "
                 "figure (another model or form factor), or the timing did not wait for the GPU.")
    return note


def styled(table):
    """``matmul_table`` or ``step_table`` formatted: rates to three digits, shares as percentages, speed-ups as ×."""
    def share(value):
        return "-" if value != value else f"{value * 100:.3g} %"

    formats = {}
    for column in table:
        if column.startswith(("of ", "MFU", "share of", "measured peak of")):
            formats[column] = share
        elif "over fp32" in column:
            formats[column] = "{:.2f}×"
        elif column in FORMATS:
            formats[column] = FORMATS[column]
        elif column not in ("verdict", "its precision"):
            formats[column] = "{:.3g}"
    return table.style.format(formats, na_rep="-")


FORMATS = {"samples/s": "{:,.0f}", "peak_mb": "{:.0f} MiB", "final_loss": "{:.3f}", "accuracy": "{:.1%}"}


def step_table(seconds: dict, comparisons: dict, fields: dict, batch: int, mfu=None):
    """The training steps side by side: each precision's ms per step and samples/s at its median in the interleaved
    pairs its speed-up over fp32 comes from (``seconds``), the speed-up with its interval and verdict, ``fields``
    ({precision: {peak_mb, final_loss, accuracy}}); with ``mfu`` (a ``flops.StepMFU``), its MFU beside the dense peak
    of its precision, of achievable, and its share of the one reference peak."""
    table = pd.DataFrame({"ms per step (pairs)": {p: s * 1e3 for p, s in seconds.items()},
                          "samples/s": {p: batch / s for p, s in seconds.items()}})
    speedups = pd.DataFrame({p: c.row() for p, c in comparisons.items()}, index=SPEEDUP_COLUMNS).T
    table = table.join(speedups.rename(columns=lambda c: c.replace("speedup", "speed-up over fp32")))
    table = table.join(pd.DataFrame(fields).T[["peak_mb", "final_loss", "accuracy"]])
    if mfu:
        u = {p: mfu.of(p, s) for p, s in seconds.items()}
        table["its precision"] = {p: x.precision for p, x in u.items()}
        table["MFU"] = {p: math.nan if x.impossible else x.mfu for p, x in u.items()}
        table["dense peak (TFLOP/s)"] = {p: x.datasheet_tflops for p, x in u.items()}
        table["of achievable"] = {p: math.nan if x.impossible else x.of_achievable for p, x in u.items()}
        table[mfu.one_peak_name] = {p: mfu.one_peak(p, s) for p, s in seconds.items()}
    return table


def support_table():
    """Every card of ``gpulab.datasheets``: its compute capability, which precisions it runs natively
    (``precision_support``), its dense TFLOP/s per precision (the denominators of MFU) and their source."""
    rows = []
    for gpu, sheet in datasheets.table().iterrows():
        cc = datasheets.SHEETS[gpu].compute_capability
        native = {p: "native" if s.available else "no" for p, s in precision_support(cc).items()}
        rows.append({"GPU": gpu, "compute capability": f"{cc[0]}.{cc[1]}", **native,
                     **{f"{p} TFLOP/s (dense)": sheet[p] for p in ("fp32", "tf32", "fp16", "bf16", "fp8")},
                     "source": sheet["source"]})
    return pd.DataFrame(rows).set_index("GPU")
