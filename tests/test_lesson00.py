"""Lesson 00's exercise checks: right answers pass, plausible wrong ones are rejected, blanks are not attempted."""

import os
import re
import sys

import nbformat
import numpy as np
import pytest
import torch

import gpulab
import gpulab.precision
from gpulab import check
from gpulab.check import CORRECT, NOT_ATTEMPTED, WRONG, ____
from gpulab.questions.lesson00 import q1, q2, q3, q4

from .conftest import ROOT, shown_solution


def status(question, *answers) -> str:
    question.check(*answers)
    return question.last.status


# ---------------------------------------------------------------- shared: answers that walk the stack, notebooks

ANSWER_NAMES = re.compile(r"expected\w*|truth\w*|answer|ref_\w+|reference|clipped|mean_grads|mean_loss|values")


def peek(wanted=lambda value: True) -> list:
    """What an answer that walks the stack finds: the locals of the check's frames (gpulab's code) whose names say
    "the answer" (or that hold a value ``wanted`` says is one)."""
    found, frame = [], sys._getframe(1)
    while frame is not None:
        if f"{os.sep}gpulab{os.sep}" in frame.f_code.co_filename:
            found += [v for k, v in frame.f_locals.items() if ANSWER_NAMES.fullmatch(k) and wanted(v)]
        frame = frame.f_back
    return found


def stack_walker(use, otherwise, wanted=lambda value: True):
    """An answer that looks through the caller frames for the expected value and answers ``use(found, *args)``, or
    ``otherwise(*args)`` when it finds nothing; ``.found`` keeps everything it found, ``.calls`` counts its calls."""
    def answer(*args, **kwargs):
        found = peek(wanted)
        answer.found += found
        answer.calls += 1
        return use(found, *args, **kwargs) if found else otherwise(*args, **kwargs)

    answer.found, answer.calls = [], 0
    return answer


def region_and_shown(lesson: str, question) -> tuple[list[str], list[str]]:
    """The code lines of a question's solution region in its solution notebook, and those of the solution it shows
    (its lines outside the notebook's regions, such as a `def`, left out), without comments or blank lines."""
    notebook = nbformat.read(next(ROOT.glob(f"solutions/{lesson}_*.ipynb")), as_version=4)
    cells = [c.source for c in notebook.cells if c.cell_type == "code"]
    check_at = next(i for i, c in enumerate(cells) if f"{question.name}.check(" in c)
    cell = next(c for c in reversed(cells[:check_at]) if "### BEGIN SOLUTION" in c)
    inside, outside, within = [], [], False
    for line in cell.splitlines():
        if "### BEGIN SOLUTION" in line or "### END SOLUTION" in line:
            within = "BEGIN" in line
        elif _code_line(line):
            (inside if within else outside).append(_code_line(line))
    shown = [line for line in map(_code_line, question.solution_text.splitlines()) if line and line not in outside]
    return inside, shown


def _code_line(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line).strip()


@pytest.mark.parametrize("lesson", ["00", "01", "02", "03", "04"])
def test_the_solution_notebooks_hold_the_solutions_the_questions_show(lesson):
    for question in check.questions(lesson):
        inside, shown = region_and_shown(lesson, question)
        assert inside and inside == shown, question.name


# ---------------------------------------------------------------- q1: model and batch on the same device


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


def predict_on_gpu_forgets_batch(model, batch, device):
    """Wrong only on a GPU: the batch is left on the CPU in the branch a CPU never takes."""
    if torch.cuda.is_available():
        return model.cuda()(batch)
    return model(batch)


def predict_hard_coded_cuda(model, batch, device):
    return model.to("cuda")(batch.to("cuda"))


def predict_hard_coded_cpu(model, batch, device):
    return model.to("cpu")(batch.to("cpu"))


def predict_without_the_model(model, batch, device):
    """Plausible but wrong: an output of the right shape, never computed by the model."""
    return torch.zeros(len(batch), 3, device=device)


def predict_in_one_line(model, batch, device):
    """Unusual but right: a module moved in place, a batch copied without blocking, the output kept."""
    return model.to(device)(batch.to(device, non_blocking=True))


def predict_to_the_models_device(model, batch, device):
    """Unusual but right: the batch follows the model's parameters, in inference mode."""
    model.to(device)
    with torch.inference_mode():
        return model(batch.to(next(model.parameters()).device))


def predict_unfinished(model, batch, device):
    raise NotImplementedError


def test_q1_same_device():
    assert status(q1, predict) == CORRECT
    assert status(q1, predict_in_one_line) == CORRECT
    assert status(q1, predict_to_the_models_device) == CORRECT
    assert status(q1, predict_unfinished) == NOT_ATTEMPTED
    assert status(q1, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    (predict_forgets_batch, "Move the model *and* the batch"),
    (predict_drops_moved_batch, "keep the moved batch"),
    (predict_moves_only_the_output, "only its output was moved"),
    (predict_returns_to_host, "no `.cpu()`"),
    (predict_on_gpu_forgets_batch, "with device='cuda' your function raised"),
    (predict_hard_coded_cuda, "not a fixed 'cuda'"),
    (predict_hard_coded_cpu, "the model ran on cpu"),
    (predict_without_the_model, "never ran the model"),
    ("predict", "pass your function itself"),
])
def test_q1_rejects(wrong, says):
    assert status(q1, wrong) == WRONG
    assert says in q1.last.message and "meta" not in q1.last.message


def predict_through_a_mask(model, batch, device):
    """Right, but the boolean mask has no stand-in without a GPU: judged on the CPU only, and said so."""
    batch = batch.to(device)
    return model.to(device)(batch[batch.sum(dim=1) == batch.sum(dim=1)])


def test_q1_says_what_it_could_not_judge():
    assert status(q1, predict_through_a_mask) == CORRECT
    assert ("could not be judged" in q1.last.message) == (not torch.cuda.is_available())


def test_q1_a_stack_walking_answer_finds_no_expected_output():
    walker = stack_walker(lambda found, model, batch, device: found[0].to(device), predict_without_the_model,
                          lambda value: isinstance(value, torch.Tensor))
    assert status(q1, walker) == WRONG and walker.calls and walker.found == []


@pytest.mark.gpu
def test_q1_on_the_gpu_catches_a_batch_left_on_the_cpu():
    assert status(q1, predict_forgets_batch) == WRONG
    assert "cuda" in q1.last.message


# ---------------------------------------------------------------- q2: matmul throughput


def test_q2_tflops_recomputed_from_the_inputs():
    n, seconds = 1024, 0.0125
    assert status(q2, n, seconds, 2 * n**3 / seconds / 1e12) == CORRECT
    assert status(q2, n, seconds, np.float64(2.0 * n**3 / 1e12) / seconds) == CORRECT  # a NumPy number is fine
    assert status(q2, n, seconds, n**3 * 2 / (seconds * 1e12)) == CORRECT  # in another order
    assert status(q2, n, seconds, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    (lambda n, s: n**3 / s / 1e12, "2 FLOPs"),
    (lambda n, s: 2 * n**3 / s / 1e9, "GFLOP/s"),
    (lambda n, s: 2 * n**3 / s, "FLOP/s: divide by 1e12"),
    (lambda n, s: 2 * n**2 / s / 1e12, "n³ multiply-adds"),
    (lambda n, s: 2 * n**3 / (s * 1e3) / 1e12, "`seconds` is in seconds"),
    (lambda n, s: 2 * n**3 / s / 2**40, "not 2⁴⁰"),
    (lambda n, s: 0.5, "expected"),  # a number from another machine
    (lambda n, s: "fast", "should be a number"),
])
def test_q2_rejects(wrong, says):
    n, seconds = 1024, 0.0125
    assert status(q2, n, seconds, wrong(n, seconds)) == WRONG
    assert says in q2.last.message


def test_q2_accepts_a_measurement():
    m = gpulab.bench(torch.mm, torch.randn(32, 32), torch.randn(32, 32), repeats=3)
    assert status(q2, 32, m, 2 * 32**3 / m.median / 1e12) == CORRECT


# ---------------------------------------------------------------- q3: the crossover

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


def faster_here_and_next(sizes, baseline_s, candidate_s):
    """Plausible but wrong: faster at a size and at the next one is taken for "from here on"."""
    pairs = list(zip(sizes, baseline_s, candidate_s, strict=True))
    for (size, b, c), (_, b2, c2) in zip(pairs, pairs[1:] + [pairs[-1]]):
        if c < b and c2 < b2:
            return size
    return None


def ties_count_as_faster(sizes, baseline_s, candidate_s):
    answer = None
    for size, b, c in reversed(list(zip(sizes, baseline_s, candidate_s, strict=True))):
        if not c <= b:
            break
        answer = size
    return answer


def position_not_size(sizes, baseline_s, candidate_s):
    size = crossover(sizes, baseline_s, candidate_s)
    return None if size is None else sizes.index(size)


def zero_for_never(sizes, baseline_s, candidate_s):
    return crossover(sizes, baseline_s, candidate_s) or 0


def reverses_in_place(sizes, baseline_s, candidate_s):
    """Unusual but right: walks the lists reversed in place (the check's own copies are not touched)."""
    for values in (sizes, baseline_s, candidate_s):
        values.reverse()
    answer = None
    for size, b, c in zip(sizes, baseline_s, candidate_s):
        if not c < b:
            break
        answer = size
    return answer


def crossover_vectorised(sizes, baseline_s, candidate_s):
    """Unusual but right: pandas, from the largest size down."""
    import pandas as pd

    faster = pd.Series([c < b for b, c in zip(baseline_s, candidate_s, strict=True)], index=sizes)
    tail = faster[::-1].cummin()[::-1]
    return int(tail[tail].index.min()) if tail.iloc[-1] else None


def crossover_unfinished(sizes, baseline_s, candidate_s):
    raise NotImplementedError


MEASURED = ([16, 32, 64], [1e-5, 4e-5, 3e-4], [2e-5, 3e-5, 1e-4])


def test_q3_crossover():
    assert status(q3, crossover) == CORRECT
    assert status(q3, crossover, *MEASURED) == CORRECT
    assert "from size 32" in q3.last.message
    assert status(q3, crossover_vectorised, *MEASURED) == CORRECT
    assert status(q3, reverses_in_place, *MEASURED) == CORRECT
    assert status(q3, crossover_unfinished, *MEASURED) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    (first_faster, "every larger one"),
    (last_slower, "every larger one"),
    (faster_at_the_largest, "every larger one"),
    (faster_here_and_next, "every larger one"),
    (ties_count_as_faster, "return None when"),
    (position_not_size, "the position in the list"),
    (zero_for_never, "return None when"),
])
def test_q3_rejects(wrong, says):
    assert status(q3, wrong, *MEASURED) == WRONG
    assert says in q3.last.message


def test_q3_a_stack_walking_answer_finds_no_expected_size():
    walker = stack_walker(lambda found, *args: found[0], lambda *args: -1,
                          lambda value: isinstance(value, int) or value is None)
    assert status(q3, walker, *MEASURED) == WRONG and walker.calls and walker.found == []


# ---------------------------------------------------------------- q4: native bf16

has_native_bf16 = shown_solution(q4, "has_native_bf16", gpulab=gpulab)


def from_the_capability(device):
    """Unusual but right: the compute capability, asked of torch."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def without_emulation(device):
    """Unusual but right: torch's own answer, emulation left out."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def test_q4_bf16_follows_the_device():
    assert status(q4, has_native_bf16) == CORRECT
    assert "A100" in q4.last.message and gpulab.device_info().name in q4.last.message
    assert status(q4, from_the_capability) == CORRECT
    assert status(q4, without_emulation) == CORRECT
    assert status(q4, ____) == NOT_ATTEMPTED


@pytest.mark.parametrize("wrong, says", [
    (lambda device: False, "computes in bf16 natively, yet your function says False"),
    (lambda device: True, "has no native bf16, yet your function says True"),
    (lambda device: torch.cuda.is_bf16_supported(), "only emulated"),
    (lambda device: torch.cuda.is_available(), "having a GPU is not enough"),
    (lambda device: gpulab.device_info().bf16_native, "look at the `device` you are given"),
    (lambda device: gpulab.precision.device_support(device)["bf16"].available, "asked about the CPU"),
    (lambda device: "yes", "return True or False"),
    (lambda device: 1, "return True or False"),
    (False, "pass your function itself"),
])
def test_q4_rejects(wrong, says):
    assert status(q4, wrong) == WRONG
    assert says in q4.last.message


def test_q4_leaves_no_simulated_device_behind():
    before = gpulab.device_info()
    q4.check(lambda device: True)
    assert gpulab.device_info() == before and torch.cuda.is_available() == (before.compute_capability is not None)


def test_q4_a_stack_walking_answer_finds_no_expected_answer():
    walker = stack_walker(lambda found, device: found[0], lambda device: False, lambda value: isinstance(value, bool))
    assert status(q4, walker) == WRONG and walker.calls and walker.found == []


# ---------------------------------------------------------------- doctor


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
