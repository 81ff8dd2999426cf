"""Lesson 01's exercise checks: right answers pass, plausible wrong ones are rejected, blanks are not attempted."""

import time

import pytest
import torch

import gpulab
from gpulab.check import CORRECT, NOT_ATTEMPTED, WRONG, ____
from gpulab.questions.lesson01 import q1, q2, q3, q4

from .conftest import shown_solution


def status(question, *answers) -> str:
    question.check(*answers)
    return question.last.status


time_ms = shown_solution(q1, "time_ms", torch=torch, time=time)


def time_ms_without_sync(fn, device):
    """Plausible but wrong on a GPU: reads the clock as soon as the work is queued."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def time_ms_events_no_wait(fn, device):
    """Plausible but wrong: events, but elapsed_time is read before the GPU has reached the end marker."""
    if device.type != "cuda":
        return time_ms_without_sync(fn, device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    return start.elapsed_time(end)


def time_ms_sync_before_only(fn, device):
    """Plausible but wrong: synchronises before starting the clock, not before reading it."""
    gpulab.sync(device)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def time_seconds(fn, device):
    start = time.perf_counter()
    fn()
    gpulab.sync(device)
    return time.perf_counter() - start


def time_ms_synchronize(fn, device):
    """Unusual but right: a synchronised host clock instead of events, on both devices."""
    gpulab.sync(device)
    start = time.perf_counter()
    fn()
    gpulab.sync(device)
    return (time.perf_counter() - start) * 1e3


def time_ms_unfinished(fn, device):
    raise NotImplementedError


def test_q1_timer():
    assert status(q1, time_ms) == CORRECT
    assert status(q1, time_ms_synchronize) == CORRECT
    assert status(q1, time_ms_without_sync) == WRONG  # caught on the simulated GPU where there is no real one
    assert "synchronize" in q1.last.message
    assert status(q1, time_ms_events_no_wait) == WRONG
    assert status(q1, time_ms_sync_before_only) == WRONG
    assert status(q1, time_seconds) == WRONG
    assert "seconds" in q1.last.message
    assert status(q1, time_ms_unfinished) == NOT_ATTEMPTED
    assert status(q1, ____) == NOT_ATTEMPTED


@pytest.mark.gpu
def test_q1_rejects_a_timer_that_does_not_wait_for_the_real_gpu():
    assert status(q1, time_ms_without_sync) == WRONG
    assert "on cuda" in q1.last.message


def test_q2_sync_points():
    assert status(q2, {"C", "D", "E", "F", "H", "I"}) == CORRECT
    assert status(q2, "c, d, e, f, h, i") == CORRECT
    assert status(q2, {"C", "D", "E", "F"}) == WRONG  # forgot boolean masks and `if` on a tensor
    assert "2 sync point(s) are missing" in q2.last.message
    assert status(q2, {"B", "C", "D", "E", "F", "H", "I"}) == WRONG
    assert status(q2, {"Z"}) == WRONG
    assert status(q2, {"C", "D", "E", "F", "H", "I", "G"}) == WRONG  # torch.where does not wait
    assert status(q2, ["i", "h", "f", "e", "d", "c"]) == CORRECT  # any order, any case, a list
    assert status(q2, ____) == NOT_ATTEMPTED


collect_losses = shown_solution(q3, "collect_losses", torch=torch)


def collect_into_buffer(train_step, steps, device):
    """Unusual but right: a buffer made on the device, copied once."""
    losses = torch.empty(steps, device=device)
    for i in range(steps):
        losses[i] = train_step().detach()
    return losses.cpu().numpy()


def collect_into_host_buffer(train_step, steps, device):
    """Plausible but wrong: the buffer lives on the host, so every write is a copy from the device."""
    losses = torch.empty(steps)
    for i in range(steps):
        losses[i] = train_step().detach()
    return losses.numpy()


def collect_with_item(train_step, steps, device):
    """The classic: one device-to-host copy, so one wait for the GPU, every step."""
    return [train_step().item() for _ in range(steps)]


def collect_with_numpy_every_step(train_step, steps, device):
    import numpy as np

    return np.array([train_step().detach().cpu().numpy() for _ in range(steps)])


def collect_then_item_each(train_step, steps, device):
    """Plausible but wrong: keeps the losses on the device, then copies them one by one."""
    losses = [train_step().detach() for _ in range(steps)]
    return [loss.item() for loss in losses]


def collect_tensors(train_step, steps, device):
    return [train_step().detach() for _ in range(steps)]


def collect_unfinished(train_step, steps, device):
    raise NotImplementedError


def test_q3_transfer_once():
    assert status(q3, collect_losses) == CORRECT
    assert status(q3, collect_into_buffer) == CORRECT
    assert status(q3, collect_with_item) == WRONG
    assert "12 times" in q3.last.message
    assert status(q3, collect_into_host_buffer) == WRONG
    assert "12 times" in q3.last.message
    assert status(q3, collect_with_numpy_every_step) == WRONG
    assert status(q3, collect_then_item_each) == WRONG
    assert status(q3, collect_tensors) == WRONG
    assert status(q3, collect_unfinished) == NOT_ATTEMPTED
    assert status(q3, ____) == NOT_ATTEMPTED


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
    assert status(q4, x, copy_s, add_s, copy_gbs * 1e9, fraction) == WRONG  # bytes/s
    assert status(q4, x, copy_s, add_s, 2 * x.nbytes / copy_s / 2**30, fraction) == WRONG  # GiB/s
    unusual = 2 * x.numel() * 4 / 1e9 / copy_s  # elements × 4 bytes, divided in another order
    assert status(q4, x, copy_s, add_s, torch.tensor(unusual), fraction) == CORRECT
    assert status(q4, x, copy_s, add_s, copy_gbs, ____) == NOT_ATTEMPTED
