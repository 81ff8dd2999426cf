"""Lesson 02: the NVML monitor, the transfer sweep, the synthetic images, the new figures and the exercise checks."""

import contextlib
import math
import sys
import time
from time import perf_counter

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402
import pynvml  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import gpulab  # noqa: E402
from gpulab import plots  # noqa: E402
from gpulab.check import CORRECT, NOT_ATTEMPTED, WRONG, Wrong, ____  # noqa: E402
from gpulab.data import SyntheticImages, image_tensors  # noqa: E402
from gpulab.monitor import COLUMNS, Monitor  # noqa: E402
from gpulab.questions.lesson02 import _SCENARIOS, PER_LANE_GBS, _judge_measure, q1, q2, q3, q4, slow_loop  # noqa: E402
from gpulab.transfers import GiB, KiB, MiB, Timeline, human_bytes, sizes, summary, sweep  # noqa: E402

from . import fake_libnvml  # noqa: E402
from .conftest import shown_solution  # noqa: E402
from .test_lesson00 import stack_walker  # noqa: E402

# ---------------------------------------------------------------- monitor


def h200() -> fake_libnvml.Card:
    """The H200 at fixed readings (87 % busy, 40 % memory activity, 3 GB used, 61 °C), its power not reported."""
    return fake_libnvml.h200(gpu_util_pct=87, memory_util_pct=40, memory_used_bytes=3 * 10**9, temp_c=61,
                             errors={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NOT_SUPPORTED})


@pytest.mark.parametrize("missing, reason", [("nvidia-ml-py", "nvidia-ml-py"), ("driver", "could not start")],
                         ids=["no pynvml", "no driver"])
def test_monitor_without_nvml_says_why_and_gives_an_empty_frame(monkeypatch, capsys, missing, reason):
    if missing == "nvidia-ml-py":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails
    with fake_libnvml.absent() if missing == "driver" else contextlib.nullcontext():  # no libnvidia-ml.so.1
        with Monitor(interval=0.01) as monitor:
            monitor.mark("phase")
            time.sleep(0.03)
    out = capsys.readouterr().out
    assert out.count("gpulab.monitor:") == 1 and reason in out
    frame = monitor.frame()
    assert frame.empty and list(frame.columns) == list(COLUMNS)
    assert not monitor.available and reason in monitor.reason
    assert math.isnan(monitor.mean())


def _until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the monitor took no sample"
        time.sleep(0.005)


def test_monitor_samples_into_a_frame():
    with fake_libnvml.installed(h200()) as library, Monitor(interval=0.005, device="cpu") as monitor:
        monitor.mark("first")
        _until(lambda: (monitor.frame()["phase"] == "first").any())  # polled: a busy machine may delay the sampler
        monitor.mark("second")
        _until(lambda: (monitor.frame()["phase"] == "second").sum() >= 3)
    frame = monitor.frame()
    assert monitor.available and list(frame.columns) == list(COLUMNS)
    assert len(frame) >= 4 and frame["time_s"].is_monotonic_increasing
    assert {"first", "second"} <= set(frame["phase"])
    assert (frame["gpu_util_pct"] == 87).all() and (frame["mem_util_pct"] == 40).all()
    assert (frame["mem_used_gb"] == 3).all() and (frame["temp_c"] == 61).all()
    assert (frame["sm_clock_mhz"] == 1980).all() and (frame["throttle"] == "").all()  # the SM clock; GPU idle is no reason
    assert frame["power_w"].isna().all()  # unsupported on this "GPU": NaN, not an error
    assert monitor.mean(phase="second") == 87 and math.isnan(monitor.mean(phase="never"))
    starts = [call for call in library.calls if call in ("nvmlInitWithFlags", "nvmlShutdown")]
    assert starts == ["nvmlInitWithFlags", "nvmlShutdown"] and library.inits == 0  # NVML released when it stops


def test_monitor_stops_sampling_and_refuses_a_second_start():
    with fake_libnvml.installed(h200()):
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


def test_timeline_waits_for_its_own_events_not_the_current_gpu(monkeypatch):
    """Spans recorded on another GPU's streams are waited for: the frame synchronises each span's end event, never
    just the current device."""
    waited = []

    class Event:
        clock = 0.0

        def __init__(self, enable_timing=False, **_):
            self.at = None

        def record(self, stream=None):
            Event.clock += 1.0
            self.at = Event.clock

        def synchronize(self):
            waited.append(self.at)

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronised the current GPU"))
    timeline = Timeline(torch.device("cuda", 1))  # a GPU's timeline: CUDA events, faked here
    for lane in ("copy stream", "compute stream"):
        with timeline.span(lane, "work"):
            pass
    spans = timeline.frame()
    assert waited == [2.0, 4.0] and list(spans["start_ms"]) == [0.0, 2.0] and list(spans["end_ms"]) == [1.0, 3.0]


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


# ---- q1: bandwidth and the link


def right_bandwidth(nbytes, seconds):
    return nbytes / seconds / 1e9


def right_link(generation, lanes):
    return PER_LANE_GBS[generation] * lanes


def test_q1_bandwidth_and_link():
    assert status(q1, right_bandwidth, right_link) == CORRECT
    assert status(q1, lambda n, s: n / 1e9 / s, lambda g, lanes: lanes * PER_LANE_GBS[g]) == CORRECT  # other order
    assert status(q1, right_bandwidth, lambda g, lanes: 0.985 * 2 ** (g - 3) * lanes) == CORRECT  # doubling per gen.
    assert status(q1, ____, right_link) == NOT_ATTEMPTED


@pytest.mark.parametrize("bandwidth, link, says", [
    (lambda n, s: n / s / 2**30, right_link, "GiB"),
    (lambda n, s: n / s, right_link, "bytes/s"),
    (lambda n, s: 8 * n / s / 1e9, right_link, "gigabits"),
    (lambda n, s: n / (s * 1e3) / 1e9, right_link, "seconds, not ms"),
    (right_bandwidth, lambda g, lanes: PER_LANE_GBS[g], "times the number of lanes"),
    (right_bandwidth, lambda g, lanes: PER_LANE_GBS[g] * 16, "not 16"),
    (right_bandwidth, lambda g, lanes: 2 * PER_LANE_GBS[g] * lanes, "both directions"),
    (right_bandwidth, lambda g, lanes: "fast", "return a number"),
])
def test_q1_rejects(bandwidth, link, says):
    assert status(q1, bandwidth, link) == WRONG
    assert says in q1.last.message


def test_q1_a_stack_walking_answer_finds_no_expected_bandwidth():
    walker = stack_walker(lambda found, n, s: found[0], lambda n, s: n / s, lambda v: isinstance(v, float))
    assert status(q1, walker, right_link) == WRONG and walker.calls and walker.found == []


# ---- q2: a loop that waits for the GPU

fast_loop = shown_solution(q2, "fast_loop", torch=torch)
mse = torch.nn.functional.mse_loss


def fast_loop_copy_into_empty_like(batches, model, device):
    """Unusual but right: the copies written as empty_like(..., device=d).copy_(..., non_blocking=True)."""
    losses = []
    for x, y in batches:
        x = torch.empty_like(x, device=device).copy_(x, non_blocking=True)
        y = torch.empty_like(y, device=device).copy_(y, non_blocking=True)
        losses.append(mse(model(x), y))
    return torch.stack(losses).mean().item()


def fast_loop_python_total(batches, model, device):
    """Unusual but right: a Python 0 that becomes a tensor on the device, and one wait at the very end."""
    total = 0
    for x, y in batches:
        total = total + mse(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return float(total) / len(batches)


def still_reads_every_step(batches, model, device):
    total = 0.0
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total += mse(model(x), y).item()
    return total / len(batches)


def synchronizes_every_step(batches, model, device, guard=lambda device: device.type != "cpu", sync=None):
    """Plausible but wrong: a synchronize per step "to be safe" is a wait per step."""
    total = torch.zeros((), device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total += mse(model(x), y)
        if guard(device):
            (sync or torch.cuda.synchronize)()
    return total.item() / len(batches)


def synchronizes_if_cuda(batches, model, device):
    """Wrong only on a GPU: the wait hides behind `device.type == "cuda"`."""
    return synchronizes_every_step(batches, model, device, guard=lambda device: device.type == "cuda")


def synchronizes_if_available(batches, model, device):
    """Wrong only on a GPU: the wait hides behind `torch.cuda.is_available()`."""
    return synchronizes_every_step(batches, model, device, guard=lambda device: torch.cuda.is_available())


def gpulab_sync_every_step(batches, model, device):
    return synchronizes_every_step(batches, model, device, guard=lambda device: True,
                                   sync=lambda: gpulab.sync(device))


def prints_every_step(batches, model, device):
    total = torch.zeros((), device=device)
    for x, y in batches:
        loss = mse(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
        print("loss", loss)
        total += loss
    return total.item() / len(batches)


def sums_into_a_host_tensor(batches, model, device):
    """Plausible but wrong: the running total lives on the host, so every step brings the loss back."""
    total = torch.zeros(())
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total += mse(model(x), y).to("cpu", non_blocking=True)
    return total.item() / len(batches)


def reads_the_total_without_waiting(batches, model, device):
    """Plausible but wrong: the one read at the end goes through a non-blocking copy nothing waits for."""
    total = torch.zeros((), device=device)
    for x, y in batches:
        total += mse(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
    return total.to("cpu", non_blocking=True).item() / len(batches)


def blocking_copies(batches, model, device):
    losses = [mse(model(x.to(device)), y.to(device)) for x, y in batches]
    return torch.stack(losses).mean().item()


def hard_coded_cuda(batches, model, device):
    losses = [mse(model(x.cuda(non_blocking=True)), y.cuda(non_blocking=True)) for x, y in batches]
    return torch.stack(losses).mean().item()


def never_copies(batches, model, device):
    losses = [mse(model.cpu()(x), y) for x, y in batches]
    return torch.stack(losses).mean().item()


def test_q2_loop_that_waits():
    def blank(batches, model, device):
        raise NotImplementedError

    assert status(q2, fast_loop) == CORRECT
    assert status(q2, fast_loop_copy_into_empty_like) == CORRECT
    assert status(q2, fast_loop_python_total) == CORRECT
    assert status(q2, blank) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    (slow_loop, "5 times while batches were still to come"),
    (still_reads_every_step, "a Python number"),
    (synchronizes_every_step, "torch.cuda.synchronize()"),
    (synchronizes_if_cuda, "torch.cuda.synchronize()"),
    (synchronizes_if_available, "torch.cuda.synchronize()"),
    (gpulab_sync_every_step, "torch.cuda.synchronize()"),
    (prints_every_step, "5 times while batches were still to come"),
    (sums_into_a_host_tensor, "host"),
    (reads_the_total_without_waiting, "nothing waited for"),
    (blocking_copies, "non_blocking=True"),
    (hard_coded_cuda, "use the `device` you are given"),
    (never_copies, "waited for the GPU 2 times"),  # the model moved back to the host: its weights come back
    (lambda b, m, d: 0.0, "must still compute the same thing"),
    (lambda b, m, d: torch.zeros(()), "return the mean loss as a Python float"),
])
def test_q2_rejects(wrong, says):
    assert status(q2, wrong) == WRONG
    assert says in q2.last.message and "meta" not in q2.last.message


def fast_loop_through_a_mask(batches, model, device):
    """Right, but the boolean mask (after the loop) has no stand-in without a GPU: judged on the CPU only, and said so."""
    losses = [mse(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True)) for x, y in batches]
    losses = torch.stack(losses)
    return losses[losses == losses].mean().item()


def test_q2_says_what_it_could_not_judge():
    assert status(q2, fast_loop_through_a_mask) == CORRECT
    assert ("could not be judged" in q2.last.message) == (not torch.cuda.is_available())


def test_q2_a_stack_walking_answer_finds_no_expected_loss():
    def copies_and_returns(found, batches, model, device):
        for x, y in batches:
            x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return found[0] if found else 0.0

    walker = stack_walker(copies_and_returns, lambda *args: copies_and_returns([], *args),
                          lambda value: isinstance(value, float))
    assert status(q2, walker) == WRONG and walker.calls and walker.found == []


# ---- q3: measuring a loader

measure = shown_solution(q3, "measure", time=time, gpulab=gpulab)


def measure_variant(clock="after the skipped batches", skip_offset=0, wait_before=True, wait_after=True,
                    count_skipped=False, first_batch="next"):
    """The shown solution with one thing changed, as a learner might get it wrong."""
    def measure(loader, train_step, device, skip):
        began = time.perf_counter()
        batches = iter(loader)
        startup_s = time.perf_counter() - began if first_batch == "iter" else None
        x, y = next(batches)
        startup_s = startup_s if startup_s is not None else time.perf_counter() - began
        start = began if clock == "before the first batch" else None
        train_step(x, y)
        start = time.perf_counter() if clock == "before the skipped batches" else start
        seen = 0
        for _ in range(skip + skip_offset):
            x, y = next(batches)
            train_step(x, y)
            seen += len(y) if count_skipped else 0
        if wait_before:
            gpulab.sync(device)
        start = time.perf_counter() if start is None else start
        for x, y in batches:
            train_step(x, y)
            seen += len(y)
        if wait_after:
            gpulab.sync(device)
        return startup_s, seen / (time.perf_counter() - start)
    return measure


def measure_including_startup(loader, train_step, device, skip):
    """Plausible but wrong: one clock around everything, start-up included."""
    start, seen = time.perf_counter(), 0
    for x, y in loader:
        train_step(x, y)
        seen += len(y)
    gpulab.sync(device)
    total = time.perf_counter() - start
    return total, seen / total


def measure_with_events(loader, train_step, device, skip):
    """Unusual but right: CUDA events around the steady part, batch count from the loader's length."""
    start = perf_counter()
    batches = iter(loader)
    first = next(batches)
    startup_s = perf_counter() - start
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


def with_result(measure, change):
    """``measure``, with its (startup_s, samples_per_s) passed through ``change``."""
    return lambda loader, train_step, device, skip: change(*measure(loader, train_step, device, skip),
                                                           loader.batch_size)


def test_q3_measure_a_loader_in_steady_state():
    def blank(loader, train_step, device, skip):
        raise NotImplementedError

    assert status(q3, measure) == CORRECT
    assert status(q3, measure_with_events) == CORRECT
    assert status(q3, measure_variant(skip_offset=1)) == CORRECT  # one batch more skipped changes nothing
    assert status(q3, blank) == NOT_ATTEMPTED
    assert status(q3, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    (measure_including_startup, "on its own"),
    (measure_variant(skip_offset=-12), "skip them before starting the clock"),  # no skipping at all
    (measure_variant(skip_offset=-1), "skip them before starting the clock"),  # one prepared batch timed
    (measure_variant(count_skipped=True), "skip them before starting the clock"),
    (measure_variant(wait_after=False), "wait for it"),
    (measure_variant(wait_before=False), "a wait for the GPU"),
    (measure_variant(clock="before the skipped batches"), "start the clock after the first batch, the skipped ones"),
    (measure_variant(clock="before the first batch"), "start the clock after the first batch, the skipped ones"),
    (measure_variant(first_batch="iter"), "not from `iter(loader)`"),
    (with_result(measure, lambda startup, rate, batch: (startup, rate / batch)), "batches, not samples"),
    (with_result(measure, lambda startup, rate, batch: (startup, rate * 3 * 8 * 8)), "elements, not samples"),
    (with_result(measure, lambda startup, rate, batch: (startup * 1e3, rate)), "milliseconds"),
    (with_result(measure, lambda startup, rate, batch: (rate, startup)), "in that order"),
    (lambda loader, train_step, device, skip: 2.0, "return two numbers"),
])
def test_q3_rejects(wrong, says):
    assert status(q3, wrong) == WRONG
    assert says in q3.last.message


@pytest.mark.parametrize("startup, rate, right", [
    (0.3, 1600, True), (0.3, 1.04 * 1600, True), (0.3, 0.96 * 1600, True), (0.31, 1600, True),
    (0.3, 1.06 * 1600, False), (0.3, 0.94 * 1600, False), (0.33, 1600, False), (0.0, 1600, False),
])
def test_q3_decides_on_injected_timings(startup, rate, right):
    """The verdict on a (startup, rate), both ways: within 5 % of the loader-bound scenario's 0.3 s and 1600/s."""
    judged = lambda: _judge_measure("loader-bound", _SCENARIOS["loader-bound"], startup, rate)
    if right:
        assert "1600 samples/s" in judged() or "samples/s" in judged()
    else:
        with pytest.raises(Wrong):
            judged()


def test_q3_runs_on_a_virtual_clock(monkeypatch):
    """Two paced loaders with 0.3 s of start-up each, and a simulated GPU: nothing really sleeps in this thread."""
    slept = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda seconds: (slept.append(seconds), real_sleep(seconds))[1])
    assert status(q3, measure) == CORRECT
    assert slept == []


def test_q3_a_stack_walking_answer_finds_no_expected_rate():
    walker = stack_walker(lambda found, loader, *args: (0.3, found[0]), lambda loader, *args: (0.3, 1.0),
                          lambda value: isinstance(value, (int, float)))
    assert status(q3, walker) == WRONG and walker.calls and walker.found == []


# ---- q4: loader settings

RIGHT_LOADER = dict(num_workers=6, pin_memory=True, persistent_workers=True, prefetch_factor=2)


def test_q4_loader_settings():
    assert status(q4, RIGHT_LOADER) == CORRECT
    assert status(q4, dict(num_workers=8, pin_memory=True, persistent_workers=True, prefetch_factor=4)) == CORRECT
    assert status(q4, dict(num_workers=5, pin_memory=True, persistent_workers=True)) == CORRECT  # exactly enough
    assert status(q4, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("change, says", [
    ({"num_workers": 0, "persistent_workers": False, "prefetch_factor": None}, "at least 5"),
    ({"num_workers": 2}, "at least 5"),
    ({"num_workers": 4}, "at least 5"),  # 3 × 64 / 40 rounded down
    ({"num_workers": 32}, "cores"),
    ({"num_workers": 6.0}, "whole number"),
    ({"pin_memory": False}, "pin_memory=True"),
    ({"pin_memory": "yes"}, "pin_memory=True"),
    ({"persistent_workers": False}, "persistent_workers=True"),
    ({"prefetch_factor": 1}, "prefetch_factor"),
    ({"prefetch_factor": 0}, "prefetch_factor"),
    ({"batch_size": 32}, "keep the batch size"),
    ({"prefetch_factr": 2}, "fails"),  # a typo: DataLoader refuses it
])
def test_q4_rejects(change, says):
    assert status(q4, {**RIGHT_LOADER, **change}) == WRONG
    assert says in q4.last.message
