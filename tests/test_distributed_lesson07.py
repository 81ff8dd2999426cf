"""Lesson 07's cells and scripts on machines this one is not: its GPU paths run here with torch's GPU count, the
lesson's plan and the launcher faked (a one-GPU machine in full mode, three GPUs, a node of a two-node job), so that
what they would do there is checked on a CPU. What only a GPU can show is marked ``gpu`` and skipped here with the
reason."""

import textwrap
from contextlib import ExitStack
from unittest import mock

import nbformat
import pytest
import torch
import torch.distributed as dist

import gpulab
from gpulab import distributed, plans
from gpulab.plans import plan07

from .conftest import ROOT

NOTEBOOK = ROOT / "notebooks" / "07_multi_gpu.ipynb"


class Stop(Exception):
    """Raised by a fake to end a cell or script at the point a test looks at."""


def cell(cell_id: str) -> str:
    """The source of one of the notebook's cells; of a %%writefile cell, the script it writes."""
    source = next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.get("id") == cell_id)
    return source.split("\n", 1)[1] if source.startswith("%%writefile") else source


SETUP, HELLO, COLLECTIVES, DDP_LAUNCH, DATA_PARALLEL, FSDP_SCRIPT, FSDP_LAUNCH = (
    "2d23945e", "9c7d0527", "5fc35b8f", "25f8ea10", "6c156b9b", "3e9dda2f", "fea3e6c6")
COLLECTIVES_SCRIPT, DDP_SCRIPT, TUNING_SCRIPT, TUNING_LAUNCH = "0f7b1d52", "71a2b8b5", "c4d7e9b1", "e5a0c3d8"


def lesson_plan(gpus: int, *, full: bool = False, card: str = "NVIDIA H100 80GB HBM3") -> plans.LessonPlan:
    """Lesson 07's plan on a machine with ``gpus`` GPUs of ``card`` (none: the CPU's quick plan)."""
    planned = plans.Card.named(card, gpus=gpus) if gpus else plans.Card("CPU", None, 2, 0)
    return plans.plan_for("07", planned, quick=not full)


@pytest.fixture
def machine(results_dir):
    """Run the setup cell as if torch saw ``gpus`` GPUs, with their plan; returns the cell's variables. Its patch is
    undone at this fixture's end: a test that also plays a card asks for ``cuda_stand_in`` first, so that the card is
    put away after it (a monkeypatch would restore the card's answer after the card had gone)."""
    with ExitStack() as patches:
        def setup(gpus: int, *, full: bool = False, card: str = "NVIDIA H100 80GB HBM3") -> dict:
            patches.enter_context(mock.patch.object(torch.cuda, "device_count", lambda: gpus))
            scope = {"__name__": "__main__", "plan": lesson_plan(gpus, full=full, card=card), "gpulab": gpulab,
                     "device": torch.device("cpu")}  # the course's device: a GPU where the CUDA stand-in plays one
            exec(cell(SETUP), scope)
            return scope
        yield setup


def launches(scope: dict, cell_id: str, stop_after: int = 99) -> list[dict]:
    """The torchrun launches a cell makes (script, arguments, nproc), with torchrun faked: each returns a run
    with no rows, and the cell is stopped after ``stop_after`` launches or at its first use of the rows."""
    calls = []

    class FakeRun:
        def raise_for_failure(self):
            return self

        def results(self, rank=0):
            raise Stop

    def fake_torchrun(script, *args, nproc=2, **kwargs):
        calls.append({"script": script.name, "args": [str(a) for a in args], "nproc": nproc, **kwargs})
        if len(calls) >= stop_after:
            raise Stop
        return FakeRun()

    scope["distributed"] = type("FakeDistributed", (), {"torchrun": staticmethod(fake_torchrun)})
    try:
        exec(cell(cell_id), scope)
    except Stop:
        pass
    finally:
        scope["distributed"] = distributed
    return calls


def argument(call: dict, name: str) -> str:
    return call["args"][call["args"].index(name) + 1]


# ----- sizes by backend: the plan's, for gloo ranks on the CPU and for GPUs --------------------------------------

def test_on_one_gpu_in_full_mode_the_gloo_runs_get_cpu_sized_work(cuda_stand_in, machine):
    scope = machine(1, full=True, card="Tesla T4")  # Colab: one GPU, full mode, the multi-rank runs gloo on the CPU
    assert scope["backend_device"] == "cpu" and scope["ranks"] == [1, 2] and scope["size"] == plan07.GLOO_WORK
    assert scope["launch"]["env"] == {"OMP_NUM_THREADS": "1"} and scope["launch"]["time_limit"] == scope["plan"].time_limit
    gloo, nccl = launches(scope, DDP_LAUNCH, stop_after=2)
    assert argument(gloo, "--device") == "cpu" and gloo["nproc"] == 2
    assert int(argument(gloo, "--width")) == plan07.GLOO_WORK.width
    assert int(argument(gloo, "--batch")) == plan07.GLOO_WORK.batch
    # the one-rank run on the GPU itself (the course's device: the CPU playing it here) takes the GPU's planned sizes
    gpu = scope["plan"].gpu_work
    assert nccl["nproc"] == 1 and int(argument(nccl, "--width")) == gpu.width > plan07.GLOO_WORK.width
    assert int(argument(nccl, "--batch")) == gpu.batch and "env" not in nccl  # all its threads: no OMP_NUM_THREADS
    (collectives,) = launches(scope, COLLECTIVES)
    assert int(argument(collectives, "--max-bytes")) == plan07.GLOO_WORK.max_bytes
    (fsdp,) = launches(scope, FSDP_LAUNCH)
    assert argument(fsdp, "--device") == "cpu" and int(argument(fsdp, "--width")) == plan07.GLOO_WORK.width


def test_without_a_gpu_there_is_no_one_rank_gpu_run(machine):
    scope = machine(0)
    (gloo,) = launches(scope, DDP_LAUNCH)
    assert argument(gloo, "--device") == "cpu" and "gpu_work" not in scope["plan"].sizes


def test_on_several_gpus_in_full_mode_the_nccl_runs_get_gpu_sized_work(machine):
    scope = machine(4, full=True)
    assert scope["backend_device"] == "cuda" and scope["size"] == scope["plan"].work and scope["launch"]["env"] == {}
    (ddp,) = launches(scope, DDP_LAUNCH)
    assert int(argument(ddp, "--width")) == scope["plan"].work.width >= 1024 and ddp["nproc"] == 4
    (tuning,) = launches(scope, TUNING_LAUNCH)
    assert argument(tuning, "--device") == "cuda" and tuning["nproc"] == 4


def test_in_quick_mode_the_launches_time_the_quick_sizes(machine):
    """CI's quick mode (no GPU): the collectives called at most QUICK_WORK.iters times per round and the DDP
    configurations timed in QUICK_WORK's rounds and calls."""
    quick = plan07.QUICK_WORK
    scope = machine(0)
    assert scope["size"] == quick
    (collectives,) = launches(scope, COLLECTIVES)
    assert int(argument(collectives, "--max-bytes")) == quick.max_bytes
    assert int(argument(collectives, "--iters")) == quick.iters < plan07.GLOO_WORK.iters
    (ddp,) = launches(scope, DDP_LAUNCH)
    assert [int(argument(ddp, name)) for name in ("--rounds", "--calls")] == [quick.rounds, quick.calls]


def test_the_collectives_script_calls_each_collective_at_most_iters_times_per_round(monkeypatch):
    """The script's calls per timed round: --iters for the smallest messages, fewer (at least 2) for larger ones,
    the same on every rank."""
    calls = []

    def fake_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel() * tensor.element_size())

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, x: (_ for _ in ()).throw(Stop()), raising=False)
    monkeypatch.setattr(dist, "all_gather_single", lambda out, x: (_ for _ in ()).throw(Stop()), raising=False)
    monkeypatch.setattr("sys.argv", ["collectives.py", "--max-bytes", str(2**20), "--iters", "7"])
    with pytest.raises(Stop):  # stopped at the first all-gather: the all-reduces are done
        exec(cell(COLLECTIVES_SCRIPT), {"__name__": "__main__"})
    per_size = {nbytes: calls.count(nbytes) for nbytes in dict.fromkeys(calls)}
    # 2 warm-up calls and 3 timed rounds: 4 KiB .. 512 KiB at the cap of 7, 1 MiB at 2**22 // 2**20 = 4 calls
    assert per_size == {**{2**k: 2 + 3 * 7 for k in range(12, 20)}, 2**20: 2 + 3 * 4}


# ----- DataParallel on as many GPUs as DDP -------------------------------------------------------------------

@pytest.mark.parametrize("gpus", [2, 3, 5, 6, 7, 8])
def test_data_parallel_uses_the_gpus_of_the_largest_ddp_run(machine, monkeypatch, gpus):
    scope = machine(gpus)
    (ddp,) = launches(scope, DDP_LAUNCH)
    seen = {}

    def fake_data_parallel(module, device_ids=None, *args, **kwargs):
        seen["device_ids"] = device_ids
        raise Stop

    monkeypatch.setattr(torch.nn, "DataParallel", fake_data_parallel)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    with pytest.raises(Stop):
        exec(cell(DATA_PARALLEL), scope)
    assert seen["device_ids"] is not None, "without device_ids DataParallel takes every visible GPU"
    assert list(seen["device_ids"]) == list(range(ddp["nproc"])) and ddp["nproc"] == gpus


# ----- hello.py: the backend from the GPUs of this node ----------------------------------------------------

@pytest.mark.parametrize("gpus_here, local_world, world, local_rank, backend", [
    (8, 8, 16, 1, "nccl"),  # a node of a two-node job: 8 GPUs for its 8 ranks, 16 ranks in all
    (8, 8, 8, 3, "nccl"),
    (1, 2, 2, 1, "gloo"),  # two ranks and one GPU: gloo on the CPU
    (0, 2, 2, 0, "gloo"),
])
def test_hello_picks_nccl_when_this_node_has_a_gpu_per_local_rank(monkeypatch, gpus_here, local_world, world,
                                                                   local_rank, backend):
    chosen = {}

    def fake_init(name, *args, **kwargs):
        chosen["backend"] = name
        raise Stop

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus_here)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.setdefault("device", device))
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    for name, value in {"RANK": world - local_world + local_rank, "WORLD_SIZE": world, "LOCAL_RANK": local_rank,
                        "LOCAL_WORLD_SIZE": local_world, "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, str(value))
    with pytest.raises(Stop):
        exec(cell(HELLO), {"__name__": "__main__"})
    assert chosen["backend"] == backend
    if backend == "nccl":
        assert chosen["device"] == torch.device("cuda", local_rank)


# ----- FSDP's bytes: counted on a CPU, measured on a GPU ----------------------------------------------------

def _fsdp_rows(tmp_path, device: str, nproc: int) -> dict:
    script = tmp_path / "fsdp_bytes.py"
    script.write_text(textwrap.dedent(cell(FSDP_SCRIPT)))
    run = distributed.torchrun(script, "--device", device, "--width", 256, nproc=nproc, time_limit=300, echo=False,
                               env={"OMP_NUM_THREADS": "1"})
    assert run.ok, run.failure()
    return {row["strategy"]: row for row in run.results()}


def test_on_a_cpu_fsdp_bytes_are_called_counted_and_default_ddp_buckets_are_not_claimed(tmp_path):
    rows = _fsdp_rows(tmp_path, "cpu", 2)
    assert {row["source"] for row in rows.values()} == {"counted"}
    count = rows["DDP"]["parameter_count"]
    assert rows["DDP"]["buckets"] is None  # inside DDP's reducer: a count of tensors does not see them
    view = rows["DDP, gradient_as_bucket_view"]
    assert view["buckets"] == 4 * count and view["gradients"] == 0  # the gradients are views into the buckets
    assert rows["FSDP"]["parameters"] == pytest.approx(4 * count / 2, rel=0.01)


@pytest.mark.gpu
def test_on_a_gpu_fsdp_and_ddp_bytes_are_measured_by_the_allocator(tmp_path):
    rows = _fsdp_rows(tmp_path, "cuda", 1)
    assert {row["source"] for row in rows.values()} == {"measured"}
    count = rows["DDP"]["parameter_count"]
    total = {s: sum(r[p] for p in ("parameters", "buckets", "gradients", "optimizer")) for s, r in rows.items()}
    assert total["DDP"] == pytest.approx(20 * count, rel=0.05)  # the buckets: 4 bytes per parameter more
    assert total["DDP, gradient_as_bucket_view"] == pytest.approx(16 * count, rel=0.05)
