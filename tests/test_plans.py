"""Each lesson planned from the learner's card (gpulab.plans): every lesson's plan for the six cards learners bring
fits the card's memory, stays in the regime it demonstrates and fits its minutes; the lesson prints the plan that
`gpulab plan --card` prints; the rates come from the shipped real runs."""

import json
import math
import os
import signal
import sys
from unittest import mock

import nbformat
import pytest

from gpulab import datasheets, plans
from gpulab.commands.cli import main
from gpulab.conditions import cpu_cores
from gpulab.plans import lesson_plan
from gpulab.plans.card import achievable
from gpulab.results import reference

from .conftest import ROOT

CARDS = plans.CARDS  # Colab's T4, an L4, an 8 GB laptop card, a workshop's A100 40 GB, the H100 and the H200
LONG = {"08", "10"}  # the capstone and the GPT's waterfall: sized to 3 minutes on an H100 (6 on a T4)
LIMITS = {"NVIDIA H100 80GB HBM3": (2.0, 3.0), "Tesla T4": (5.0, 6.0)}  # the issue's minutes: a lesson, a long one


@pytest.fixture(params=CARDS)
def card(request):
    return plans.Card.named(request.param)


@pytest.mark.parametrize("number", plans.LESSONS)
def test_every_lesson_fits_each_card_in_memory_regime_and_minutes(card, number):
    plan = plans.plan_for(number, card)
    assert 0 < plan.memory_gb <= card.usable_gb(), f"{plan.memory_gb:.2f} GB planned on {card.name}"
    failing = [f"{r.name}: {r.detail}" for r in plan.regimes if not r.holds]
    assert not failing, failing
    assert plan.minutes <= plan.target_minutes, str(plan)
    if card.name in LIMITS:
        assert plan.minutes <= LIMITS[card.name][number in LONG]


def test_the_targets_are_the_issues_minutes():
    t4, h100 = plans.Card.named("Tesla T4"), plans.Card.named("NVIDIA H100 80GB HBM3")
    assert plans.lesson_plan.target_minutes(h100) == 2 and plans.lesson_plan.target_minutes(h100, long=True) == 3
    assert plans.lesson_plan.target_minutes(t4) == 5 and plans.lesson_plan.target_minutes(t4, long=True) == 6


def test_rates_are_the_datasheets_times_what_the_h100_reached_in_the_shipped_runs():
    rows = reference("04_matmul_precision").query("kind == 'peak' and precision == 'fp32'")
    share = rows["tflops"].max() / datasheets.SHEETS["H100 SXM"].tflops["fp32"]
    assert achievable()["fp32"] == pytest.approx(share)
    t4 = plans.Card.named("Tesla T4")
    assert t4.tflops("fp32") == pytest.approx(8.1 * share)
    assert t4.tflops("bf16") == 0 and t4.amp_precision == "fp16"  # no native bf16 on sm_75
    assert 0 < achievable()["copy"] < 1 and 0 < achievable()["host"] < 1 and 0 < achievable()["fp8"] < 1


def test_what_a_t4_lacks_is_said_and_an_h200_lacks_only_a_second_gpu():
    features = tuple(plans.card.FEATURES)
    t4 = plans.Card.named("Tesla T4").lacks(features)
    assert [line.split(" (")[0].split(":")[0] for line in t4] == ["native bf16", "TF32 tensor cores", "flash attention",
                                                                  "FP8 tensor cores", "GPM", "a second GPU"]
    assert plans.Card.named("NVIDIA H200").lacks(features) == [plans.card.FEATURES["second gpu"]]
    assert plans.Card.named("NVIDIA H200", gpus=8).lacks(features) == []


# Cards the datasheets do not list, as torch would report them (test values): an Ampere workstation card and a card of
# an architecture newer than any listed
UNLISTED = {"NVIDIA RTX A6000": dict(major=8, minor=6, total_memory=51_000_000_000, multi_processor_count=84,
                                     L2_cache_size=6 * 2**20),
            "NVIDIA GeForce RTX 5090": dict(major=12, minor=0, total_memory=33_600_000_000, multi_processor_count=170,
                                            L2_cache_size=96 * 2**20)}


@pytest.mark.parametrize("name", UNLISTED)
def test_a_card_without_a_datasheet_has_its_own_architecture_and_guesses_only_its_rates(name):
    """Its capability, the features that follow from it, memory, SMs and L2 are CUDA's; its rates and bandwidth a
    listed card's per SM (of a card with the same precisions), said so in its note; every lesson plans on it."""
    from unittest import mock

    from . import cuda_stand_in, fake_libnvml

    card = cuda_stand_in.Card(name, **UNLISTED[name])
    with (mock.patch.dict(cuda_stand_in.CARDS, {name: card}),
          mock.patch.dict(cuda_stand_in.NVML_CARDS, {name: fake_libnvml.a100_40gb}),
          cuda_stand_in.installed(name)):
        here = plans.Card.here(quick=False)
    assert datasheets.find(name) is None
    capability = (card.major, card.minor)
    assert here.compute_capability == capability and here.sm == f"sm_{card.major}{card.minor}"
    assert here.memory_gb == card.total_memory / 1e9 and here.sheet.sms == card.multi_processor_count
    assert here.sheet.l2_mib == card.L2_cache_size / 2**20
    assert (here.bf16_native, here.tf32, here.flash_attention) == (True,) * 3
    assert here.fp8 == (capability >= (8, 9)) and here.gpm == (capability >= (9, 0))
    assert (here.tflops("fp8") > 0) == here.fp8 and here.tflops("bf16") > 0
    donor = next(s for s in datasheets.SHEETS.values() if f"the {s.name}'s per SM" in here.note)
    assert set(donor.tflops) == set(here.sheet.tflops)
    per_sm = card.multi_processor_count / donor.sms
    assert here.sheet.tflops["fp16"] == pytest.approx(donor.tflops["fp16"] * per_sm)
    assert here.sheet.bandwidth_gbs == pytest.approx(donor.bandwidth_gbs * per_sm)
    assert "guesses" in here.note and "sm_" in str(here)
    for plan in plans.course(here):
        assert 0 < plan.memory_gb <= here.usable_gb(), plan.lesson


def test_a_card_without_a_datasheet_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match=r"no datasheet for 'Radeon VII'.*\bT4\b"):
        plans.Card.named("Radeon VII")


def test_quick_mode_keeps_its_fixed_sizes_and_plans_no_minutes():
    plan = plans.plan_for("00", plans.Card("CPU", None, 2, 0), quick=True)
    assert plan.matmul_sizes == [16, 32, 64, 128, 256, 512] and math.isnan(plan.minutes)
    assert "Quick mode" in str(plan)


def test_quick_mode_on_a_gpu_says_that_some_sizes_follow_the_card():
    """Lesson 01's copies grow past the card's L2 in quick mode too: the plan must not say nothing follows the card."""
    t4, h200 = (plans.plan_for("01", plans.Card.named(name), quick=True) for name in ("Tesla T4", "NVIDIA H200"))
    assert t4.copy_mb != h200.copy_mb
    assert "Quick mode" in str(t4) and "nothing is planned from the card" not in str(t4)
    assert "follow what the card has" in str(t4)


@pytest.mark.parametrize("card_name", ["Tesla T4", "NVIDIA H200"])
def test_the_printed_plan_is_short_and_its_details_hold_the_rest(card_name):
    """A lesson prints the card, the minutes, what the card lacks and the sizes that carry a why (no None, no internal
    size without one); ``details()`` has every size, part and regime."""
    for plan in plans.course(plans.Card.named(card_name)):
        short, full = str(plan), plan.details()
        shown = [k for k, v in plan.sizes.items() if k in plan.why and v is not None]
        assert [f"  {k}: " in short for k in plan.sizes] == [k in shown for k in plan.sizes], plan.lesson
        assert "None" not in short and len(short.splitlines()) <= 20, short
        assert short.endswith("print(plan.details())")
        assert all(f"  {k} " in full for k in plan.sizes), full
        assert all(p.name in full for p in plan.parts) and all(r.name in full for r in plan.regimes)
    assert "  copy_bytes: 16 MiB — " in str(plans.plan_for("02", plans.Card.named("Tesla T4")))


def test_the_printed_plan_shows_a_regime_only_where_it_does_not_hold():
    from dataclasses import replace

    plan = replace(plans.plan_for("00", plans.Card.named("Tesla T4")),
                   regimes=(plans.Regime("kept", True, "kept's numbers"), plans.Regime("lost", False, "lost's numbers")))
    assert "  - lost: lost's numbers" in str(plan) and "kept" not in str(plan)
    assert "yes  kept: kept's numbers" in plan.details() and "NO   lost: lost's numbers" in plan.details()


def test_a_plan_refuses_a_size_it_does_not_have():
    plan = plans.plan_for("00", plans.Card.named("Tesla T4"))
    with pytest.raises(AttributeError, match="no size 'batch'.*matmul_sizes"):
        getattr(plan, "batch")  # noqa: B009 (an attribute read that must raise)


# ---- gpulab plan ------------------------------------------------------------------------------------------------

def test_the_command_lists_every_lesson_with_its_minutes_as_json(capsys):
    assert main(["plan", "--card", "Tesla T4", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [entry["lesson"] for entry in listed] == list(plans.LESSONS)
    assert all(entry["minutes"] > 0 and entry["card"] == "Tesla T4" and entry["cpu_cores"] == 2 for entry in listed)


def test_the_command_prints_the_plans_and_the_course_total(capsys):
    assert main(["plan", "--card", "NVIDIA H200", "--cpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "Lesson 00 · Setup and diagnostics: planned for NVIDIA H200" in out and "host: 4 CPU cores" in out
    assert out.count("Minutes, part by part:") == len(plans.LESSONS)  # each plan's details
    assert "The course on NVIDIA H200: about" in out


def test_the_command_without_a_gpu_or_with_an_unknown_card_says_what_to_do(capsys):
    assert main(["plan"]) == 2
    assert "no GPU here: name a card" in capsys.readouterr().err
    assert main(["plan", "--card", "Radeon VII"]) == 2
    assert "no datasheet for 'Radeon VII'" in capsys.readouterr().err


# ---- the lesson prints what the command prints -------------------------------------------------------------------

def planning_cell(number: str) -> str:
    path = next((ROOT / "notebooks").glob(f"{number}_*.ipynb"))
    return next(c.source for c in nbformat.read(path, as_version=4).cells
                if c.cell_type == "code" and "plans.lesson(" in c.source)


@pytest.mark.parametrize("card_name", ["Tesla T4", "NVIDIA H200"])
@pytest.mark.parametrize("number", plans.LESSONS)
def test_the_lessons_planning_cell_prints_the_commands_plan(number, card_name, monkeypatch, capsys):
    """The lesson's own cell, in full mode on this CPU playing the card, against `gpulab plan --card` for the card
    with this machine's cores."""
    from .cuda_stand_in import installed

    monkeypatch.setenv("GPULAB_QUICK", "0")
    monkeypatch.delenv("CI", raising=False)
    scope = {"__name__": "__main__"}
    with installed(card_name):
        exec(compile(planning_cell(number), f"<lesson {number}: plan>", "exec"), scope)
    printed = capsys.readouterr().out
    assert main(["plan", "--card", card_name, "--cpus", str(cpu_cores()), "--json"]) == 0
    command = {entry["lesson"]: entry for entry in json.loads(capsys.readouterr().out)}[number]
    assert scope["plan"].as_dict() == command
    assert printed.startswith(str(scope["plan"])) and "Minutes, part by part" not in printed  # the short form


@pytest.mark.parametrize("extra", [["--card", "Tesla T4"], ["--cpus", "4"], ["--gpus", "2"], ["--json"]])
def test_the_markdown_table_refuses_the_options_it_would_ignore(extra, capsys):
    assert main(["plan", "--markdown", *extra]) == 2
    assert "it takes no --card, --cpus, --gpus or --json" in capsys.readouterr().err


def test_gpus_without_a_card_is_refused(capsys):
    assert main(["plan", "--gpus", "2"]) == 2
    assert "--gpus goes with --card" in capsys.readouterr().err


def test_the_command_ends_quietly_when_its_reader_stops_reading(capsys):
    """`gpulab plan | head` once head has exited: writing raises BrokenPipeError; no traceback, SIGPIPE's status."""
    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as closed_pipe, mock.patch.object(sys, "stdout", closed_pipe):
        assert main(["plan", "--card", "Tesla T4"]) == 128 + signal.SIGPIPE
    assert capsys.readouterr().err == ""


def test_a_lesson_warns_when_less_memory_is_free_than_its_plan_needs(monkeypatch, capsys):
    """On the stand-in's T4, memory held before the lesson plans (a meta tensor: counted by the stand-in's allocator,
    which mem_get_info subtracts from the card's total, and never allocated) leaves less free than the plan needs."""
    import torch

    from .cuda_stand_in import installed

    monkeypatch.setenv("GPULAB_QUICK", "0")
    monkeypatch.delenv("CI", raising=False)
    with installed("Tesla T4") as gpu:
        plan = plans.lesson("00", show=False)
        assert "Warning" not in capsys.readouterr().out
        held = torch.empty(gpu.card.total_memory - int(plan.memory_gb * 1e9) // 2, dtype=torch.uint8, device="meta")
        free_gb = torch.cuda.mem_get_info()[0] / 1e9
        plans.lesson("00", show=False)
        del held
    assert capsys.readouterr().out.startswith(f"Warning: {free_gb:.1f} GB of the card's memory is free now, and the "
                                              f"largest experiment needs {plan.memory_gb:.1f} GB")


def test_the_readmes_table_of_minutes_is_the_plans():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- plan-minutes")[1].split("-->", 1)[1].split("<!-- /plan-minutes -->")[0].strip()
    assert table == plans.minutes_markdown(), "run `gpulab plan --markdown` and paste its table into the README"


def test_the_markdown_table_has_a_row_per_card_and_a_column_per_lesson(capsys):
    assert main(["plan", "--markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| card | " + " | ".join(plans.LESSONS) + " | course |"
    assert [line.split(" | ")[0].lstrip("| ") for line in lines[2:]] == list(plans.CARDS)


def test_a_printed_size_reads_as_a_learner_would_write_it():
    shown = lesson_plan._shown
    assert shown("rates", {"naive": 1772.27, "amp": 27659.3, "unused": None}) == "naive 1,772, amp 27,659"
    assert shown("compile_s", 70.68) == "70.7 s" and shown("lr", 0.1) == "0.1" and shown("steps", 150) == "150"
    assert shown("text_bytes", 3 * 2**20) == "3 MiB" and shown("n", 1_000_000) == "1,000,000"
    assert shown("sizes", list(range(8))) == "0 … 7 (8 values)"
