"""Lesson 03's largest-batch searches on a GPU: the searches that are compared count memory the same way, and what
the caching allocator holds beyond the tensors (cuDNN's workspace) is measured as a finding of its own.

On the H200 (tests/data/lesson03/) the bisection counted the allocator's peak and found batch 48, where the naive
and the written-out searches counted tensors and found 128 and 136: a difference of method, shown as one of search.
Here the lesson's own cells run on a simulated GPU: tensors on the meta device (shapes, no memory, no arithmetic), and
an allocator that counts every tensor and, for a convolution of 56 samples or more, a workspace of the size the
H200's trials imply."""

from types import SimpleNamespace

import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import gpulab
from gpulab import batch_finder, batching, memory, models
from gpulab.batch_finder import find_max_batch
from gpulab.memory import MemoryTracker, TrackerError, WorkspaceMeter

from .conftest import ROOT

MiB = 2**20
H200 = pd.read_csv(ROOT / "tests" / "data" / "lesson03" / "h200_03_batch_finder.csv")
_PEAK = dict(zip(H200.batch_size, H200.peak_MiB))  # the allocator's peak of each trial on the H200, in MiB
WORKSPACE_FROM = 56  # batch 48 fitted in 23.8 MiB, batch 56 took 76.9 MiB: a workspace appeared between them
WORKSPACE = int((_PEAK[56] - _PEAK[48] * 56 / 48) * MiB)  # what batch 56 took beyond batch 48's bytes per sample
CUDA = torch.device("cuda", 0)
META = torch.device("meta")


def run(scope: dict, lesson: str, *markers: str) -> dict:
    """Run the lesson's code cells that contain ``markers``, in order, in ``scope`` (the notebook's globals)."""
    cells = nbformat.read(ROOT / "notebooks" / "03_batching.ipynb", as_version=4).cells
    for marker in markers:
        found = [c.source for c in cells if c.cell_type == "code" and marker in c.source]
        assert len(found) == 1, f"lesson {lesson}: {len(found)} code cells contain {marker!r}"
        exec(compile(found[0], f"<lesson {lesson}: {marker}>", "exec"), scope)
    return scope


class SimulatedAllocator(MemoryTracker):
    """A CUDA caching allocator, simulated: it counts every tensor, as the allocator counts its blocks (without their
    rounding), and a convolution of WORKSPACE_FROM samples or more takes WORKSPACE bytes of scratch memory for the
    length of its call, as cuDNN's algorithm did on the H200."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if "convolution" in func.overloadpacket.__name__ and args[0].shape[0] >= WORKSPACE_FROM:
            self.peak = max(self.peak, self.current + WORKSPACE)  # taken beside the outputs, freed at the return
        return out


@pytest.fixture
def gpu(monkeypatch):
    """A simulated GPU for the batch finder, the WorkspaceMeter and the lesson's cells: torch.cuda's memory statistics
    read the simulated allocator, which counts from here on."""
    allocator = SimulatedAllocator()
    cuda = torch.cuda
    for name, fn in {
        "memory_allocated": lambda device=None: allocator.current,
        "memory_reserved": lambda device=None: allocator.current,
        "max_memory_allocated": lambda device=None: allocator.peak,
        "reset_peak_memory_stats": lambda device=None: allocator.reset_peak(),
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "get_device_properties": lambda device=None: SimpleNamespace(total_memory=141 * 2**30, name="simulated"),
    }.items():
        monkeypatch.setattr(cuda, name, fn)
    monkeypatch.setattr(batch_finder, "get_device", lambda spec=None: CUDA)
    monkeypatch.setattr(memory, "get_device", lambda spec=None: CUDA)
    with allocator:
        yield allocator


def trial(batch_size, device=META):
    """The lesson's trial: a whole SmallCNN training step built from scratch, here on the meta device."""
    model = models.SmallCNN(width=16).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch_size, 3, 32, 32, device=device), torch.randint(0, 10, (batch_size,), device=device)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


# ----- find_max_batch counts what it is told to count ----------------------------------------------------------

def test_the_h200_fixture_holds_the_jump_the_simulation_uses():
    assert _PEAK[48] < 64 < _PEAK[56] and 40 * MiB < WORKSPACE < 60 * MiB
    assert set(H200.outcome) == {"fits", "over budget"} and H200.budget_MiB.eq(64).all()


def test_a_search_on_a_gpu_counts_the_allocator_by_default_and_tensors_when_asked(gpu):
    by_allocator = find_max_batch(trial, budget_bytes=64 * MiB, granularity=8)
    by_tensors = find_max_batch(trial, budget_bytes=64 * MiB, granularity=8, count="tensors")
    assert by_allocator.count == "allocator" and by_allocator.batch_size == 48  # what the H200 found
    assert by_tensors.count == "tensors" and by_tensors.batch_size == 136  # what the lesson's other searches found
    assert "counting the allocator's bytes" in str(by_allocator) and "counting the bytes of tensors" in str(by_tensors)
    over = [t for t in by_allocator.trials if t.batch_size == 56]
    assert over and not over[0].fits and over[0].peak_bytes > 64 * MiB  # the workspace, not the tensors, ran out
    assert by_tensors.allocated_after == by_tensors.allocated_before == 0  # counted as the search counts


def test_counting_tensors_works_on_a_cpu_and_the_allocator_needs_cuda():
    search = find_max_batch(lambda b: torch.ones(1024 * b, dtype=torch.uint8), budget_bytes=100 * 1024)
    assert search.count == "tensors" and search.batch_size == 100
    with pytest.raises(ValueError, match="count='allocator' needs a CUDA device"):
        find_max_batch(lambda b: None, count="allocator")
    with pytest.raises(ValueError, match="count is 'allocator' or 'tensors'"):
        find_max_batch(lambda b: None, count="bytes")


# ----- the WorkspaceMeter ---------------------------------------------------------------------------------------

def test_the_workspace_meter_names_the_convolution_that_took_scratch_memory(gpu):
    with WorkspaceMeter() as meter:
        trial(WORKSPACE_FROM)
    table = meter.table()
    assert table.iloc[0].op.startswith("convolution") and table.iloc[0].scratch_bytes == WORKSPACE
    assert (table.set_index("op").scratch_bytes.drop(["convolution", "convolution_backward"]) == 0).all()
    assert table.set_index("op").calls["convolution"] >= 2  # every convolution call was seen
    with WorkspaceMeter() as small:
        trial(WORKSPACE_FROM - 8)
    assert small.table().scratch_bytes.max() == 0  # below the jump, no scratch memory


def test_the_workspace_meter_before_a_step_says_what_to_do(gpu):
    with pytest.raises(TrackerError, match="run the step inside `with meter:` first"):
        WorkspaceMeter().table()


def test_the_workspace_meter_on_a_cpu_counts_the_operators_and_says_their_scratch_is_not_measured():
    with WorkspaceMeter("cpu") as meter:
        torch.ones(4, 4) @ torch.ones(4, 4)
    table = meter.table()
    assert table.set_index("op").calls.to_dict() == {"ones": 2, "mm": 1}
    assert table.scratch_bytes.isna().all() and "no caching allocator" in meter.note


def test_the_workspace_meter_reads_the_allocator_of_the_cuda_stand_in(cuda_stand_in):
    """The GPU path on the CPU playing an H200: the allocator's statistics around each operator, read from the stand-in
    (a CPU's operators take no scratch beyond their outputs: 0 bytes each)."""
    with WorkspaceMeter() as meter:
        trial(8, device=torch.device("cpu"))
    table = meter.table()
    assert meter.note == "" and (table.scratch_bytes == 0).all() and table.scratch_bytes.dtype.kind == "i"
    assert {"convolution", "convolution_backward"} <= set(table.op)


# ----- the lesson's cells, on the simulated GPU -----------------------------------------------------------------

@pytest.fixture
def lesson(gpu, results_dir, monkeypatch, capsys):
    """Lesson 03's imports, on the simulated GPU in quick mode, its tensors on the meta device."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    monkeypatch.setattr(gpulab, "device_info", lambda device=None: SimpleNamespace(name="simulated H200"))
    monkeypatch.setattr(batching, "device_info", lambda device=None: SimpleNamespace(name="simulated H200"))
    scope = run({"__name__": "__main__", "gpulab": gpulab, "device": META}, "03", "plans.lesson(",
                "from gpulab import batch_finder")
    scope.update(on_gpu=True, display=lambda *args, **kwargs: None)
    capsys.readouterr()
    yield scope
    plt.close("all")


def test_the_compared_searches_count_alike_and_the_workspace_is_a_finding_of_its_own(lesson, capsys):
    run(lesson, "03", "def trial(", "card = batch_finder.MemoryTracker(budget)", "def largest_batch(",
        "search = batch_finder.find_max_batch(")
    out = capsys.readouterr().out
    assert lesson["naive"] == 128 and lesson["written_out"] == 136
    assert lesson["search"].batch_size == lesson["written_out"], out  # the H200 printed 48 here: another count
    assert lesson["search"].count == lesson["count"] == "tensors"
    assert "All three searches counted the bytes of tensors" in out and "1.06× the naive one" in out

    run(lesson, "03", "def both_peaks(")
    out = capsys.readouterr().out
    beyond = lesson["beyond"]
    assert list(beyond.index) == sorted(t.batch_size for t in lesson["search"].trials if t.fits)
    below, above = beyond[beyond.index < WORKSPACE_FROM], beyond[beyond.index >= WORKSPACE_FROM]
    assert (below.beyond_MiB == 0).all() and (below.scratch_MiB == 0).all()
    # the workspace lives during a convolution, not at the tensors' own peak: the card holds more, by at most it
    assert ((above.beyond_MiB > 0) & (above.beyond_MiB <= WORKSPACE / MiB)).all()
    assert above.scratch_op.str.startswith("convolution").all()
    assert above.scratch_MiB.tolist() == pytest.approx([WORKSPACE / MiB] * len(above))
    assert lesson["by_allocator"].batch_size == 48  # the H200's answer, now explained
    most = beyond.beyond_MiB.idxmax()
    assert f"At batch {most} the allocator's peak was {beyond.allocator_MiB[most]:.1f} MiB" in out
    assert "cuDNN's workspace" in out and "fits batch 48, where counting tensors fitted 136" in out
    written = pd.read_csv(lesson["workspace_log"].path)
    assert written.tensors_MiB.tolist() == pytest.approx(beyond.tensors_MiB.tolist())


def test_without_a_gpu_the_workspace_cell_says_what_needs_one(lesson, capsys, monkeypatch):
    monkeypatch.setattr(batch_finder, "get_device", lambda spec=None: torch.device("cpu"))
    lesson.update(on_gpu=False, device=torch.device("cpu"))
    run(lesson, "03", "def trial(")
    capsys.readouterr()
    run(lesson, "03", "def both_peaks(")  # without a GPU the cell needs no search
    out = capsys.readouterr().out
    assert out.startswith("No GPU here") and "cuDNN" in out and "beyond" not in lesson
