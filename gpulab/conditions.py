"""The state of the machine while something was measured: how busy the CPU was, and on a GPU its SM clock over the
measured span, why the clocks were held down, temperature and power.

    with conditions.Watch(device) as watch:
        ...                                          # the measured work
    print(f"{seconds * 1e3:.2f} ms", *watch.conditions.caveats())

On a GPU, ``Watch`` samples NVML in a background thread while the work runs (every 50 ms, and once more as it
ends): the lowest, median and highest SM clock, every reason NVML gave for holding the clocks down, the hottest
and the most power seen. What the GPU did *before* the span (a large matrix product that left it at its power
limit) is not the span's: the reading taken as the span starts is kept out, and NVML's running totals of throttled
time are compared over the span itself.

A number measured at a power limit is normal for long, dense work (a large matmul holds any GPU at its limit), so
the caveat says what was seen; only a machine that was busy with other work (more threads wanting to run than the
CPU has cores) gets the advice to measure again on a quiet machine, and a GPU slowed for heat the advice to check
its cooling (``advice``). ``gpulab.ResultLog`` records the state and the caveats beside each row.

The load average is the whole machine's (in a container often the host's), averaged over the last minute, and
it counts the measurement's own threads; it is a hint, not proof. NVML is started once and kept open (see
``gpulab.nvml.shared``).
"""

import math
import os
import statistics
import threading
from dataclasses import dataclass, field

import torch

from . import nvml
from .colab import on_colab
from .device import DeviceError, get_device, on_gpu

nan = math.nan
POWER = ("SW power cap", "power brake", "board limit")  # held at the power limit: what dense work does
# A power flag is the power limit at work where the lowest SM clock fell more than SLOWED under the card's maximum, or
# the power drawn came within NEAR_LIMIT of the limit. The H200 (lesson 09 on 2026-11-28, in tests/data) was flagged at
# 200-640 W of 700 with its clock at most one 15 MHz step (0.8 %) under 1980: boost jitter. Held down, it ran
# 1380-1875 MHz (5-30 % under) at 678-706 W and 1515-1575 MHz at 554-557 W; 1920-1965 MHz only at 694-697 W.
SLOWED, NEAR_LIMIT = 0.05, 0.95
HEAT = ("SW thermal slowdown", "HW thermal slowdown", "HW slowdown", "thermal slowdown")
# A card of at most this board power (a T4's 70 W, an L4's 72 W: what a PCIe slot gives without a power cable) runs
# any sustained work at its power limit, below its top clock: its normal state, which a caveat states, not flags.
LOW_POWER_W = 75.0


@dataclass(frozen=True)
class Conditions:
    """The machine at one moment (``snapshot``) or over a span (``Watch``); NaN or empty where unknown."""

    load_avg: float = nan  # 1-minute load average: threads running or waiting for a CPU core
    cpu_cores: int = 0  # CPU cores this process may run on (0: unknown)
    gpu: bool = False  # the readings below were asked of a GPU (they stay NaN where NVML cannot answer)
    sm_clock_mhz: float = nan  # the median SM clock over the span (a snapshot: the reading)
    sm_clock_low_mhz: float = nan  # the lowest and highest SM clock seen over the span
    sm_clock_high_mhz: float = nan
    sm_clock_max_mhz: float = nan  # the card's maximum SM clock
    gpu_temp_c: float = nan  # the hottest seen
    gpu_power_w: float = nan  # the most power drawn
    gpu_power_limit_w: float = nan
    throttle: tuple[str, ...] = ()  # why the clocks were held down ("SW power cap", ...); GPU idle is not throttling
    throttle_ns: tuple[tuple[str, int], ...] = field(default=(), repr=False)  # NVML's running totals, for Watch

    @property
    def oversubscribed(self) -> bool:
        """More threads wanted a CPU core than this process may use (load average above the core count)."""
        return self.cpu_cores > 0 and self.load_avg > self.cpu_cores

    @property
    def throttled(self) -> bool:
        return bool(self.throttle)

    @property
    def busy(self) -> bool:
        """The machine was busy with other work: the measurement is not this machine's best, and a rerun on a
        quiet machine would measure something else."""
        return self.oversubscribed

    @property
    def at_power_limit(self) -> bool:
        """The power limit held the clocks down: the lowest SM clock more than 5 % under the card's maximum (a step
        under it is boost jitter), or power within 5 % of the limit; True where neither can be read."""
        clock_known = self.sm_clock_low_mhz == self.sm_clock_low_mhz and self.sm_clock_max_mhz == self.sm_clock_max_mhz
        power_known = self.gpu_power_w == self.gpu_power_w and self.gpu_power_limit_w == self.gpu_power_limit_w
        if not clock_known and not power_known:
            return True
        slowed = clock_known and self.sm_clock_low_mhz < (1 - SLOWED) * self.sm_clock_max_mhz
        return slowed or (power_known and self.gpu_power_w >= NEAR_LIMIT * self.gpu_power_limit_w)

    def clocks(self) -> str:
        """The SM clock over the span in words ("1515–1980 MHz of 1980"), "" where unknown."""
        if self.sm_clock_low_mhz != self.sm_clock_low_mhz:
            return ""
        low, high = self.sm_clock_low_mhz, self.sm_clock_high_mhz
        span = f"{low:.0f} MHz" if low == high else f"{low:.0f}–{high:.0f} MHz"
        return span + (f" of {self.sm_clock_max_mhz:.0f}" if self.sm_clock_max_mhz == self.sm_clock_max_mhz else "")

    def caveats(self) -> list[str]:
        """Plain sentences on what the machine did while this was measured, where it matters; empty when nothing
        does."""
        said = []
        if self.oversubscribed and on_colab():
            said.append(f"the CPU was oversubscribed (load average {self.load_avg:.1f} on this Colab runtime's "
                        f"{self.cpu_cores} vCPUs: threads waited for a core, this notebook's own among them)")
        elif self.oversubscribed:
            cores = f"{self.cpu_cores} core" + ("s" if self.cpu_cores != 1 else "")
            said.append(f"the CPU was oversubscribed (load average {self.load_avg:.1f} on {cores})")
        clocks = f"; SM clock {self.clocks()}" if self.clocks() else ""
        power = [r for r in self.throttle if r in POWER]
        heat = [r for r in self.throttle if r in HEAT]
        other = [r for r in self.throttle if r not in POWER and r not in HEAT]
        if power and self.at_power_limit and self.gpu_power_limit_w <= LOW_POWER_W:
            limit = f"{self.gpu_power_limit_w:.0f} W"
            said.append(f"the GPU ran at its {limit} power limit ({', '.join(power)}{clocks}), as a {limit} card runs "
                        "any sustained work")
        elif power and self.at_power_limit:
            said.append(f"the GPU ran at its power limit ({', '.join(power)}{clocks}), as long, dense work does")
        elif power:  # NVML raises the flag at low power too (the H200 did so on PCIe copies at 130-250 W of 700)
            drawn = (f" at {self.gpu_power_w:.0f} W of {self.gpu_power_limit_w:.0f} W"
                     if self.gpu_power_w == self.gpu_power_w and self.gpu_power_limit_w == self.gpu_power_limit_w else "")
            said.append(f"NVML reported {', '.join(power)}{drawn}{self._clock_unslowed()}")
        if heat:
            said.append(f"the GPU slowed down for heat or a hardware limit ({', '.join(heat)}{clocks if not power else ''})")
        if other:
            said.append(f"the GPU's clocks were held down ({', '.join(other)})")
        return said

    def _clock_unslowed(self) -> str:
        """Where the SM clock stayed, for a power flag that did not slow it ("" where unknown)."""
        if self.sm_clock_low_mhz != self.sm_clock_low_mhz:
            return ""
        if self.sm_clock_max_mhz != self.sm_clock_max_mhz:
            return f", with the SM clock at {self.clocks()}"
        if self.sm_clock_low_mhz >= self.sm_clock_max_mhz:
            return ", with the SM clock at its maximum"
        return f", with the SM clock within {SLOWED:.0%} of its maximum ({self.clocks()})"

    def advice(self) -> str:
        """What to do before trusting the number: "" when the conditions were fit to measure, or when nothing can be
        done (on Colab the runtime's vCPUs are all there is: the caveat says what the load means)."""
        if self.busy and not on_colab():
            return "rerun on a quiet machine before trusting it"
        if any(r in HEAT for r in self.throttle):
            return "check the GPU's cooling before trusting it"
        return ""

    def row(self) -> dict:
        """The columns a results row records: load and cores always, the GPU's readings on a GPU, and ``caveat``."""
        row = {"load_avg": round(self.load_avg, 2), "cpu_cores": self.cpu_cores}
        if self.gpu:
            row.update(sm_clock_mhz=self.sm_clock_mhz, sm_clock_low_mhz=self.sm_clock_low_mhz,
                       sm_clock_high_mhz=self.sm_clock_high_mhz, sm_clock_max_mhz=self.sm_clock_max_mhz,
                       gpu_temp_c=self.gpu_temp_c, gpu_power_w=round(self.gpu_power_w, 1),
                       gpu_power_limit_w=round(self.gpu_power_limit_w, 1), throttle=", ".join(self.throttle))
        row["caveat"] = "; ".join(self.caveats())
        return row


@dataclass(frozen=True)
class _Reading:
    """One NVML reading: SM clock (MHz), temperature (°C), power (W), throttle reasons."""

    clock: float
    temp: float
    power: float
    reasons: tuple[str, ...]


def snapshot(device: str | torch.device | int | None = None) -> Conditions:
    """The machine's state now; the GPU is read only when ``device`` (default: the course device) is a CUDA one."""
    load, cores = load_average(), cpu_cores()
    handle = _nvml_handle(device)
    if handle is None:
        return Conditions(load, cores, gpu=_cuda_index(device) is not None)
    nv, h = handle
    now = _read(nv, h)
    return Conditions(load, cores, True, now.clock, now.clock, now.clock, max_sm_clock_mhz(nv, h), now.temp, now.power,
                      power_limit_w(nv, h), now.reasons, nvml.throttle_time_ns(nv, h))


class Watch:
    """The machine's state over a span: ``with Watch(device) as w: ...``, then ``w.conditions``. On a GPU, NVML is
    read every ``interval`` seconds in a background thread while the span runs, and once more as it ends."""

    def __init__(self, device: str | torch.device | int | None = None, interval: float = 0.05):
        self.device, self.interval = device, interval
        self.conditions: Conditions | None = None
        self._readings: list[_Reading] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watch":
        self._load = load_average()
        self._handle = _nvml_handle(self.device)
        if self._handle is not None:
            nv, h = self._handle
            self._totals = nvml.throttle_time_ns(nv, h)
            self._thread = threading.Thread(target=self._sample, name="gpulab-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> Conditions:
        """End the span; its conditions (also kept in ``self.conditions``)."""
        load, cores = _worst(self._load, load_average()), cpu_cores()
        if self._handle is None:
            self.conditions = Conditions(load, cores, gpu=_cuda_index(self.device) is not None)
            return self.conditions
        self._stop.set()
        self._thread.join()
        nv, h = self._handle
        readings = [*self._readings, _read(nv, h)]  # the end: the clock just after the work ran
        totals = nvml.throttle_time_ns(nv, h)
        before = dict(self._totals)
        grew = tuple(cause for cause, ns in totals if ns > before.get(cause, ns))
        clocks = [r.clock for r in readings if r.clock == r.clock]
        self.conditions = Conditions(
            load, cores, True,
            statistics.median(clocks) if clocks else nan, min(clocks, default=nan), max(clocks, default=nan),
            max_sm_clock_mhz(nv, h), max((r.temp for r in readings if r.temp == r.temp), default=nan),
            max((r.power for r in readings if r.power == r.power), default=nan), power_limit_w(nv, h),
            tuple(dict.fromkeys([reason for r in readings for reason in r.reasons] + list(grew))), totals,
        )
        return self.conditions

    def __enter__(self) -> "Watch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _sample(self) -> None:
        nv, h = self._handle
        while not self._stop.wait(self.interval):  # not at the start: that reading is what ran before the span
            self._readings.append(_read(nv, h))


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


def _nvml_handle(device):
    """``(pynvml, handle)`` of the CUDA device ``device`` names; None for another device, or where NVML is missing."""
    index = _cuda_index(device)
    if index is None:
        return None
    try:
        return nvml.shared(index)
    except nvml.NvmlUnavailable:
        return None


def _read(nv, handle) -> _Reading:
    clock = nvml.read(nv, "nvmlDeviceGetClockInfo", handle, getattr(nv, "NVML_CLOCK_SM", 1))
    temp = nvml.read(nv, "nvmlDeviceGetTemperature", handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    power_mw = nvml.read(nv, "nvmlDeviceGetPowerUsage", handle)
    return _Reading(_number(clock), _number(temp), _number(power_mw) / 1e3, nvml.throttle_reasons(nv, handle))


def max_sm_clock_mhz(nv, handle) -> float:
    """The card's maximum SM clock (MHz; NaN where NVML cannot say)."""
    return _number(nvml.read(nv, "nvmlDeviceGetMaxClockInfo", handle, getattr(nv, "NVML_CLOCK_SM", 1)))


def power_limit_w(nv, handle) -> float:
    """The power limit the card enforces (W; NaN where NVML cannot say)."""
    return _number(nvml.read(nv, "nvmlDeviceGetEnforcedPowerLimit", handle)) / 1e3


def _cuda_index(device) -> int | None:
    """The CUDA index ``device`` names (an int is one), None for any other device."""
    if isinstance(device, int):
        return device
    if device is None:
        try:
            device = get_device()
        except DeviceError:
            return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return None
    return (device.index or 0) if on_gpu(device) else None


def _number(value) -> float:
    return nan if value is None else float(value)


def _worst(a: float, b: float) -> float:
    """The larger of two readings, either of which may be unknown (NaN)."""
    return max((v for v in (a, b) if v == v), default=nan)
