"""Each lesson planned from the learner's card: one sizing rule for the whole course.

A lesson reads the card (``Card``: its datasheet, the share of each rate a real card reached, the host's cores) and
sizes each experiment with the course's own predictors (FLOP counts, the memory predictor, the pipeline's measured
rates) so that it fits the card's memory with a margin, fits the lesson's minutes, and stays in the regime it
demonstrates; it prints that plan first, with what the card lacks. Quick mode (no GPU, CI, ``GPULAB_QUICK``) keeps
its small fixed sizes. ``gpulab plan --card NAME`` prints the same plans without a GPU.

    plan = plans.lesson("00")        # in a lesson, after the setup cell: printed, then read as plan.sizes_name
"""

import importlib

import torch

from ..device import get_device, on_gpu
from ..mode import quick_mode
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime

__all__ = ["LESSONS", "Card", "LessonPlan", "Part", "Regime", "course", "lesson", "plan_for"]

# The lessons that plan from the card, each by its module here (``planNN.plan(card, quick) -> LessonPlan``).
LESSONS = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11")


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
