"""Every lesson runs whole, in quick mode, on this CPU playing Colab's Tesla T4 (sm_75: no native bf16, SDPA's flash
and cuDNN backends refused, no FP8, no GPM, 15.8 GB); the lessons whose path turns on bf16 or FP8 also as an L4
(sm_89). tests/lessons_as_cards.py runs them; tests/cuda_stand_in.py plays the card."""

import pytest

from .conftest import ROOT
from .lessons_as_cards import run_as

LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
AS_L4 = ("04", "08", "10", "11")  # bf16 and FP8 where a T4 has neither: 04, 08, 10 train in bf16, 11 multiplies in fp8


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem[:2])
def test_the_lesson_runs_whole_as_a_t4(lesson, results_dir):
    run_as(lesson, "Tesla T4")


@pytest.mark.parametrize("lesson", [p for p in LESSONS if p.stem[:2] in AS_L4], ids=lambda p: p.stem[:2])
def test_the_lesson_runs_whole_as_an_l4(lesson, results_dir):
    run_as(lesson, "NVIDIA L4")
