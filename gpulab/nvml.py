"""Access to NVML (the library behind nvidia-smi) through nvidia-ml-py, degrading to a reason."""

import atexit
import math
import os
import threading
from contextlib import contextmanager

import torch


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; the message says why. ``reason`` is the underlying error in its own words, and
    ``module_missing`` says whether the cause is the Python module (not the driver)."""

    def __init__(self, message: str, reason: str = "", module_missing: bool = False):
        super().__init__(message)
        self.reason, self.module_missing = reason or message, module_missing


@contextmanager
def session():
    """Initialise NVML for the duration of a ``with`` block; raises NvmlUnavailable with the reason."""
    pynvml = _start()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _start():
    """The pynvml module, initialised (NVML counts its starts: each needs its own nvmlShutdown)."""
    try:
        import pynvml
    except ImportError as err:
        raise NvmlUnavailable("the 'pynvml' module is missing: pip install nvidia-ml-py", str(err), True) from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"NVML could not start ({err})", str(err)) from err
    return pynvml


def available() -> tuple[bool, str]:
    """(True, driver version) when NVML works, else (False, the reason)."""
    try:
        with session() as nv:
            return True, _text(nv.nvmlSystemGetDriverVersion())
    except NvmlUnavailable as err:
        return False, str(err)


def handle_for(nv, index: int = 0):
    """The NVML handle of torch's CUDA device ``index`` (matched by PCI bus id, as CUDA_VISIBLE_DEVICES may renumber
    devices); raises NvmlUnavailable where NVML has no such GPU."""
    if index < torch.cuda.device_count():  # 0 without CUDA
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            pci = f"{props.pci_domain_id:08x}:{bus:02x}:{props.pci_device_id:02x}.0"
            try:
                return nv.nvmlDeviceGetHandleByPciBusId(pci.encode())
            except nv.NVMLError:
                pass
    try:
        return nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as err:
        raise NvmlUnavailable(f"NVML has no GPU {index}: {err}", str(err)) from None


def query(nv, fn, *args, default=None):
    """Call an NVML query, returning ``default`` where this GPU or driver does not support it."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return default


# ---------------------------------------------------------------- one session kept open, for cheap repeated reads

_shared: dict = {}  # pid; nv: the pynvml module, or why NVML could not start; handles: by GPU index
_lock = threading.Lock()


def shared(index: int = 0):
    """``(pynvml, handle)`` of GPU ``index`` from one NVML session opened on first use and kept for the process,
    so that a reading costs a few NVML calls rather than an nvmlInit; raises NvmlUnavailable (remembered, so a
    machine without NVML pays for trying once). ``close_shared()`` ends it; a forked child opens its own."""
    with _lock:
        if _shared.get("pid") != os.getpid():
            _shared.clear()
            _shared["pid"] = os.getpid()
            try:
                _shared["nv"] = _start()
            except NvmlUnavailable as err:
                _shared["nv"] = str(err)
            else:
                atexit.unregister(close_shared)  # once, however often a session is reopened
                atexit.register(close_shared)
        nv = _shared["nv"]
        if isinstance(nv, str):
            raise NvmlUnavailable(nv)
        handles = _shared.setdefault("handles", {})
        if index not in handles:
            handles[index] = handle_for(nv, index)
        return nv, handles[index]


def close_shared() -> None:
    """End the session ``shared()`` keeps (the next call starts a new one); safe to call at any time."""
    with _lock:
        nv = _shared.get("nv")
        pid = _shared.get("pid")
        _shared.clear()
    if nv is not None and not isinstance(nv, str) and pid == os.getpid():
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


# ---------------------------------------------------------------- readings that not every GPU or driver supports


def read(nv, name: str, *args, default=None):
    """``nv.<name>(*args)``, or ``default`` where this nvidia-ml-py lacks the function or the GPU/driver does not
    support it (an old driver answers a newer function with an NVMLError)."""
    fn = getattr(nv, name, None)
    return default if fn is None else query(nv, fn, *args, default=default)


# NVML's clock event ("throttle") reasons: a bit each. GPU idle (0x1) and application clocks (0x2) are left out:
# there the clocks are low because nothing runs, or because someone chose them, not held down by a limit.
THROTTLE_REASONS = {
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "power brake",
    0x100: "display clock setting",
    0x200: "board limit",
    0x400: "reliability",
}
NOT_THROTTLING = 0x1 | 0x2


def throttle_reasons(nv, handle) -> tuple[str, ...]:
    """Why the GPU's clocks are held down right now, as short names (``()`` when they are not, or NVML cannot say)."""
    return decode_reasons(reason_bits(nv, handle) or 0)


def reason_bits(nv, handle) -> int | None:
    """NVML's clock event reason bits now; None where neither the current query (driver 535+) nor its older name
    answers."""
    bits = read(nv, "nvmlDeviceGetCurrentClocksEventReasons", handle)
    return read(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", handle) if bits is None else bits


def decode_reasons(bits: int) -> tuple[str, ...]:
    """NVML's reason bits as short names, in bit order; a bit this table does not know is named in hex."""
    bits = int(bits) & ~NOT_THROTTLING
    return tuple(THROTTLE_REASONS.get(1 << i, f"reason {1 << i:#x}") for i in range(bits.bit_length()) if bits >> i & 1)


# NVML counts, per cause, the time the clocks spent below what was asked for (the numbers DCGM reports as power and
# thermal violations). Two readings bracketing a measurement show throttling that neither moment caught.
_COUNTERS = (("NVML_PERF_POLICY_POWER", 0, "SW power cap"), ("NVML_PERF_POLICY_THERMAL", 1, "thermal slowdown"))


def throttle_time_ns(nv, handle) -> tuple[tuple[str, int], ...]:
    """NVML's running totals of throttled time, ``((cause, nanoseconds), ...)``; the causes it does not count are left out."""
    totals = []
    for constant, default, cause in _COUNTERS:
        status = read(nv, "nvmlDeviceGetViolationStatus", handle, getattr(nv, constant, default))
        ns = getattr(status, "violationTime", None)
        if ns is not None:
            totals.append((cause, int(ns)))
    return tuple(totals)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------- GPM: what the SMs did, Hopper and newer

def gpm_sample(nv, handle):
    """A GPM sample of the GPU's counters now, to measure a span with ``gpm_sm_activity``; None where GPM is not
    offered (GPUs before Hopper, an older driver or nvidia-ml-py, no permission)."""
    try:
        if not nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
            return None
        sample = nv.nvmlGpmSampleAlloc()
        try:
            return nv.nvmlGpmSampleGet(handle, sample)
        except nv.NVMLError:
            nv.nvmlGpmSampleFree(sample)
            raise
    except (AttributeError, nv.NVMLError):
        return None


def gpm_sm_activity(nv, handle, start) -> float:
    """The SM activity (%) between the GPM sample ``start`` and now: the share of the SMs' time that had work, over
    every SM (DCGM's SM_ACTIVE), unlike NVML's utilisation, which counts time when any kernel ran, even on one SM.
    NaN where GPM is not offered; ``start`` is freed."""
    if start is None:
        return math.nan
    end = None
    try:
        end = nv.nvmlGpmSampleAlloc()  # kept before it is filled, so that a failed read frees it too
        end = nv.nvmlGpmSampleGet(handle, end)
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version, request.numMetrics = nv.NVML_GPM_METRICS_GET_VERSION, 1
        request.sample1, request.sample2 = start, end
        request.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
        metric = nv.nvmlGpmMetricsGet(request).metrics[0]
        return float(metric.value) if metric.nvmlReturn == 0 else math.nan
    except (AttributeError, nv.NVMLError):
        return math.nan
    finally:
        for sample in (start, end):
            if sample is not None:
                query(nv, nv.nvmlGpmSampleFree, sample)
