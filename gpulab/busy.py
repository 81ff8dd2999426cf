"""How busy one configuration keeps the GPU, measured as the field measures it: a short profiler window of that
configuration's own steps, and the time a kernel ran over the steps' window (lesson 06's method).

NVML's "GPU utilisation", sampled while an epoch runs, cannot tell two configurations apart: NVML averages it over
its own sample period (1/6 s to 1 s), so a 70 ms epoch holds a few samples that belong partly to whatever ran
before, and it counts time when *any* kernel ran, even one thread on one SM. ``measure`` profiles a few steps of
one configuration with ``torch.profiler`` and reads the trace (``traces.gpu_busy``); then it runs the same steps
unprofiled for about a second and reads NVML's utilisation and, on Hopper and newer where nvidia-ml-py offers it,
NVML's GPM SM activity (the share of the SMs' time that had work), both over that second, as a cross-check.

    >>> print(busy.measure(lambda: train_step(x, y), label="bf16, compiled"))  # an illustration, not a measurement
    bf16, compiled: kernels ran 96.1% of the step window over 20 profiled steps of 4.2 ms (NVML utilisation 100%, SM activity 88%)
"""

import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from . import nvml, traces
from .device import get_device, on_gpu
from .mode import by_mode
from .timing import synced_clock

nan = math.nan


@dataclass(frozen=True)
class Busy:
    """The GPU's busy share for one configuration. Shares are fractions; NaN where not measurable (no GPU, no NVML)."""

    label: str
    steps: int = 0  # profiled steps
    step_ms: float = nan  # the median step's window in the trace
    kernel_share: float = nan  # a kernel ran, over the steps' window (the trace)
    busy_share: float = nan  # a kernel, copy or memset ran
    nvml_util: float = nan  # NVML's utilisation over ~1 s of unprofiled steps: a kernel ran, even on one SM
    sm_activity: float = nan  # NVML's GPM SM activity over the same second (Hopper and newer)
    note: str = ""  # why something was not measured

    @classmethod
    def from_trace(cls, label: str, trace, note: str = "", **nvml_readings) -> "Busy":
        """The busy share of the profiled steps of ``trace`` (a path or a loaded Chrome trace with ProfilerStep
        ranges): kernel time over the steps' window, the steps' windows added up. A trace without GPU kernels (a
        CPU's) gives the steps and their window, and NaN shares with a note that says why."""
        trace = traces.load_trace(trace)
        if not traces.has_device_events(trace):
            windows = traces.steps(trace)
            step_ms = windows["end_ms"] - windows["start_ms"]
            missing = "the trace has no GPU kernels (recorded on a CPU): the busy share is a GPU's"
            return cls(label, len(windows), float(statistics.median(step_ms)), note=_joined(missing, note),
                       **nvml_readings)
        per_step = traces.gpu_busy(trace)
        window = per_step["step_ms"].sum()
        return cls(label, len(per_step), float(statistics.median(per_step["step_ms"])),
                   float(per_step["kernel_ms"].sum() / window), float(per_step["busy_ms"].sum() / window),
                   note=note, **nvml_readings)

    def row(self) -> dict:
        return {"busy_label": self.label, "busy_steps": self.steps, "busy_step_ms": self.step_ms,
                "kernel_busy": self.kernel_share, "gpu_busy_any": self.busy_share, "nvml_util": self.nvml_util,
                "sm_activity": self.sm_activity}

    def __str__(self) -> str:
        steps = f"{self.steps} profiled steps of {self.step_ms:.3g} ms"
        if self.kernel_share != self.kernel_share:
            return f"{self.label}: {steps}; GPU busy not measured ({self.note})"
        text = f"{self.label}: kernels ran {self.kernel_share:.1%} of the step window over {steps}"
        extra = [f"NVML utilisation {self.nvml_util:.0%}" if self.nvml_util == self.nvml_util else "",
                 f"SM activity {self.sm_activity:.0%}" if self.sm_activity == self.sm_activity else ""]
        extra = [e for e in extra if e]
        return text + (f" ({', '.join(extra)})" if extra else "")


def _joined(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def measure(step, *, label: str = "", steps: int | None = None, warmup: int = 3, device=None,
            nvml_seconds: float | None = None, keep_trace: str | Path | None = None) -> Busy:
    """Profile ``steps`` calls of ``step()`` (one training step of one configuration, after ``warmup`` unprofiled
    calls) and return its GPU busy share from the trace; then, on a GPU, call it for about ``nvml_seconds`` more,
    unprofiled, for NVML's readings over the same work. ``keep_trace`` saves the trace there (``.json.gz``).

    The same steps on every device: on a CPU the profiler records CPU activity only, so the result has the steps and
    their window, and NaN shares with a note (a CPU trace has no kernels; NVML reads a GPU)."""
    device = get_device(device)
    label = label or getattr(step, "__name__", "step")
    steps = steps or by_mode(full=20, quick=3)
    nvml_seconds = by_mode(full=1.0, quick=0.2) if nvml_seconds is None else nvml_seconds
    for _ in range(warmup):
        step()
    synced_clock(device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(keep_trace) if keep_trace else Path(folder) / "busy.json"  # compressing costs ~0.7 s a trace
        path.parent.mkdir(parents=True, exist_ok=True)
        with profile(activities=activities(device), acc_events=True,  # acc_events: torch 2.11 warns without it
                     schedule=one_cycle(steps), on_trace_ready=lambda prof: prof.export_chrome_trace(str(path))) as prof:
            for _ in range(1 + steps):
                step()
                prof.step()
        trace = traces.load_trace(path)
    if not on_gpu(device):
        return Busy.from_trace(label, trace, note="no NVML readings: NVML reads a GPU")
    util, activity = _nvml_readings(step, device, nvml_seconds)
    return Busy.from_trace(label, trace, nvml_util=util, sm_activity=activity)


def one_cycle(steps: int):
    """The profiler's schedule of ``measure``: one step of warm-up, then ``steps`` recorded, once (``repeat=1``).

    With torch's default ``repeat=0`` the cycle starts again after the recorded steps, so a trace exported after the
    ``with`` block holds the new cycle, empty (torch/profiler/profiler.py, ``schedule``: "the zero value means that
    the cycles will continue until the profiling is finished"; the 2026-11-28 H200 run crashed on it). With
    ``repeat=1`` the last recorded step is ``RECORD_AND_SAVE`` and ``on_trace_ready`` exports exactly those steps, as
    torch's docs do (``torch.profiler.profile``'s example: ``schedule(wait=1, warmup=1, active=2, repeat=1)``)."""
    return schedule(wait=0, warmup=1, active=steps, repeat=1)


def activities(device) -> list[ProfilerActivity]:
    """What the profiler records for work on ``device``: the CPU's operators, and on a GPU its kernels where this
    torch can record them (a CPU stand-in for a GPU records the CPU's only)."""
    cuda = on_gpu(device) and ProfilerActivity.CUDA in torch.profiler.supported_activities()
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]


def _nvml_readings(step, device: torch.device, seconds: float) -> tuple[float, float]:
    """NVML's utilisation (its last sample period's, read every 100 ms) and GPM SM activity while ``step`` runs
    unprofiled for about ``seconds``; fractions, NaN where NVML or GPM is not offered."""
    try:
        nv, handle = nvml.shared(device.index or 0)
    except nvml.NvmlUnavailable:
        return nan, nan
    start, readings = nvml.gpm_sample(nv, handle), []
    began = last = time.perf_counter()
    while time.perf_counter() - began < seconds:
        step()
        if time.perf_counter() - last >= 0.1:
            synced_clock(device)  # NVML's period ends now: it must have seen these steps' kernels
            util = nvml.query(nv, nv.nvmlDeviceGetUtilizationRates, handle)
            if util is not None:
                readings.append(util.gpu)
            last = time.perf_counter()
    synced_clock(device)
    activity = nvml.gpm_sm_activity(nv, handle, start)
    return (statistics.mean(readings) / 100 if readings else nan), activity / 100
