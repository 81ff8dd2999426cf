"""Lesson 03's GPU branches and the batch finder's, run on the CPU playing an NVIDIA H200 (tests/cuda_stand_in.py):
the allocator's statistics around each trial, the budget checked against the card's memory, a search of the card
capped by the plan that meets the card's own out-of-memory errors, and the lesson's cells that count a step two ways.
The stand-in's allocator counts the same tensors a MemoryTracker does (a CPU takes no cuDNN workspace), so where the
H200 found a difference (tests/test_lesson03_workspace.py replays it) the stand-in finds none: what runs here is the
code around torch's calls, never the GPU."""

from unittest import mock

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

import gpulab
from gpulab.batch_finder import OUT_OF_MEMORY, OVER_BUDGET, find_max_batch

from .test_lesson03 import bytes_step
from .test_mfu_lessons_03_04 import H200, h200_ceilings, replay, run

MiB = 2**20
CPU = torch.device("cpu")


# ----- the batch finder's GPU branches ---------------------------------------------------------------------------

def test_a_budget_above_the_cards_memory_is_refused_naming_the_card(cuda_stand_in):
    total = cuda_stand_in.card.total_memory
    with pytest.raises(ValueError, match=r"is more than this GPU has \(143,156\.1 MiB, NVIDIA H200\); leave it out"):
        find_max_batch(bytes_step(1), budget_bytes=2 * total)
    assert find_max_batch(bytes_step(1), budget_bytes=total, max_batch=8).batch_size == 8


def test_a_budget_above_this_machines_memory_is_refused_on_a_cpu():
    with pytest.raises(ValueError, match="more than this machine has .* of RAM"):
        find_max_batch(bytes_step(1), budget_bytes=2**60)


def test_a_search_counting_the_allocator_reads_its_statistics_and_stops_at_the_budget(cuda_stand_in):
    budget = 100 * 1024
    by_allocator = find_max_batch(bytes_step(1024), budget_bytes=budget)
    by_tensors = find_max_batch(bytes_step(1024), budget_bytes=budget, count="tensors")
    assert by_allocator.count == "allocator" and by_tensors.count == "tensors"
    assert by_allocator.batch_size == by_tensors.batch_size == 100  # the stand-in's allocator counts the tensors
    assert [t.peak_bytes for t in by_allocator.trials if t.fits] == [t.peak_bytes for t in by_tensors.trials if t.fits]
    assert {t.outcome for t in by_allocator.trials} == {"fits", OVER_BUDGET}
    assert by_allocator.allocated_after == by_allocator.allocated_before


def test_a_search_of_the_whole_card_meets_the_cards_out_of_memory_not_a_budget(cuda_stand_in):
    """Without a budget the search runs until the card refuses: here the stand-in's card, capped with
    set_per_process_memory_fraction. A failure is the device's out-of-memory error, never "over budget"; after it the
    cache goes back (empty_cache) and nothing stays allocated."""
    before = torch.cuda.memory_allocated()
    total = cuda_stand_in.card.total_memory
    torch.cuda.set_per_process_memory_fraction((before + 100 * 1024) / total)
    search = find_max_batch(bytes_step(1024), max_batch=1024)
    assert search.batch_size == 100 and search.budget_bytes is None and search.count == "allocator"
    assert {t.outcome for t in search.trials if not t.fits} == {OUT_OF_MEMORY}
    assert search.allocated_before == search.allocated_after == before
    assert torch.cuda.memory_reserved() == -(-before // (2 * MiB)) * 2 * MiB  # the cache emptied after the failures


# ----- lesson 03's cells -----------------------------------------------------------------------------------------

@pytest.fixture
def lesson(cuda_stand_in, results_dir, monkeypatch, capsys):
    """Lesson 03's imports on the CPU playing an H200; figures not shown."""
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)

    def start(quick: bool) -> dict:
        monkeypatch.setenv("GPULAB_QUICK", "1" if quick else "0")
        scope = run({"gpulab": gpulab, "device": CPU}, "03", "plans.lesson(", "from gpulab import batch_finder")
        scope["display"] = lambda *args, **kwargs: None
        capsys.readouterr()
        return scope

    yield start
    plt.close("all")


SEARCH_CELLS = ("card = batch_finder.MemoryTracker(budget)", "def largest_batch(", "search = batch_finder.find_max_batch(")


def test_in_quick_mode_the_searches_run_within_the_budget_and_count_the_step_two_ways(lesson, capsys):
    scope = lesson(quick=True)
    assert scope["on_gpu"]
    run(scope, "03", "def trial(")
    assert "Searching within a budget of 64 MiB" in capsys.readouterr().out
    scope["budget"] = 8 * MiB  # the lesson's 64 MiB at a fraction of the time: the same code
    run(scope, "03", *SEARCH_CELLS)
    out = capsys.readouterr().out
    assert "PyTorch's cache still reserves" in out  # the GPU's line after the naive loop
    search = scope["search"]
    assert search.count == "tensors" and search.batch_size == scope["written_out"] and scope["naive_left"] == 0

    run(scope, "03", "def both_peaks(")
    out = capsys.readouterr().out
    beyond = scope["beyond"]
    assert list(beyond.index) == sorted(t.batch_size for t in search.trials if t.fits)
    assert (beyond.beyond_MiB == 0).all() and (beyond.scratch_MiB == 0).all()  # no workspace on a CPU
    assert "No operator took scratch memory beyond its outputs there" in out
    assert scope["by_allocator"].count == "allocator" and scope["by_allocator"].batch_size == search.batch_size
    assert f"the same 8 MiB fits batch {search.batch_size}, where counting tensors fitted {search.batch_size}" in out
    written = pd.read_csv(scope["workspace_log"].path)
    assert written.allocator_MiB.tolist() == pytest.approx(beyond.allocator_MiB.tolist())


def test_in_full_mode_the_searches_meet_the_out_of_memory_error_of_the_card_capped_by_the_plan(lesson, capsys,
                                                                                               cuda_stand_in):
    """Full mode on a GPU: the card itself, capped at the plan's cap_gb with set_per_process_memory_fraction (the
    stand-in's allocator refuses past it as a capped GPU's does), the cap lifted after the searches. Today's lesson
    searched the whole card, bounded by nothing but max_batch=2**18."""
    scope = lesson(quick=False)
    plan, total = scope["plan"], cuda_stand_in.card.total_memory
    assert plan.cap_gb == pytest.approx(0.75 * 141, abs=0.05) and plan.search_max_batch < 2**18
    run(scope, "03", "def trial(")
    assert scope["budget"] is None and scope["count"] == "allocator"
    assert cuda_stand_in.tracker.budget == pytest.approx(plan.cap_gb * 1e9)  # the cap, on the card's allocator
    assert f"Searching the card up to a cap of {plan.cap_gb:g} GB of its 150.1 GB" in capsys.readouterr().out
    card = 12 * MiB  # the cap, made small: the stand-in refuses past it as a capped GPU does
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + card) / total)
    run(scope, "03", *SEARCH_CELLS)
    search = scope["search"]
    assert search.budget_bytes is None and 1 <= search.batch_size < scope["naive"] * 2
    assert {t.outcome for t in search.trials if not t.fits} == {OUT_OF_MEMORY}
    assert scope["naive_left"] == 0 and search.allocated_after == search.allocated_before
    assert cuda_stand_in.tracker.budget == total  # the whole card again after the searches
    run(scope, "03", "def both_peaks(")
    out = capsys.readouterr().out
    assert "the searches on the card met real out-of-memory errors" in out and "by_allocator" not in scope
    assert all(2 * b <= search.batch_size for b in scope["beyond"].index)  # only up to half the largest


def test_the_sweep_gives_the_cache_back_after_each_model(lesson, monkeypatch):
    """Section 2 on the stand-in, with the step times and ceilings the H200 measured (tests/data/lesson03/): each
    model's steps timed and their tensors counted, the cache emptied after each model's sweep."""
    h200_ceilings(monkeypatch)
    replay(monkeypatch, H200["throughput"])
    scope = lesson(quick=True)
    run(scope, "03", "MODELS = {", "utilisation = batching.Utilisation(")
    emptied = []
    with mock.patch.object(torch.cuda, "empty_cache", lambda: emptied.append(len(scope["rows"]))):
        run(scope, "03", 'ResultLog("03_throughput")')
    assert emptied == [6, 12]  # after SmallCNN's six batch sizes, and after WideMLP's
    curve = scope["curve"]
    assert (curve.tensors_peak_MiB > 0).all() and set(curve.ceiling_precision) == {"tf32", "fp32"}
