"""The machine's state beside every measurement (gpulab.conditions) and in the monitor's samples.

NVML is always a fake here (no driver on the course's CPU machines): libnvidia-ml played by tests/fake_libnvml.py under
nvidia-ml-py's real wrappers. The load average and the core count are always set by the test: nothing depends on how
busy the machine running the tests is.
"""

import math
import os
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pynvml
import pytest

from gpulab import conditions, nvml
from gpulab.conditions import Conditions, Watch, snapshot
from gpulab.monitor import COLUMNS, Monitor

from . import fake_libnvml
from .fake_libnvml import APP_CLOCKS, HW_SLOWDOWN, HW_THERMAL, IDLE, SW_POWER_CAP

DATA = Path(__file__).parent / "data"
ATTENTION = DATA / "h200" / "2026-11-28" / "09_attention_8192.csv"  # lesson 09 on the H200, 2026-11-28
RUN = DATA / "lesson09" / "2026-11-28-h200"  # the same run's ceilings and monitor samples


def h200(**readings) -> fake_libnvml.Card:
    """The H200 at 1980 of 1980 MHz, 71 °C, 650 of 700 W, 87 % busy, 3 GB used, 5 µs throttled by power so far."""
    return fake_libnvml.h200(**{"temp_c": 71, "power_w": 650, "gpu_util_pct": 87, "memory_util_pct": 40,
                                "memory_used_bytes": 3 * 10**9, "violation_ns": {pynvml.NVML_PERF_POLICY_POWER: 5_000},
                                **readings})


@pytest.fixture
def gpu():
    """That H200 in place of libnvidia-ml; yields the fake library (``gpu.cards[0]`` is the card, ``gpu.calls`` its
    C calls)."""
    with fake_libnvml.installed(h200()) as library:
        yield library


def nvml_starts(library) -> list[str]:
    """The library's nvmlInit and nvmlShutdown calls, in order."""
    return [call for call in library.calls if call in ("nvmlInitWithFlags", "nvmlShutdown")]


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


def test_a_cpu_snapshot_never_touches_nvml(gpu):
    gpu.cards[0].reasons = SW_POWER_CAP
    state = snapshot("cpu")
    assert gpu.calls == [] and not state.gpu and not state.throttled
    assert state.row() == {"load_avg": 0.5, "cpu_cores": 4, "caveat": ""}


def test_the_default_device_on_a_cpu_machine_is_the_cpu(gpu, monkeypatch):
    monkeypatch.setenv("GPULAB_DEVICE", "cpu")
    assert not snapshot().gpu and gpu.calls == []


def test_a_snapshot_is_cheap_on_a_cpu(monkeypatch):
    def no_waiting(seconds):
        raise AssertionError(f"snapshot waited {seconds} s (sampling the CPU over an interval?)")

    monkeypatch.setattr(time, "sleep", no_waiting)  # decided without a clock: a busy machine cannot fail it
    assert snapshot("cpu").cpu_cores >= 1


# ---------------------------------------------------------------- the GPU


def test_a_gpu_running_free_has_no_caveat(gpu):
    gpu.cards[0].reasons = IDLE | APP_CLOCKS  # idle and application clocks are not throttling
    state = snapshot("cuda:0")
    assert state.gpu and state.throttle == () and state.caveats() == []
    assert (state.sm_clock_mhz, state.sm_clock_max_mhz, state.gpu_temp_c) == (1980, 1980, 71)
    assert (state.gpu_power_w, state.gpu_power_limit_w) == (650, 700)
    assert state.row() == {"load_avg": 0.5, "cpu_cores": 4, "sm_clock_mhz": 1980, "sm_clock_low_mhz": 1980,
                           "sm_clock_high_mhz": 1980, "sm_clock_max_mhz": 1980, "gpu_temp_c": 71, "gpu_power_w": 650,
                           "gpu_power_limit_w": 700, "throttle": "", "caveat": ""}


def test_a_throttled_gpu_says_why(gpu, monkeypatch):
    card = gpu.cards[0]
    card.reasons, card.power_w = IDLE | SW_POWER_CAP | HW_SLOWDOWN | HW_THERMAL, 695  # what the H200 drew, held at 700
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


@pytest.mark.parametrize("old", ["driver", "nvidia-ml-py", "card"])
def test_an_older_driver_or_library_falls_back_to_the_throttle_reasons_query(monkeypatch, old):
    """An older driver lacks the function (NVML_ERROR_FUNCTION_NOT_FOUND), an older nvidia-ml-py its wrapper, a card
    may answer NOT_SUPPORTED: each reads the reasons by their older name."""
    query = "nvmlDeviceGetCurrentClocksEventReasons"
    card = h200(reasons=SW_POWER_CAP, errors={query: pynvml.NVML_ERROR_NOT_SUPPORTED} if old == "card" else {})
    if old == "nvidia-ml-py":
        monkeypatch.delattr(pynvml, query)
    with fake_libnvml.installed(card, missing=(query,) if old == "driver" else ()) as library:
        assert snapshot("cuda").throttle == ("SW power cap",)
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in library.calls


def test_every_unsupported_query_reads_as_unknown(gpu):
    queries = ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetTemperature",
               "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetViolationStatus",
               "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
    card = gpu.cards[0]
    card.reasons, card.errors = SW_POWER_CAP, dict.fromkeys(queries, pynvml.NVML_ERROR_NOT_SUPPORTED)
    state = snapshot("cuda:0")
    assert state.gpu and state.throttle == () and state.throttle_ns == () and state.caveats() == []
    assert all(math.isnan(v) for v in (state.sm_clock_mhz, state.sm_clock_max_mhz, state.gpu_temp_c,
                                       state.gpu_power_w, state.gpu_power_limit_w))


@pytest.mark.parametrize("old", ["driver", "nvidia-ml-py"])
def test_a_library_missing_the_functions_reads_as_unknown(monkeypatch, old):
    names = ("nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons",
             "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetViolationStatus")
    if old == "nvidia-ml-py":
        for name in names:
            monkeypatch.delattr(pynvml, name)
    with fake_libnvml.installed(h200(reasons=SW_POWER_CAP), missing=names if old == "driver" else ()):
        state = snapshot("cuda:0")
    assert math.isnan(state.sm_clock_mhz) and state.throttle == () and state.gpu_temp_c == 71


@pytest.fixture
def without_pynvml(monkeypatch):
    """``import pynvml`` fails, as where nvidia-ml-py is not installed; no NVML session left from elsewhere."""
    nvml.close_shared()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    yield
    nvml.close_shared()


def a_gpu_snapshot_without_nvml(monkeypatch) -> None:
    machine(monkeypatch, 9.0, 2)
    first, second = snapshot("cuda:0"), snapshot("cuda:0")
    assert first == second and first.gpu and math.isnan(first.sm_clock_mhz) and first.throttle == ()
    assert first.caveats() == ["the CPU was oversubscribed (load average 9.0 on 2 cores)"]  # the CPU's still counts
    with pytest.raises(nvml.NvmlUnavailable):
        nvml.shared(0)


def test_without_pynvml_a_gpu_snapshot_is_unknown(without_pynvml, monkeypatch):
    a_gpu_snapshot_without_nvml(monkeypatch)


def test_without_a_driver_a_gpu_snapshot_is_unknown_and_nvml_is_tried_once(monkeypatch):
    with fake_libnvml.absent() as tries:
        a_gpu_snapshot_without_nvml(monkeypatch)
    assert tries == ["libnvidia-ml.so.1"]


def test_with_the_driver_not_loaded_nvml_is_tried_once(monkeypatch):
    with fake_libnvml.installed(h200(), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED) as library:
        a_gpu_snapshot_without_nvml(monkeypatch)
    assert library.calls == ["nvmlInitWithFlags"]


def test_nvml_is_started_once_and_shut_down_once(gpu):
    for _ in range(3):
        snapshot("cuda:0")
    assert nvml_starts(gpu) == ["nvmlInitWithFlags"]
    nvml.close_shared()
    nvml.close_shared()
    assert nvml_starts(gpu) == ["nvmlInitWithFlags", "nvmlShutdown"] and gpu.inits == 0


# ---------------------------------------------------------------- over a span


def watched(card, during, monkeypatch, samples: int = 3) -> Conditions:
    """A Watch (sampling every millisecond) over a span in which ``during(card)`` changes the fake GPU; its readings
    wait until ``during`` has run (a busy machine may delay this thread past the first reading), and the span lasts
    until the watch has taken ``samples`` of them (polled: no fixed sleep for a busy machine to cross)."""
    changed, read = threading.Event(), conditions._read
    monkeypatch.setattr(conditions, "_read", lambda *args: changed.wait() and read(*args))
    watch = Watch("cuda:0", interval=0.001).start()
    during(card)
    changed.set()
    deadline = time.monotonic() + 60
    while len(watch._readings) < samples and time.monotonic() < deadline:
        time.sleep(0.001)
    return watch.stop()


def test_a_span_does_not_inherit_the_power_cap_of_the_work_before_it(gpu, monkeypatch):
    """Lesson 09's first run carried "SW power cap" from the ceiling search before it: at the span's start the GPU
    was still at its limit. The reading at the start belongs to what ran before, and is left out."""
    card = gpu.cards[0]
    card.reasons = SW_POWER_CAP

    def quiet(card):
        card.reasons = IDLE

    state = watched(card, quiet, monkeypatch)
    assert state.throttle == () and state.caveats() == [] and state.advice() == ""


def test_a_span_keeps_every_reason_and_the_clock_range_it_saw(gpu, monkeypatch):
    card = gpu.cards[0]

    def capped(card):
        card.reasons, card.sm_clock_mhz = SW_POWER_CAP, 1515

    state = watched(card, capped, monkeypatch)
    assert state.throttle == ("SW power cap",) and (state.sm_clock_low_mhz, state.sm_clock_high_mhz) == (1515, 1515)
    assert state.caveats() == ["the GPU ran at its power limit (SW power cap; SM clock 1515 MHz of 1980), "
                               "as long, dense work does"]
    assert state.advice() == ""  # a matmul at the power limit is normal: no "rerun on a quiet machine"

    def varying(card):
        card.sm_clock_mhz = 1755

    card.reasons, card.sm_clock_mhz = IDLE, 1980
    state = watched(card, varying, monkeypatch)
    assert (state.sm_clock_low_mhz, state.sm_clock_high_mhz) == (1755, 1755) and state.sm_clock_mhz == 1755


def test_a_span_shows_throttling_that_no_reading_caught(gpu, monkeypatch):
    card = gpu.cards[0]

    def briefly_capped(card):  # clocks held down by the power limit between readings
        card.violation_ns = {pynvml.NVML_PERF_POLICY_POWER: 9_000_000}

    def briefly_hot(card):  # NVML's thermal counter, asked for by its own policy
        card.violation_ns = {pynvml.NVML_PERF_POLICY_POWER: 9_000_000, pynvml.NVML_PERF_POLICY_THERMAL: 4_000}

    assert watched(card, briefly_capped, monkeypatch).throttle == ("SW power cap",)
    assert watched(card, briefly_hot, monkeypatch).throttle == ("thermal slowdown",)
    assert watched(card, lambda card: None, monkeypatch).throttle == ()  # counters that did not move say nothing


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


def recorded(row) -> Conditions:
    """The conditions a results row recorded, as the measurement saw them."""
    return Conditions(row.load_avg, row.cpu_cores, True, row.sm_clock_mhz, row.sm_clock_low_mhz, row.sm_clock_high_mhz,
                      row.sm_clock_max_mhz, row.gpu_temp_c, row.gpu_power_w, row.gpu_power_limit_w,
                      tuple(row.throttle.split(", ")) if isinstance(row.throttle, str) else ())


def test_a_power_flag_one_clock_step_under_the_top_is_not_running_at_the_limit():
    """Lesson 09's attention on the H200 at 8192 tokens: flagged at 379-640 W of 700 with the SM clock at 1965-1980 of
    1980 MHz. Four rows were captioned "ran at its power limit" for one 15 MHz dip: boost jitter, not a slowdown."""
    rows = pd.read_csv(ATTENTION)
    flagged = rows[rows["throttle"].notna()]
    assert len(flagged) == 5 and not any(recorded(row).at_power_limit for row in flagged.itertuples())
    caveats = {row.label: recorded(row).caveats() for row in flagged.itertuples()}
    assert caveats["SDPA, flash forced"] == ["NVML reported SW power cap at 437 W of 700 W, with the SM clock within 5% "
                                             "of its maximum (1965–1980 MHz of 1980)"]
    assert caveats["SDPA (PyTorch's choice)"] == ["NVML reported SW power cap at 379 W of 700 W, with the SM clock at "
                                                  "its maximum"]


def test_a_clock_held_down_by_the_power_limit_is_running_at_the_limit_at_any_power_reading():
    """The ceilings' matmuls on the same H200: bf16 held at 1515 MHz while NVML read 557 W; fp32 and tf32 at 695-699 W."""
    ceilings = pd.read_csv(RUN / "09_ceilings.csv")
    assert all(recorded(row).at_power_limit for row in ceilings.itertuples())
    (bf16,) = [recorded(row) for row in ceilings.itertuples() if row.precision == "bf16"]
    assert bf16.caveats() == ["the GPU ran at its power limit (SW power cap; SM clock 1515 MHz of 1980), as long, "
                              "dense work does"]


def test_every_flagged_monitor_sample_of_the_h200_is_judged_by_its_clock_and_power(gpu):
    """The monitor's flagged samples of that run, replayed through the fake card: held down (1380-1875 MHz, or 1575 MHz
    at 554 W) or at the limit (1920-1965 MHz at 694-697 W) is the power limit; one step under the top at 569 W and the
    top at 200-415 W are not."""
    samples = pd.read_csv(RUN / "monitor.csv").dropna(subset=["throttle"])
    card = gpu.cards[0]
    verdicts = {}
    for sample in samples.itertuples():
        card.sm_clock_mhz, card.power_w, card.reasons = int(sample.sm_clock_mhz), sample.power_w, SW_POWER_CAP
        verdicts[(sample.sm_clock_mhz, round(sample.power_w))] = snapshot("cuda:0").at_power_limit
    assert sorted(key for key, at_limit in verdicts.items() if not at_limit) == [(1965, 569), (1980, 200), (1980, 415)]
    assert len(verdicts) == len(samples) == 21


def test_a_power_flag_with_the_clock_unknown_says_only_what_was_read():
    unknown_clock = Conditions(gpu=True, gpu_power_w=250, gpu_power_limit_w=700, throttle=("SW power cap",))
    assert unknown_clock.caveats() == ["NVML reported SW power cap at 250 W of 700 W"]
    unknown_power = Conditions(gpu=True, sm_clock_low_mhz=1980, sm_clock_high_mhz=1980, sm_clock_max_mhz=1980,
                               throttle=("SW power cap",))
    assert unknown_power.caveats() == ["NVML reported SW power cap, with the SM clock at its maximum"]
    assert Conditions(gpu=True, throttle=("SW power cap",)).at_power_limit  # nothing read: the flag is all there is


def test_a_hot_gpu_is_told_to_cool_down_not_to_find_a_quieter_machine():
    hot = Conditions(load_avg=0.5, cpu_cores=4, gpu=True, throttle=("HW thermal slowdown",))
    assert hot.advice() == "check the GPU's cooling before trusting it" and not hot.busy


# ---------------------------------------------------------------- the monitor


def test_monitor_samples_the_clock_throttling_and_load(gpu):
    card = gpu.cards[0]
    card.reasons, card.power_w = SW_POWER_CAP | IDLE, 695
    with Monitor(interval=0.005, device="cpu") as monitor:
        monitor.mark("run")
        time.sleep(0.03)
    frame = monitor.frame()
    assert list(frame.columns) == list(COLUMNS) and len(frame) >= 1
    assert (frame["sm_clock_mhz"] == 1980).all() and (frame["throttle"] == "SW power cap").all()
    assert (frame["load_avg"] == 0.5).all()
    # 695 W of 700: at the limit (the card's limit and top clock are read when sampling starts)
    assert monitor.caveats() == ["the GPU ran at its power limit (SW power cap; SM clock 1980 MHz of 1980), as long, "
                                 "dense work does"]


def test_the_monitor_tells_a_power_cap_flag_at_low_power_from_running_at_the_limit(gpu):
    """The H200 raised "SW power cap" at 250 W of 700 with its clock at the top: not a power-limited run."""
    card = gpu.cards[0]
    card.reasons, card.power_w = SW_POWER_CAP, 250
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


def test_monitor_without_nvml_keeps_its_columns_and_has_no_caveats(without_pynvml, capsys):
    with Monitor(interval=0.01) as monitor:
        monitor.mark("phase")
    assert capsys.readouterr().out.count("gpulab.monitor:") == 1
    assert monitor.frame().empty and list(monitor.frame().columns) == list(COLUMNS)
    assert monitor.caveats() == [] and monitor.caveats("phase") == []


def test_the_machines_state_is_the_gpus_under_the_stand_in_and_the_cpus_alone_on_the_cpu(course_device):
    """conditions asks gpulab.on_gpu which GPU to read: under the CUDA stand-in, the card its fake libnvidia-ml plays
    (here held at its power limit), on the CPU no GPU at all."""
    from gpulab import on_gpu

    state = conditions.snapshot(course_device)
    assert state.gpu is on_gpu(course_device)
    if on_gpu(course_device):
        assert state.sm_clock_max_mhz == 1980 and state.gpu_power_limit_w == 700
    else:
        assert math.isnan(state.sm_clock_mhz) and not state.throttle
