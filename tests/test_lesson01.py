"""Lesson 01's exercise checks: right answers pass, plausible wrong ones are rejected, blanks are not attempted."""

import time

import pytest
import torch

import gpulab
from gpulab.check import CORRECT, NOT_ATTEMPTED, WRONG, ____
from gpulab.questions.lesson01 import q1, q2, q3, q4

from .conftest import shown_solution

device = gpulab.get_device()


def status(question, *answers) -> str:
    question.check(*answers)
    return question.last.status


time_ms = shown_solution(q1, "time_ms", device=device, torch=torch, time=time)


def time_ms_without_sync(fn):
    """Plausible but wrong on a GPU: reads the clock as soon as the work is queued."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def time_seconds(fn):
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def test_q1_timer():
    assert status(q1, time_ms) == CORRECT
    assert status(q1, time_seconds) == WRONG
    assert "seconds" in q1.last.message
    assert status(q1, ____) == NOT_ATTEMPTED


@pytest.mark.gpu
def test_q1_rejects_a_timer_that_does_not_wait_for_the_gpu():
    assert status(q1, time_ms_without_sync) == WRONG
    assert "synchronize" in q1.last.message.lower()


def test_q2_sync_points():
    assert status(q2, {"C", "D", "E", "F", "H", "I"}) == CORRECT
    assert status(q2, "c, d, e, f, h, i") == CORRECT
    assert status(q2, {"C", "D", "E", "F"}) == WRONG  # forgot boolean masks and `if` on a tensor
    assert "2 sync point(s) are missing" in q2.last.message
    assert status(q2, {"B", "C", "D", "E", "F", "H", "I"}) == WRONG
    assert status(q2, {"Z"}) == WRONG
    assert status(q2, ____) == NOT_ATTEMPTED


def collect_losses(train_step, steps):
    losses = [train_step().detach() for _ in range(steps)]
    return torch.stack(losses).cpu().numpy()


def collect_into_buffer(train_step, steps):
    losses = torch.empty(steps, device=device)
    for i in range(steps):
        losses[i] = train_step().detach()
    return losses.cpu().numpy()


def collect_with_item(train_step, steps):
    """The classic: one device-to-host copy, so one wait for the GPU, every step."""
    return [train_step().item() for _ in range(steps)]


def collect_with_numpy_every_step(train_step, steps):
    import numpy as np

    return np.array([train_step().detach().cpu().numpy() for _ in range(steps)])


def collect_tensors(train_step, steps):
    return [train_step().detach() for _ in range(steps)]


def collect_unfinished(train_step, steps):
    raise NotImplementedError


def test_q3_transfer_once():
    assert status(q3, collect_losses) == CORRECT
    assert status(q3, collect_into_buffer) == CORRECT
    assert status(q3, collect_with_item) == WRONG
    assert "12 times" in q3.last.message
    assert status(q3, collect_with_numpy_every_step) == WRONG
    assert status(q3, collect_tensors) == WRONG
    assert status(q3, collect_unfinished) == NOT_ATTEMPTED


def test_q4_bandwidth_recomputed_from_the_inputs():
    x = torch.randn(1_000_000)
    copy_s, add_s = 2e-4, 4e-4
    copy_gbs = 2 * x.nbytes / copy_s / 1e9
    fraction = 3 * x.nbytes / add_s / 1e9 / copy_gbs
    assert status(q4, x, copy_s, add_s, copy_gbs, fraction) == CORRECT
    assert status(q4, x, copy_s, add_s, x.nbytes / copy_s / 1e9, fraction) == WRONG  # counted the copy's bytes once
    assert "reads every byte" in q4.last.message
    assert status(q4, x, copy_s, add_s, copy_gbs, 2 * x.nbytes / add_s / 1e9 / copy_gbs) == WRONG
    assert status(q4, x, copy_s, add_s, copy_gbs, fraction * 100) == WRONG
    assert status(q4, x, copy_s, add_s, copy_gbs, ____) == NOT_ATTEMPTED
