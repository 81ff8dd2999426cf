"""gpulab.memory: the tracker's timeline and phases, snapshots read offline, clear errors for misuse, and the
memory plots of lesson 05."""

import contextlib
import gc
import io
import math
import os
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import gpulab  # noqa: E402
from gpulab import memory, models, plots, tasks  # noqa: E402
from gpulab.device import DeviceError  # noqa: E402
from gpulab.memory import MemoryTracker, SnapshotError, TrackerError  # noqa: E402

MiB = 2**20


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ----- the tracker's timeline -----------------------------------------------------------------------

def test_timeline_records_allocations_frees_and_phases():
    tracker = MemoryTracker(record=True)
    with tracker:
        tracker.mark("make")
        a = torch.ones(100, dtype=torch.uint8)
        b = torch.ones(50, dtype=torch.uint8)
        tracker.mark("free")
        del a
    events = tracker.timeline()
    assert list(events.columns) == memory.TIMELINE_COLUMNS
    assert events["action"].tolist() == ["mark", "alloc", "alloc", "mark", "free"]
    assert events["phase"].tolist() == ["make", "make", "make", "free", "free"]
    assert events["allocated"].tolist() == [0, 100, 150, 150, 50]
    assert events.loc[events["action"] == "alloc", "op"].tolist() == ["ones", "ones"]
    assert tracker.current == 50 and tracker.peak == 150
    del b


def test_timeline_of_a_training_step_climbs_in_the_forward_and_falls_in_the_backward():
    model = models.ResidualMLP(in_features=16, width=16, depth=2)
    x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
    tracker = MemoryTracker(record=True)
    with tracker:
        tracker.mark("forward")
        loss = F.cross_entropy(model(x), y)
        tracker.mark("backward")
        loss.backward()
    events = tracker.timeline()
    most = events.groupby("phase")["allocated"].max()
    after_forward = events[events["phase"] == "forward"]["allocated"].iloc[-1]
    grads = sum(p.numel() * 4 for p in model.parameters())
    assert most["backward"] >= after_forward  # gradients arrive while the activations are still alive
    assert events["allocated"].iloc[-1] == tracker.current >= grads  # gradients (and the loss) remain


def test_tracker_budget_is_an_out_of_memory_error():
    assert issubclass(memory.BudgetExceeded, torch.OutOfMemoryError)
    with pytest.raises(torch.OutOfMemoryError, match="budget of 0.0 MiB"), MemoryTracker(budget=100):
        torch.ones(200, dtype=torch.uint8)


def test_a_budget_refuses_the_allocation_that_would_pass_it_as_the_allocator_does():
    """A CUDA allocator past its limit raises before it takes the memory; the tracker drops the result uncounted and
    keeps no reference to it in the error's traceback, so inside ``except`` only what fitted is alive (lesson 05's
    demo printed the refused tensor among what its error held)."""
    with MemoryTracker(budget=MiB) as tracker:
        kept = torch.ones(MiB // 2, dtype=torch.uint8)
        try:
            torch.ones(MiB, dtype=torch.uint8)
        except memory.BudgetExceeded as err:
            during, peak, raised_by = tracker.current, tracker.peak, err.tracker
            assert "needed 1.5 MiB of tensors, more than the budget of 1.0 MiB" in str(err)
    assert during == peak == MiB // 2 and raised_by is tracker and kept.numel() == MiB // 2


def test_a_refused_step_frees_its_tensors_as_soon_as_its_error_is_gone_without_a_collection():
    """Nothing the error refers to refers back to it: a cycle would keep the failed step's frames, and every tensor
    they hold, until the garbage collector ran (lesson 03's naive loop, which collects nothing, left 11 MiB)."""
    def step():
        held = torch.ones(MiB // 2, dtype=torch.uint8)
        return held, torch.ones(MiB, dtype=torch.uint8)

    gc.disable()
    try:
        with MemoryTracker(budget=MiB) as tracker:
            try:
                step()
            except memory.BudgetExceeded:
                pass
            assert tracker.current == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("use, says", [
    (lambda t: t.timeline(), "MemoryTracker\\(record=True\\)"),
    (lambda t: t.mark("forward"), "inside `with tracker:`"),
])
def test_tracker_without_record_or_outside_its_block_says_what_to_do(use, says):
    tracker = MemoryTracker()
    with tracker:
        torch.ones(10)
    with pytest.raises(TrackerError, match=says):
        use(tracker)


def test_timeline_before_anything_ran_says_so():
    with pytest.raises(TrackerError, match="recorded nothing yet"):
        MemoryTracker(record=True).timeline()


def test_mark_works_again_in_a_nested_block():
    tracker = MemoryTracker(record=True)
    with tracker:
        with tracker:
            tracker.mark("inner")
        tracker.mark("outer")
    with pytest.raises(TrackerError):
        tracker.mark("after")
    assert tracker.timeline()["phase"].tolist() == ["inner", "outer"]


@pytest.mark.parametrize("budget", ["1GB", -1, 0, float("nan"), True])
def test_a_budget_that_is_not_a_number_of_bytes_says_so(budget):
    with pytest.raises(ValueError, match="budget is a positive number of bytes"):
        MemoryTracker(budget=budget)


def test_a_tracker_nested_in_itself_counts_each_tensor_once():
    alone, nested = MemoryTracker(), MemoryTracker()
    with alone:
        kept = torch.ones(1000)
    with nested, nested:
        kept = torch.ones(1000)
    assert nested.peak == alone.peak == kept.untyped_storage().nbytes()



def test_an_operator_that_returns_its_inputs_storage_unannounced_adds_nothing():
    """``aten::_unsafe_view`` (a 3-d @ 2-d matmul ends with it) returns the storage ``mm`` just made, and its schema
    does not say it aliases: that storage is counted once."""
    with MemoryTracker() as tracker:
        x, w = torch.randn(4, 8, 16), torch.randn(16, 32)
        out = x @ w
    assert tracker.current == sum(t.untyped_storage().nbytes() for t in (x, w, out))

# ----- snapshots, read offline ----------------------------------------------------------------------

def _frames(name):
    return [{"name": name, "filename": "train.py", "line": 1}]


def _trace_entry(action, addr, size, name="fn"):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": _frames(name)}


def _rounded(nbytes):
    """A block's size as the caching allocator hands it out: at least 512 bytes, a multiple of 512."""
    return max(512, -(-nbytes // 512) * 512)


class RecordedAllocator:
    """Builds what ``torch.cuda.memory._snapshot()`` returns, with the field names of torch/cuda/memory.py's
    Segment, Block and TraceEntry: one segment whose blocks are rounded up to 512 bytes (``size``) and remember the
    bytes asked for (``requested_size``), and a trace whose alloc and free entries carry the bytes asked for, as
    CUDACachingAllocator.cpp records them (``orig_size`` at alloc, ``block->requested_size`` at free)."""

    def __init__(self, segment_size=20 * MiB):
        self.segment_size = segment_size
        self.trace = [_trace_entry("segment_alloc", 0, segment_size)]
        self.blocks = {}  # address -> requested bytes, state, name
        self.next_address = 0

    def alloc(self, requested, name="fn"):
        address, self.next_address = self.next_address, self.next_address + _rounded(requested)
        self.blocks[address] = {"requested": requested, "state": "active_allocated", "name": name}
        self.trace.append(_trace_entry("alloc", address, requested, name))
        return address

    def free(self, address, *, completed=True):
        """free_requested, then free_completed; without it the block waits for another stream (active_awaiting_free)."""
        block = self.blocks[address]
        self.trace.append(_trace_entry("free_requested", address, block["requested"], block["name"]))
        if completed:
            self.trace.append(_trace_entry("free_completed", address, block["requested"], block["name"]))
        block["state"] = "inactive" if completed else "active_awaiting_free"

    def snapshot(self):
        blocks = [{"address": address, "size": _rounded(b["requested"]), "requested_size": b["requested"],
                   "state": b["state"], "frames": _frames(b["name"])} for address, b in sorted(self.blocks.items())]
        blocks.append({"address": self.next_address, "size": self.segment_size - self.next_address,
                       "requested_size": 0, "state": "inactive", "frames": []})
        live = [b["size"] for b in blocks if b["state"] == "active_allocated"]
        active = [b["size"] for b in blocks if b["state"] != "inactive"]
        segment = {"device": 0, "address": 0, "total_size": self.segment_size, "stream": 0, "segment_type": "large",
                   "segment_pool_id": (0, 0), "allocated_size": sum(live), "active_size": sum(active), "blocks": blocks}
        return {"segments": [segment], "device_traces": [list(self.trace)]}


# Requested sizes that are no multiple of 512, as real tensors' often are: the rounding must not leak into the timeline.
A, B, C = 4 * MiB + 100, 4 * MiB, 2 * MiB + 1


def fake_snapshot():
    """20 MiB reserved; A and B allocated, B freed, C allocated and freed on a stream that may still use it."""
    allocator = RecordedAllocator()
    a = allocator.alloc(A, "forward")
    b = allocator.alloc(B)
    allocator.free(b)
    c = allocator.alloc(C)
    allocator.free(c, completed=False)
    assert a == 0
    return allocator.snapshot()


def test_snapshot_timeline_counts_allocated_and_reserved():
    events = memory.snapshot_timeline(fake_snapshot())
    assert list(events.columns) == [*memory.TIMELINE_COLUMNS, "reserved"]
    assert events["action"].tolist() == ["segment_alloc", "alloc", "alloc", "free_requested", "free_completed", "alloc",
                                         "free_requested"]
    assert events["allocated"].tolist() == [0, A, A + B, A + B, A, A + C, A + C]
    assert (events["reserved"] / MiB).tolist() == [20] * 7
    assert events["op"].iloc[1] == "forward"


def test_snapshot_timeline_starts_from_the_requested_bytes_of_live_blocks_not_their_rounded_size():
    snapshot = fake_snapshot()
    segment = snapshot["segments"][0]
    assert segment["allocated_size"] == _rounded(A) != A  # the allocator's rounding: what a segment adds up
    assert memory.live_bytes(snapshot["segments"]) == A + C  # what the trace's sizes add up to
    events = memory.snapshot_timeline(snapshot)
    assert events["allocated"].iloc[0] == 0 and events["allocated"].min() == 0  # a whole history starts from nothing


def test_snapshot_timeline_of_a_truncated_history_starts_from_the_state_before_it():
    snapshot = fake_snapshot()
    snapshot["device_traces"][0] = snapshot["device_traces"][0][2:]  # max_entries dropped the oldest two
    events = memory.snapshot_timeline(snapshot)
    assert events["allocated"].tolist() == [A + B, A + B, A, A + C, A + C]
    assert (events["reserved"] / MiB).tolist() == [20] * 5


def test_live_bytes_of_an_older_snapshot_without_blocks_reads_allocated_size():
    assert memory.live_bytes([{"total_size": 20 * MiB, "allocated_size": 6 * MiB}]) == 6 * MiB


def test_load_snapshot_reads_what_dump_snapshot_wrote(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(fake_snapshot()))
    assert memory.load_snapshot(path)["device_traces"][0][0]["action"] == "segment_alloc"


@pytest.mark.parametrize("content, says", [
    (None, "no snapshot at"),
    (b"not a pickle at all", "is not a memory snapshot"),
    (pickle.dumps([1, 2, 3]), "no device_traces"),
    (pickle.dumps({"device_traces": [[{"size": 1}]]}), "not lists of trace entries"),
    (pickle.dumps({"segments": [], "device_traces": [[]]}), "_record_memory_history"),
])
def test_load_snapshot_says_what_is_wrong_with_the_file(tmp_path, content, says):
    path = tmp_path / "snapshot.pickle"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SnapshotError, match=says):
        memory.load_snapshot(path)


@pytest.mark.parametrize("device", [1, -1, True, "0"])
def test_snapshot_timeline_rejects_a_device_the_snapshot_lacks(device):
    with pytest.raises(SnapshotError, match="one of the snapshot's devices, 0 to 0"):
        memory.snapshot_timeline(fake_snapshot(), device=device)


def test_recording_history_without_cuda_says_so_and_carries_on(capsys):
    if torch.cuda.is_available():
        pytest.skip("there is a CUDA device here")
    assert memory.record_history(device="cpu") is False
    assert "No CUDA device here" in capsys.readouterr().out


def test_record_history_keeps_python_stacks_only(cuda_stand_in):
    """torch's default, stacks="all", symbolizes C++ frames when the snapshot is written: minutes, not seconds. On the
    CUDA stand-in (the history itself is GPU-only: the stand-in refuses it, and a spy takes its place here)."""
    calls = []
    with mock.patch.object(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: calls.append((a, kw))):
        assert memory.record_history(max_entries=10) is True
    assert calls == [((), {"max_entries": 10, "context": "all", "stacks": "python"})]


def test_record_history_on_the_stand_in_says_it_cannot_record_where_torch_refuses(cuda_stand_in, capsys):
    assert memory.record_history() is False  # the stand-in refuses, as a backend without a history raises
    assert "cannot record a memory history" in capsys.readouterr().out


def test_outside_allocator_on_the_stand_in_subtracts_what_pytorch_reserved(cuda_stand_in, fake_nvml_card):
    """NVML's memory of this process (tests/fake_libnvml.py's H200, through nvidia-ml-py's wrappers) minus torch's
    reserved; where NVML does not list this process (in a container it sees other ids) or cannot say how much it uses,
    the device's used memory (mem_get_info) minus reserved instead, which the text names."""
    held = torch.ones(3 * MiB, dtype=torch.uint8)  # 3 MiB allocated: two 2 MiB segments reserved
    reserved = torch.cuda.memory_reserved()
    assert reserved == 4 * MiB
    fake_nvml_card.processes = [(os.getpid() + 1, 9 * MiB), (os.getpid(), 700 * MiB)]
    nbytes, how = memory.outside_allocator()
    assert nbytes == 700 * MiB - reserved and how.startswith("NVML's memory of this process")
    for processes in ([(os.getpid() + 1, 700 * MiB)], [(os.getpid(), None)]):
        fake_nvml_card.processes = processes
        nbytes, how = memory.outside_allocator()
        assert nbytes == 0 and "all processes" in how  # the stand-in's card holds nothing but what torch reserved
    del held


def test_snapshot_timeline_takes_the_cuda_device_a_lesson_runs_on(cuda_stand_in):
    events = memory.snapshot_timeline(fake_snapshot(), device=torch.device("cpu"))  # the stand-in's device 0
    assert events["allocated"].iloc[-1] == A + C
    assert memory.snapshot_timeline(fake_snapshot(), device=torch.device("cuda", 0)).equals(events)


def test_a_device_that_does_not_exist_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("there is a CUDA device here")
    with pytest.raises(DeviceError, match="gpulab doctor"):
        memory.record_history(device="cuda:99")
    with pytest.raises(DeviceError):
        memory.outside_allocator("cuda:99")


def test_nothing_outside_the_allocator_on_a_cpu():
    assert memory.outside_allocator("cpu") is None


def test_mib():
    assert memory.mib(3 * MiB / 2) == "1.5 MiB"


@pytest.mark.gpu
def test_a_real_snapshot_becomes_a_timeline(tmp_path):
    path = tmp_path / "snapshot.pickle"
    assert memory.record_history(max_entries=1000, device="cuda")
    try:
        x = torch.ones(MiB, device="cuda")
        del x
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = memory.snapshot_timeline(memory.load_snapshot(path), device=torch.cuda.current_device())
    assert "alloc" in set(events["action"]) and (events["reserved"] >= events["allocated"]).all()


@pytest.mark.gpu
def test_outside_allocator_counts_the_cuda_context():
    torch.ones(1, device="cuda")
    nbytes, how = memory.outside_allocator("cuda")
    assert nbytes > 0 and "reserved" in how


# ----- a training run's peak, on every device -------------------------------------------------------

def test_training_peak_memory_counts_a_runs_state_and_its_steps_peak_on_every_device(course_device):
    """A run whose state is 4 KiB and whose step holds 16 KiB at its peak: on the CPU the tracker counts it; on the
    stand-in the allocator's statistics, read through torch.cuda (_CudaAllocator), count the same bytes."""
    def step(state):
        torch.ones(2048) * 2  # 8 KiB of ones and 8 KiB of their double, alive at once

    peaks_read = []
    max_memory_allocated = torch.cuda.max_memory_allocated
    with mock.patch.object(torch.cuda, "max_memory_allocated",
                           lambda device=None: peaks_read.append(device) or max_memory_allocated(device)):
        peak = tasks.training_peak_memory(lambda: torch.zeros(1024), step, device=course_device)
    assert peak == 4096 + 16384
    assert bool(peaks_read) == gpulab.on_gpu(course_device)  # the allocator's statistics on the GPU's path only


# ----- the memory plots -----------------------------------------------------------------------------

def test_predicted_vs_measured_stacks_parts_and_names_the_ratio():
    frame = pd.DataFrame([
        {"optimizer": "SGD", "source": "predicted", "weights": 8.0, "grads": 8.0},
        {"optimizer": "SGD", "source": "measured", "weights": 8.0, "grads": 9.0},
        {"optimizer": "Adam", "source": "predicted", "weights": 8.0, "grads": 8.0},
        {"optimizer": "Adam", "source": "measured", "weights": 8.0, "grads": 8.0},
    ])
    ax = plots.predicted_vs_measured(frame, ["weights", "grads"], label="optimizer", title="t")
    assert len(ax.patches) == 8  # 2 parts x 2 sources x 2 optimizers
    texts = [t.get_text() for t in ax.texts]
    assert any("17 MiB (1.06× predicted)" in t for t in texts) and any("(1.00× predicted)" in t for t in texts)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["SGD", "Adam"]


def test_memory_timeline_shades_phases_and_marks_out_of_memory():
    events = pd.DataFrame({"event": range(5), "phase": ["fwd", "fwd", "bwd", "bwd", "bwd"],
                           "action": ["alloc", "alloc", "free", "oom", "alloc"], "op": [""] * 5,
                           "bytes": [MiB] * 5, "allocated": [MiB, 2 * MiB, MiB, MiB, 2 * MiB]})
    ax = plots.memory_timeline(events.assign(reserved=4 * MiB))
    assert [line.get_label() for line in ax.get_lines()] == ["allocated", "reserved"]
    assert {t.get_text() for t in ax.texts} == {"fwd", "bwd"}
    assert ax.collections and ax.collections[-1].get_label() == "out of memory"


def test_tradeoff_and_relative_bars():
    frame = pd.DataFrame({"config": ["none", "k=1", "k=2"], "step_ms": [10.0, 13.0, 12.0],
                          "peak_MiB": [100.0, 40.0, 55.0]})
    ax = plots.tradeoff(frame, "step_ms", "peak_MiB", label="config")
    assert [t.get_text() for t in ax.texts] == ["none", "k=1", "k=2"]
    assert ax.get_xlim()[0] == 0 and ax.get_ylim()[0] == 0
    ax = plots.relative_bars(frame, {"peak_MiB": "peak (MiB)", "step_ms": "time (ms)"}, label="config",
                             baseline="none")
    texts = [t.get_text() for t in ax.texts]
    assert " 0.40× (40)" in texts and " 1.30× (13)" in texts and texts.count(" 1.00× (100)") == 1


# ----- lesson 05's GPU path and its timing verdicts, run on the CPU -----------------------------------------
# The lesson's cells are executed here as the notebook runs them, with fakes standing in for what needs a GPU
# (the allocator's history, a fragmentation run) or for the clock (comparisons whose verdict is known).

LESSON = Path(__file__).resolve().parents[1] / "notebooks" / "05_memory.ipynb"


def lesson_cell(marker: str) -> str:
    """The source of the one code cell of lesson 05 that contains ``marker``."""
    cells = [c.source for c in nbformat.read(LESSON, as_version=4).cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, f"{len(cells)} code cells of {LESSON.name} contain {marker!r}"
    return cells[0]


def run_cell(marker: str, scope: dict) -> dict:
    exec(compile(lesson_cell(marker), f"<05_memory: {marker}>", "exec"), scope)
    return scope


@pytest.fixture
def lesson(results_dir, monkeypatch):
    """The lesson's namespace after its plan (quick mode), imports and section 1's measuring functions, on this CPU,
    with section 3's sizes (section 4 reads them)."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__", "gpulab": gpulab, "device": torch.device("cpu")}
    for marker in ("plans.lesson(", "import contextlib", "def measuring():"):
        run_cell(marker, scope)
    scope.update(mlp_width=scope["plan"].mlp_width, mlp_depth=scope["plan"].mlp_depth)
    return scope


def _overlap(a, b, slack=1.0) -> bool:
    return a.x0 + slack < b.x1 and b.x0 + slack < a.x1 and a.y0 + slack < b.y1 and b.y0 + slack < a.y1


def _along_and_across(text, renderer):
    """A label rotated by 0-90°, as its extent along its baseline and across it: (u0, u1, v0, v1) in pixels. The
    corner it starts from lies h·sin θ right of its upright bounding box's left edge, on that box's bottom."""
    box, angle = text.get_window_extent(renderer), math.radians(text.get_rotation())
    rotation = text.get_rotation()
    text.set_rotation(0)
    upright = text.get_window_extent(renderer)
    text.set_rotation(rotation)
    x, y = box.x0 + upright.height * math.sin(angle), box.y0
    u, v = x * math.cos(angle) + y * math.sin(angle), -x * math.sin(angle) + y * math.cos(angle)
    return u, u + upright.width, v, v + upright.height


def _labels_overlap(a, b, renderer, slack=1.0) -> bool:
    if a.get_rotation() == b.get_rotation() and 0 < a.get_rotation() < 90:  # compare them along their own baseline
        (au0, au1, av0, av1), (bu0, bu1, bv0, bv1) = (_along_and_across(t, renderer) for t in (a, b))
        return au0 + slack < bu1 and bu0 + slack < au1 and av0 + slack < bv1 and bv0 + slack < av1
    return _overlap(a.get_window_extent(renderer), b.get_window_extent(renderer), slack)


def assert_labels_clear(ax, *, inside=True):
    """No label covers another label or a bar, and (``inside``) every label lies within the axes."""
    renderer = ax.figure.canvas.get_renderer()
    texts = [t for t in ax.texts if t.get_text().strip()]
    boxes = [t.get_window_extent(renderer) for t in texts]
    for i, text in enumerate(texts):
        for other in texts[i + 1:]:
            assert not _labels_overlap(text, other, renderer), f"label {text.get_text()!r} covers {other.get_text()!r}"
    if not inside:
        return
    frame = ax.get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for p in ax.patches
            if isinstance(p, Rectangle) and p.get_width() and p.get_height()]
    for text, box in zip(texts, boxes):
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1, f"label {text.get_text()!r} leaves the axes"
        assert not any(_overlap(box, bar) for bar in bars), f"label {text.get_text()!r} covers a bar"


class OperatorLog(TorchDispatchMode):
    """Every operator that runs, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_section_1_warms_up_with_every_operator_its_measurement_runs(lesson, capsys):
    """Libraries allocate at the first call of an operator (cuBLASLt: at the first nn.Linear's addmm, not at a plain
    matmul); a warm-up that misses one leaves that memory inside section 1's measurement."""
    run_cell("def predict(", lesson)
    lesson.update(width=32, depth=3, batch_size=4)  # the same code at a size this test runs in no time
    log, measurement_starts = OperatorLog(), []
    measuring = lesson["measuring"]

    def noted_measuring():
        measurement_starts.append(len(log.ops))
        return measuring()

    lesson["measuring"] = noted_measuring
    run_cell("def first_step_phases", lesson)
    with log:
        run_cell("warm_up()  # needed", lesson)
    assert measurement_starts, "section 1 measured nothing"
    warm, measured = set(log.ops[:measurement_starts[0]]), set(log.ops[measurement_starts[0]:])
    assert measured <= warm, f"not warmed up before the measurement: {sorted(measured - warm)}"


def test_snapshot_cell_records_python_stacks_and_draws_the_allocators_timeline(lesson, monkeypatch, capsys):
    calls, snapshot = [], fake_snapshot()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(pickle.dumps(snapshot)))
    lesson.update(on_gpu=True, device=torch.device("cuda", 0), make_step=lambda k: (lambda: None))
    run_cell("_record_memory_history(", lesson)
    assert calls[0][1]["stacks"] == "python" and calls[0][1]["context"] == "all"
    assert calls[-1] == ((), {"enabled": None})  # recording stopped
    lines = {line.get_label(): line.get_ydata() for line in plt.gcf().axes[0].get_lines()}
    assert lines["allocated"][0] == 0 and lines["allocated"][-1] * MiB == A + C
    assert "written in" in capsys.readouterr().out


def test_snapshot_cell_without_a_gpu_says_so(lesson, capsys):
    run_cell("_record_memory_history(", lesson)
    assert "No GPU here" in capsys.readouterr().out


class _FakeAllocator:
    """Just enough of torch for lesson 05's fragmentation script: a caching allocator within a memory budget whose
    free memory, after the script's frees, lies in 20 MiB holes. A request larger than every hole needs new memory;
    with the budget fully reserved it frees its cache and retries: the default allocator cannot give back a segment
    that still holds tensors (out of memory), expandable segments unmap the holes' pages and map the request."""

    TOTAL = 80 * 2**30
    OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
    uint8 = "uint8"

    def __init__(self, expandable: bool):
        self.expandable, self.allocated, self.reserved, self.retries, self.budget = expandable, 0, 0, 0, self.TOTAL
        self.cuda = self

    def device(self, kind, index):
        return (kind, index)

    def set_per_process_memory_fraction(self, fraction, device):
        self.budget = fraction * self.TOTAL

    def get_device_properties(self, device):
        return SimpleNamespace(total_memory=self.TOTAL)

    def empty(self, nbytes, dtype=None, device=None):
        hole = self.reserved if self.allocated == 0 else 20 * MiB  # the script's tensors are 20 MiB each
        if not (nbytes <= self.reserved - self.allocated and nbytes <= hole):  # not served from the cache
            if self.reserved + nbytes <= self.budget:
                self.reserved += nbytes
            else:
                self.retries += 1
                if not self.expandable:
                    raise self.OutOfMemoryError(f"tried to allocate {nbytes} bytes")
                self.reserved = self.allocated + nbytes
        self.allocated += nbytes
        return _FakeTensor(self, nbytes)

    def memory_allocated(self, device):
        return self.allocated

    def memory_reserved(self, device):
        return self.reserved

    def memory_stats(self, device):
        return {"num_alloc_retries": self.retries}

    def memory_snapshot(self):
        return [{"is_expandable": self.expandable}]


class _FakeTensor:
    def __init__(self, allocator, nbytes):
        self.allocator, self.nbytes = allocator, nbytes

    def __del__(self):
        self.allocator.allocated -= self.nbytes


def test_fragmentation_shows_how_each_allocator_answered_the_request(lesson, monkeypatch, capsys, tmp_path):
    """Before the 64 MiB request both allocators hold the same bytes; the chart must show the state after it."""
    script = lesson_cell("%%writefile").split("\n", 1)[1]

    def run(args, env, **kwargs):  # the script, run in this process with the fake allocator as torch
        fake = _FakeAllocator(expandable="expandable_segments:True" in env.get("PYTORCH_ALLOC_CONF", ""))
        out = io.StringIO()
        with monkeypatch.context() as m, contextlib.redirect_stdout(out):
            m.setitem(sys.modules, "torch", fake)
            m.setattr(sys, "argv", [str(a) for a in args[1:]])
            exec(compile(script, "05_fragmentation.py", "exec"), {"__name__": "__main__"})
        return SimpleNamespace(returncode=0, stdout=out.getvalue(), stderr="")

    lesson.update(on_gpu=True, device=torch.device("cuda", 0), subprocess=SimpleNamespace(run=run),
                  fragmentation_script=tmp_path / "05_fragmentation.py")
    run_cell("fragmentation_log = gpulab.ResultLog", lesson)
    out = capsys.readouterr().out
    assert "default: 13 tensors of 20 MiB kept" in out and "does NOT fit (out of memory) after 1 retry" in out
    assert "expandable segments: 13 tensors of 20 MiB kept" in out and "fits after 1 retry" in out
    ax = plt.gcf().axes[0]
    bars = [t.get_text() for t in ax.get_yticklabels()]
    assert bars == ["default, before the request", "default, after it", "expandable segments, before the request",
                    "expandable segments, after it"]
    allocated = [p.get_width() for p in ax.containers[0]]
    assert allocated[0] == allocated[1] == allocated[2] == 260  # the same 13 tensors of 20 MiB kept ...
    assert allocated[3] == 260 + 64  # ... until expandable segments mapped the 64 MiB tensor
    frame = lesson["frag"]
    assert frame["alloc_retries"].tolist() == [1, 1] and frame["large_fits"].tolist() == [False, True]


def _comparisons_of(ratios):
    """A stand-in for gpulab.compare that runs each step once (its warm-up) and returns pairs with these ratios."""
    def compare(baseline, candidate, *, labels, **kwargs):
        baseline(), candidate()
        return gpulab.Comparison.of([1.0] * len(ratios), [1 / r for r in ratios], labels=labels)
    return compare


WITHIN_NOISE = [0.8, 1.25, 0.9, 1.1, 1.0, 0.95, 1.05, 0.85]
SLOWER = [0.7, 0.72, 0.75, 0.74, 0.71, 0.73, 0.76, 0.7]


@pytest.mark.parametrize("ratios, verdict", [(WITHIN_NOISE, "within noise"), (SLOWER, "slower")])
def test_checkpointing_and_remedies_print_only_the_verdicts_their_pairs_support(lesson, monkeypatch, capsys, ratios,
                                                                                 verdict):
    monkeypatch.setattr(gpulab, "compare", _comparisons_of(ratios))
    run_cell("def forward_checkpointed", lesson)
    checkpointing = capsys.readouterr().out.splitlines()
    run_cell("def remedy_step", lesson)
    remedies = capsys.readouterr().out.splitlines()
    for section, expected in ((checkpointing, 4), (remedies, 6)):
        timed = [line for line in section if " vs " in line]
        assert len(timed) == expected and all(f"×, {verdict} (" in line for line in timed), timed
        others = {"faster", "slower", "within noise"} - {verdict}
        assert not any(word in line for line in section for word in others), section
    axes = [ax for number in plt.get_fignums() for ax in plt.figure(number).axes]
    assert len(axes) == 4  # section 4: peaks and speed-ups; section 9: memory and speed-ups
    for ax in axes:
        assert_labels_clear(ax)
    speed_bars = [p.get_facecolor() for p in plt.figure(plt.get_fignums()[-1]).axes[1].patches]
    grey, red = matplotlib.colors.to_rgba("0.6"), matplotlib.colors.to_rgba("tab:red")
    assert set(speed_bars) == {grey if verdict == "within noise" else red}


def test_tracker_timeline_phase_names_stand_apart(lesson, monkeypatch, capsys):
    monkeypatch.setattr(gpulab, "compare", _comparisons_of(WITHIN_NOISE))
    run_cell("def forward_checkpointed", lesson)
    plt.close("all")
    run_cell("recorder = memory.MemoryTracker(record=True)", lesson)
    assert_labels_clear(plt.gcf().axes[0], inside=False)
