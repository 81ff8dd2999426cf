"""Each lesson planned from the learner's card: one sizing rule for the whole course.

A lesson reads the card (``Card``: its datasheet, the share of each rate a real card reached, the host's cores) and
sizes each experiment with the course's own predictors (FLOP counts, the memory predictor, the pipeline's measured
rates) so that it fits the card's memory with a margin, fits the lesson's minutes, and stays in the regime it
demonstrates; it prints that plan first, with what the card lacks. Quick mode (no GPU, CI, ``GPULAB_QUICK``) keeps
its small fixed sizes. ``gpulab plan --card NAME`` prints the same plans without a GPU.

    plan = plans.lesson("00")        # in a lesson, after the setup cell: printed, then read as plan.sizes_name
    print(plan.details())            # every size, each part's seconds, each demonstration's regime
"""

import importlib

import torch

from ..device import get_device, on_gpu
from ..mode import quick_mode
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime

__all__ = ["CARDS", "LESSONS", "Card", "LessonPlan", "Part", "Regime", "course", "lesson", "minutes_markdown", "plan_for"]

# The lessons that plan from the card, each by its module here (``planNN.plan(card, quick) -> LessonPlan``).
LESSONS = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11")
# The cards learners bring, by the names torch reports: Colab's T4, an L4, an 8 GB laptop card, a workshop's A100 40 GB,
# and the H100 and H200 the course was measured on (the README's table of minutes; the tests plan every lesson for each)
CARDS = ("Tesla T4", "NVIDIA L4", "NVIDIA GeForce RTX 4060 Laptop GPU", "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3",
         "NVIDIA H200")


def plan_for(number: str, card: Card, *, quick: bool = False) -> LessonPlan:
    """Lesson ``number``'s plan for ``card`` (full sizes unless ``quick``)."""
    if number not in LESSONS:
        raise ValueError(f"no plan for lesson {number!r}: the lessons planned are {', '.join(LESSONS)}")
    return importlib.import_module(f".plan{number}", __name__).plan(card, quick=quick)


def lesson(number: str, device=None, *, show: bool = True) -> LessonPlan:
    """This machine's plan for lesson ``number``: printed (``show``), then returned for the cells to read. On a GPU,
    the memory free now is checked against what the plan's largest experiment holds (another process may hold some)."""
    quick = quick_mode()
    plan = plan_for(number, Card.here(device, quick=quick), quick=quick)
    if show:
        print(plan)
    if on_gpu(device) and not quick:
        free_gb = torch.cuda.mem_get_info(get_device(device))[0] / 1e9
        if free_gb < plan.memory_gb:
            print(f"Warning: {free_gb:.1f} GB of the card's memory is free now, and the largest experiment needs "
                  f"{plan.memory_gb:.1f} GB: another process holds the rest (nvidia-smi names it). Free it, or expect "
                  "that experiment to run out of memory.")
    return plan


def course(card: Card, *, quick: bool = False) -> list[LessonPlan]:
    """Every lesson's plan for ``card``, in order."""
    return [plan_for(number, card, quick=quick) for number in LESSONS]


def minutes_markdown(cards=CARDS) -> str:
    """The minutes every lesson plans on each of ``cards`` (each with its typical host), as a Markdown table: a row per
    card, a column per lesson, and the course's total."""
    rows = []
    for name in cards:
        plans = course(Card.named(name))
        rows.append([name, *(f"{p.minutes:.1f}" for p in plans), f"{sum(p.minutes for p in plans):.0f}"])
    head = ["card", *LESSONS, "course"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
