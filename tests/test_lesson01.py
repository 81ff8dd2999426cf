"""Lesson 01's exercise checks: right answers pass, plausible wrong ones are rejected, blanks are not attempted."""

import threading
import time
import timeit
from time import perf_counter

import numpy as np
import pytest
import torch

import gpulab
from gpulab.check import CORRECT, NOT_ATTEMPTED, WRONG, Wrong, ____
from gpulab.questions.lesson01 import _judge_timer, q1, q2, q3, q4
from gpulab.questions.stand_in import virtual_clock

from .conftest import shown_solution
from .test_lesson00 import stack_walker


def status(question, *answers) -> str:
    question.check(*answers)
    return question.last.status


# ---------------------------------------------------------------- q1: time GPU work correctly

time_ms = shown_solution(q1, "time_ms", torch=torch, time=time, gpulab=gpulab)


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


def time_ms_twice_averaged(fn, device):
    """Plausible but wrong: "more accurate" with two calls, averaged; fn must run once."""
    start = time.perf_counter()
    fn()
    fn()
    gpulab.sync(device)
    return (time.perf_counter() - start) * 1e3 / 2


def time_ms_with_warmup(fn, device):
    fn()  # a warm-up call: the work runs twice
    return time_ms(fn, device)


def time_ms_events_times_1000(fn, device):
    """Plausible but wrong: elapsed_time taken for seconds."""
    if device.type != "cuda":
        return time_ms(fn, device)
    return time_ms(fn, device) * 1e3


def time_us_on_the_cpu(fn, device):
    return time_ms(fn, device) * 1e3


def time_ms_cpu_time(fn, device):
    """Plausible but wrong: process time counts the CPU's work, not the time that passed."""
    start = time.process_time()
    fn()
    gpulab.sync(device)
    return (time.process_time() - start) * 1e3


def time_ms_synchronize(fn, device):
    """Unusual but right: a synchronised host clock instead of events, on both devices."""
    gpulab.sync(device)
    start = time.perf_counter()
    fn()
    gpulab.sync(device)
    return (time.perf_counter() - start) * 1e3


def time_ms_own_clock(fn, device):
    """Unusual but right: a clock imported by name, and timeit's default timer on the GPU."""
    if device.type == "cuda":
        start = timeit.default_timer()
        fn()
        torch.cuda.synchronize()
        return (timeit.default_timer() - start) * 1e3
    start = perf_counter()
    fn()
    return (perf_counter() - start) * 1e3


def time_ms_unfinished(fn, device):
    raise NotImplementedError


def test_q1_timer():
    assert status(q1, time_ms) == CORRECT
    assert status(q1, time_ms_synchronize) == CORRECT
    assert status(q1, time_ms_own_clock) == CORRECT
    assert status(q1, time_ms_unfinished) == NOT_ATTEMPTED
    assert status(q1, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    (time_ms_without_sync, "the clock stopped when the work was queued"),  # on the simulated GPU, on every machine
    (time_ms_events_no_wait, "wait for the end event"),
    (time_ms_sync_before_only, "the clock stopped when the work was queued"),
    (time_seconds, "that is seconds"),
    (time_ms_twice_averaged, "called fn() 2 times"),
    (time_ms_with_warmup, "called fn() 2 times"),
    (time_ms_events_times_1000, "`elapsed_time()` is already in milliseconds"),
    (time_us_on_the_cpu, "microseconds"),
    (time_ms_cpu_time, "read a wall clock"),
    (lambda fn, device: "fast", "return a number of milliseconds"),
])
def test_q1_rejects(wrong, says):
    assert status(q1, wrong) == WRONG
    assert says in q1.last.message


@pytest.mark.parametrize("got, right", [(32.0, True), (30.5, True), (47.0, True), (15.0, False), (49.0, False),
                                        (0.032, False), (32000.0, False)])
def test_q1_decides_on_injected_timings(got, right):
    """The verdict on a timing, both ways: a timer reading within 0.5× to 1.5× of 32 ms passes."""
    if right:
        assert "32 ms" in _judge_timer(got, 1, 32.0, "on a simulated GPU", gpu=True)
    else:
        with pytest.raises(Wrong):
            _judge_timer(got, 1, 32.0, "on a simulated GPU", gpu=True)


def test_q1_times_on_a_virtual_clock_that_load_cannot_move():
    """Real work takes no virtual time, a sleep is exact, and another thread's sleep is real and moves nothing."""
    with virtual_clock() as clock:
        start = time.perf_counter()
        other = threading.Thread(target=lambda: time.sleep(0.01))
        other.start()
        other.join()
        sum(range(200_000))
        time.sleep(0.25)
        assert time.perf_counter() - start == 0.25 and clock.now == start + 0.25
    q1.check(time_ms)
    assert "30 ms for 30 ms on the CPU" in q1.last.message and "32 ms for 32 ms" in q1.last.message


def test_q1_a_stack_walking_answer_finds_no_expected_time():
    walker = stack_walker(lambda found, fn, device: found[0], lambda fn, device: 0.0,
                          lambda value: isinstance(value, (int, float)))
    assert status(q1, walker) == WRONG and walker.calls and walker.found == []


@pytest.mark.gpu
def test_q1_rejects_a_timer_that_does_not_wait_for_the_real_gpu():
    with pytest.MonkeyPatch.context() as patch:  # the simulated GPU passes it: only the real one can catch it
        patch.setattr("gpulab.questions.lesson01._judge_timer", lambda got, calls, truth, where, gpu: f"{got:.3g} ms")
        assert status(q1, time_ms_without_sync) == WRONG
    assert "on cuda" in q1.last.message


# ---------------------------------------------------------------- q2: which calls wait


def test_q2_sync_points():
    assert status(q2, {"C", "D", "E", "F", "H", "I"}) == CORRECT
    assert status(q2, "c, d, e, f, h, i") == CORRECT
    assert status(q2, ["i", "h", "f", "e", "d", "c"]) == CORRECT  # any order, any case, a list
    assert status(q2, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    ({"C", "D", "E", "F"}, "2 call(s) that wait are missing, where the host needs: a result whose shape depends on"),
    ({"C", "D", "E", "F", "H"}, "Python needs a number (`.item()`) or a bool"),
    ({"B", "C", "D", "E", "F", "H", "I"}, "B do(es) not wait: a reduction returns a tensor on the GPU"),
    ({"C", "D", "E", "F", "H", "I", "G"}, "G do(es) not wait: element-wise work only queues"),  # torch.where
    ({"A", "B", "C", "D", "E", "F", "G", "H", "I"}, "6 of your 9 choices are right"),  # "everything waits"
    ({"Z"}, "Z is not one of the choices"),
    (3, "answer with a set of letters"),
])
def test_q2_rejects(wrong, says):
    assert status(q2, wrong) == WRONG
    assert says in q2.last.message


# ---------------------------------------------------------------- q3: transfer once, not every step

collect_losses = shown_solution(q3, "collect_losses", torch=torch)


def collect_into_buffer(train_step, steps, device):
    """Unusual but right: a buffer made on the device, copied once."""
    losses = torch.empty(steps, device=device)
    for i in range(steps):
        losses[i] = train_step().detach()
    return losses.cpu().numpy()


def collect_non_blocking_then_wait(train_step, steps, device):
    """Unusual but right: a non-blocking copy to the host, and a wait before the values are used."""
    losses = torch.stack([train_step().detach() for _ in range(steps)])
    host = losses.to("cpu", non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host.numpy()


def collect_as_list(train_step, steps, device):
    """Unusual but right: one copy, as a list of floats."""
    return torch.cat([train_step().detach().reshape(1) for _ in range(steps)]).tolist()


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
    return np.array([train_step().detach().cpu().numpy() for _ in range(steps)])


def collect_then_item_each(train_step, steps, device):
    """Plausible but wrong: keeps the losses on the device, then copies them one by one."""
    losses = [train_step().detach() for _ in range(steps)]
    return [loss.item() for loss in losses]


def collect_with_torch_tensor(train_step, steps, device):
    """Plausible but wrong: torch.tensor reads every loss back, one by one."""
    return torch.tensor([train_step().detach() for _ in range(steps)]).numpy()


def collect_tensors(train_step, steps, device):
    return [train_step().detach() for _ in range(steps)]


def collect_without_detach(train_step, steps, device):
    """Plausible but wrong: every step's graph stays alive in the list until the end."""
    losses = [train_step() for _ in range(steps)]
    return torch.stack(losses).detach().cpu().numpy()


def collect_without_detach_numpy(train_step, steps, device):
    return torch.stack([train_step() for _ in range(steps)]).cpu().numpy()


def collect_under_no_grad(train_step, steps, device):
    """Plausible but wrong: no graph to keep, but a real step could not back-propagate either."""
    with torch.no_grad():
        return torch.stack([train_step() for _ in range(steps)]).cpu().numpy()


def collect_non_blocking_unread(train_step, steps, device):
    """Plausible but wrong: a non-blocking copy to the host, read before it has arrived."""
    losses = torch.stack([train_step().detach() for _ in range(steps)])
    return losses.to("cpu", non_blocking=True).numpy()


def collect_non_blocking_into_pageable(train_step, steps, device):
    """Plausible but wrong: a non-blocking copy into pageable host memory, read without a wait."""
    losses = torch.stack([train_step().detach() for _ in range(steps)])
    host = torch.empty(steps)
    host.copy_(losses, non_blocking=True)
    return host.numpy()


def collect_without_cpu(train_step, steps, device):
    """Wrong only on a GPU: NumPy cannot read device memory."""
    return torch.stack([train_step().detach() for _ in range(steps)]).numpy()


def collect_with_sync_each_step(train_step, steps, device):
    """Wrong only on a GPU: a wait "to be safe" after every step, in the branch a CPU never takes."""
    losses = []
    for _ in range(steps):
        losses.append(train_step().detach())
        if device.type == "cuda":
            torch.cuda.synchronize()
    return torch.stack(losses).cpu().numpy()


def collect_unfinished(train_step, steps, device):
    raise NotImplementedError


def test_q3_transfer_once():
    assert status(q3, collect_losses) == CORRECT
    assert status(q3, collect_into_buffer) == CORRECT
    assert status(q3, collect_non_blocking_then_wait) == CORRECT
    assert status(q3, collect_as_list) == CORRECT
    assert status(q3, collect_unfinished) == NOT_ATTEMPTED
    assert status(q3, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    (collect_with_item, "12 times"),
    (collect_into_host_buffer, "12 times"),
    (collect_with_numpy_every_step, "12 times"),
    (collect_then_item_each, "12 times"),
    (collect_with_torch_tensor, "12 times"),
    (collect_tensors, "return the losses as a NumPy array"),
    (collect_without_detach, "11 steps' graphs were alive at once"),
    (collect_without_detach_numpy, "autograd graph"),
    (collect_under_no_grad, "gradients off"),
    (collect_non_blocking_unread, "nothing waited for it"),
    (collect_non_blocking_into_pageable, "nothing waited for it"),
    (collect_without_cpu, "can't convert cuda device type tensor to numpy"),
    (collect_with_sync_each_step, "waited for the GPU 11 times"),
    (lambda train_step, steps, device: [train_step().item() for _ in range(steps - 1)], "called it 11 times"),
])
def test_q3_rejects(wrong, says):
    assert status(q3, wrong) == WRONG
    assert says in q3.last.message and "meta" not in q3.last.message


def collect_through_a_mask(train_step, steps, device):
    """Right, but the boolean mask has no stand-in without a GPU: judged on the CPU only, and said so."""
    losses = torch.stack([train_step().detach() for _ in range(steps)])
    return losses[losses == losses].cpu().numpy()


def test_q3_says_what_it_could_not_judge():
    assert status(q3, collect_through_a_mask) == CORRECT
    assert ("could not be judged" in q3.last.message) == (not torch.cuda.is_available())


def test_q3_a_stack_walking_answer_finds_no_expected_losses():
    def found_losses(value):
        return isinstance(value, (torch.Tensor, np.ndarray, list)) and len(value) == 12

    walker = stack_walker(lambda found, train_step, steps, device: [train_step() for _ in range(steps)] and found[0],
                          lambda train_step, steps, device: [train_step() for _ in range(steps)] and np.zeros(steps),
                          found_losses)
    assert status(q3, walker) == WRONG and walker.calls and walker.found == []


# ---------------------------------------------------------------- q4: bandwidth of a vector add

X = torch.randn(1_000_000)
COPY_S, ADD_S = 2e-4, 4e-4
COPY_GBS = 2 * X.nbytes / COPY_S / 1e9
FRACTION = 3 * X.nbytes / ADD_S / 1e9 / COPY_GBS


def test_q4_bandwidth_recomputed_from_the_inputs():
    assert status(q4, X, COPY_S, ADD_S, COPY_GBS, FRACTION) == CORRECT
    unusual = 2 * X.numel() * 4 / 1e9 / COPY_S  # elements × 4 bytes, divided in another order
    assert status(q4, X, COPY_S, ADD_S, torch.tensor(unusual), FRACTION) == CORRECT
    assert status(q4, X, COPY_S, ADD_S, COPY_GBS, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("copy_gbs, fraction, says", [
    (X.nbytes / COPY_S / 1e9, FRACTION, "reads every byte *and* writes it"),
    (2 * X.numel() / COPY_S / 1e9, FRACTION, "not elements"),
    (COPY_GBS * 1e9, FRACTION, "bytes per second"),
    (2 * X.nbytes / COPY_S / 2**30, FRACTION, "GiB/s"),
    (2 * X.nbytes / (COPY_S * 1e3) / 1e9, FRACTION, "in seconds"),
    (COPY_GBS, 2 * X.nbytes / ADD_S / 1e9 / COPY_GBS, "reads two arrays and writes one"),
    (COPY_GBS, FRACTION * 100, "not a percentage"),
    (COPY_GBS, 1 / FRACTION, "the copy's bandwidth over the add's"),
    (COPY_GBS, 0.9, "expected the fraction"),
])
def test_q4_rejects(copy_gbs, fraction, says):
    assert status(q4, X, COPY_S, ADD_S, copy_gbs, fraction) == WRONG
    assert says in q4.last.message
