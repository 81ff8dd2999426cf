"""Lesson 02: the NVML monitor, the transfer sweep, the synthetic images, the new figures and the exercise checks."""

import math
import sys
import time
import types

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import gpulab  # noqa: E402
from gpulab import plots  # noqa: E402
from gpulab.check import CORRECT, NOT_ATTEMPTED, WRONG, ____  # noqa: E402
from gpulab.data import SyntheticImages, image_tensors  # noqa: E402
from gpulab.monitor import COLUMNS, Monitor  # noqa: E402
from gpulab.questions.lesson02 import PER_LANE_GBS, q1, q2, q3, q4, slow_loop  # noqa: E402
from gpulab.transfers import GiB, KiB, MiB, Timeline, human_bytes, sizes, summary, sweep  # noqa: E402

from .conftest import shown_solution  # noqa: E402

# ---------------------------------------------------------------- monitor


def fake_pynvml(calls: list) -> types.ModuleType:
    """A stand-in for nvidia-ml-py: fixed readings, power unsupported, every call logged in ``calls``."""
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nv.NVMLError = NVMLError
    nv.NVML_TEMPERATURE_GPU = 0
    nv.nvmlInit = lambda: calls.append("init")
    nv.nvmlShutdown = lambda: calls.append("shutdown")
    nv.nvmlDeviceGetHandleByIndex = lambda index: f"gpu{index}"
    nv.nvmlDeviceGetHandleByPciBusId = lambda bus: "gpu0"
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 * 10**9, total=80 * 10**9)
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 61

    def unsupported(h):
        raise NVMLError("Not Supported")

    nv.nvmlDeviceGetPowerUsage = unsupported
    return nv


def no_driver() -> types.ModuleType:
    """nvidia-ml-py installed, but no NVIDIA driver: nvmlInit fails, as on this course's CPU machines."""
    nv = fake_pynvml([])

    def fail():
        raise nv.NVMLError("NVML Shared Library Not Found")

    nv.nvmlInit = fail
    return nv


@pytest.mark.parametrize(("module", "reason"), [(None, "nvidia-ml-py"), (no_driver(), "could not start")],
                         ids=["no pynvml", "no driver"])
def test_monitor_without_nvml_says_why_and_gives_an_empty_frame(monkeypatch, capsys, module, reason):
    monkeypatch.setitem(sys.modules, "pynvml", module)  # None: `import pynvml` fails
    with Monitor(interval=0.01) as monitor:
        monitor.mark("phase")
        time.sleep(0.03)
    out = capsys.readouterr().out
    assert out.count("gpulab.monitor:") == 1 and reason in out
    frame = monitor.frame()
    assert frame.empty and list(frame.columns) == list(COLUMNS)
    assert not monitor.available and reason in monitor.reason
    assert math.isnan(monitor.mean())


def test_monitor_samples_into_a_frame(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls))
    with Monitor(interval=0.005, device="cpu") as monitor:
        monitor.mark("first")
        time.sleep(0.05)
        monitor.mark("second")
        time.sleep(0.05)
    frame = monitor.frame()
    assert monitor.available and list(frame.columns) == list(COLUMNS)
    assert len(frame) >= 4 and frame["time_s"].is_monotonic_increasing
    assert {"first", "second"} <= set(frame["phase"])
    assert (frame["gpu_util_pct"] == 87).all() and (frame["mem_util_pct"] == 40).all()
    assert (frame["mem_used_gb"] == 3).all() and (frame["temp_c"] == 61).all()
    assert frame["power_w"].isna().all()  # unsupported on this "GPU": NaN, not an error
    assert monitor.mean(phase="second") == 87 and math.isnan(monitor.mean(phase="never"))
    assert calls == ["init", "shutdown"]  # NVML released when the monitor stops


def test_monitor_stops_sampling_and_refuses_a_second_start(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([]))
    monitor = Monitor(interval=0.005).start()
    with pytest.raises(RuntimeError, match="already running"):
        monitor.start()
    monitor.stop()
    monitor.stop()
    count = len(monitor.frame())
    time.sleep(0.03)
    assert len(monitor.frame()) == count >= 1
    with pytest.raises(ValueError):
        Monitor(interval=0)


# ---------------------------------------------------------------- transfers


def test_sizes_and_human_bytes():
    assert sizes(4 * KiB, 1 * MiB) == [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB]
    assert sizes(4 * KiB, GiB)[-1] == GiB and sizes(1, 1) == [1]
    assert human_bytes(4 * KiB) == "4 KiB" and human_bytes(GiB) == "1 GiB" and human_bytes(100) == "100 B"
    with pytest.raises(ValueError):
        sizes(0, 10)


def test_sweep_times_each_copy_allocates_outside_and_logs(results_dir):
    made = []

    def make_copy(nbytes, pinned):  # a CPU stand-in for a host→device copy
        made.append((nbytes, pinned))
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        return lambda: dst.copy_(src)

    log = gpulab.ResultLog("02_test_sweep")
    frame = sweep({"H2D": make_copy}, [4 * KiB, 64 * KiB], memories=("pageable",), device="cpu", log=log,
                  min_time=0.01, link_gbps=31.5)
    assert made == [(4 * KiB, False), (64 * KiB, False)]  # one allocation per point, never inside the timing
    assert list(frame["nbytes"]) == [4 * KiB, 64 * KiB] and (frame["gbps"] > 0).all()
    assert frame["gbps"].tolist() == pytest.approx((frame["nbytes"] / frame["median_s"] / 1e9).tolist())
    logged = log.frame()
    assert len(logged) == 2 and (logged["link_gbps"] == 31.5).all() and (logged["memory"] == "pageable").all()


def test_summary_takes_the_largest_size_and_the_link_share():
    frame = pd.DataFrame({"direction": ["H2D"] * 4, "memory": ["pageable", "pageable", "pinned", "pinned"],
                          "nbytes": [KiB, GiB, KiB, GiB], "gbps": [0.1, 10.0, 0.2, 25.0]})
    table = summary(frame, link_gbps=31.5).set_index("memory")
    assert table.loc["pinned", "gbps"] == 25.0 and table.loc["pinned", "size"] == "1 GiB"
    assert table.loc["pinned", "of_link"] == pytest.approx(25 / 31.5)
    assert summary(frame)["of_link"].isna().all()


def test_an_empty_timeline_has_its_columns():
    assert list(Timeline().frame().columns) == ["lane", "kind", "start_ms", "end_ms"]


@pytest.mark.gpu
def test_timeline_and_pinned_sweep_on_the_gpu(results_dir):
    device = torch.device("cuda")
    timeline, stream = Timeline(), torch.cuda.Stream()
    x = torch.ones(8 * MiB, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(stream), timeline.span("copy stream", "copy"):
        y = x.to(device, non_blocking=True)
    torch.cuda.current_stream().wait_stream(stream)
    with timeline.span("compute stream", "compute"):
        y.float().sum()
    spans = timeline.frame()
    assert list(spans["lane"]) == ["copy stream", "compute stream"]
    assert (spans["end_ms"] > spans["start_ms"]).all() and spans["start_ms"].min() == 0

    def make_h2d(nbytes, pinned):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return lambda: host.to(device, non_blocking=True)

    frame = sweep({"H2D": make_h2d}, [MiB, 16 * MiB], device=device, min_time=0.02)
    assert set(frame["memory"]) == {"pageable", "pinned"} and (frame["gbps"] > 0.1).all()


# ---------------------------------------------------------------- data


def test_synthetic_images_are_deterministic_and_augmented():
    raw = SyntheticImages(4, image_size=40, crop=32, augment=False)
    image, label = raw[1]
    assert image.dtype == torch.uint8 and image.shape == (3, 40, 40) and 0 <= label < 10
    assert torch.equal(image, raw[1][0]) and not torch.equal(image, raw[2][0])
    x, label = SyntheticImages(4, image_size=40, crop=32)[1]
    assert x.dtype == torch.float32 and x.shape == (3, 32, 32) and label == raw[1][1]
    assert x.min() < 0 < x.max()  # normalised around zero
    with pytest.raises(IndexError):
        raw[4]
    with pytest.raises(ValueError):
        SyntheticImages(4, image_size=16, crop=32)


def test_synthetic_images_load_in_worker_processes():
    loader = DataLoader(SyntheticImages(8, image_size=24, crop=16), batch_size=4, num_workers=1)
    shapes = [tuple(x.shape) for x, _ in loader]
    assert shapes == [(4, 3, 16, 16)] * 2


def test_image_tensors():
    images, labels = image_tensors(10, image_size=8, num_classes=3)
    assert images.shape == (10, 3, 8, 8) and images.dtype == torch.uint8
    assert labels.shape == (10,) and labels.dtype == torch.int64 and labels.max() < 3
    assert torch.equal(images, image_tensors(10, image_size=8, num_classes=3)[0])


# ---------------------------------------------------------------- figures


def test_timeline_figure_draws_one_row_per_lane():
    spans = pd.DataFrame({"lane": ["copy stream", "compute stream", "copy stream"],
                          "kind": ["copy", "compute", "copy"], "start_ms": [0.0, 1.0, 1.0],
                          "end_ms": [1.0, 2.0, 2.0]})
    ax = plots.timeline(spans, title="overlap")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["copy stream", "compute stream"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"copy", "compute"}


def test_utilisation_figure_names_each_phase_and_handles_no_samples():
    samples = pd.DataFrame({"time_s": [0.0, 0.1, 0.2, 0.3], "phase": ["a", "a", "", "b"],
                            "gpu_util_pct": [10.0, 12.0, 0.0, 95.0]})
    ax = plots.utilisation(samples)
    assert {t.get_text() for t in ax.texts} == {"a", "b"} and ax.get_ylim() == (0, 105)
    empty = plots.utilisation(pd.DataFrame(columns=list(COLUMNS)))
    assert "no samples" in empty.texts[0].get_text()


# ---------------------------------------------------------------- exercise checks


def status(question, *answers) -> str:
    question.check(*answers)
    return question.last.status


def test_q1_bandwidth_and_link():
    def right_bandwidth(nbytes, seconds):
        return nbytes / seconds / 1e9

    def right_link(generation, lanes):
        return PER_LANE_GBS[generation] * lanes

    assert status(q1, right_bandwidth, right_link) == CORRECT
    assert status(q1, lambda n, s: n / s / 2**30, right_link) == WRONG and "GiB" in q1.last.message
    assert status(q1, lambda n, s: n / s, right_link) == WRONG and "bytes/s" in q1.last.message
    assert status(q1, right_bandwidth, lambda g, lanes: PER_LANE_GBS[g]) == WRONG
    assert status(q1, lambda n, s: n / (s * 1e3) / 1e9, right_link) == WRONG and "seconds" in q1.last.message
    assert status(q1, lambda n, s: n / 1e9 / s, lambda g, lanes: lanes * PER_LANE_GBS[g]) == CORRECT  # other order
    assert status(q1, ____, right_link) == NOT_ATTEMPTED


fast_loop = shown_solution(q2, "fast_loop", torch=torch)


def fast_loop_copy_into_empty_like(batches, model, device):
    """Unusual but right: the copies written as empty_like(..., device=d).copy_(..., non_blocking=True)."""
    losses = []
    for x, y in batches:
        x = torch.empty_like(x, device=device).copy_(x, non_blocking=True)
        y = torch.empty_like(y, device=device).copy_(y, non_blocking=True)
        losses.append(torch.nn.functional.mse_loss(model(x), y))
    return torch.stack(losses).mean().item()


def still_reads_every_step(batches, model, device):
    total = 0.0
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total += torch.nn.functional.mse_loss(model(x), y).item()
    return total / len(batches)


def synchronizes_every_step(batches, model, device):
    """Plausible but wrong: a synchronize per step "to be safe" is a wait per step."""
    total = torch.zeros((), device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total += torch.nn.functional.mse_loss(model(x), y)
        if device.type != "cpu":
            torch.cuda.synchronize()
    return total.item() / len(batches)


def sums_into_a_host_tensor(batches, model, device):
    """Plausible but wrong: the running total lives on the host, so every step brings the loss back."""
    total = torch.zeros(())
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total += torch.nn.functional.mse_loss(model(x), y).to("cpu", non_blocking=True)
    return total.item() / len(batches)


def blocking_copies(batches, model, device):
    losses = [torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)) for x, y in batches]
    return torch.stack(losses).mean().item()


def never_copies(batches, model, device):
    losses = [torch.nn.functional.mse_loss(model.cpu()(x), y) for x, y in batches]
    return torch.stack(losses).mean().item()


def test_q2_loop_that_waits():
    def blank(batches, model, device):
        raise NotImplementedError

    assert status(q2, fast_loop) == CORRECT
    assert status(q2, fast_loop_copy_into_empty_like) == CORRECT
    assert status(q2, slow_loop) == WRONG and "5 times while batches were still to come" in q2.last.message
    assert status(q2, still_reads_every_step) == WRONG
    assert status(q2, synchronizes_every_step) == WRONG and "synchronize" in q2.last.message
    assert status(q2, sums_into_a_host_tensor) == WRONG and "host" in q2.last.message
    assert status(q2, blocking_copies) == WRONG and "non_blocking=True" in q2.last.message
    assert status(q2, never_copies) == WRONG
    assert status(q2, lambda b, m, d: 0.0) == WRONG  # not the same loss
    assert status(q2, blank) == NOT_ATTEMPTED


measure = shown_solution(q3, "measure", time=time, gpulab=gpulab)


def measure_including_startup(loader, train_step, device, skip):
    """Plausible but wrong: one clock around everything, start-up included."""
    start, seen = time.perf_counter(), 0
    for x, y in loader:
        train_step(x, y)
        seen += len(y)
    gpulab.sync(device)
    total = time.perf_counter() - start
    return total, seen / total


def measure_without_skipping(loader, train_step, device, skip):
    """Plausible but wrong: starts the clock at the first batch, while prepared batches are still waiting."""
    start = time.perf_counter()
    batches = iter(loader)
    x, y = next(batches)
    startup_s = time.perf_counter() - start
    train_step(x, y)
    seen, start = 0, time.perf_counter()
    for x, y in batches:
        train_step(x, y)
        seen += len(y)
    gpulab.sync(device)
    return startup_s, seen / (time.perf_counter() - start)


def measure_without_waiting(loader, train_step, device, skip):
    """Plausible but wrong: the clock stops while the GPU still works through queued steps."""
    start = time.perf_counter()
    batches = iter(loader)
    x, y = next(batches)
    startup_s = time.perf_counter() - start
    for _ in range(skip):
        train_step(*next(batches))
    seen, start = 0, time.perf_counter()
    for x, y in batches:
        train_step(x, y)
        seen += len(y)
    return startup_s, seen / (time.perf_counter() - start)


def measure_batches_per_second(loader, train_step, device, skip):
    startup_s, samples_per_s = measure(loader, train_step, device, skip)
    return startup_s, samples_per_s / loader.batch_size


def measure_with_events(loader, train_step, device, skip):
    """Unusual but right: CUDA events around the steady part, batch count from the loader's length."""
    start = time.perf_counter()
    batches = iter(loader)
    first = next(batches)
    startup_s = time.perf_counter() - start
    for x, y in [first] + [next(batches) for _ in range(skip)]:
        train_step(x, y)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    timed = 0
    for x, y in batches:
        train_step(x, y)
        timed += 1
    end.record()
    end.synchronize()
    return startup_s, timed * loader.batch_size / (begin.elapsed_time(end) / 1e3)


def test_q3_measure_a_loader_in_steady_state():
    def blank(loader, train_step, device, skip):
        raise NotImplementedError

    assert status(q3, measure) == CORRECT
    assert status(q3, measure_with_events) == CORRECT
    assert status(q3, measure_including_startup) == WRONG
    assert status(q3, measure_without_skipping) == WRONG and "skip them" in q3.last.message
    assert status(q3, measure_without_waiting) == WRONG and "wait for it" in q3.last.message
    assert status(q3, measure_batches_per_second) == WRONG and "batches, not samples" in q3.last.message
    assert status(q3, blank) == NOT_ATTEMPTED
    assert status(q3, ____) == NOT_ATTEMPTED


def test_q4_loader_settings():
    right = dict(num_workers=6, pin_memory=True, persistent_workers=True, prefetch_factor=2)
    assert status(q4, right) == CORRECT
    assert status(q4, dict(num_workers=8, pin_memory=True, persistent_workers=True, prefetch_factor=4)) == CORRECT
    assert status(q4, {**right, "num_workers": 0, "persistent_workers": False, "prefetch_factor": None}) == WRONG
    assert status(q4, {**right, "num_workers": 2}) == WRONG and "at least 5" in q4.last.message
    assert status(q4, {**right, "num_workers": 32}) == WRONG and "cores" in q4.last.message
    assert status(q4, {**right, "pin_memory": False}) == WRONG
    assert status(q4, {**right, "persistent_workers": False}) == WRONG
    assert status(q4, {**right, "prefetch_factr": 2}) == WRONG  # a typo: DataLoader refuses it
    assert status(q4, ____) == NOT_ATTEMPTED
