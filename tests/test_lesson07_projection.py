"""Lesson 07's projection to GPU clusters takes the compute measured on the device it is about: its cells run here on
the rows the course's first H200 run wrote (one GPU: DDP on two gloo processes on the CPU, and on one NCCL rank on the
GPU), with torchrun faked to return them; the one-GPU machine is the CUDA stand-in playing the H200."""

import math
from contextlib import nullcontext
from unittest import mock

import matplotlib
import pandas as pd
import pytest
import torch

import gpulab
from gpulab import distributed, plans

from .conftest import ROOT
from .cuda_stand_in import installed
from .test_distributed_lesson07 import SETUP, cell, lesson_plan

matplotlib.use("Agg")
DATA = ROOT / "tests" / "data" / "07_multi_gpu"
DDP_LAUNCH, SCALING, COMPUTE_COST, CHECK, PROJECTION, SUMMARY = (
    "25f8ea10", "3a65e1e3", "1237e691", "d8a9cff0", "7b10ab50", "f13b9235")
ROW_KEYS = ("world", "device", "part", "ranks", "max_difference", "scale", "kind", "grad_bytes", "batch_per_rank",
            "bucket_cap_mb", "all_reduces", "way", "all_reduces_per_backward", "ranks_disagree_by")


def h200_rows(device: str, rounds: int = 8) -> list[dict]:
    """The rows ddp_train.py printed on the H200 for ``device``'s ranks; each timed block at the median it logged."""
    logged = pd.read_csv(DATA / "h200_quick_07_ddp.csv")
    rows = []
    for row in logged[logged.device == device].to_dict("records"):
        printed = {k: row[k] for k in ROW_KEYS if not (isinstance(row[k], float) and math.isnan(row[k]))}
        if not math.isnan(row["median_s"]):
            printed["times"] = [row["median_s"]] * rounds
        rows.append(printed)
    return rows


class FakeRun:
    def __init__(self, rows, nproc):
        self.rows, self.nproc, self.seconds = rows, nproc, 1.0

    def raise_for_failure(self):
        return self

    def results(self, rank=0):
        return self.rows


def section_5(monkeypatch, results_dir, gpus: int) -> dict:
    """Sections 3 and 5 of the notebook on a machine with ``gpus`` GPUs (one: the stand-in playing the H200), on the
    H200's rows; the cells' variables."""
    scope = {"__name__": "__main__", "gpulab": gpulab, "plans": plans, "device": torch.device("cpu"),
             "plan": lesson_plan(gpus, card="NVIDIA H200")}
    monkeypatch.setenv("GPULAB_QUICK", "1")
    with installed("NVIDIA H200") if gpus else nullcontext(), mock.patch.object(torch.cuda, "device_count", lambda: gpus):
        exec(cell(SETUP), scope)

        def fake_torchrun(script, *args, nproc=2, **kwargs):  # the one-rank run is the GPU's
            return FakeRun(h200_rows("cuda" if nproc == 1 else "cpu"), nproc)

        scope["distributed"] = type("FakeDistributed", (), {"torchrun": staticmethod(fake_torchrun),
                                                             "record": staticmethod(distributed.record)})
        exec(cell(DDP_LAUNCH), scope)
    scope["distributed"] = distributed
    collectives = pd.read_csv(DATA / "h200_quick_07_collectives.csv")
    scope.update(collectives=collectives, all_reduce=collectives[collectives.op == "all_reduce"])
    for cell_id in (SCALING, CHECK, PROJECTION):
        exec(cell(cell_id), scope)
    return scope


def compute_of(device: str) -> float:
    rows = pd.read_csv(DATA / "h200_quick_07_ddp.csv")
    return rows[(rows.device == device) & (rows.kind == "compute") & (rows.ranks == 1)].median_s.iloc[0]


def test_on_one_gpu_the_projection_uses_the_gpus_compute_not_the_cpu_ranks(monkeypatch, results_dir, capsys):
    """On the H200 the 64-GPU projection used the CPU rank's 9.9 ms compute where the GPU's step took 1.6 ms."""
    scope = section_5(monkeypatch, results_dir, gpus=1)
    out = capsys.readouterr().out
    table = scope["table"]
    clusters = table[table.link.isin([t.name for t in distributed.TOPOLOGIES])]
    assert clusters.compute_s.tolist() == pytest.approx([compute_of("cuda")] * len(clusters))  # 1.64 ms: the GPU's
    here = table[table.link == scope["here"].name]
    assert here.compute_s.tolist() == pytest.approx([compute_of("cpu")] * len(here))  # beside the gloo ranks measured
    assert "1.6 ms per step measured on the GPU here" in out
    assert "could not run here" in out and "gloo processes on the CPU" in out


def test_without_a_gpu_the_projection_says_it_uses_the_cpus_compute(monkeypatch, results_dir, capsys):
    scope = section_5(monkeypatch, results_dir, gpus=0)
    out = capsys.readouterr().out
    assert scope["table"].compute_s.tolist() == pytest.approx([compute_of("cpu")] * len(scope["table"]))
    assert "No GPU here: the projection uses this CPU's compute, 9.9 ms per step" in out


def test_the_summary_says_which_compute_the_projection_used_and_what_did_not_run(monkeypatch, results_dir, capsys):
    scope = section_5(monkeypatch, results_dir, gpus=1)
    capsys.readouterr()
    summary = cell(SUMMARY)
    assert "Not run here" in summary
    start = summary.index("print(f\"- the 64-GPU projection")  # the summary's line on the projection, run alone
    exec(summary[start:summary.index("\n", start)], scope)
    assert "1.6 ms per step, measured on the GPU here" in capsys.readouterr().out


@pytest.mark.parametrize("cores, said", [(16, "each have a core of their own among 16"), (2, "take all 2 cores")])
def test_the_cpu_ranks_are_said_to_share_cores_only_where_they_do(monkeypatch, results_dir, capsys, cores, said):
    """The H200's 16 cores ran two one-thread ranks, and the lesson said they "share 16 cores"."""
    scope = section_5(monkeypatch, results_dir, gpus=1)
    monkeypatch.setattr(scope["os"], "cpu_count", lambda: cores)
    capsys.readouterr()
    exec(cell(COMPUTE_COST), scope)
    assert said in capsys.readouterr().out
