"""Lesson 07's GPU lines that a CPU can run: its scripts in torchrun children under the CUDA stand-in
(tests/cuda_stand_in.py, installed in each child by a small wrapper script), so that their GPU branches (the device
set, the allocator's statistics read after each phase, the rows called "measured") run on gloo ranks, and the notebook's
cells read those rows as on a machine with two GPUs. NCCL between GPUs, DataParallel and real allocator figures stay a
GPU's to show (tests/test_gpu_only_surface.py lists them): the stand-in counts tensors, it proves the Python around
torch.cuda's calls, never the GPU."""

import textwrap

import pandas as pd
import pytest
import torch

import gpulab
from gpulab import distributed

from .conftest import ROOT
from .test_distributed_lesson07 import DDP_SCRIPT, FSDP_LAUNCH, FSDP_SCRIPT, SETUP, TUNING_SCRIPT, cell, lesson_plan

WITH_STAND_IN = '''
    """Run a script under the CUDA stand-in: python with_stand_in.py <repository> <script> [its arguments]."""
    import runpy
    import sys

    root, script = sys.argv[1], sys.argv[2]
    sys.path.insert(0, root)
    from tests.cuda_stand_in import install

    install("NVIDIA H200")
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")
'''


def on_the_stand_in(tmp_path, cell_id: str, *args, nproc: int) -> distributed.Run:
    """The script a %%writefile cell writes, launched by torchrun on ``nproc`` gloo ranks, each under the stand-in."""
    script, wrapper = tmp_path / "script.py", tmp_path / "with_stand_in.py"
    script.write_text(textwrap.dedent(cell(cell_id)))
    wrapper.write_text(textwrap.dedent(WITH_STAND_IN))
    run = distributed.torchrun(wrapper, ROOT, script, *args, nproc=nproc, time_limit=300, echo=False,
                               env={"OMP_NUM_THREADS": "1"})
    assert run.ok, run.failure()
    return run


def test_fsdp_bytes_are_measured_by_the_allocator_on_gpu_ranks_and_the_lesson_reads_them_so(
        tmp_path, monkeypatch, results_dir, capsys):
    """fsdp_bytes.py's GPU branch on two ranks: torch.cuda.memory_allocated() after each phase (the stand-in's, a
    count of the tensors alive), rows called "measured", DDP's buckets seen (inside its reducer, where a count of the
    rank's tensors does not look); then cells 41 and 42 as on two GPUs: the measured bars and their text."""
    run = on_the_stand_in(tmp_path, FSDP_SCRIPT, "--device", "cpu", "--width", 256, nproc=2)
    rows = run.results(rank=None)
    assert {row["source"] for row in rows} == {"measured"} and {row["rank"] for row in rows} == {0, 1}
    mine = {row["strategy"]: row for row in rows if row["rank"] == 0}
    count = mine["DDP"]["parameter_count"]
    total = {s: sum(r[p] for p in ("parameters", "buckets", "gradients", "optimizer")) for s, r in mine.items()}
    assert total["DDP"] == pytest.approx(20 * count, rel=0.05)  # its buckets: 4 bytes per parameter more
    assert total["DDP, gradient_as_bucket_view"] == pytest.approx(16 * count, rel=0.05)
    assert mine["FSDP"]["parameters"] == pytest.approx(4 * count / 2, rel=0.05)  # its own shard of the parameters

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the notebook on a machine with two GPUs
    scope = {"__name__": "__main__", "gpulab": gpulab, "plan": lesson_plan(2, card="NVIDIA H200")}
    exec(cell(SETUP), scope)
    assert scope["backend_device"] == "cuda" and scope["ranks"] == [1, 2]
    launched = []

    class Launch:
        def raise_for_failure(self):
            return self

        def results(self, rank=0):
            return rows if rank is None else [r for r in rows if r["rank"] == rank]

    def torchrun(script, *args, nproc=2, **kwargs):
        launched.append([str(a) for a in args])
        return Launch()

    scope["distributed"] = type("Distributed", (), {"torchrun": staticmethod(torchrun), "record": distributed.record})
    scope["display"] = lambda *args: None
    scope["plt"] = type("Plt", (), {"show": staticmethod(lambda: None)})
    exec(cell(FSDP_LAUNCH), scope)
    exec(cell("5be964f8"), scope)
    assert launched == [["--device", "cuda", *map(str, scope["size"].args())]]
    said = capsys.readouterr().out
    assert "lower bars measured: torch.cuda.memory_allocated() after each phase" in said
    assert "On 2 GPUs, torch.cuda.memory_allocated() after each phase: one rank holds" in said
    held = scope["held"].set_index("strategy")
    ratios = held[["parameters", "buckets", "gradients", "optimizer"]].sum(axis=1) / held[
        [f"predicted_{p}" for p in ("parameters", "buckets", "gradients", "optimizer")]].sum(axis=1)
    assert ratios[["DDP", "DDP, gradient_as_bucket_view"]].tolist() == pytest.approx([1.0, 1.0], rel=0.05)
    assert isinstance(gpulab.ResultLog("07_fsdp_bytes").frame(), pd.DataFrame)


def test_the_ddp_scripts_gpu_branch_times_its_blocks_with_the_ranks_meeting_on_a_gloo_group(tmp_path):
    """ddp_train.py and ddp_tuning.py on two ranks that each play a GPU: the blocks wait for the GPU's queue
    (torch.cuda.synchronize) and the ranks meet on a gloo group of their own before each block (a CPU wait, the GPUs
    idle), as NCCL ranks do; the rows are those the notebook reads. The bucket caps, sized from the model's layers,
    make three different numbers of all-reduces (the lesson's caps of 1, 25 and 100 MB made 3, 1 and 1 at its width of
    512: two of its three configurations were the same one)."""
    sizes = ["--device", "cpu", "--width", 512, "--batch", 8, "--rounds", 2, "--calls", 1]
    rows = on_the_stand_in(tmp_path, DDP_SCRIPT, *sizes, nproc=2).results()
    assert {(r["part"], r.get("kind"), r["ranks"]) for r in rows} == {
        ("gradients", None, 2), ("scaling", "step", 1), ("scaling", "step", 2), ("scaling", "compute", 1),
        ("scaling", "compute", 2), ("scaling", "forward", 1)}
    assert all(len(r["times"]) == 2 for r in rows if r["part"] == "scaling")
    gradients = next(r for r in rows if r["part"] == "gradients")
    assert gradients["max_difference"] <= 1e-12 * gradients["scale"]
    tuned = on_the_stand_in(tmp_path, TUNING_SCRIPT, *sizes, nproc=2).results()
    buckets = sorted((r["bucket_cap_mb"], r["all_reduces"]) for r in tuned if r["part"] == "buckets")
    assert [count for _, count in buckets] == [3, 2, 1]  # a bucket per layer, two layers' worth, one for all
    ways = {r["way"]: r for r in tuned if r["part"] == "accumulation"}
    per_backward = ways["without no_sync()"]["all_reduces_per_backward"]
    assert [ways[w]["all_reduces"] for w in ("no_sync() but the last", "without no_sync()", "no_sync() on all")] == [
        per_backward, 4 * per_backward, 0]
    assert ways["no_sync() on all"]["ranks_disagree_by"] > 0 == ways["no_sync() but the last"]["ranks_disagree_by"]
