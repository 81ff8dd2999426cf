"""gpulab.memory: the tracker's timeline and phases, snapshots read offline, clear errors for misuse, and the
memory plots of lesson 05."""

import pickle

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpulab import memory, models, plots  # noqa: E402
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


# ----- snapshots, read offline ----------------------------------------------------------------------

def _entry(action, size, name="fn"):
    return {"action": action, "addr": 0, "size": size, "stream": 0, "frames": [{"name": name, "filename": "x.py",
                                                                                   "line": 1}]}


def fake_snapshot():
    """A snapshot as torch.cuda.memory._snapshot() gives it: 20 MiB reserved, 6 MiB allocated at the end."""
    trace = [_entry("segment_alloc", 20 * MiB), _entry("alloc", 4 * MiB, "forward"), _entry("alloc", 4 * MiB),
             _entry("free_requested", 4 * MiB), _entry("free_completed", 4 * MiB), _entry("alloc", 2 * MiB)]
    segments = [{"device": 0, "address": 0, "total_size": 20 * MiB, "allocated_size": 6 * MiB, "blocks": []}]
    return {"segments": segments, "device_traces": [trace]}


def test_snapshot_timeline_counts_allocated_and_reserved():
    events = memory.snapshot_timeline(fake_snapshot())
    assert list(events.columns) == [*memory.TIMELINE_COLUMNS, "reserved"]
    assert (events["allocated"] / MiB).tolist() == [0, 4, 8, 8, 4, 6]
    assert (events["reserved"] / MiB).tolist() == [20] * 6
    assert events["op"].iloc[1] == "forward"


def test_snapshot_timeline_of_a_truncated_history_starts_from_the_state_before_it():
    snapshot = fake_snapshot()
    snapshot["device_traces"][0] = snapshot["device_traces"][0][2:]  # max_entries dropped the oldest two
    events = memory.snapshot_timeline(snapshot)
    assert (events["allocated"] / MiB).tolist() == [8, 8, 4, 6]
    assert (events["reserved"] / MiB).tolist() == [20] * 4


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
