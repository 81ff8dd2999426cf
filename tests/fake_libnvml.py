"""A fake libnvidia-ml at the C boundary: installed as ``pynvml.nvmlLib``, so that nvidia-ml-py's own wrappers run.

It proves the Python around NVML's C calls (the arguments the wrappers pass, the structures they read, the constants,
the return codes and how gpulab handles them), never a real GPU's values: every reading is one the test set.

    with fake_libnvml.installed(fake_libnvml.h200(sm_clock_mhz=1515, power_w=695)) as library:
        card = library.cards[0]
        card.reasons = fake_libnvml.SW_POWER_CAP     # the next call reads it
        ...

Each C function the course calls is declared with its parameter list from nvml.h and called through a ctypes prototype:
a call with the wrong count raises TypeError, one with a wrong type ctypes.ArgumentError, as ctypes raises them. Its
body fills the wrappers' own structures through the pointers they pass and returns NVML's codes: UNINITIALIZED before
the first nvmlInit and after the last nvmlShutdown (NVML counts them), INVALID_ARGUMENT for a handle, sensor, clock
type, policy or GPM sample it does not know, NOT_SUPPORTED for GPM on a card without it and for the video clock (which
it does not play), and the error that a card's ``errors`` names for a function. A function it does not define is
missing from the library, as from an older driver: the wrapper raises NVMLError (NVML_ERROR_FUNCTION_NOT_FOUND).
"""

import re
import threading
from contextlib import contextmanager
from ctypes import CFUNCTYPE, POINTER, c_char, c_char_p, c_int, c_uint, c_ulonglong, c_void_p, cast, create_string_buffer, memmove
from dataclasses import dataclass, field

import pynvml as nv

from gpulab import nvml

IDLE, APP_CLOCKS = nv.nvmlClocksEventReasonGpuIdle, nv.nvmlClocksEventReasonApplicationsClocksSetting
SW_POWER_CAP, HW_SLOWDOWN = nv.nvmlClocksEventReasonSwPowerCap, nv.nvmlClocksEventReasonHwSlowdown
HW_THERMAL = nv.nvmlClocksEventReasonHwThermalSlowdown

DEVICE, UINT = nv.c_nvmlDevice_t, POINTER(c_uint)
PROTOTYPES = {  # nvml.h's parameters of every function the course's wrappers call
    "nvmlInitWithFlags": (c_uint,),
    "nvmlShutdown": (),
    "nvmlSystemGetDriverVersion": (POINTER(c_char), c_uint),
    "nvmlSystemGetCudaDriverVersion": (POINTER(c_int),),
    "nvmlDeviceGetCount_v2": (UINT,),
    "nvmlDeviceGetHandleByIndex_v2": (c_uint, POINTER(DEVICE)),
    "nvmlDeviceGetHandleByPciBusId_v2": (c_char_p, POINTER(DEVICE)),
    "nvmlDeviceGetName": (DEVICE, POINTER(c_char), c_uint),
    "nvmlDeviceGetTemperature": (DEVICE, c_uint, UINT),
    "nvmlDeviceGetClockInfo": (DEVICE, c_uint, UINT),
    "nvmlDeviceGetMaxClockInfo": (DEVICE, c_uint, UINT),
    "nvmlDeviceGetCurrentClocksEventReasons": (DEVICE, POINTER(c_ulonglong)),
    "nvmlDeviceGetCurrentClocksThrottleReasons": (DEVICE, POINTER(c_ulonglong)),
    "nvmlDeviceGetViolationStatus": (DEVICE, c_uint, POINTER(nv.c_nvmlViolationTime_t)),
    "nvmlDeviceGetUtilizationRates": (DEVICE, POINTER(nv.c_nvmlUtilization_t)),
    "nvmlDeviceGetMemoryInfo": (DEVICE, POINTER(nv.c_nvmlMemory_t)),
    "nvmlDeviceGetMemoryInfo_v2": (DEVICE, POINTER(nv.c_nvmlMemory_v2_t)),
    "nvmlDeviceGetPowerUsage": (DEVICE, UINT),
    "nvmlDeviceGetEnforcedPowerLimit": (DEVICE, UINT),
    "nvmlDeviceGetComputeRunningProcesses_v3": (DEVICE, UINT, POINTER(nv.c_nvmlProcessInfo_v3_t)),
    "nvmlDeviceGetCurrPcieLinkGeneration": (DEVICE, UINT),
    "nvmlDeviceGetCurrPcieLinkWidth": (DEVICE, UINT),
    "nvmlDeviceGetMaxPcieLinkGeneration": (DEVICE, UINT),
    "nvmlDeviceGetMaxPcieLinkWidth": (DEVICE, UINT),
    "nvmlGpmQueryDeviceSupport": (DEVICE, POINTER(nv.c_nvmlGpmSupport_t)),
    "nvmlGpmSampleAlloc": (POINTER(nv.c_nvmlGpmSample_t),),
    "nvmlGpmSampleGet": (DEVICE, nv.c_nvmlGpmSample_t),
    "nvmlGpmSampleFree": (nv.c_nvmlGpmSample_t,),
    "nvmlGpmMetricsGet": (POINTER(nv.c_nvmlGpmMetricsGet_t),),
}


@dataclass(slots=True)
class Card:
    """One GPU as the fake library plays it: fixed facts, then readings a test sets (a call reads them as they are)."""

    name: str
    memory_total_mib: int
    power_limit_w: float
    sm_clock_max_mhz: int
    memory_clock_mhz: int
    pcie_max: tuple[int, int]  # generation, width
    driver: str
    cuda_driver: int  # nvmlSystemGetCudaDriverVersion: 13000 is CUDA 13.0
    gpm: bool  # GPM offered (Hopper and newer)
    pci_bus_id: str = "00000000:18:00.0"
    sm_clock_mhz: int | None = None  # None: the maximum
    gpu_util_pct: int = 0
    memory_util_pct: int = 0
    memory_used_bytes: int = 0  # what processes allocated
    reserved_mib: int = 0  # what the driver keeps (nvmlMemory_v2_t.reserved; version 1 counts it as used)
    power_w: float = 0.0
    temp_c: int = 35
    reasons: int = IDLE  # clock event reason bits
    violation_ns: dict = field(default_factory=dict)  # NVML_PERF_POLICY_* -> throttled time so far (0 if absent)
    sm_activity_pct: float = 0.0  # GPM SM activity over the span that ends with the later of two samples
    processes: list = field(default_factory=list)  # (pid, bytes used or None where NVML cannot say) on the card
    pcie_now: tuple[int, int] | None = None  # the link now (None: at its maximum)
    errors: dict = field(default_factory=dict)  # C function -> the NVML error this card answers it with

    def __post_init__(self):
        if self.sm_clock_mhz is None:
            self.sm_clock_mhz = self.sm_clock_max_mhz


def h200(**readings) -> Card:
    """The course's H200 (driver 580.159.04, CUDA 13.0), with GPM."""
    return Card("NVIDIA H200", 143771, 700.0, 1980, 3201, (5, 16), "580.159.04", 13000, True, **readings)


def h100(**readings) -> Card:
    """An H100 SXM (80 GB HBM3), with GPM."""
    return Card("NVIDIA H100 80GB HBM3", 81559, 700.0, 1980, 2619, (5, 16), "580.159.04", 13000, True, **readings)


COLAB_DRIVER = ("550.54.15", 12040)  # Colab's driver and its CUDA 12.4, which the cards below Hopper are played with


def t4(**readings) -> Card:
    """A Colab T4: a card before Hopper, without GPM (nvmlGpmQueryDeviceSupport says so; sampling is NOT_SUPPORTED)."""
    return Card("Tesla T4", 15360, 70.0, 1590, 5001, (3, 16), *COLAB_DRIVER, False,
                **{"pci_bus_id": "00000000:00:04.0", **readings})


def l4(**readings) -> Card:
    """An L4 (Ada, sm_89: FP8, no GPM), as nvidia-smi and deviceQuery showed one publicly: 23034 MiB, 72 W, 2040 MHz,
    its memory at 6251 MHz; PCIe Gen4 x16."""
    return Card("NVIDIA L4", 23034, 72.0, 2040, 6251, (4, 16), *COLAB_DRIVER, False,
                **{"pci_bus_id": "00000000:00:03.0", **readings})


def rtx_4060_laptop(**readings) -> Card:
    """An RTX 4060 Laptop GPU (Ada, sm_89, no GPM): the datasheet's 8 GiB (its NVML total not found in public sources),
    its highest power limit (115 W; laptops set 35-115 W) and boost clock (2370 MHz), 16 Gbps GDDR6 (8001 MHz), PCIe
    Gen4 x8."""
    return Card("NVIDIA GeForce RTX 4060 Laptop GPU", 8192, 115.0, 2370, 8001, (4, 8), *COLAB_DRIVER, False,
                **{"pci_bus_id": "00000000:01:00.0", **readings})


def a100_40gb(**readings) -> Card:
    """An A100 SXM4 40 GB (Ampere, sm_80: no FP8, no GPM): 40537 MiB (as nvidia-smi shows it in public logs), 400 W,
    1410 MHz, HBM2 at 1215 MHz, PCIe Gen4 x16."""
    return Card("NVIDIA A100-SXM4-40GB", 40537, 400.0, 1410, 1215, (4, 16), *COLAB_DRIVER, False, **readings)


class _Return(Exception):
    """Ends a C function's body with NVML's return code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Function:
    """One C function of the library: its nvml.h prototype, called through ctypes as the real library's would be."""

    def __init__(self, library: "FakeLibrary", name: str, argtypes: tuple):
        self.__name__, self.argtypes, self._library = name, argtypes, library
        self._body = getattr(library, "_" + name)
        self._c = CFUNCTYPE(c_int, *argtypes)(self._enter)
        self._raised = threading.local()

    def __call__(self, *args):
        if len(args) != len(self.argtypes):  # ctypes lets a cdecl call pass extra arguments: a real bug here
            raise TypeError(f"{self.__name__} takes {len(self.argtypes)} arguments ({len(args)} given)")
        code = self._c(*args)
        error = self._raised.__dict__.pop("error", None)
        if error is not None:
            raise error  # a bug in the fake's body: ctypes would only print it
        return code

    def _enter(self, *args) -> int:
        library = self._library
        library.calls.append(self.__name__)
        if library.inits == 0 and self.__name__ != "nvmlInitWithFlags":
            return nv.NVML_ERROR_UNINITIALIZED
        try:
            self._body(*args)
        except _Return as ret:
            return ret.code
        except BaseException as err:  # noqa: BLE001 - handed to __call__, which raises it
            self._raised.error = err
            return nv.NVML_ERROR_UNKNOWN
        return nv.NVML_SUCCESS


class FakeLibrary:
    """libnvidia-ml with ``cards`` (NVML's order; the first card's driver is the system's); ``missing``: C functions it
    lacks, as an older driver's does; ``init_error``: the code nvmlInit returns (e.g. NVML_ERROR_DRIVER_NOT_LOADED).
    ``calls`` lists every C call, ``inits`` the sessions open."""

    def __init__(self, *cards: Card, missing=(), init_error: int = nv.NVML_SUCCESS):
        self.cards, self.init_error, self.inits, self.calls = list(cards), init_error, 0, []
        self._handles = [create_string_buffer(8) for _ in self.cards]  # what each handle points to
        self._samples = {}  # GPM sample address -> [its buffer, None or (card, SM activity, order) once read]
        self._taken = 0
        self._functions = {name: Function(self, name, argtypes) for name, argtypes in PROTOTYPES.items()
                           if name not in missing}

    def __getattr__(self, name):  # as ctypes.CDLL finds a symbol, or does not
        functions = self.__dict__.get("_functions", {})
        if name not in functions:
            raise AttributeError(f"libnvidia-ml.so.1: undefined symbol: {name}")
        return functions[name]

    @property
    def gpm_samples_held(self) -> int:
        """GPM samples allocated and not freed."""
        return len(self._samples)

    # ------------------------------------------------------------ the C functions' bodies (ctypes-converted arguments)

    def _nvmlInitWithFlags(self, flags):
        if self.init_error != nv.NVML_SUCCESS:
            raise _Return(self.init_error)
        self.inits += 1

    def _nvmlShutdown(self):
        self.inits -= 1

    def _nvmlSystemGetDriverVersion(self, buffer, length):
        _text(buffer, length, self.cards[0].driver if self.cards else "")

    def _nvmlSystemGetCudaDriverVersion(self, out):
        _write(out, self.cards[0].cuda_driver if self.cards else 0)

    def _nvmlDeviceGetCount_v2(self, out):
        _write(out, len(self.cards))

    def _nvmlDeviceGetHandleByIndex_v2(self, index, out):
        if index >= len(self.cards):
            raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
        handle = cast(self._handles[index], DEVICE)
        self._card(handle, "nvmlDeviceGetHandleByIndex_v2")  # a card may refuse it (NO_PERMISSION in a container)
        _write(out, handle)

    def _nvmlDeviceGetHandleByPciBusId_v2(self, bus_id, out):
        wanted = _pci(bus_id)
        if wanted is None:
            raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
        found = [i for i, card in enumerate(self.cards) if _pci(card.pci_bus_id.encode()) == wanted]
        if not found:
            raise _Return(nv.NVML_ERROR_NOT_FOUND)
        _write(out, cast(self._handles[found[0]], DEVICE))

    def _nvmlDeviceGetName(self, handle, buffer, length):
        _text(buffer, length, self._card(handle, "nvmlDeviceGetName").name)

    def _nvmlDeviceGetTemperature(self, handle, sensor, out):
        card = self._card(handle, "nvmlDeviceGetTemperature")
        _write(out, card.temp_c, valid=sensor == nv.NVML_TEMPERATURE_GPU)

    def _nvmlDeviceGetClockInfo(self, handle, clock, out):
        card = self._card(handle, "nvmlDeviceGetClockInfo")
        _write(out, _clock(clock, card.sm_clock_mhz, card.memory_clock_mhz))

    def _nvmlDeviceGetMaxClockInfo(self, handle, clock, out):
        card = self._card(handle, "nvmlDeviceGetMaxClockInfo")
        _write(out, _clock(clock, card.sm_clock_max_mhz, card.memory_clock_mhz))

    def _nvmlDeviceGetCurrentClocksEventReasons(self, handle, out):
        _write(out, self._card(handle, "nvmlDeviceGetCurrentClocksEventReasons").reasons)

    def _nvmlDeviceGetCurrentClocksThrottleReasons(self, handle, out):
        _write(out, self._card(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").reasons)

    def _nvmlDeviceGetViolationStatus(self, handle, policy, out):
        card = self._card(handle, "nvmlDeviceGetViolationStatus")
        valid = policy in (*range(nv.NVML_PERF_POLICY_RELIABILITY + 1), nv.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
                           nv.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS)
        _fill(out, valid, violationTime=card.violation_ns.get(policy, 0))

    def _nvmlDeviceGetUtilizationRates(self, handle, out):
        card = self._card(handle, "nvmlDeviceGetUtilizationRates")
        _fill(out, gpu=card.gpu_util_pct, memory=card.memory_util_pct)

    def _nvmlDeviceGetMemoryInfo(self, handle, out):
        card = self._card(handle, "nvmlDeviceGetMemoryInfo")
        total, used = card.memory_total_mib * 2**20, card.memory_used_bytes + card.reserved_mib * 2**20
        _fill(out, total=total, used=used, free=total - used)

    def _nvmlDeviceGetMemoryInfo_v2(self, handle, out):
        """nvml.h: the caller sets the struct's ``version`` to ``nvmlMemory_v2``; the driver's reserve apart."""
        card = self._card(handle, "nvmlDeviceGetMemoryInfo_v2")
        if out.contents.version != nv.nvmlMemory_v2:
            raise _Return(nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        total, reserved = card.memory_total_mib * 2**20, card.reserved_mib * 2**20
        _fill(out, total=total, reserved=reserved, used=card.memory_used_bytes,
              free=total - reserved - card.memory_used_bytes)

    def _nvmlDeviceGetPowerUsage(self, handle, out):
        _write(out, round(self._card(handle, "nvmlDeviceGetPowerUsage").power_w * 1000))  # milliwatts

    def _nvmlDeviceGetEnforcedPowerLimit(self, handle, out):
        _write(out, round(self._card(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_w * 1000))

    def _nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count, infos):
        """NVML's two-call protocol: too small an array (or none) answers INSUFFICIENT_SIZE with the count needed."""
        processes = self._card(handle, "nvmlDeviceGetComputeRunningProcesses_v3").processes
        if not count:
            raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
        room, count[0] = count[0], len(processes)
        if not processes:
            return
        if not infos or room < len(processes):
            raise _Return(nv.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, (pid, used) in enumerate(processes):
            unknown = nv.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            infos[i].pid, infos[i].usedGpuMemory = pid, unknown if used is None else used
            infos[i].gpuInstanceId = infos[i].computeInstanceId = nv.NVML_VALUE_NOT_AVAILABLE_uint.value

    def _nvmlDeviceGetCurrPcieLinkGeneration(self, handle, out):
        card = self._card(handle, "nvmlDeviceGetCurrPcieLinkGeneration")
        _write(out, (card.pcie_now or card.pcie_max)[0])

    def _nvmlDeviceGetCurrPcieLinkWidth(self, handle, out):
        card = self._card(handle, "nvmlDeviceGetCurrPcieLinkWidth")
        _write(out, (card.pcie_now or card.pcie_max)[1])

    def _nvmlDeviceGetMaxPcieLinkGeneration(self, handle, out):
        _write(out, self._card(handle, "nvmlDeviceGetMaxPcieLinkGeneration").pcie_max[0])

    def _nvmlDeviceGetMaxPcieLinkWidth(self, handle, out):
        _write(out, self._card(handle, "nvmlDeviceGetMaxPcieLinkWidth").pcie_max[1])

    def _nvmlGpmQueryDeviceSupport(self, handle, out):
        card = self._card(handle, "nvmlGpmQueryDeviceSupport")
        if out and out.contents.version != nv.NVML_GPM_SUPPORT_VERSION:
            raise _Return(nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        _fill(out, isSupportedDevice=int(card.gpm))

    def _nvmlGpmSampleAlloc(self, out):
        buffer = create_string_buffer(8)
        _write(out, cast(buffer, nv.c_nvmlGpmSample_t))
        self._samples[_address(buffer)] = [buffer, None]

    def _nvmlGpmSampleGet(self, handle, sample):
        card = self._card(handle, "nvmlGpmSampleGet")
        if not card.gpm:
            raise _Return(nv.NVML_ERROR_NOT_SUPPORTED)
        self._taken += 1
        self._sample(sample)[1] = (card, card.sm_activity_pct, self._taken)

    def _nvmlGpmSampleFree(self, sample):
        self._sample(sample)
        del self._samples[_address(sample)]

    def _nvmlGpmMetricsGet(self, request):
        """The metrics between two samples read from one card, the later as ``sample2``; SM activity only."""
        if not request:
            raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
        request = request.contents
        if request.version != nv.NVML_GPM_METRICS_GET_VERSION:
            raise _Return(nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first, second = self._sample(request.sample1)[1], self._sample(request.sample2)[1]
        if not 0 < request.numMetrics <= nv.NVML_GPM_METRIC_MAX or None in (first, second) \
                or first[0] is not second[0] or first[2] >= second[2]:
            raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
        for metric in request.metrics[:request.numMetrics]:
            known = metric.metricId == nv.NVML_GPM_METRIC_SM_UTIL
            metric.nvmlReturn = nv.NVML_SUCCESS if known else nv.NVML_ERROR_NOT_SUPPORTED
            metric.value = second[1] if known else 0.0

    # ------------------------------------------------------------ handles and samples

    def _card(self, handle, function: str) -> Card:
        """The card ``handle`` points to; INVALID_ARGUMENT for a handle this library did not give."""
        address = cast(handle, c_void_p).value
        found = [card for card, target in zip(self.cards, self._handles) if _address(target) == address]
        if not found:
            raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
        if function in found[0].errors:
            raise _Return(found[0].errors[function])
        return found[0]

    def _sample(self, sample) -> list:
        """A GPM sample allocated and not freed; INVALID_ARGUMENT for any other pointer."""
        entry = self._samples.get(cast(sample, c_void_p).value)
        if entry is None:
            raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
        return entry


def _address(obj) -> int:
    return cast(obj, c_void_p).value


def _write(out, value, valid: bool = True) -> None:
    """``*out = value``; INVALID_ARGUMENT for a NULL pointer or an argument NVML rejects."""
    if not out or not valid:
        raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
    out[0] = value


def _fill(out, valid: bool = True, **fields) -> None:
    """Set fields of the structure ``out`` points to, as NVML writes them."""
    if not out or not valid:
        raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
    for name, value in fields.items():
        setattr(out.contents, name, value)


def _text(buffer, length: int, text: str) -> None:
    """A C string into the caller's buffer of ``length`` bytes; INSUFFICIENT_SIZE where it does not fit."""
    data = text.encode() + b"\0"
    if not buffer:
        raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
    if length < len(data):
        raise _Return(nv.NVML_ERROR_INSUFFICIENT_SIZE)
    memmove(buffer, data, len(data))


def _clock(clock: int, sm_mhz: int, memory_mhz: int) -> int:
    """A clock by NVML's type: graphics and SM run together on these cards; the video clock is not played."""
    if clock == nv.NVML_CLOCK_VIDEO:
        raise _Return(nv.NVML_ERROR_NOT_SUPPORTED)
    if clock not in (nv.NVML_CLOCK_GRAPHICS, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM):
        raise _Return(nv.NVML_ERROR_INVALID_ARGUMENT)
    return memory_mhz if clock == nv.NVML_CLOCK_MEM else sm_mhz


_PCI = re.compile(rb"(?:([0-9a-f]+):)?([0-9a-f]+):([0-9a-f]+)(?:\.([0-9a-f]+))?", re.IGNORECASE)


def _pci(bus_id: bytes | None) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of a PCI bus id in one of the forms NVML accepts (hex: domain:bus:device.function,
    domain:bus:device, bus:device.function); None for any other text."""
    match = _PCI.fullmatch(bus_id or b"")
    if match is None or (match[1] is None and match[4] is None):
        return None
    return tuple(int(part or b"0", 16) for part in match.groups())


@contextmanager
def _swapped(library):
    """``library`` as pynvml's loaded libnvidia-ml (None: not loaded yet), with no function pointer cached from another
    and no NVML session of gpulab's left open, before or after."""
    saved = nv.nvmlLib, nv._nvmlLib_refcount, dict(nv._nvmlGetFunctionPointer_cache)
    nvml.close_shared()
    nv.nvmlLib, nv._nvmlLib_refcount = library, 0
    nv._nvmlGetFunctionPointer_cache.clear()
    try:
        yield library
    finally:
        nvml.close_shared()
        nv.nvmlLib, nv._nvmlLib_refcount = saved[:2]
        nv._nvmlGetFunctionPointer_cache.clear()
        nv._nvmlGetFunctionPointer_cache.update(saved[2])


@contextmanager
def installed(*cards: Card, missing=(), init_error: int = nv.NVML_SUCCESS):
    """The fake library with ``cards`` (default: an H200) in place of libnvidia-ml for the ``with`` block."""
    with _swapped(FakeLibrary(*(cards or (h200(),)), missing=missing, init_error=init_error)) as library:
        yield library


@contextmanager
def absent():
    """No libnvidia-ml at all (nvidia-ml-py installed, no driver): loading it fails as ctypes fails to find it. Yields
    the list of the libraries pynvml tried to load."""
    tries = []

    def no_library(name, *args, **kwargs):
        tries.append(name)
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    loader, nv.CDLL = nv.CDLL, no_library
    try:
        with _swapped(None):
            yield tries
    finally:
        nv.CDLL = loader
