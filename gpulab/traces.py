"""What the profiler recorded, as pandas DataFrames: operator and kernel tables, step timelines, GPU busy time per step.

The lessons write ``torch.profiler`` out in their cells; this module only reads what it produced:

- ``op_table(prof)``: the CPU side of ``prof.key_averages()`` as a DataFrame (times in ms): one row per operator,
  ``record_function`` range and CUDA runtime call; ``kernel_table(prof)``: its GPU side (one row per kernel, copy,
  memset, and the GPU-side span of each range); ``top_ops`` the largest rows of either;
- ``load_trace(path)``: a Chrome trace (``prof.export_chrome_trace``, ``.json`` or ``.json.gz``);
- ``steps``, ``phase_times``, ``timeline_spans``: the ``ProfilerStep#N`` windows, the time in each
  ``record_function`` range per step, and the spans a timeline figure draws;
- ``gpu_busy(trace)``: per step, the time the GPU ran anything (kernels, copies, memsets), the time it ran kernels,
  and the rest (idle); ``temporal_breakdown``: the same over the whole trace, as HolisticTraceAnalysis splits it;
- ``idle_breakdown``: the GPU's idle time per stream by cause (host wait, kernel wait, other), as HTA classifies it;
- ``bottleneck(trace)``: what limits the profiled steps, read from those two: the GPU (busy nearly all the time),
  the CPU (its idle time mostly host wait), launch overhead (mostly kernel wait), or something else;
- ``range_spans(trace)``: each ``record_function`` range's CPU side beside its GPU side (see below);
- ``runtime_calls``: the CUDA runtime and driver calls in a trace (cudaLaunchKernel, cudaMalloc, ...), counted;
- ``record`` / ``reference_trace``: a GPU trace from a full run, shipped with its provenance in
  ``gpulab/reference/``; ``hta_breakdown``: HolisticTraceAnalysis itself on a trace.

How the numbers relate. A trace recorded on a GPU holds each ``ProfilerStep#N`` and ``record_function`` range twice:
on the CPU (``user_annotation``) and as a GPU-side span (``gpu_user_annotation``). The GPU side spans only the GPU
work launched *directly* inside the range, on the thread that opened it: not inside a nested range (that range's own
GPU side holds it), and not from another thread (autograd launches backward's kernels from a thread of its own). So a
``ProfilerStep`` whose work all sits in nested ranges has a GPU side of one copy or kernel, microseconds long, and a
``backward`` range one of the kernel that seeds the gradient. Steps are the CPU-side ones only. The GPU is *busy*
while a kernel, a copy or a memset runs (HTA's compute plus non-compute time) and *idle* otherwise (HTA's idle time);
``kernel_ms`` counts kernels alone, which is what NVML's "GPU utilisation" samples. ``temporal_breakdown`` and
``idle_breakdown`` agree with HTA (tests/test_traces_real_gpu.py checks it on real A100 and MI250 traces, with HTA
itself), except where HTA does something that has a name:

- HTA first rounds every event inward to whole microseconds (start up, end down; its workaround for events that
  overlap by nanoseconds), which shortens each kernel by up to 1 µs and lengthens each gap by as much: on a trace of
  many short kernels its idle time, kernel wait most, comes out larger. ``hta_rounding=True`` rounds the same way
  here and gives HTA's numbers; ``hta_breakdown(..., exact=True)`` turns HTA's rounding off and gives gpulab's.
- HTA's temporal breakdown counts every event with a ``stream`` argument as GPU time: CUDA synchronisation records
  (``cuda_sync``: stream and context syncs, stream waits, when they are recorded), which are the host or a stream
  *waiting*, and the CPU op that launches a Triton kernel; and it counts NCCL kernels as non-compute. gpulab counts
  kernels (NCCL's too), copies and memsets.
- Both mean to leave out GPU events the CPU queued after the last profiled step (code after the loop): gpulab does,
  from the CPU side of the last ``ProfilerStep``. HTA 0.5 keeps them when it includes the last step (as
  ``hta_breakdown`` runs it): it compares start times shifted to the trace's start with an end time it does not shift.
  The lesson's traces end at the last ``prof.step()``, so they hold no such events.

Bad input (an empty profile, a trace without GPU events, a missing or corrupt file) raises ``TraceError``
with one line saying what to do.
"""

import gzip
import json
import logging
import math
import os
import re
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from .mode import quick_mode
from .results import REFERENCE_DIR, environment

GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
DEVICE_SIDE_CATEGORIES = {*GPU_CATEGORIES, "gpu_user_annotation", "cuda_sync"}  # the GPU's rows of a trace
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the CPU's calls into the CUDA (or HIP) runtime and driver
PHASES = ("data", "forward", "backward", "optimizer")
STEP_PREFIX = "ProfilerStep#"
_US_PER_MS = 1e3
_RUNTIME_NAME = re.compile(r"^(cuda|cu[A-Z]|hip|hsa_)\w*$")  # cudaLaunchKernel, cuLaunchKernel, hipMemcpyWithStream
_HTA_EXACT_ENV = "HTA_DISABLE_NS_ROUNDING"


class TraceError(ValueError):
    """A profile or trace that cannot be analysed; the message says what to do."""


class NoDeviceEvents(TraceError):
    """The profile or trace holds no GPU events (recorded on a CPU, or without ProfilerActivity.CUDA)."""


# ----- the operator and kernel tables -----------------------------------------------------------------


def op_table(profile, *, group_by_input_shape: bool = False) -> pd.DataFrame:
    """The CPU side of ``profile.key_averages()`` as a DataFrame: one row per operator, ``record_function`` range
    and CUDA runtime call (and input shapes, when grouped).

    Columns: operator, input_shapes, kind ("operator", "range" or "runtime"), is_range (a ``record_function`` range
    or ``ProfilerStep*``), device_type ("CPU"), calls, self_cpu_ms, cpu_total_ms, self_device_ms (the time the
    kernels this operator launched itself ran on the GPU), device_total_ms (with its children's kernels),
    self_cpu_mem_mb, self_device_mem_mb. Each kernel's time is in the ``self_device_ms`` of one row only, so the
    column sums to the GPU time of the kernels the operators launched.

    On a GPU, ``key_averages()`` also holds a row per kernel and a GPU-side row per range (device_type CUDA):
    those are in ``kernel_table(profile)``, so that a range is one row here and no kernel is counted twice.
    ``profile`` is a ``torch.profiler.profile`` or the EventList its ``key_averages()`` returned.
    """
    rows = [row for row in _rows(profile, group_by_input_shape) if row["device_type"] == "CPU"]
    if not rows:
        raise TraceError("the profile holds no events: with a schedule(wait, warmup, active), call prof.step() "
                         "after every step, at least wait + warmup + active times, and read it after the `with` block")
    return pd.DataFrame(rows)


def kernel_table(profile, *, group_by_input_shape: bool = False) -> pd.DataFrame:
    """The GPU side of ``profile.key_averages()``: one row per kernel, copy and memset (kind "kernel", "memcpy",
    "memset"), and per ``record_function`` range that launched GPU work directly (kind "range", is_range: its GPU
    side, from the first to the last GPU event launched inside it on its own thread and outside its nested ranges;
    see ``range_spans``). The columns of ``op_table``; here ``operator`` is the kernel's name, the CPU columns are 0
    and ``self_device_ms`` = ``device_total_ms`` is the time it ran.
    """
    rows = [row for row in _rows(profile, group_by_input_shape) if row["device_type"] != "CPU"]
    if not rows:
        raise NoDeviceEvents("this profile has no GPU kernels: it was recorded on a CPU or without "
                             "ProfilerActivity.CUDA. op_table(prof) has its CPU side; profile on a GPU for kernels")
    return pd.DataFrame(rows)


def _rows(profile, group_by_input_shape: bool) -> list[dict]:
    rows = []
    for e in _averages(profile, group_by_input_shape):
        device_type = getattr(getattr(e, "device_type", None), "name", "CPU")
        is_range = bool(getattr(e, "is_user_annotation", False)) or e.key.startswith("ProfilerStep")
        rows.append({
            "operator": e.key,
            "input_shapes": str(e.input_shapes) if group_by_input_shape else "",
            "kind": _kind(e.key, is_range, device_type),
            "is_range": is_range,
            "device_type": device_type,
            "calls": e.count,
            "self_cpu_ms": e.self_cpu_time_total / _US_PER_MS,
            "cpu_total_ms": e.cpu_time_total / _US_PER_MS,
            "self_device_ms": e.self_device_time_total / _US_PER_MS,
            "device_total_ms": e.device_time_total / _US_PER_MS,
            "self_cpu_mem_mb": e.self_cpu_memory_usage / 1e6,
            "self_device_mem_mb": e.self_device_memory_usage / 1e6,
        })
    return rows


def _kind(name: str, is_range: bool, device_type: str) -> str:
    if is_range:
        return "range"
    if device_type == "CPU":
        return "runtime" if _RUNTIME_NAME.match(name) else "operator"
    if name.startswith(("Memcpy", "Memset")):  # Kineto's names for copies and memsets ("Memcpy HtoD (...)")
        return name[:6].lower()
    return "kernel"


def _averages(profile, group_by_input_shape: bool):
    if hasattr(profile, "key_averages") and not isinstance(profile, list):
        try:
            return profile.key_averages(group_by_input_shape=group_by_input_shape)
        except AssertionError:  # torch: "Profiler must be initialized before getting key averages"
            raise TraceError("this profiler has not recorded anything: run your steps inside "
                             "`with torch.profiler.profile(...) as prof:` and pass `prof`") from None
    if isinstance(profile, list):
        return profile
    raise TraceError(f"op_table() needs a torch.profiler.profile or its key_averages(), got {type(profile).__name__}")


def top_ops(table: pd.DataFrame, by: str = "self_device_ms", n: int = 10, ranges: bool = False) -> pd.DataFrame:
    """The ``n`` rows of an ``op_table`` (or ``kernel_table``) with the most ``by``; ranges left out unless ``ranges``."""
    if not isinstance(table, pd.DataFrame) or by not in table.columns:
        columns = ", ".join(c for c in getattr(table, "columns", []) if c.endswith("_ms")) or "none: pass op_table(prof)"
        raise TraceError(f"top_ops() needs an op_table(...) DataFrame and one of its time columns ({columns}), got by={by!r}")
    rows = table if ranges else table[~table["is_range"]]
    if rows.empty:
        raise TraceError("the table has no operators, only record_function ranges: profile code that runs PyTorch ops")
    if by.startswith(("self_device", "device")) and not (rows[by] > 0).any():
        raise NoDeviceEvents(f"this profile has no device time (column {by} is all zero): it was recorded on a CPU or "
                             "without ProfilerActivity.CUDA. Sort by self_cpu_ms instead, or profile on a GPU")
    return rows.sort_values(by, ascending=False).head(n).reset_index(drop=True)


# ----- traces: loading, events, steps -----------------------------------------------------------------


def load_trace(path) -> dict:
    """A Chrome trace written by ``prof.export_chrome_trace(path)`` (``.json`` or ``.json.gz``), as a dict.

    A dict that already is a trace is returned as it is.
    """
    if isinstance(path, dict):
        trace, where = path, "this dict"
    else:
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"no trace at {path}: write one with prof.export_chrome_trace({str(path)!r}) first")
        try:
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as f:
                trace = json.load(f)
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TraceError(f"{path} is not a readable trace ({type(err).__name__}: {err}); export it again "
                             "with prof.export_chrome_trace()") from None
        where = str(path)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{where} is not a Chrome trace from torch.profiler (it has no 'traceEvents' list)")
    return trace


def _complete(trace) -> list[dict]:
    """The trace's complete events (``"ph": "X"``) that have a start time."""
    return [e for e in load_trace(trace)["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]


def events(trace) -> pd.DataFrame:
    """The trace's complete events (``"ph": "X"``), one row each, times in ms from the trace's first event.

    Columns: name, cat, kind (kernel, memcpy, memset for GPU events; the category otherwise), pid, tid,
    start_ms, end_ms, dur_ms.
    """
    rows = _complete(trace)
    if not rows:
        raise TraceError("the trace holds no events: was anything run inside the profiler's active steps?")
    frame = pd.DataFrame({
        "name": [str(e.get("name", "")) for e in rows],
        "cat": [str(e.get("cat", "")) for e in rows],
        "pid": [str(e.get("pid", "")) for e in rows],
        "tid": [str(e.get("tid", "")) for e in rows],
        "ts": [_microseconds(e, "ts") for e in rows],
        "dur": [_microseconds(e, "dur", 0.0) for e in rows],
    })
    origin = frame["ts"].min()
    frame["kind"] = frame["cat"].map(GPU_CATEGORIES).fillna(frame["cat"])
    frame["start_ms"] = (frame["ts"] - origin) / _US_PER_MS
    frame["dur_ms"] = frame["dur"] / _US_PER_MS
    frame["end_ms"] = frame["start_ms"] + frame["dur_ms"]
    return frame.drop(columns=["ts", "dur"]).sort_values("start_ms", kind="stable").reset_index(drop=True)


def _microseconds(event: dict, key: str, default: float | None = None) -> float:
    """An event's ``ts`` or ``dur`` as a number, or a TraceError naming the event."""
    value = event.get(key, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TraceError(f"event {str(event.get('name', '?'))[:60]!r} has {key}={value!r}, not a number of "
                         "microseconds: is this a Chrome/Kineto trace exported by torch.profiler?") from None


def has_device_events(trace) -> bool:
    """True when the trace holds GPU kernels (it was recorded on a GPU with ProfilerActivity.CUDA)."""
    return any(e.get("cat") == "kernel" for e in _complete(trace))


def _step_marks(frame: pd.DataFrame) -> pd.DataFrame:
    """The CPU-side ``ProfilerStep#N`` ranges of an ``events`` frame, with their step number, in time order.

    A GPU trace also holds each one as a GPU-side span (``gpu_user_annotation``) over the GPU work launched directly
    in the step, outside its nested ranges: a second, much shorter window for the same step. Those are left out.
    """
    marks = frame[frame["name"].str.startswith(STEP_PREFIX) & ~frame["cat"].isin(DEVICE_SIDE_CATEGORIES)]
    return marks.assign(step=marks["name"].str.removeprefix(STEP_PREFIX).astype(int)).sort_values("start_ms")


def steps(trace) -> pd.DataFrame:
    """The ``ProfilerStep#N`` windows (one per ``prof.step()``, from the CPU's side): step, start_ms, end_ms, cpu_ms.

    A step's window runs from its start to the next step's start; the last one until its CPU side ends or the last
    GPU event it launched ends, whichever is later (the GPU runs behind the CPU, so a step's kernels can end after it).
    """
    trace = load_trace(trace)
    frame = events(trace)
    marks = _step_marks(frame)
    if marks.empty:
        raise TraceError("the trace has no ProfilerStep#N ranges: call prof.step() at the end of every training step")
    gpu = _device_activity(trace)
    gpu_end = gpu["end"].max() / _US_PER_MS if len(gpu) else 0.0
    last_end = max(marks["end_ms"].iloc[-1], gpu_end)
    ends = list(marks["start_ms"].iloc[1:]) + [last_end]
    return pd.DataFrame({"step": marks["step"].to_numpy(), "start_ms": marks["start_ms"].to_numpy(), "end_ms": ends,
                         "cpu_ms": marks["dur_ms"].to_numpy()})


def busy_ms(intervals, start_ms: float, end_ms: float) -> float:
    """Milliseconds of [start_ms, end_ms] covered by at least one interval (overlaps counted once).

    ``intervals`` is a DataFrame with start_ms and end_ms columns, or (start, end) pairs.
    """
    pairs = intervals[["start_ms", "end_ms"]].to_numpy() if isinstance(intervals, pd.DataFrame) else intervals
    clipped = sorted((max(s, start_ms), min(e, end_ms)) for s, e in pairs if e > start_ms and s < end_ms)
    total, reach = 0.0, start_ms
    for s, e in clipped:
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


# ----- the GPU's activity: busy, idle, and why ------------------------------------------------------------


def _device_activity(trace, hta_rounding: bool = False) -> pd.DataFrame:
    """The GPU's kernels, copies and memsets (µs from the trace's first event): stream, kind, name, start, end, and
    ``launch``, the time of the CUDA runtime or driver call that queued it (matched by ``correlation``; NaN when there
    is none).

    When the trace holds two profiled steps or more, only the events the CPU launched by the end of the last one (its
    CPU side) are kept: a kernel queued after the profiled steps is no part of them (HTA's rule, which HTA 0.5 itself
    misses when it includes the last step). With ``hta_rounding``, every event is first rounded inward to whole
    microseconds, as HTA does by default.
    """
    raw = _complete(trace)
    origin = min((float(e["ts"]) for e in raw), default=0.0)

    def span(e):  # from the trace's first event: the difference of two large timestamps is exact, their sum is not
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if hta_rounding:
            return math.ceil(ts) - math.ceil(origin), math.floor(ts + dur) - math.ceil(origin)
        return ts - origin, ts - origin + dur

    launched_at = {e["args"]["correlation"]: span(e)[0] for e in raw
                   if e.get("cat") in RUNTIME_CATEGORIES and "correlation" in (e.get("args") or {})}
    rows = []
    for e in raw:
        if e.get("cat") in GPU_CATEGORIES:
            args = e.get("args") or {}
            start, end = span(e)
            rows.append({"stream": args.get("stream", e.get("tid")), "kind": GPU_CATEGORIES[e["cat"]],
                         "name": str(e.get("name", "")), "start": start, "end": end,
                         "launch": launched_at.get(args.get("correlation"), float("nan"))})
    gpu = pd.DataFrame(rows, columns=["stream", "kind", "name", "start", "end", "launch"])
    marks = [e for e in raw if str(e.get("name", "")).startswith(STEP_PREFIX) and e.get("cat") not in
             DEVICE_SIDE_CATEGORIES]
    if len({e["name"] for e in marks}) >= 2:  # as HTA: with one step or none, it keeps everything
        gpu = gpu[gpu["launch"] <= max(span(e)[1] for e in marks)]
    return gpu.sort_values("start", kind="stable").reset_index(drop=True)


def _require_kernels(trace, what: str) -> pd.DataFrame:
    gpu = _device_activity(trace)
    if not (gpu["kind"] == "kernel").any():
        raise NoDeviceEvents(f"this trace has no GPU kernels: it was recorded on a CPU or without "
                             f"ProfilerActivity.CUDA. {what} needs a trace recorded on a GPU (see traces.reference_trace())")
    return gpu


def gpu_busy(trace) -> pd.DataFrame:
    """Per step: how long the GPU ran anything, how long it ran kernels, and how long it ran nothing.

    Columns: step, step_ms, busy_ms (a kernel, copy or memset ran: the union of their intervals, overlaps counted
    once), kernel_ms (a kernel ran), idle_ms (nothing ran: step_ms - busy_ms, HTA's idle time), busy_share,
    kernel_share, kernels, memcpy_ms, memset_ms. ``kernel_share`` is what NVML's "GPU utilisation" approximates over
    its sample period: the share of time *any* kernel ran, however small (one thread counts), from any process on the
    GPU, where the trace holds this process's only (copy engines do not count there).
    """
    trace = load_trace(trace)
    gpu = _require_kernels(trace, "GPU busy time")
    gpu = gpu.assign(start_ms=gpu["start"] / _US_PER_MS, end_ms=gpu["end"] / _US_PER_MS)
    by_kind = {kind: gpu[gpu["kind"] == kind] for kind in GPU_CATEGORIES.values()}
    rows = []
    for step in steps(trace).itertuples():
        window = step.end_ms - step.start_ms
        busy = busy_ms(gpu, step.start_ms, step.end_ms)
        kernel = busy_ms(by_kind["kernel"], step.start_ms, step.end_ms)
        kernels = by_kind["kernel"]
        inside = kernels[(kernels["start_ms"] < step.end_ms) & (kernels["end_ms"] > step.start_ms)]
        rows.append({"step": step.step, "step_ms": window, "busy_ms": busy, "kernel_ms": kernel,
                     "idle_ms": window - busy, "busy_share": _share(busy, window), "kernel_share": _share(kernel, window),
                     "kernels": len(inside), "memcpy_ms": busy_ms(by_kind["memcpy"], step.start_ms, step.end_ms),
                     "memset_ms": busy_ms(by_kind["memset"], step.start_ms, step.end_ms)})
    return pd.DataFrame(rows)


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else float("nan")


def temporal_breakdown(trace, hta_rounding: bool = False) -> pd.DataFrame:
    """The GPU's time from its first event to its last (HTA's "kernel time"), split as HTA's temporal breakdown
    splits it: idle, compute (a kernel ran) and non-compute (only copies or memsets ran). One row:
    span_ms, busy_ms, compute_ms, non_compute_ms, idle_ms, idle_share. See the module's notes on how it relates to
    HTA's own numbers."""
    gpu = _require_kernels(trace, "The temporal breakdown")
    gpu = _device_activity(trace, hta_rounding) if hta_rounding else gpu
    pairs = list(zip(gpu["start"], gpu["end"]))
    first, last = gpu["start"].min(), gpu["end"].max()
    busy = busy_ms(pairs, first, last)
    compute = busy_ms([p for p, kind in zip(pairs, gpu["kind"]) if kind == "kernel"], first, last)
    span = last - first
    return pd.DataFrame([{"span_ms": span / _US_PER_MS, "busy_ms": busy / _US_PER_MS, "compute_ms": compute / _US_PER_MS,
                          "non_compute_ms": (busy - compute) / _US_PER_MS, "idle_ms": (span - busy) / _US_PER_MS,
                          "idle_share": (span - busy) / span if span > 0 else 0.0}])


IDLE_CATEGORIES = ("host_wait", "kernel_wait", "other")


def idle_breakdown(trace, kernel_wait_us: float = 30.0, hta_rounding: bool = False) -> pd.DataFrame:
    """The GPU's idle time per stream, by cause, classified as HolisticTraceAnalysis does it, from the trace JSON.

    Each gap before a GPU event (kernel, copy, memset) on its stream is **host wait** when the CPU called the
    CUDA runtime to launch that event only after the stream had run dry (the CPU was the bottleneck), **kernel
    wait** when the gap is shorter than ``kernel_wait_us`` (launch overhead between back-to-back kernels), and
    **other** otherwise. It counts only GPU events launched by the end of the last ``ProfilerStep``, and with
    ``hta_rounding`` rounds each event inward to whole microseconds first, as HTA does by default.
    Columns: stream, idle_category, idle_ms, idle_share (of that stream's idle time).
    """
    _require_kernels(trace, "Idle time by cause")
    gpu = _device_activity(trace, hta_rounding)
    rows = []
    for stream, events_on in gpu.sort_values("start", kind="stable").groupby("stream", sort=True):
        previous_end = events_on["end"].shift(1)
        gap = (events_on["start"] - previous_end).dropna()
        host = (events_on["launch"] > previous_end).loc[gap.index]
        category = pd.Series("other", index=gap.index)
        category[~host & (gap < kernel_wait_us)] = "kernel_wait"
        category[host] = "host_wait"
        total = gap.sum()
        for name in IDLE_CATEGORIES:
            idle_us = gap[category == name].sum()
            rows.append({"stream": stream, "idle_category": name, "idle_ms": idle_us / _US_PER_MS,
                         "idle_share": idle_us / total if total > 0 else 0.0})
    return pd.DataFrame(rows)


GPU_BOUND_AT = 0.9  # busy this share of the steps' window or more: the GPU is what limits them
_BOUND_BY_CAUSE = {"host_wait": "CPU", "kernel_wait": "launch overhead", "other": "other"}


@dataclass(frozen=True)
class Bottleneck:
    """What limits the profiled steps of a GPU trace: ``bound`` is "GPU" when the GPU was busy at least
    ``GPU_BOUND_AT`` of the steps' window, else named after the largest cause of its idle time: "CPU" (host wait),
    "launch overhead" (kernel wait) or "other". Shares are fractions; ``idle_causes`` splits the idle time between
    the GPU's events by cause (``idle_breakdown``, all streams together)."""

    bound: str
    busy_share: float
    kernel_share: float
    idle_causes: dict

    def __str__(self) -> str:
        busy = f"the GPU ran kernels, copies or memsets {self.busy_share:.1%} of the profiled steps' time"
        if self.bound == "GPU":
            return f"the GPU is the bottleneck: {busy}"
        cause = max(self.idle_causes, key=self.idle_causes.get)
        why = {"host_wait": "host wait (the CPU had not queued the next GPU work yet)",
               "kernel_wait": "kernel wait (short gaps between back-to-back kernels: launch overhead)",
               "other": "neither host nor kernel wait (waits on events or other streams)"}[cause]
        return (f"the {self.bound} is the bottleneck, not the GPU: {busy}, and {self.idle_causes[cause]:.0%} of its "
                f"idle time was {why}")


def bottleneck(trace, busy_at_least: float = GPU_BOUND_AT) -> Bottleneck:
    """Read from a GPU trace what limits its profiled steps (see ``Bottleneck``): the busy share over all the steps'
    windows together (``gpu_busy``), and the causes of the idle time (``idle_breakdown``)."""
    busy = gpu_busy(trace)
    window = busy["step_ms"].sum()
    idle = idle_breakdown(trace).groupby("idle_category")["idle_ms"].sum().reindex(IDLE_CATEGORIES, fill_value=0.0)
    total = idle.sum()
    causes = {name: float(ms / total) if total > 0 else 0.0 for name, ms in idle.items()}
    if total == 0:  # no gap between GPU events: the idle time is before the first one, waiting for the CPU
        causes["host_wait"] = 1.0
    busy_share = _share(busy["busy_ms"].sum(), window)
    bound = "GPU" if busy_share >= busy_at_least else _BOUND_BY_CAUSE[max(causes, key=causes.get)]
    return Bottleneck(bound, busy_share, _share(busy["kernel_ms"].sum(), window), causes)


def range_spans(trace) -> pd.DataFrame:
    """Each ``record_function`` range and ``ProfilerStep`` of a GPU trace: its CPU side beside its GPU side.

    Columns: step (the ``ProfilerStep`` the range ran in; NaN outside them), name, cpu_ms (the CPU side's length),
    launched (the GPU events the CPU launched while the range ran, from any thread or nested range), gpu_span_ms (the
    GPU side's length; NaN when the range has none), in_span (the GPU events inside the GPU side). The GPU side spans
    only the work launched directly in the range on its own thread (the module's notes), so for a ``ProfilerStep``
    ``in_span`` is far below ``launched``.
    """
    raw = _complete(trace)
    gpu = _require_kernels(trace, "The GPU side of the ranges")
    origin = min(float(e["ts"]) for e in raw)

    def window(e):
        start = float(e["ts"]) - origin
        return start, start + float(e.get("dur", 0.0))

    gpu_side = {(e.get("args") or {}).get("External id"): window(e) for e in raw if e.get("cat") == "gpu_user_annotation"}
    cpu_side = [e for e in raw if e.get("cat") == "user_annotation"]
    windows = steps(trace)
    rows = []
    for e in cpu_side:
        start, end = window(e)
        span = gpu_side.get((e.get("args") or {}).get("External id"))
        inside = windows[(windows["start_ms"] * _US_PER_MS <= start) & (start < windows["end_ms"] * _US_PER_MS)]
        rows.append({
            "step": inside["step"].iloc[0] if len(inside) else float("nan"),
            "name": str(e.get("name", "")),
            "cpu_ms": (end - start) / _US_PER_MS,
            "launched": int(gpu["launch"].between(start, end).sum()),
            "gpu_span_ms": (span[1] - span[0]) / _US_PER_MS if span else float("nan"),
            "in_span": int(((gpu["start"] >= span[0]) & (gpu["end"] <= span[1])).sum()) if span else 0,
        })
    return pd.DataFrame(rows, columns=["step", "name", "cpu_ms", "launched", "gpu_span_ms", "in_span"])

def runtime_calls(trace) -> pd.DataFrame:
    """The CPU's calls into the CUDA (or HIP) runtime and driver in a trace, per name: name, calls, total_ms, mean_us,
    most calls first. ``cudaLaunchKernel`` counts launches, ``cudaMalloc`` / ``cudaFree`` the allocations the
    caching allocator could not serve from its cache, ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` the
    times the CPU waited. Empty on a trace recorded without ProfilerActivity.CUDA."""
    calls = [(str(e.get("name", "")), float(e.get("dur", 0.0))) for e in _complete(trace)
             if e.get("cat") in RUNTIME_CATEGORIES]
    frame = pd.DataFrame(calls, columns=["name", "dur"])
    table = frame.groupby("name", sort=False)["dur"].agg(["count", "sum"]).reset_index()
    table.columns = ["name", "calls", "total_ms"]
    table["total_ms"] = table["total_ms"] / _US_PER_MS
    table["mean_us"] = table["total_ms"] * _US_PER_MS / table["calls"].clip(lower=1)
    return table.sort_values(["calls", "total_ms"], ascending=False, kind="stable").reset_index(drop=True)


def phase_times(trace, phases=PHASES) -> pd.DataFrame:
    """Per step, the CPU time spent in each ``record_function`` range named in ``phases``, and the rest ("other").

    Works on CPU-only traces too: it reads the ranges the training loop marked on the CPU.
    """
    frame = events(trace)
    ranges = frame[frame["cat"].eq("user_annotation") & frame["name"].isin(phases)]
    if ranges.empty:
        raise TraceError(f"the trace has none of the ranges {list(phases)}: wrap each part of the step in "
                         "`with torch.profiler.record_function(name):`")
    rows = []
    for step in steps(trace).itertuples():
        inside = ranges[(ranges["start_ms"] >= step.start_ms) & (ranges["start_ms"] < step.end_ms)]
        row = {"step": step.step, **{p: inside.loc[inside["name"] == p, "dur_ms"].sum() for p in phases}}
        row["other"] = max(step.end_ms - step.start_ms - sum(row[p] for p in phases), 0.0)
        rows.append(row)
    return pd.DataFrame(rows)


def op_ranges(trace, ranges=PHASES) -> pd.DataFrame:
    """The trace's CPU operators (``cat == "cpu_op"``), each with the ``record_function`` range it ran in.

    Column ``range`` holds the name from ``ranges`` whose span on the same thread contains the operator's start,
    or "" when it ran outside all of them. Answers "which part of the step calls this operator?".
    """
    frame = events(trace)
    ops = frame[frame["cat"] == "cpu_op"].sort_values("start_ms")
    marks = frame[frame["cat"].eq("user_annotation") & frame["name"].isin(ranges)].sort_values("start_ms")
    marks = marks[["tid", "start_ms", "end_ms", "name"]].rename(
        columns={"start_ms": "range_start_ms", "end_ms": "range_end_ms", "name": "range"})
    merged = pd.merge_asof(ops, marks, left_on="start_ms", right_on="range_start_ms", by="tid", direction="backward")
    outside = merged["range"].isna() | (merged["start_ms"] >= merged["range_end_ms"])
    merged["range"] = merged["range"].where(~outside, "")
    return merged.drop(columns=["range_start_ms", "range_end_ms"]).reset_index(drop=True)


def allocations(trace) -> pd.DataFrame:
    """The memory allocations in a trace recorded with ``profile_memory=True``: one row each (bytes, device).

    Frees (negative sizes) are left out. Empty when the profile did not record memory.
    """
    trace = load_trace(trace)
    rows = [e.get("args", {}) for e in trace["traceEvents"]
            if isinstance(e, dict) and e.get("name") == "[memory]" and e.get("args", {}).get("Bytes", 0) > 0]
    return pd.DataFrame({"bytes": [int(a["Bytes"]) for a in rows],
                         "device": ["cpu" if a.get("Device Type", 0) == 0 else "gpu" for a in rows]})


def timeline_spans(trace, ranges=PHASES) -> pd.DataFrame:
    """Spans for ``plots.trace_timeline``: the CPU's ``record_function`` ranges (one lane per thread) and the
    GPU's kernels, copies and memsets (one lane per stream). Columns lane, kind, start_ms, end_ms."""
    frame = events(trace)
    cpu = frame[frame["cat"].eq("user_annotation") & frame["name"].isin(ranges)]
    gpu = frame[frame["kind"].isin(GPU_CATEGORIES.values())]
    threads = {tid: f"CPU thread {i}" for i, tid in enumerate(dict.fromkeys(cpu["tid"]))}
    spans = pd.concat([
        pd.DataFrame({"lane": cpu["tid"].map(threads), "kind": cpu["name"], "start_ms": cpu["start_ms"],
                      "end_ms": cpu["end_ms"]}),
        pd.DataFrame({"lane": "GPU " + gpu["pid"] + " stream " + gpu["tid"], "kind": "GPU " + gpu["kind"],
                      "start_ms": gpu["start_ms"], "end_ms": gpu["end_ms"]}),
    ])
    if spans.empty:
        raise TraceError(f"the trace has none of the ranges {list(ranges)} and no GPU events to draw")
    return spans.reset_index(drop=True)


# ----- a GPU trace with its provenance ------------------------------------------------------------------


SHIPPED_CATEGORIES = {"user_annotation", "gpu_user_annotation", "cuda_runtime", "cuda_driver", *GPU_CATEGORIES}


def record(trace_path, name: str = "06_trace", command: str = "", target_dir=None) -> Path:
    """Ship a GPU trace exported by a full run of the lesson: ``gpulab/reference/<name>.json.gz``, with provenance.

    The provenance (the same fields as a ``ResultLog`` row, the date and the command) goes into the trace's
    ``"gpulab"`` key; Perfetto and HolisticTraceAnalysis ignore it. To stay small the shipped copy keeps the
    ranges, the CUDA runtime calls and the GPU's events (what the timeline and HTA read), not every CPU operator
    or allocation. Quick-mode and CPU traces are refused: a shipped trace comes from a full run on a real GPU.
    """
    trace = load_trace(trace_path)
    if not has_device_events(trace):
        raise NoDeviceEvents("this trace has no GPU kernels: only a trace recorded on a GPU can be shipped")
    if quick_mode():
        raise TraceError("this is a quick-mode run: shipped traces come from full runs (GPULAB_QUICK=0 on a GPU)")
    kept = [e for e in trace["traceEvents"]
            if isinstance(e, dict) and (e.get("ph") != "X" or e.get("cat") in SHIPPED_CATEGORIES
                                        or str(e.get("name", "")).startswith(STEP_PREFIX))]
    provenance = {**environment(), "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "command": command}
    target = Path(target_dir or REFERENCE_DIR) / f"{name}.json.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(target, "wt", encoding="utf-8") as f:
        json.dump({**trace, "traceEvents": kept, "gpulab": provenance}, f)
    return target


def reference_trace(name: str = "06_trace"):
    """The GPU trace the course ships as ``gpulab/reference/<name>.json(.gz)`` and its provenance, after one
    line saying where it comes from; ``(None, {})`` (and a line saying so) when none ships yet."""
    path = next((p for p in (REFERENCE_DIR / f"{name}.json.gz", REFERENCE_DIR / f"{name}.json") if p.exists()), None)
    if path is None:
        print(f"No reference trace '{name}' ships with the course yet: a full run of this lesson on a GPU "
              f"(GPULAB_QUICK=0) records one with traces.record(), into gpulab/reference/{name}.json.gz.")
        return None, {}
    trace = load_trace(path)
    meta = trace.get("gpulab") or {}
    if not meta.get("device_name"):
        raise TraceError(f"{path.name} carries no provenance (no 'gpulab' key with the device): it cannot be shown "
                         "as a reference; record it again with traces.record()")
    print(f"Reference trace '{name}': {meta['device_name']}, driver {meta.get('driver') or '?'}, torch {meta.get('torch')}, "
          f"recorded {str(meta.get('recorded_at', '?'))[:10]}" + (f" by `{meta['command']}`" if meta.get("command") else "")
          + ".")
    return trace, meta


# ----- HolisticTraceAnalysis ----------------------------------------------------------------------------


def hta_available() -> tuple[bool, str]:
    """(True, version) when HolisticTraceAnalysis can be imported, else (False, what to install)."""
    try:
        from importlib.metadata import version

        import hta  # noqa: F401
    except ImportError:
        return False, "HolisticTraceAnalysis is not installed: pip install holistictraceanalysis"
    return True, version("holistictraceanalysis")


def hta_breakdown(trace, *, exact: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """HolisticTraceAnalysis on one GPU trace: (temporal breakdown, idle-time breakdown per stream).

    The temporal breakdown splits the GPU's time into idle, compute and non-compute (copies, memsets);
    the idle breakdown splits idle time into host wait (the CPU did not queue work fast enough), kernel
    wait (the short gaps between back-to-back kernels) and other. Times in µs, as HTA gives them.

    HTA rounds every event inward to whole microseconds before it analyses a trace; ``exact=True`` runs it with
    that rounding off (its ``HTA_DISABLE_NS_ROUNDING=1``), on the timestamps gpulab's own functions read.
    """
    ok, why = hta_available()
    if not ok:
        raise TraceError(why)
    trace = load_trace(trace)
    if not has_device_events(trace):  # HTA itself fails on such a trace with an IndexError
        raise NoDeviceEvents("HolisticTraceAnalysis needs GPU kernels in the trace: this one was recorded on a CPU or "
                             "without ProfilerActivity.CUDA (use traces.reference_trace() for a GPU trace)")
    from hta.trace_analysis import TraceAnalysis

    hta_log = logging.getLogger("hta")
    level = hta_log.level
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # HTA 0.5 still uses pandas calls that pandas 3 deprecates; they are HTA's to fix, not the learner's.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(hta|pandas)(\.|$)")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(hta|pandas)(\.|$)")
        path = Path(tmp) / "rank-0.json.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump({**trace, "distributedInfo": trace.get("distributedInfo") or {"rank": 0}}, f)
        hta_log.setLevel(logging.ERROR)  # its progress lines are logged as warnings
        try:
            with _environment(**{_HTA_EXACT_ENV: "1" if exact else None}):
                analysis = TraceAnalysis(trace_files={0: str(path)}, trace_dir=tmp, include_last_profiler_step=True)
            temporal = analysis.get_temporal_breakdown(visualize=False)
            idle, _ = analysis.get_idle_time_breakdown(visualize=False)
        except Exception as err:  # HTA's own failure on a trace it does not understand: say so in one line
            raise TraceError(f"HolisticTraceAnalysis {why} could not analyse this trace ({type(err).__name__}: {err}); "
                             "traces.idle_breakdown(trace) classifies idle time the same way from the trace JSON") from None
        finally:
            hta_log.setLevel(level)
    return temporal.reset_index(drop=True), idle.reset_index(drop=True)


@contextmanager
def _environment(**values):
    """Set (a string) or unset (None) environment variables for the ``with`` block, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
