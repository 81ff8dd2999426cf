"""Lesson 05 on a GPU, checked on a CPU: the out-of-memory demo stays inside a bounded share of the card and gives the
card back, and section 4 explains checkpointing's measured cost beside the textbook's with the numbers it prints.

The H200 run (tests/data/lesson05/) held 142,186 MiB of the card's 143,156 MiB in its OOM demo, and measured
checkpointing at 0.38–0.59× the speed where the textbook's one more forward predicts about 0.75×, without saying why.
The demo runs here on a simulated card of the H200's size, its tensors on the meta device (shapes, no memory)."""

from types import SimpleNamespace

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from torch import nn

import gpulab
from gpulab import models
from gpulab.memory import MemoryTracker

from .conftest import ROOT
from .test_memory import run_cell

MiB = 2**20
DATA = ROOT / "tests" / "data" / "lesson05"
H200_OOM = pd.read_csv(DATA / "h200_05_oom.csv").iloc[0]
H200_CHECKPOINTING = pd.read_csv(DATA / "h200_05_checkpointing.csv").set_index("config")
PER_SAMPLE = 20.3 * 1024  # bytes of activations per sample of the deeper ResidualMLP, as the H200 fitted them


class SimulatedCard(MemoryTracker):
    """A CUDA card of ``total`` bytes, simulated: its caching allocator counts every tensor (reserving exactly what is
    allocated), and an allocation past ``fraction`` of the card (set_per_process_memory_fraction; the whole card by
    default) raises torch.OutOfMemoryError instead of taking the memory."""

    def __init__(self, total: int):
        super().__init__()
        self.total, self.fraction, self.fractions, self.emptied_after = total, 1.0, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        peak = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.current > self.fraction * self.total:
            del out  # the allocator refuses before it takes the memory: nothing of it stays in the traceback
            self.peak = peak
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated). {self.fraction * self.total / MiB:,.0f} "
                                         f"MiB allowed; {self.current / MiB:,.0f} MiB asked for")
        return out

    def set_fraction(self, fraction, device=None):
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:  # as torch.cuda checks it
            raise TypeError(f"fraction must be a float from 0 to 1, got {fraction!r}")
        self.fraction = fraction
        self.fractions.append(fraction)

    def empty_cache(self):
        self.emptied_after.append(self.fractions[-1] if self.fractions else None)


@pytest.fixture
def card(monkeypatch):
    """The H200's 143,156 MiB, simulated; torch.cuda's memory functions read it, and it counts from here on."""
    card = SimulatedCard(int(H200_OOM.capacity_MiB * MiB))
    for name, fn in {
        "memory_allocated": lambda device=None: card.current,
        "memory_reserved": lambda device=None: card.current,
        "max_memory_reserved": lambda device=None: card.peak,
        "reset_peak_memory_stats": lambda device=None: card.reset_peak(),
        "mem_get_info": lambda device=None: (card.total - card.current, card.total),
        "get_device_properties": lambda device=None: SimpleNamespace(total_memory=card.total),
        "set_per_process_memory_fraction": card.set_fraction,
        "empty_cache": card.empty_cache,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    with card:
        yield card


@pytest.fixture
def lesson(results_dir, monkeypatch):
    """Lesson 05's imports and measuring functions, in quick mode, on this CPU."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    scope = {"__name__": "__main__", "gpulab": gpulab, "device": torch.device("cpu")}
    for marker in ("plans.lesson(", "import contextlib", "def measuring():"):
        run_cell(marker, scope)
    scope.update(mlp_width=scope["plan"].mlp_width, mlp_depth=scope["plan"].mlp_depth)  # section 3's, which 4 reads
    yield scope
    plt.close("all")


def oom_scope(lesson):
    """What section 7 needs from before it, on the simulated GPU: section 3's fit of the deeper ResidualMLP."""
    lesson.update(on_gpu=True, device=torch.device("meta"), mlp_width=64, mlp_depth=8,
                  fits={"ResidualMLP, 8 blocks": (PER_SAMPLE, 0.0)})
    return lesson


# ----- section 7: a real OOM, inside a bounded share of the card ------------------------------------------------

def test_the_h200_fixture_shows_the_demo_filled_the_card():
    assert H200_OOM.during_MiB / H200_OOM.capacity_MiB > 0.99


def test_the_oom_demo_runs_out_inside_its_cap_and_lifts_it_afterwards(lesson, card, capsys):
    run_cell("oom_model = models.ResidualMLP", oom_scope(lesson))
    out = capsys.readouterr().out
    assert "OutOfMemoryError: CUDA out of memory (simulated)" in out  # a real out-of-memory error, still
    assert len(card.fractions) == 2 and card.fractions[-1] == 1.0, card.fractions  # capped, then the whole card again
    cap = card.fractions[0] * card.total
    assert cap <= lesson["oom_budget"] + 64 * MiB  # what the process held (the model) plus the demo's budget
    assert lesson["during"] <= cap and lesson["held_most"] <= cap  # the failed step never passed the cap
    assert lesson["during"] > lesson["oom_budget"] / 2  # it did fill its share before failing
    assert lesson["after"] == lesson["baseline"] and card.emptied_after[-1] == 1.0  # cache emptied once uncapped
    row = pd.read_csv(lesson["oom_log"].path).iloc[-1]
    assert row.cap_MiB == pytest.approx(cap / MiB) and row.reserved_most_MiB <= row.cap_MiB
    assert f"within its cap of {cap / MiB:,.1f} MiB" in out and "Cap lifted" in out
    taken = lesson["held_most"] - lesson["reserved_before"]  # reserved on top of what the process held: the budget's unit
    assert f"The demo took at most {taken / MiB:.1f} MiB more reserved memory" in out and taken <= lesson["oom_budget"]


class _Broken(nn.Module):
    """A model whose forward fails with a bug, not with out-of-memory."""

    def __init__(self, **kwargs):
        super().__init__()

    def forward(self, x):
        raise ValueError("a bug in the model")


def test_the_cap_is_lifted_even_when_the_step_fails_otherwise(lesson, card, monkeypatch):
    monkeypatch.setattr(models, "ResidualMLP", _Broken)
    with pytest.raises(ValueError, match="a bug in the model"):
        run_cell("oom_model = models.ResidualMLP", oom_scope(lesson))
    assert card.fractions[0] < 1.0 and card.fractions[-1] == 1.0 and card.emptied_after[-1] == 1.0


def test_the_oom_demo_on_a_cpu_uses_the_same_budget_as_an_emulated_card(lesson, capsys):
    lesson.update(mlp_width=64, mlp_depth=8, fits={"ResidualMLP, 8 blocks": (PER_SAMPLE, 0.0)})
    run_cell("oom_model = models.ResidualMLP", lesson)
    out = capsys.readouterr().out
    assert "BudgetExceeded" in out and lesson["card"].budget == lesson["oom_budget"] and "cap" not in out
    # the emulated card refuses as a GPU does: what the error held fitted the budget, and the summary says so
    assert lesson["baseline"] == 0 and lesson["during"] <= lesson["oom_budget"] and lesson["taken"] == lesson["card"].peak
    assert (f"The demo took at most {lesson['card'].peak / MiB:.1f} MiB of tensors in the emulated card: within its "
            "budget of 64 MiB.") in out


# ----- section 4: checkpointing's measured cost, explained ------------------------------------------------------

def _h200_speed(config: str) -> float:
    return float(H200_CHECKPOINTING.speedup[config])


JITTER = [1.0, 0.99, 1.01, 0.98, 1.02, 1.0, 0.995, 1.005]  # a little spread, so that every interval is narrow
STEP_S = 6e-3


def fake_compare(seconds: dict, noisy: set = frozenset()):
    """gpulab.compare, answering from ``seconds`` by label after one call of each side; a label in ``noisy`` gets
    a spread of ±20 % instead, wide enough that no verdict holds."""
    def compare(baseline, candidate, *, labels, **kwargs):
        baseline(), candidate()
        spread = [1.0, 0.8, 1.2, 0.85, 1.15, 0.9, 1.1, 1.0] if labels[1] in noisy else JITTER
        return gpulab.Comparison.of([seconds[labels[0]]] * len(spread),
                                    [seconds[labels[1]] * j for j in spread], labels=labels)
    return compare


H200_SECONDS = {  # the H200's speeds of section 4, and a forward of the blocks at 0.45 of a step
    "no checkpointing": STEP_S, "a whole step": STEP_S, "1 segment": STEP_S / _h200_speed("k=8"),
    "the blocks' forward": 0.45 * STEP_S, "8 segments": STEP_S / _h200_speed("k=1"),
    **{config: STEP_S / _h200_speed(config) for config in H200_CHECKPOINTING.index},
}


def test_checkpointings_cost_is_explained_with_the_h200s_speeds(lesson, monkeypatch, capsys):
    monkeypatch.setattr(gpulab, "compare", fake_compare(H200_SECONDS))
    run_cell("def forward_checkpointed", lesson)
    capsys.readouterr()
    run_cell("def forward_of_the_blocks", lesson)
    out = capsys.readouterr().out
    assert lesson["share"] == pytest.approx(0.45, rel=0.02)
    predicted = 1 / (1 + lesson["share"])
    assert lesson["predicted"] == pytest.approx(predicted)
    assert f"took {lesson['share']:.2f} of a whole step here" in out and "more than the third" in out
    assert f"One more forward of them predicts {predicted:.2f}× the speed" in out
    assert f"ran at {_h200_speed('k=8'):.2f}×" in out and "slower than that" in out  # 0.59× against 0.69×
    segments = lesson["segments"]
    assert segments.verdict == "slower" and segments.speedup == pytest.approx(_h200_speed("k=1") / _h200_speed("k=8"),
                                                                              rel=0.02)
    per_call = (1 / segments.speedup - 1) / 7
    assert f"each further checkpoint call cost about {per_call:.0%} of a one-segment step" in out
    cost = lesson["cost"]
    assert cost.speed.tolist() == pytest.approx([0.75, predicted, _h200_speed("k=8"), _h200_speed("k=1")], rel=0.02)


def test_checkpointing_that_costs_what_the_textbook_says_is_called_so(lesson, monkeypatch, capsys):
    seconds = {"no checkpointing": STEP_S, "a whole step": STEP_S, "the blocks' forward": STEP_S / 3,
               "1 segment": STEP_S * 4 / 3, "8 segments": STEP_S * 4 / 3,
               **{f"k={k}": STEP_S * 4 / 3 for k in (1, 2, 4, 8)}}
    monkeypatch.setattr(gpulab, "compare", fake_compare(seconds, noisy={"8 segments"}))
    run_cell("def forward_checkpointed", lesson)
    capsys.readouterr()
    run_cell("def forward_of_the_blocks", lesson)
    out = capsys.readouterr().out
    assert "about the third the textbook assumes" in out and "predicts 0.75× the speed" in out
    assert "within what one more forward predicts" in out
    assert "could not tell them apart" in out and "each further checkpoint call" not in out
