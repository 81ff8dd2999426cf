"""The state of the machine while something was measured: how busy the CPU was, and on a GPU its SM clock,
throttling, temperature and power.

    before = conditions.snapshot(device)
    ...                                              # the measured work
    state = conditions.during(before, conditions.snapshot(device))
    print(f"{seconds * 1e3:.2f} ms", *state.caveats())

A number measured while the GPU's clocks were held down by a power or thermal limit, or while more threads
wanted to run than the CPU has cores, is still a number, but not this machine's best: ``caveats()`` says so
in plain words, and ``gpulab.ResultLog`` records the state, and the caveats, beside each row.

The load average is the whole machine's (in a container often the host's), averaged over the last minute, and
it counts the measurement's own threads; it is a hint, not proof. A snapshot costs a few microseconds on a
CPU and a few NVML calls on a GPU (NVML is started once and kept open, see ``gpulab.nvml.shared``).
"""

import math
import os
from dataclasses import dataclass, field, replace

import torch

from . import nvml

nan = math.nan


@dataclass(frozen=True)
class Conditions:
    """The machine at one moment (``snapshot``) or over a span (``during``); NaN or empty where unknown."""

    load_avg: float = nan  # 1-minute load average: threads running or waiting for a CPU core
    cpu_cores: int = 0  # CPU cores this process may run on (0: unknown)
    gpu: bool = False  # the readings below were asked of a GPU (they stay NaN where NVML cannot answer)
    sm_clock_mhz: float = nan  # SM clock now (during: at the end, just after the work ran)
    sm_clock_max_mhz: float = nan
    gpu_temp_c: float = nan
    gpu_power_w: float = nan
    gpu_power_limit_w: float = nan
    throttle: tuple[str, ...] = ()  # why the clocks were held down ("SW power cap", ...); GPU idle is not throttling
    throttle_ns: tuple[tuple[str, int], ...] = field(default=(), repr=False)  # NVML's running totals, for during()

    @property
    def oversubscribed(self) -> bool:
        """More threads wanted a CPU core than this process may use (load average above the core count)."""
        return self.cpu_cores > 0 and self.load_avg > self.cpu_cores

    @property
    def throttled(self) -> bool:
        return bool(self.throttle)

    def caveats(self) -> list[str]:
        """Plain sentences on what makes a measurement taken in these conditions suspect; empty when nothing does."""
        said = []
        if self.oversubscribed:
            cores = f"{self.cpu_cores} core" + ("s" if self.cpu_cores != 1 else "")
            said.append(f"the CPU was oversubscribed (load average {self.load_avg:.1f} on {cores})")
        if self.throttled:
            said.append(f"the GPU was throttled ({', '.join(self.throttle)})")
        return said

    def row(self) -> dict:
        """The columns a results row records: load and cores always, the GPU's readings on a GPU, and ``caveat``."""
        row = {"load_avg": round(self.load_avg, 2), "cpu_cores": self.cpu_cores}
        if self.gpu:
            row.update(sm_clock_mhz=self.sm_clock_mhz, sm_clock_max_mhz=self.sm_clock_max_mhz,
                       gpu_temp_c=self.gpu_temp_c, gpu_power_w=round(self.gpu_power_w, 1),
                       gpu_power_limit_w=round(self.gpu_power_limit_w, 1), throttle=", ".join(self.throttle))
        row["caveat"] = "; ".join(self.caveats())
        return row


def snapshot(device: str | torch.device | int | None = None) -> Conditions:
    """The machine's state now; the GPU is read only when ``device`` (default: the course device) is a CUDA one."""
    load, cores = load_average(), cpu_cores()
    index = _cuda_index(device)
    if index is None:
        return Conditions(load, cores)
    try:
        nv, handle = nvml.shared(index)
    except nvml.NvmlUnavailable:
        return Conditions(load, cores, gpu=True)
    clock = nvml.read(nv, "nvmlDeviceGetClockInfo", handle, getattr(nv, "NVML_CLOCK_SM", 1))
    clock_max = nvml.read(nv, "nvmlDeviceGetMaxClockInfo", handle, getattr(nv, "NVML_CLOCK_SM", 1))
    temp = nvml.read(nv, "nvmlDeviceGetTemperature", handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    power_mw = nvml.read(nv, "nvmlDeviceGetPowerUsage", handle)
    limit_mw = nvml.read(nv, "nvmlDeviceGetEnforcedPowerLimit", handle)
    return Conditions(
        load, cores, True, _number(clock), _number(clock_max), _number(temp), _number(power_mw) / 1e3,
        _number(limit_mw) / 1e3, nvml.throttle_reasons(nv, handle), nvml.throttle_time_ns(nv, handle),
    )


def during(before: Conditions, after: Conditions) -> Conditions:
    """The state over a span, from snapshots at its start and end: the worse of the two (the higher load,
    temperature and power, every throttle reason either saw, plus any throttling NVML counted in between,
    which neither moment may show); the SM clock read at the end."""
    counted = dict(before.throttle_ns)
    grew = tuple(cause for cause, ns in after.throttle_ns if ns > counted.get(cause, ns))
    return replace(
        after,
        load_avg=_worst(before.load_avg, after.load_avg),
        cpu_cores=after.cpu_cores or before.cpu_cores,
        gpu=before.gpu or after.gpu,
        sm_clock_mhz=_known(after.sm_clock_mhz, before.sm_clock_mhz),
        sm_clock_max_mhz=_known(after.sm_clock_max_mhz, before.sm_clock_max_mhz),
        gpu_temp_c=_worst(before.gpu_temp_c, after.gpu_temp_c),
        gpu_power_w=_worst(before.gpu_power_w, after.gpu_power_w),
        gpu_power_limit_w=_known(after.gpu_power_limit_w, before.gpu_power_limit_w),
        throttle=tuple(dict.fromkeys(before.throttle + after.throttle + grew)),
    )


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return nan


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS says, else all of them; 0 if unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def _cuda_index(device) -> int | None:
    """The CUDA index ``device`` names (an int is one), None for any other device."""
    if isinstance(device, int):
        return device
    if device is None:
        from .device import DeviceError, get_device

        try:
            device = get_device()
        except DeviceError:
            return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return None
    return (device.index or 0) if device.type == "cuda" else None


def _number(value) -> float:
    return nan if value is None else float(value)


def _worst(a: float, b: float) -> float:
    """The larger of two readings, either of which may be unknown (NaN)."""
    return max((v for v in (a, b) if v == v), default=nan)


def _known(a: float, b: float) -> float:
    return a if a == a else b
