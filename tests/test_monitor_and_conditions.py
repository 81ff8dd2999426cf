"""The machine's state beside every measurement (gpulab.conditions) and in the monitor's samples.

NVML is always a fake here (no driver on the course's CPU machines), and the load average and the core count
are always set by the test: nothing depends on how busy the machine running the tests is.
"""

import math
import os
import sys
import threading
import time
import types

import pytest

from gpulab import conditions, nvml
from gpulab.conditions import Conditions, Watch, snapshot
from gpulab.monitor import COLUMNS, Monitor

IDLE, APP_CLOCKS, SW_POWER_CAP, HW_SLOWDOWN, HW_THERMAL = 0x1, 0x2, 0x4, 0x8, 0x40


def fake_nvml(calls: list | None = None, reasons: int = 0, unsupported: tuple[str, ...] = ()) -> types.ModuleType:
    """A stand-in for nvidia-ml-py on a GPU at 1980 of 1980 MHz, 71 °C, 650 of 700 W, clock event reasons
    ``reasons`` (``nv.state`` changes them, and the throttle counters); every call logged in ``calls``;
    the functions named in ``unsupported`` raise NVMLError as a GPU or driver without them does."""
    calls = [] if calls is None else calls
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nv.NVMLError = NVMLError
    nv.NVML_TEMPERATURE_GPU, nv.NVML_CLOCK_SM = 0, 1
    nv.NVML_PERF_POLICY_POWER, nv.NVML_PERF_POLICY_THERMAL = 0, 1
    nv.state = types.SimpleNamespace(reasons=reasons, clock=1980, violation_ns={0: 5_000, 1: 0})
    nv.nvmlInit = lambda: calls.append("init")
    nv.nvmlShutdown = lambda: calls.append("shutdown")
    nv.nvmlDeviceGetHandleByIndex = lambda index: f"gpu{index}"
    nv.nvmlDeviceGetHandleByPciBusId = lambda bus: "gpu0"
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 * 10**9, total=80 * 10**9)
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 71
    nv.nvmlDeviceGetPowerUsage = lambda h: 650_000
    nv.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    nv.nvmlDeviceGetClockInfo = lambda h, clock: nv.state.clock
    nv.nvmlDeviceGetMaxClockInfo = lambda h, clock: 1980
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: nv.state.reasons
    nv.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: nv.state.reasons
    nv.nvmlDeviceGetViolationStatus = lambda h, policy: types.SimpleNamespace(
        referenceTime=0, violationTime=nv.state.violation_ns[policy])

    def unsupported_query(*args):
        raise NVMLError("Not Supported")

    for name in unsupported:
        setattr(nv, name, unsupported_query)
    return nv


@pytest.fixture
def use_nvml(monkeypatch):
    """Install a fake (or None: ``import pynvml`` fails) as pynvml, with no NVML session left from elsewhere."""
    nvml.close_shared()

    def install(module):
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module

    yield install
    nvml.close_shared()


def machine(monkeypatch, load: float, cores: int) -> None:
    """This machine's load average and usable cores, as the test says."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    machine(monkeypatch, 0.5, 4)


# ---------------------------------------------------------------- the CPU


@pytest.mark.parametrize("load, cores, expected", [
    (3.1, 2, ["the CPU was oversubscribed (load average 3.1 on 2 cores)"]),
    (1.5, 1, ["the CPU was oversubscribed (load average 1.5 on 1 core)"]),
    (2.0, 2, []),  # every core busy is not oversubscribed
    (0.3, 16, []),
])
def test_the_cpu_is_oversubscribed_when_the_load_average_exceeds_the_cores(monkeypatch, load, cores, expected):
    machine(monkeypatch, load, cores)
    state = snapshot("cpu")
    assert (state.load_avg, state.cpu_cores) == (load, cores)
    assert state.caveats() == expected and state.oversubscribed == bool(expected)


def test_without_a_load_average_there_is_no_caveat(monkeypatch):
    monkeypatch.delattr(os, "getloadavg")
    state = snapshot("cpu")
    assert math.isnan(state.load_avg) and state.caveats() == []


def test_a_cpu_snapshot_never_touches_nvml(use_nvml):
    calls = []
    use_nvml(fake_nvml(calls, reasons=SW_POWER_CAP))
    state = snapshot("cpu")
    assert calls == [] and not state.gpu and not state.throttled
    assert state.row() == {"load_avg": 0.5, "cpu_cores": 4, "caveat": ""}


def test_the_default_device_on_a_cpu_machine_is_the_cpu(use_nvml, monkeypatch):
    calls = []
    use_nvml(fake_nvml(calls))
    monkeypatch.setenv("GPULAB_DEVICE", "cpu")
    assert not snapshot().gpu and calls == []


def test_a_snapshot_is_cheap_on_a_cpu(monkeypatch):
    def no_waiting(seconds):
        raise AssertionError(f"snapshot waited {seconds} s (sampling the CPU over an interval?)")

    monkeypatch.setattr(time, "sleep", no_waiting)  # decided without a clock: a busy machine cannot fail it
    assert snapshot("cpu").cpu_cores >= 1


# ---------------------------------------------------------------- the GPU


def test_a_gpu_running_free_has_no_caveat(use_nvml):
    use_nvml(fake_nvml(reasons=IDLE | APP_CLOCKS))  # idle and application clocks are not throttling
    state = snapshot("cuda:0")
    assert state.gpu and state.throttle == () and state.caveats() == []
    assert (state.sm_clock_mhz, state.sm_clock_max_mhz, state.gpu_temp_c) == (1980, 1980, 71)
    assert (state.gpu_power_w, state.gpu_power_limit_w) == (650, 700)
    assert state.row() == {"load_avg": 0.5, "cpu_cores": 4, "sm_clock_mhz": 1980, "sm_clock_low_mhz": 1980,
                           "sm_clock_high_mhz": 1980, "sm_clock_max_mhz": 1980, "gpu_temp_c": 71, "gpu_power_w": 650,
                           "gpu_power_limit_w": 700, "throttle": "", "caveat": ""}


def test_a_throttled_gpu_says_why(use_nvml, monkeypatch):
    use_nvml(fake_nvml(reasons=IDLE | SW_POWER_CAP | HW_SLOWDOWN | HW_THERMAL))
    machine(monkeypatch, 5.0, 2)
    state = snapshot(0)
    assert state.throttle == ("SW power cap", "HW slowdown", "HW thermal slowdown")
    assert state.caveats() == [
        "the CPU was oversubscribed (load average 5.0 on 2 cores)",
        "the GPU ran at its power limit (SW power cap; SM clock 1980 MHz of 1980), as long, dense work does",
        "the GPU slowed down for heat or a hardware limit (HW slowdown, HW thermal slowdown)"]
    assert state.advice() == "rerun on a quiet machine before trusting it"
    assert state.row()["throttle"] == "SW power cap, HW slowdown, HW thermal slowdown"
    assert state.row()["caveat"] == "; ".join(state.caveats())


def test_an_unknown_reason_bit_is_named_in_hex():
    assert nvml.decode_reasons(0x800 | SW_POWER_CAP | IDLE) == ("SW power cap", "reason 0x800")


@pytest.mark.parametrize("old", ["driver", "nvidia-ml-py"])
def test_an_older_driver_or_library_falls_back_to_the_throttle_reasons_query(use_nvml, old):
    nv = use_nvml(fake_nvml(reasons=SW_POWER_CAP, unsupported=("nvmlDeviceGetCurrentClocksEventReasons",)))
    if old == "nvidia-ml-py":
        del nv.nvmlDeviceGetCurrentClocksEventReasons
    assert snapshot("cuda").throttle == ("SW power cap",)


def test_every_unsupported_query_reads_as_unknown(use_nvml):
    queries = ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetTemperature",
               "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetViolationStatus",
               "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
    use_nvml(fake_nvml(reasons=SW_POWER_CAP, unsupported=queries))
    state = snapshot("cuda:0")
    assert state.gpu and state.throttle == () and state.throttle_ns == () and state.caveats() == []
    assert all(math.isnan(v) for v in (state.sm_clock_mhz, state.sm_clock_max_mhz, state.gpu_temp_c,
                                       state.gpu_power_w, state.gpu_power_limit_w))


def test_a_library_missing_the_functions_reads_as_unknown(use_nvml):
    nv = use_nvml(fake_nvml(reasons=SW_POWER_CAP))
    for name in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons",
                 "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetViolationStatus"):
        delattr(nv, name)
    state = snapshot("cuda:0")
    assert math.isnan(state.sm_clock_mhz) and state.throttle == () and state.gpu_temp_c == 71


@pytest.mark.parametrize("module", [None, "no driver"], ids=["no pynvml", "no driver"])
def test_without_nvml_a_gpu_snapshot_is_unknown_and_nvml_is_tried_once(use_nvml, monkeypatch, module):
    calls = []
    if module is not None:
        module = fake_nvml(calls)

        def fail():
            calls.append("init")
            raise module.NVMLError("NVML Shared Library Not Found")

        module.nvmlInit = fail
    use_nvml(module)
    machine(monkeypatch, 9.0, 2)
    first, second = snapshot("cuda:0"), snapshot("cuda:0")
    assert first == second and first.gpu and math.isnan(first.sm_clock_mhz) and first.throttle == ()
    assert first.caveats() == ["the CPU was oversubscribed (load average 9.0 on 2 cores)"]  # the CPU's still counts
    assert calls == ([] if module is None else ["init"])
    with pytest.raises(nvml.NvmlUnavailable):
        nvml.shared(0)


def test_nvml_is_started_once_and_shut_down_once(use_nvml):
    calls = []
    use_nvml(fake_nvml(calls))
    for _ in range(3):
        snapshot("cuda:0")
    assert calls == ["init"]
    nvml.close_shared()
    nvml.close_shared()
    assert calls == ["init", "shutdown"]


# ---------------------------------------------------------------- over a span


def watched(nv, during, monkeypatch, samples: int = 3) -> Conditions:
    """A Watch (sampling every millisecond) over a span in which ``during(nv)`` changes the fake GPU; its readings
    wait until ``during`` has run (a busy machine may delay this thread past the first reading), and the span lasts
    until the watch has taken ``samples`` of them (polled: no fixed sleep for a busy machine to cross)."""
    changed, read = threading.Event(), conditions._read
    monkeypatch.setattr(conditions, "_read", lambda *args: changed.wait() and read(*args))
    watch = Watch("cuda:0", interval=0.001).start()
    during(nv)
    changed.set()
    deadline = time.monotonic() + 60
    while len(watch._readings) < samples and time.monotonic() < deadline:
        time.sleep(0.001)
    return watch.stop()


def test_a_span_does_not_inherit_the_power_cap_of_the_work_before_it(use_nvml, monkeypatch):
    """Lesson 09's first run carried "SW power cap" from the ceiling search before it: at the span's start the GPU
    was still at its limit. The reading at the start belongs to what ran before, and is left out."""
    nv = use_nvml(fake_nvml(reasons=SW_POWER_CAP))

    def quiet(nv):
        nv.state.reasons = IDLE

    state = watched(nv, quiet, monkeypatch)
    assert state.throttle == () and state.caveats() == [] and state.advice() == ""


def test_a_span_keeps_every_reason_and_the_clock_range_it_saw(use_nvml, monkeypatch):
    nv = use_nvml(fake_nvml(reasons=IDLE))

    def capped(nv):
        nv.state.reasons, nv.state.clock = SW_POWER_CAP, 1515

    state = watched(nv, capped, monkeypatch)
    assert state.throttle == ("SW power cap",) and (state.sm_clock_low_mhz, state.sm_clock_high_mhz) == (1515, 1515)
    assert state.caveats() == ["the GPU ran at its power limit (SW power cap; SM clock 1515 MHz of 1980), "
                               "as long, dense work does"]
    assert state.advice() == ""  # a matmul at the power limit is normal: no "rerun on a quiet machine"

    def varying(nv):
        nv.state.clock = 1755

    nv.state.reasons, nv.state.clock = IDLE, 1980
    state = watched(nv, varying, monkeypatch)
    assert (state.sm_clock_low_mhz, state.sm_clock_high_mhz) == (1755, 1755) and state.sm_clock_mhz == 1755


def test_a_span_shows_throttling_that_no_reading_caught(use_nvml, monkeypatch):
    nv = use_nvml(fake_nvml(reasons=IDLE))

    def briefly_capped(nv):
        nv.state.violation_ns = {0: 9_000_000, 1: 0}  # clocks held down by the power limit between readings

    assert watched(nv, briefly_capped, monkeypatch).throttle == ("SW power cap",)
    assert watched(nv, lambda nv: None, monkeypatch).throttle == ()  # counters that did not move say nothing


def test_a_span_on_the_cpu_starts_no_thread_and_has_no_gpu_columns(monkeypatch):
    with Watch("cpu") as watch:
        machine(monkeypatch, 6.0, 4)
    assert watch._thread is None and not watch.conditions.gpu
    assert list(watch.conditions.row()) == ["load_avg", "cpu_cores", "caveat"]
    assert watch.conditions.row()["caveat"] == "the CPU was oversubscribed (load average 6.0 on 4 cores)"


def test_a_power_cap_flag_at_low_power_and_full_clocks_is_not_called_running_at_the_limit():
    """The H200 flagged "SW power cap" on PCIe copies at 130-250 W of 700 W with the clock at 1965-1980 of 1980 MHz."""
    copies = Conditions(load_avg=0.5, cpu_cores=4, gpu=True, sm_clock_low_mhz=1980, sm_clock_high_mhz=1980,
                        sm_clock_max_mhz=1980, gpu_power_w=250, gpu_power_limit_w=700, throttle=("SW power cap",))
    assert not copies.at_power_limit
    assert copies.caveats() == ["NVML reported SW power cap at 250 W of 700 W, with the SM clock at its maximum"]
    gemm = Conditions(load_avg=0.5, cpu_cores=4, gpu=True, sm_clock_low_mhz=1515, sm_clock_high_mhz=1980,
                      sm_clock_max_mhz=1980, gpu_power_w=695, gpu_power_limit_w=700, throttle=("SW power cap",))
    assert gemm.at_power_limit and gemm.caveats()[0].startswith("the GPU ran at its power limit")


def test_a_hot_gpu_is_told_to_cool_down_not_to_find_a_quieter_machine():
    hot = Conditions(load_avg=0.5, cpu_cores=4, gpu=True, throttle=("HW thermal slowdown",))
    assert hot.advice() == "check the GPU's cooling before trusting it" and not hot.busy


# ---------------------------------------------------------------- the monitor


def test_monitor_samples_the_clock_throttling_and_load(use_nvml):
    use_nvml(fake_nvml(reasons=SW_POWER_CAP | IDLE))
    with Monitor(interval=0.005, device="cpu") as monitor:
        monitor.mark("run")
        time.sleep(0.03)
    frame = monitor.frame()
    assert list(frame.columns) == list(COLUMNS) and len(frame) >= 1
    assert (frame["sm_clock_mhz"] == 1980).all() and (frame["throttle"] == "SW power cap").all()
    assert (frame["load_avg"] == 0.5).all()
    # 650 W of 700: at the limit (the card's limit and top clock are read when sampling starts)
    assert monitor.caveats() == ["the GPU ran at its power limit (SW power cap; SM clock 1980 MHz of 1980), as long, "
                                 "dense work does"]


def test_the_monitor_tells_a_power_cap_flag_at_low_power_from_running_at_the_limit(use_nvml):
    """The H200 raised "SW power cap" at 250 W of 700 with its clock at the top: not a power-limited run."""
    nv = fake_nvml(reasons=SW_POWER_CAP)
    nv.nvmlDeviceGetPowerUsage = lambda h: 250_000
    use_nvml(nv)
    with Monitor(interval=0.005, device="cpu") as monitor:
        pass  # it samples at least once
    assert monitor.caveats() == ["NVML reported SW power cap at 250 W of 700 W, with the SM clock at its maximum"]


def test_monitor_caveats_by_phase(monkeypatch):
    machine(monkeypatch, 1.0, 2)
    monitor = Monitor(interval=0.1, device="cpu")
    # samples as the sampling thread appends them: time, phase, util, mem util, mem GB, W, °C, MHz, throttle, load
    monitor._rows = [
        (0.0, "cool", 90.0, 40.0, 3.0, 300.0, 60.0, 1980.0, "", 1.0),
        (0.1, "cool", 91.0, 40.0, 3.0, 310.0, 60.0, 1980.0, "", 1.2),
        (0.2, "hot", 99.0, 40.0, 3.0, 700.0, 88.0, 1500.0, "", 1.1),
        (0.3, "hot", 99.0, 40.0, 3.0, 700.0, 90.0, 1400.0, "SW power cap, SW thermal slowdown", 1.1),
        (0.4, "busy cpu", 20.0, 5.0, 3.0, 100.0, 60.0, 1980.0, "", 3.4),
    ]
    assert monitor.caveats("cool") == [] and monitor.caveats("never") == []
    assert monitor.caveats("hot") == ["the GPU ran at its power limit (SW power cap; SM clock 1400–1500 MHz), as "
                                      "long, dense work does",
                                      "the GPU slowed down for heat or a hardware limit (SW thermal slowdown)"]
    assert monitor.caveats("busy cpu") == ["the CPU was oversubscribed (load average 3.4 on 2 cores)"]
    assert len(monitor.caveats()) == 3


def test_monitor_without_nvml_keeps_its_columns_and_has_no_caveats(use_nvml, capsys):
    use_nvml(None)
    with Monitor(interval=0.01) as monitor:
        monitor.mark("phase")
    assert capsys.readouterr().out.count("gpulab.monitor:") == 1
    assert monitor.frame().empty and list(monitor.frame().columns) == list(COLUMNS)
    assert monitor.caveats() == [] and monitor.caveats("phase") == []
