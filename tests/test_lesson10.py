"""Lesson 10's exercise check: a graph break found and fixed. It accepts the solution it shows and an unusual right
answer, calls a blank answer "not attempted", and rejects plausible wrong answers with a message that names the
mistake (these tests came with the question from lesson 09). No check times the learner's code."""

import pytest
import torch

from gpulab.check import ____
from gpulab.questions import lesson10

from .conftest import checker_values, shown_solution


def blank_function(*args, **kwargs):
    raise NotImplementedError


def right(question, name):
    return shown_solution(question, name, torch=torch)


# ----- q1: a graph break found and fixed ----------------------------------------------------------------------------------

def scaled_by_fmin(x, w1, w2, limit=4.0):
    """Unusual but right: the scale as a factor capped at 1 by torch.fmin, which ignores a NaN (as scaled_mlp's
    `peak > limit` is False for one)."""
    h = x @ w1
    return torch.relu(h * torch.fmin(limit / h.abs().amax(), torch.ones(()))) @ w2


def scaled_by_clamp(x, w1, w2, limit=4.0):
    """Right on ordinary inputs, but a clamp of limit / NaN is NaN: one NaN in the input spreads to every row."""
    h = x @ w1
    return torch.relu(h * torch.clamp(limit / h.abs().amax(), max=1.0)) @ w2


def scaled_by_a_mask(x, w1, w2, limit=4.0):
    """Right on ordinary inputs, but on an all-zero input 0 × (limit / 0) = 0 × inf is NaN."""
    h = x @ w1
    peak = h.abs().amax()
    over = (peak > limit).float()
    return torch.relu(over * h * (limit / peak) + (1 - over) * h) @ w2


def compiled_path_differs(x, w1, w2, limit=4.0):
    """Right eagerly; under torch.compile it drops the scaling (no break, but another computation)."""
    if torch.compiler.is_compiling():
        return torch.relu(x @ w1) @ w2
    return lesson10.scaled_mlp(x, w1, w2, limit)


def item_kept(x, w1, w2, limit=4.0):
    """.item() kept, which capture_scalar_outputs=True puts in the graph: the number still goes to Python."""
    h = x @ w1
    factor = torch.full((), limit) / h.abs().max().item()
    return torch.relu(torch.where(factor < 1, h * factor, h)) @ w2


def branch_dropped(x, w1, w2, limit=4.0):
    return torch.relu(x @ w1) @ w2


def always_scaled(x, w1, w2, limit=4.0):
    h = x @ w1
    return torch.relu(h * (limit / h.abs().amax())) @ w2


def largest_value_not_magnitude(x, w1, w2, limit=4.0):
    h = x @ w1
    peak = h.amax()
    return torch.relu(torch.where(peak > limit, h * (limit / peak), h)) @ w2


def branch_on_a_tensor(x, w1, w2, limit=4.0):
    h = x @ w1
    peak = h.abs().amax()
    if peak > limit:  # no .item(), still a branch on data
        h = h * (limit / peak)
    return torch.relu(h) @ w2


def values_clamped(x, w1, w2, limit=4.0):
    return torch.relu(torch.clamp(x @ w1, -limit, limit)) @ w2


@pytest.mark.parametrize("answer", [lambda: right(lesson10.q1, "scaled_mlp_fixed"), lambda: scaled_by_fmin],
                         ids=["shown", "fmin"])
def test_q1_accepts_right_answers(answer):
    lesson10.q1.check(answer())
    assert lesson10.q1.last.status == "correct", lesson10.q1.last.message


@pytest.mark.parametrize("wrong, says", [
    (lesson10.scaled_mlp, "graph break"),
    (branch_on_a_tensor, "graph break"),
    (branch_dropped, "past the limit"),
    (always_scaled, "stay within the limit"),
    (largest_value_not_magnitude, "past the limit"),
    (values_clamped, "computes something else"),
    (scaled_by_clamp, "on an input with one NaN"),
    (scaled_by_a_mask, "on an all-zero input"),
    (compiled_path_differs, "under torch.compile your function computes something else"),
    (lambda x, w1, w2, limit=4.0: (x @ w1).tolist(), "return the MLP's output"),
])
def test_q1_rejects_plausible_wrong_answers(wrong, says):
    lesson10.q1.check(wrong)
    assert lesson10.q1.last.status == "wrong"
    assert says in lesson10.q1.last.message, lesson10.q1.last.message


def test_q1_rejects_item_kept_under_capture_scalar_outputs():
    """A learner who set capture_scalar_outputs=True sees no break from .item(); the check runs Dynamo's default."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        lesson10.q1.check(item_kept)
        assert torch._dynamo.config.capture_scalar_outputs  # the learner's setting is left as it was
    assert lesson10.q1.last.status == "wrong"
    assert "capture_scalar_outputs=True only hides the .item() break" in lesson10.q1.last.message


# ----- answers that walk up the stack to the checks' own values -------------------------------------------------------

def walking(reference, fallback):
    """An answer that walks up the stack to the check's frames and returns the right answer (``reference`` of its
    arguments) if any value there equals it, else ``fallback``; ``.found`` keeps what it found."""
    def answer(*args, **kwargs):
        right_answer = reference(*args, **kwargs)
        found = [v for v in checker_values() if type(v) is type(right_answer) and _same(v, right_answer)]
        answer.found += found
        return found[-1] if found else fallback
    answer.found = []
    return answer


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.allclose(a, b))
    return a == b or (isinstance(a, float) and abs(a - b) <= 1e-9 * abs(b))


def test_a_stack_walking_answer_finds_no_expected_value():
    answer = walking(lesson10.scaled_mlp, torch.zeros(16, 8))
    lesson10.q1.check(answer)
    assert lesson10.q1.last.status == "wrong" and answer.found == [], (lesson10.q1.last.message, answer.found[:3])


@pytest.mark.parametrize("blank", [(blank_function,), (____,)])
def test_blank_answers_are_not_attempted(blank):
    lesson10.q1.check(*blank)
    assert lesson10.q1.last.status == "not attempted"
