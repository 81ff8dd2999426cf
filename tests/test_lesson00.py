"""Lesson 00's exercise checks: right answers pass, plausible wrong ones are rejected, blanks are not attempted."""

import numpy as np
import pytest
import torch

import gpulab
from gpulab.check import CORRECT, NOT_ATTEMPTED, WRONG, ____
from gpulab.questions.lesson00 import q1, q2, q3, q4

from .conftest import shown_solution


def status(question, *answers) -> str:
    question.check(*answers)
    return question.last.status


def predict(model, batch, device):
    model = model.to(device)
    batch = batch.to(device)
    return model(batch)


def predict_forgets_batch(model, batch, device):
    model = model.to(device)
    return model(batch)


def predict_drops_moved_batch(model, batch, device):
    model.to(device)
    batch.to(device)  # the moved tensor is thrown away
    return model(batch)


def predict_moves_only_the_output(model, batch, device):
    """Plausible but wrong: the model runs where it is (the CPU) and only its output reaches the device."""
    return model(batch).to(device)


def predict_returns_to_host(model, batch, device):
    return model.to(device)(batch.to(device)).cpu()


def predict_in_one_line(model, batch, device):
    """Unusual but right: a module moved in place, a batch copied without blocking, the output kept."""
    return model.to(device)(batch.to(device, non_blocking=True))


def predict_unfinished(model, batch, device):
    raise NotImplementedError


def test_q1_same_device():
    assert status(q1, predict) == CORRECT
    assert status(q1, predict_in_one_line) == CORRECT
    assert status(q1, predict_forgets_batch) == WRONG
    assert "batch" in q1.last.message
    assert status(q1, predict_drops_moved_batch) == WRONG
    assert status(q1, predict_moves_only_the_output) == WRONG
    assert "only its output was moved" in q1.last.message
    assert status(q1, predict_returns_to_host) == WRONG
    assert "no `.cpu()`" in q1.last.message
    assert status(q1, predict_unfinished) == NOT_ATTEMPTED
    assert status(q1, ____) == NOT_ATTEMPTED


def test_q2_tflops_recomputed_from_the_inputs():
    n, seconds = 1024, 0.0125
    assert status(q2, n, seconds, 2 * n**3 / seconds / 1e12) == CORRECT
    assert status(q2, n, seconds, n**3 / seconds / 1e12) == WRONG
    assert "2 FLOPs" in q2.last.message
    assert status(q2, n, seconds, 2 * n**3 / seconds / 1e9) == WRONG
    assert status(q2, n, seconds, 2 * n**3 / seconds) == WRONG  # FLOP/s
    assert status(q2, n, seconds, 2 * n**2 / seconds / 1e12) == WRONG  # n² multiply-adds
    assert status(q2, n, seconds, np.float64(2.0 * n**3 / 1e12) / seconds) == CORRECT  # a NumPy number is fine
    assert status(q2, n, seconds, ____) == NOT_ATTEMPTED


def test_q2_accepts_a_measurement():
    m = gpulab.bench(torch.mm, torch.randn(32, 32), torch.randn(32, 32), repeats=3)
    assert status(q2, 32, m, 2 * 32**3 / m.median / 1e12) == CORRECT


crossover = shown_solution(q3, "crossover")


def first_faster(sizes, baseline_s, candidate_s):
    """Plausible but wrong: one lucky point at a small size is taken for the crossover."""
    return next((s for s, b, c in zip(sizes, baseline_s, candidate_s, strict=True) if c < b), None)


def last_slower(sizes, baseline_s, candidate_s):
    """Plausible but wrong: the last size where the candidate was still slower (one too early)."""
    slower = [s for s, b, c in zip(sizes, baseline_s, candidate_s, strict=True) if not c < b]
    return slower[-1] if slower else sizes[0]


def faster_at_the_largest(sizes, baseline_s, candidate_s):
    """Plausible but wrong: looks at the largest size only."""
    return sizes[-1] if candidate_s[-1] < baseline_s[-1] else None


def crossover_vectorised(sizes, baseline_s, candidate_s):
    """Unusual but right: pandas, from the largest size down."""
    import pandas as pd

    faster = pd.Series([c < b for b, c in zip(baseline_s, candidate_s, strict=True)], index=sizes)
    tail = faster[::-1].cummin()[::-1]
    return int(tail[tail].index.min()) if tail.iloc[-1] else None


def crossover_unfinished(sizes, baseline_s, candidate_s):
    raise NotImplementedError


def test_q3_crossover():
    assert status(q3, crossover) == CORRECT
    measured = ([16, 32, 64], [1e-5, 4e-5, 3e-4], [2e-5, 3e-5, 1e-4])
    assert status(q3, crossover, *measured) == CORRECT
    assert "from size 32" in q3.last.message
    assert status(q3, crossover_vectorised, *measured) == CORRECT
    assert status(q3, first_faster) == WRONG
    assert status(q3, last_slower) == WRONG
    assert status(q3, faster_at_the_largest) == WRONG
    assert status(q3, crossover_unfinished, *measured) == NOT_ATTEMPTED


def test_q4_bf16_follows_the_device():
    native = gpulab.device_info().bf16_native
    assert status(q4, native) == CORRECT
    assert status(q4, not native) == WRONG
    assert status(q4, "yes") == WRONG
    assert status(q4, 1) == WRONG  # a number is not an answer to a yes/no question
    assert status(q4, None) == WRONG
    assert status(q4, np.bool_(native)) == CORRECT
    assert status(q4, ____) == NOT_ATTEMPTED


@pytest.mark.gpu
def test_q1_on_the_gpu_catches_a_batch_left_on_the_cpu():
    assert status(q1, predict_forgets_batch) == WRONG
    assert "cuda" in q1.last.message


def test_doctor_knows_minor_version_compatibility(monkeypatch):
    """Lesson 00 teaches it: a driver for CUDA 12.2 runs a torch built for 12.8 (same major), not one built for 13.0."""
    from gpulab import doctor
    from gpulab.doctor import Severity

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    works = doctor._driver_matches(driver_cuda=(12, 2))
    assert works.severity == Severity.OK and "minor-version compatibility" in works.summary
    fails = doctor._no_gpu(driver_cuda=(12, 2))
    assert fails.severity == Severity.ERROR and "minor-version compatibility" in fails.summary
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert doctor._driver_matches(driver_cuda=(12, 8)).severity == Severity.WARNING
    assert "driver supports at most CUDA 12.8" in doctor._no_gpu(driver_cuda=(12, 8)).summary
