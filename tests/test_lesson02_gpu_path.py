"""Lesson 02's GPU branches run on this CPU under the CUDA stand-in (tests/cuda_stand_in.py: the CPU plays an NVIDIA
H200), in quick mode: the copies and their timing, pinned memory, non-blocking copies, the prefetcher's two streams
and its timeline, the hazard of reading a copy too early, and the GPU busy share of each loader configuration, with the
real ``gpulab.busy.measure``. They prove the Python around torch.cuda's calls (which calls, in which order, what is
done with their answers), never the GPU: a CPU copies nothing to a device and overlaps nothing, so no test here reads
a speed. The cells' own timings in quick mode are a few seconds each."""

import dataclasses
import math
import warnings

import matplotlib.pyplot as plt
import pytest
import torch

import gpulab
from gpulab import Comparison
from gpulab.timing import Measurement
from gpulab.transfers import Timeline

from .test_mfu_lessons_03_04 import code

# A DataLoader asked to pin asks torch.accelerator, which the stand-in leaves as this machine has it: it warns, and
# the loader hands over unpinned batches (the lesson's own pinned tensors are pinned by the stand-in).
NO_ACCELERATOR = "'pin_memory' argument is set as true but no accelerator is found"


def run(scope: dict, *markers: str) -> dict:
    """Run lesson 02's code cells that contain ``markers``, in order, in ``scope`` (the notebook's globals)."""
    for marker in markers:
        exec(compile(code("02", marker), f"<lesson 02: {marker}>", "exec"), scope)
    return scope


@pytest.fixture
def lesson(cuda_stand_in, monkeypatch, results_dir):
    """The notebook's globals after its imports, on the CPU playing an H200 (NVML's answers from the stand-in's fake
    libnvidia-ml: 97 % utilisation, 80 % SM activity), in quick mode; figures not shown and tables kept in ``shown``."""
    cuda_stand_in.nvml.gpu_util_pct, cuda_stand_in.nvml.sm_activity_pct = 97, 80.0
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    scope = run({"__name__": "__main__", "gpulab": gpulab, "device": torch.device("cpu")}, 'plans.lesson("02")',
                "from gpulab.transfers import")
    scope["shown"] = []
    scope["display"] = scope["shown"].append
    assert scope["on_gpu"] and scope["info"].name == "NVIDIA H200" and scope["nvml_ok"]
    assert scope["link_gbps"] == pytest.approx(63.0, abs=0.1)  # the H200's Gen5 x16, read through NVML
    yield scope
    plt.close("all")


def test_the_copy_timings_and_the_bandwidth_sweep_run_their_gpu_branch(lesson, capsys):
    """Cells 6, 8, 9 and 11: the naive and the right timing of a copy, the sweep over sizes and memories, pinned
    against pageable in interleaved pairs, and how long a non-blocking copy leaves Python free."""
    run(lesson, "PCIe link of", "Naive 1: wall clock", "def make_h2d(", "def plot_bandwidth(",
        "for memory, x in host.items()")
    said = capsys.readouterr().out
    assert "So no host↔device copy can go faster than 63.0 GB/s in one direction." in said
    assert "× what the PCIe link can carry: it timed the launch" in said
    assert "(pageable) of the 63.0 GB/s the link can carry" in said
    assert "Copying 16 MiB from pinned host memory to NVIDIA H200:" in said
    assert "right: CUDA events, warmed up, median of 10" in said and "it timed the launch" in said
    swept = lesson["bandwidth"]
    assert len(swept) == 2 * 2 * 7 and set(swept["memory"]) == {"pageable", "pinned"}  # 4 KiB, 16 KiB, .. 16 MiB
    assert len(gpulab.ResultLog("02_transfer_bandwidth").frame()) == len(swept)
    assert lesson["shown"][0]["size"].tolist() == ["16 MiB"] * 4  # the summary at the largest size
    assert "compared in interleaved pairs, pinned copies were" in said and "A 4 KiB copy took" in said
    assert "pageable: the call returned after" in said and "pinned: the call returned after" in said


def test_the_prefetcher_overlaps_on_two_streams_and_draws_them(lesson, capsys):
    """Cells 13, 14 and 16: the batches in pinned memory, the serial loop on one stream, the prefetcher's copy stream
    and compute stream (wait_stream, record_stream), their comparison in interleaved pairs and their timelines."""
    run(lesson, "batch_bytes, n_batches, width", "def serial(batches, timeline)")
    assert all(batch.is_pinned() for batch in lesson["batches"])
    rows = gpulab.ResultLog("02_overlap").frame()
    assert rows["loop"].tolist() == ["serial", "overlapped", "overlapped against serial"]
    assert "Overlapping copies with compute: overlapped vs serial" in capsys.readouterr().out
    drawn = {}
    lesson["plots"] = type("Plots", (), {"style": staticmethod(gpulab.plots.style), "timeline": staticmethod(
        lambda frame, title, ax: drawn.setdefault(title, frame))})
    run(lesson, "traces = {")
    serial, overlapped = drawn.values()
    batches = lesson["n_batches"]
    assert serial["lane"].tolist() == ["default stream"] * 2 * batches
    assert serial["kind"].tolist() == ["copy", "compute"] * batches
    assert (overlapped["lane"] == "copy stream").sum() == (overlapped["lane"] == "compute stream").sum() == batches
    for frame in (serial, overlapped):
        assert frame["start_ms"].min() == 0 and (frame["end_ms"] >= frame["start_ms"]).all()


def test_the_hazard_reads_a_copy_that_a_cpu_has_already_made(lesson, capsys):
    """Cell 18 on its GPU branch: a CPU copies at once, so every value has arrived when the read begins, and the
    cell says the copy had finished (on a GPU it is queued behind the matmuls: the H200 read 0 of them)."""
    run(lesson, "Read at once")
    said = capsys.readouterr().out
    assert "Read at once: 1,048,576 of 1,048,576 values had arrived (when the read began, the copy had finished)" in said
    assert "Read after copied.synchronize(): 1,048,576 of 1,048,576 values." in said


@pytest.fixture
def fast_timing(monkeypatch):
    """gpulab.bench answers 5 ms at once, and gpulab.compare calls each side once and answers 2× faster: the loader
    cells' own timings are not what these tests check, the code that makes and reads them is."""
    monkeypatch.setattr(gpulab, "bench", lambda fn, *args, label=None, **kwargs: Measurement(label, (0.005,) * 3,
                                                                                             "cpu", 1))
    compared = []

    def compare(baseline, candidate, *, labels, **kwargs):
        baseline(), candidate()
        compared.append(labels)
        return dataclasses.replace(Comparison.of([2.0] * 5, [1.0] * 5, labels=labels), baseline_warmup=(2.5,),
                                   candidate_warmup=(1.5,))

    monkeypatch.setattr(gpulab, "compare", compare)
    return compared


def test_each_loader_configuration_is_profiled_with_the_real_busy_measure(lesson, fast_timing, capsys):
    """Cells 21, 23 and 30 on a GPU's path with gpulab.busy.measure itself (lesson 02's other tests replace it). On
    the H200 (2026-11-28) cell 21 raised NoDeviceEvents: measure exported the profile after its block, when torch's
    default schedule (repeat=0) had started a new, empty cycle; before that fix measure returned without profiling on
    a CPU, so no test saw it. Here every configuration's own steps are profiled and found in the trace, and NVML's
    readings over the same steps come from the fake H200; the stand-in's trace has no kernels, so the kernel shares
    are NaN with the reason. Then the comparisons a GPU adds (cells 24, 25, 27, 30) run on what the sweep found."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", NO_ACCELERATOR, UserWarning)
        run(lesson, "one augmented sample", "def train_step(", "def steady_rate(", 'ResultLog("02_dataloader")')
    steps = lesson["busy_steps"]
    ceiling = lesson["ceiling_busy"]
    assert ceiling.steps == gpulab.by_mode(full=20, quick=3) and ceiling.step_ms > 0
    assert math.isnan(ceiling.kernel_share) and "the trace has no GPU kernels" in ceiling.note
    assert ceiling.nvml_util == pytest.approx(0.97) and ceiling.sm_activity == pytest.approx(0.80)
    said = capsys.readouterr().out
    assert f"How busy the GPU is, data already on the device: {ceiling.steps} profiled steps of" in said
    rows = lesson["log"].frame().set_index("config")
    assert list(rows.index) == list(lesson["configs"])
    assert (rows["busy_steps"] == steps).all() and (rows["busy_step_ms"] > 0).all()  # its own steps, profiled
    assert rows["kernel_busy"].isna().all() and rows["nvml_util"].tolist() == pytest.approx([0.97] * len(rows))
    assert (rows["sm_clock_mhz"] == 1980).all()  # each row with the played card's state over its own measurements

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", NO_ACCELERATOR, UserWarning)
        run(lesson, "def plot_loader(", "def epoch_of(", "Highest steady rate measured", "monitored_loader = DataLoader(",
            "def augment_on_device(", "uint8_loader = DataLoader(")
    tuned = list(lesson["configs"])[-1]
    where = "GPU"
    assert fast_timing == [  # the tuned loader against the first and against data on the device; the monitor's cost
        (list(lesson["configs"])[0], tuned), (tuned, "data already on the device"),
        ("no monitor", "monitor every 0.1 s"), ("no monitor", "monitor every 0.01 s"),
        (tuned, f"data set on the {where}, augmented there"), (tuned, "uint8 loader")]
    said = capsys.readouterr().out
    assert "The tuned loader feeds the GPU: beyond the noise, it trains within 10 % of the rate" not in said
    assert "falls short" in said  # the data on the device 2× faster (fake): the loader falls short of it
    assert "monitor every 0.01 s: 2.00× (2.00–2.00×) the speed without it (5 interleaved pairs of epochs)" in said
    fed = gpulab.ResultLog("02_fed_gpu").frame().set_index("config")
    assert (fed["busy_steps"] == steps).all() and len(fed) == 2  # the two pipelines, each profiled on its own steps
    assert f"uint8 from {lesson['workers'][-1]} workers, augmented on the GPU" in fed.index


def test_the_timeline_times_spans_on_the_host_clock_on_a_cpu_and_with_events_on_a_gpu(course_device):
    """transfers.Timeline on every device: CUDA events on a GPU (here the stand-in's, on the host clock), the host's
    clock on a CPU; the same frame."""
    timeline = Timeline(course_device)
    assert timeline.on_gpu == gpulab.on_gpu(course_device)
    for lane in ("copy stream", "compute stream"):
        with timeline.span(lane, "work"):
            torch.ones(1000).sum()
    frame = timeline.frame()
    assert frame["lane"].tolist() == ["copy stream", "compute stream"]
    assert frame["start_ms"].iloc[0] == 0 and frame["start_ms"].iloc[1] >= frame["end_ms"].iloc[0] > 0
