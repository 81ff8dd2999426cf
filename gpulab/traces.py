"""What the profiler recorded, as pandas DataFrames: operator tables, step timelines, GPU busy time per step.

The lessons write ``torch.profiler`` out in their cells; this module only reads what it produced:

- ``op_table(prof)``: ``prof.key_averages()`` as a DataFrame (times in ms), ``top_ops`` its largest rows;
- ``load_trace(path)``: a Chrome trace (``prof.export_chrome_trace``, ``.json`` or ``.json.gz``);
- ``steps``, ``phase_times``, ``timeline_spans``: the ``ProfilerStep#N`` windows, the time in each
  ``record_function`` range per step, and the spans a timeline figure draws;
- ``gpu_busy(trace)``: per step, the time at least one kernel ran (the union of kernel intervals) and the rest;
- ``record`` / ``reference_trace``: a GPU trace from a full run, shipped with its provenance in
  ``gpulab/reference/``;
- ``hta_breakdown``: HolisticTraceAnalysis's temporal and idle-time breakdown of a GPU trace, and
  ``idle_breakdown``: the same idle-time classification (host wait, kernel wait, other) done here.

Bad input (an empty profile, a trace without GPU events, a missing or corrupt file) raises ``TraceError``
with one line saying what to do.
"""

import gzip
import json
import logging
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from .mode import quick_mode
from .results import REFERENCE_DIR, environment

GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
PHASES = ("data", "forward", "backward", "optimizer")
STEP_PREFIX = "ProfilerStep#"
_US_PER_MS = 1e3


class TraceError(ValueError):
    """A profile or trace that cannot be analysed; the message says what to do."""


class NoDeviceEvents(TraceError):
    """The profile or trace holds no GPU events (recorded on a CPU, or without ProfilerActivity.CUDA)."""


# ----- the operator table -----------------------------------------------------------------------------


def op_table(profile, *, group_by_input_shape: bool = False) -> pd.DataFrame:
    """``profile.key_averages()`` as a DataFrame: one row per operator (and input shapes, when grouped).

    Columns: operator, input_shapes, is_range (a ``record_function`` range or ``ProfilerStep*``), calls,
    self_cpu_ms, cpu_total_ms, self_device_ms, device_total_ms, self_cpu_mem_mb, self_device_mem_mb.
    ``profile`` is a ``torch.profiler.profile`` or the EventList its ``key_averages()`` returned.
    """
    averages = _averages(profile, group_by_input_shape)
    rows = [{
        "operator": e.key,
        "input_shapes": str(e.input_shapes) if group_by_input_shape else "",
        "is_range": bool(e.is_user_annotation) or e.key.startswith("ProfilerStep"),
        "calls": e.count,
        "self_cpu_ms": e.self_cpu_time_total / _US_PER_MS,
        "cpu_total_ms": e.cpu_time_total / _US_PER_MS,
        "self_device_ms": e.self_device_time_total / _US_PER_MS,
        "device_total_ms": e.device_time_total / _US_PER_MS,
        "self_cpu_mem_mb": e.self_cpu_memory_usage / 1e6,
        "self_device_mem_mb": e.self_device_memory_usage / 1e6,
    } for e in averages]
    if not rows:
        raise TraceError("the profile holds no events: with a schedule(wait, warmup, active), call prof.step() "
                         "after every step, at least wait + warmup + active times, and read it after the `with` block")
    return pd.DataFrame(rows)


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
    """The ``n`` rows of an ``op_table`` with the most ``by``; ``record_function`` ranges left out unless ``ranges``."""
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


def events(trace) -> pd.DataFrame:
    """The trace's complete events (``"ph": "X"``), one row each, times in ms from the trace's first event.

    Columns: name, cat, kind (kernel, memcpy, memset for GPU events; the category otherwise), pid, tid,
    start_ms, end_ms, dur_ms.
    """
    trace = load_trace(trace)
    rows = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    if not rows:
        raise TraceError("the trace holds no events: was anything run inside the profiler's active steps?")
    frame = pd.DataFrame({
        "name": [str(e.get("name", "")) for e in rows],
        "cat": [str(e.get("cat", "")) for e in rows],
        "pid": [str(e.get("pid", "")) for e in rows],
        "tid": [str(e.get("tid", "")) for e in rows],
        "ts": [float(e["ts"]) for e in rows],
        "dur": [float(e.get("dur", 0.0)) for e in rows],
    })
    origin = frame["ts"].min()
    frame["kind"] = frame["cat"].map(GPU_CATEGORIES).fillna(frame["cat"])
    frame["start_ms"] = (frame["ts"] - origin) / _US_PER_MS
    frame["dur_ms"] = frame["dur"] / _US_PER_MS
    frame["end_ms"] = frame["start_ms"] + frame["dur_ms"]
    return frame.drop(columns=["ts", "dur"]).sort_values("start_ms", kind="stable").reset_index(drop=True)


def has_device_events(trace) -> bool:
    """True when the trace holds GPU kernels (it was recorded on a GPU with ProfilerActivity.CUDA)."""
    return bool((events(trace)["kind"] == "kernel").any())


def steps(trace) -> pd.DataFrame:
    """The ``ProfilerStep#N`` windows (one per ``prof.step()``): step, start_ms, end_ms, cpu_ms.

    A step's window runs from its start to the next step's start; the last one until its CPU side ends or the
    last GPU event ends, whichever is later (the GPU runs behind the CPU, so a step's kernels can end after it).
    """
    frame = events(trace)
    marks = frame[frame["name"].str.startswith(STEP_PREFIX)]
    if marks.empty:
        raise TraceError("the trace has no ProfilerStep#N ranges: call prof.step() at the end of every training step")
    marks = marks.assign(step=marks["name"].str.removeprefix(STEP_PREFIX).astype(int)).sort_values("start_ms")
    gpu = frame[frame["kind"].isin(GPU_CATEGORIES.values())]
    last_end = max(marks["end_ms"].iloc[-1], gpu["end_ms"].max() if len(gpu) else 0.0)
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


def gpu_busy(trace) -> pd.DataFrame:
    """Per step: how long at least one kernel ran on the GPU, and how long none did.

    Columns: step, step_ms, busy_ms, idle_ms, busy_share, kernels, memcpy_ms. ``busy_share`` is what
    NVML's "GPU utilisation" approximates over its sample period: the share of time *any* kernel ran.
    """
    trace = load_trace(trace)
    frame = events(trace)
    kernels = frame[frame["kind"] == "kernel"]
    if kernels.empty:
        raise NoDeviceEvents("this trace has no GPU kernels: it was recorded on a CPU or without ProfilerActivity.CUDA. "
                             "GPU busy time needs a trace recorded on a GPU (see traces.reference_trace())")
    copies = frame[frame["kind"] == "memcpy"]
    rows = []
    for step in steps(trace).itertuples():
        busy = busy_ms(kernels, step.start_ms, step.end_ms)
        window = step.end_ms - step.start_ms
        inside = kernels[(kernels["start_ms"] < step.end_ms) & (kernels["end_ms"] > step.start_ms)]
        rows.append({"step": step.step, "step_ms": window, "busy_ms": busy, "idle_ms": window - busy,
                     "busy_share": busy / window if window > 0 else float("nan"), "kernels": len(inside),
                     "memcpy_ms": busy_ms(copies, step.start_ms, step.end_ms)})
    return pd.DataFrame(rows)


IDLE_CATEGORIES = ("host_wait", "kernel_wait", "other")


def idle_breakdown(trace, kernel_wait_us: float = 30.0) -> pd.DataFrame:
    """The GPU's idle time per stream, by cause, classified as HolisticTraceAnalysis does it, from the trace JSON.

    Each gap before a GPU event (kernel, copy, memset) on its stream is **host wait** when the CPU called the
    CUDA runtime to launch that event only after the stream had run dry (the CPU was the bottleneck), **kernel
    wait** when the gap is shorter than ``kernel_wait_us`` (launch overhead between back-to-back kernels), and
    **other** otherwise. Like HTA, it counts only GPU events launched by the end of the last ``ProfilerStep``.
    Columns: stream, idle_category, idle_ms, idle_share (of that stream's idle time).
    """
    trace = load_trace(trace)
    raw = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    if not any(e.get("cat") == "kernel" for e in raw):
        raise NoDeviceEvents("this trace has no GPU kernels: idle time by cause needs a trace recorded on a GPU "
                             "(see traces.reference_trace())")
    launched_at = {e["args"]["correlation"]: float(e["ts"]) for e in raw
                   if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = pd.DataFrame([{"stream": e.get("args", {}).get("stream", e.get("tid")), "ts": float(e["ts"]),
                         "end": float(e["ts"]) + float(e.get("dur", 0.0)),
                         "launch": launched_at.get(e.get("args", {}).get("correlation"), float("nan"))}
                        for e in raw if e.get("cat") in GPU_CATEGORIES])
    step_ends = [float(e["ts"]) + float(e.get("dur", 0.0)) for e in raw if str(e.get("name")).startswith(STEP_PREFIX)]
    if step_ends:  # as HTA: only what the CPU launched by the end of the last profiled step
        gpu = gpu[gpu["launch"] <= max(step_ends)]
    rows = []
    for stream, events_on in gpu.sort_values("ts").groupby("stream", sort=True):
        previous_end = events_on["end"].shift(1)
        gap = (events_on["ts"] - previous_end).dropna()
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


def hta_breakdown(trace) -> tuple[pd.DataFrame, pd.DataFrame]:
    """HolisticTraceAnalysis on one GPU trace: (temporal breakdown, idle-time breakdown per stream).

    The temporal breakdown splits the GPU's time into idle, compute and non-compute (copies, memsets);
    the idle breakdown splits idle time into host wait (the CPU did not queue work fast enough), kernel
    wait (the short gaps between back-to-back kernels) and other.
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
            analysis = TraceAnalysis(trace_files={0: str(path)}, trace_dir=tmp, include_last_profiler_step=True)
            temporal = analysis.get_temporal_breakdown(visualize=False)
            idle, _ = analysis.get_idle_time_breakdown(visualize=False)
        except Exception as err:  # HTA's own failure on a trace it does not understand: say so in one line
            raise TraceError(f"HolisticTraceAnalysis {why} could not analyse this trace ({type(err).__name__}: {err}); "
                             "traces.idle_breakdown(trace) classifies idle time the same way from the trace JSON") from None
        finally:
            hta_log.setLevel(level)
    return temporal.reset_index(drop=True), idle.reset_index(drop=True)
