"""Every lesson runs whole, in quick mode, on this CPU playing Colab's Tesla T4 (sm_75: no native bf16, SDPA's flash
and cuDNN backends refused, no FP8, no GPM, 15.8 GB); the lessons whose path turns on bf16 or FP8 also as an L4
(sm_89). tests/lessons_as_cards.py runs them; tests/cuda_stand_in.py plays the card."""

import nbformat
import pytest

from .conftest import ROOT
from .lessons_as_cards import planned_for, run_as

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)

LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
AS_L4 = ("04", "08", "10", "11")  # bf16 and FP8 where a T4 has neither: 04, 08, 10 train in bf16, 11 multiplies in fp8
# 09's sm89 attention rules run as an L4 in tests/test_lesson09_plan.py (its backends cells, seconds), not whole here


CARDS_PLAYED = {"T4": "Tesla T4", "L4": "NVIDIA L4"}


def _run_whole(lesson, card: str) -> type:
    """A class of one test, the lesson run whole as ``card``: pytest-xdist's loadscope gives each class to a worker
    of its own, so that the runs spread over the workers rather than queueing on the one that got this module."""
    def test_runs_whole(self, results_dir):
        run_as(lesson, card)
    return type(f"TestLesson{lesson.stem[:2]}As{card.split()[-1]}", (), {"test_runs_whole": test_runs_whole})


for _lesson in LESSONS:
    for _short, _card in CARDS_PLAYED.items():
        if _short == "T4" or _lesson.stem[:2] in AS_L4:
            _class = _run_whole(_lesson, _card)
            globals()[_class.__name__] = _class


def test_a_lesson_that_did_not_plan_for_the_card_played_fails():
    """What the lesson's plan cell prints where the stand-in did not take effect in the kernel (a CPU), or played
    another card, fails the run; the card's own line passes."""
    def executed(printed: str) -> nbformat.NotebookNode:
        cell = nbformat.v4.new_code_cell('plan = plans.lesson("09")')
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
        return nbformat.v4.new_notebook(cells=[cell])

    t4 = "Lesson 09 · MFU: planned for Tesla T4 (sm_75, 16 GB at 320 GB/s, dense TFLOP/s fp32 8.1, fp16 65, PCIe Gen3 x16"
    assert planned_for(executed(t4 + "\nSizes:"), "Tesla T4") == t4
    for printed in ("Lesson 09 · MFU: planned for CPU (2 cores)", t4.replace("fp16 65", "fp16 65, bf16 65"),
                    t4.replace("Tesla T4 (sm_75", "NVIDIA L4 (sm_89")):
        with pytest.raises(AssertionError):
            planned_for(executed(printed), "Tesla T4")
