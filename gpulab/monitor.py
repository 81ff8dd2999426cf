"""A GPU monitor: NVML samples (utilisation, memory, power, temperature, SM clock, throttling) and the CPU's
load average, taken in a background thread.

    with Monitor(interval=0.1) as mon:
        mon.mark("workers=0")      # label the samples that follow
        ...
    mon.frame()                    # one row per sample, a pandas DataFrame

Without NVML (no NVIDIA driver, or a CPU-only machine) it prints one message saying why and
its frame is empty, with the same columns.

``gpu_util_pct`` is NVML's "GPU utilisation": the share of the last sample period (1/6 s to 1 s,
depending on the GPU) during which at least one kernel was running; it says nothing about how
much of the GPU each kernel used. ``mem_util_pct`` is the share of time the memory was being
read or written, not how full it is (that is ``mem_used_gb``). ``throttle`` names why the clocks were held
down at that moment ("SW power cap", "HW thermal slowdown", ...; empty when they were not), and ``load_avg``
is the machine's 1-minute load average; ``mon.caveats(phase)`` says whether either made a phase suspect.
"""

import math
import threading
import time
from contextlib import ExitStack

import pandas as pd
import torch

from . import nvml
from .conditions import Conditions, cpu_cores, load_average, max_sm_clock_mhz, power_limit_w
from .device import get_device, on_gpu

COLUMNS = ("time_s", "phase", "gpu_util_pct", "mem_util_pct", "mem_used_gb", "power_w", "temp_c",
           "sm_clock_mhz", "throttle", "load_avg")


class Monitor:
    """Samples one GPU every ``interval`` seconds while running (``start()``/``stop()`` or ``with``)."""

    def __init__(self, interval: float = 0.1, device: str | torch.device | int | None = None):
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        self.interval = interval
        self.index = _index(device)
        self.available = False
        self.reason = ""
        self._rows: list[tuple] = []
        self._phase = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = ExitStack()
        self._cores = cpu_cores()
        self._card = {}  # the card's maximum SM clock and power limit, read when sampling starts

    def start(self) -> "Monitor":
        """Start sampling in a background thread (or say why it cannot)."""
        if self._thread is not None:
            raise RuntimeError("this Monitor is already running; stop() it first")
        try:
            nv, handle = self._open()
        except nvml.NvmlUnavailable as err:
            self.available, self.reason = False, str(err)
            self._nvml.close()
            print(f"gpulab.monitor: no GPU samples will be taken ({err}). The monitor's frame stays empty.")
            return self
        self.available = True
        self._card = {"sm_clock_max_mhz": max_sm_clock_mhz(nv, handle), "gpu_power_limit_w": power_limit_w(nv, handle)}
        self._stop.clear()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(nv, handle), name="gpulab-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling; safe to call twice."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._nvml.close()

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def mark(self, phase: str) -> None:
        """Label the samples taken from now on (e.g. the configuration being measured)."""
        self._phase = str(phase)

    def frame(self) -> pd.DataFrame:
        """The samples so far, one row each (empty, with the same columns, without NVML)."""
        return pd.DataFrame(list(self._rows), columns=list(COLUMNS))

    def mean(self, column: str = "gpu_util_pct", phase: str | None = None) -> float:
        """Mean of ``column`` over all samples, or over those of ``phase``; NaN when there are none."""
        frame = self.frame()
        if phase is not None:
            frame = frame[frame["phase"] == phase]
        values = frame[column].dropna()
        return float(values.mean()) if len(values) else math.nan

    def caveats(self, phase: str | None = None) -> list[str]:
        """What made the samples (all, or those of ``phase``) suspect: any throttled sample, a load average above
        the cores; empty when nothing did, or there are no samples."""
        frame = self.frame()
        if phase is not None:
            frame = frame[frame["phase"] == phase]
        reasons = [r.strip() for text in frame["throttle"].dropna() for r in str(text).split(",") if r.strip()]
        loads, clocks, power = frame["load_avg"].dropna(), frame["sm_clock_mhz"].dropna(), frame["power_w"].dropna()
        worst = Conditions(load_avg=float(loads.max()) if len(loads) else math.nan, cpu_cores=self._cores, gpu=True,
                           sm_clock_low_mhz=float(clocks.min()) if len(clocks) else math.nan,
                           sm_clock_high_mhz=float(clocks.max()) if len(clocks) else math.nan,
                           gpu_power_w=float(power.max()) if len(power) else math.nan,
                           throttle=tuple(dict.fromkeys(reasons)), **self._card)
        return worst.caveats()

    def _open(self):
        nv = self._nvml.enter_context(nvml.session())
        return nv, nvml.handle_for(nv, self.index)

    def _run(self, nv, handle) -> None:
        while True:  # at least one sample, however short the run
            self._rows.append((time.perf_counter() - self._t0, self._phase, *sample(nv, handle), load_average()))
            if self._stop.wait(self.interval):
                return


def sample(nv, handle) -> tuple[float, float, float, float, float, float, str]:
    """One reading: GPU and memory utilisation (%), memory used (GB), power (W), temperature (°C), SM clock (MHz),
    throttle reasons (short names, comma-separated; empty when none, or where NVML cannot say)."""
    util = nvml.query(nv, nv.nvmlDeviceGetUtilizationRates, handle)
    memory = nvml.query(nv, nv.nvmlDeviceGetMemoryInfo, handle)
    power_mw = nvml.query(nv, nv.nvmlDeviceGetPowerUsage, handle)
    temp = nvml.query(nv, nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
    clock = nvml.read(nv, "nvmlDeviceGetClockInfo", handle, getattr(nv, "NVML_CLOCK_SM", 1))
    nan = math.nan
    return (
        float(util.gpu) if util is not None else nan,
        float(util.memory) if util is not None else nan,
        memory.used / 1e9 if memory is not None else nan,
        power_mw / 1e3 if power_mw is not None else nan,
        float(temp) if temp is not None else nan,
        float(clock) if clock is not None else nan,
        ", ".join(nvml.throttle_reasons(nv, handle)),
    )


def _index(device) -> int:
    """The CUDA index to watch: the given one, else the course device's (0 on a CPU)."""
    if isinstance(device, int):
        return device
    if device is None:
        device = get_device()
    device = torch.device(device)
    return (device.index or 0) if on_gpu(device) else 0
