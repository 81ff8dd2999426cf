"""Lesson 07's exercise checks: each accepts the solution it shows and an unusual right answer, calls a blank
answer "not attempted", and rejects plausible wrong answers with a message that names the mistake, an answer
that looks through the checker's frames for the expected values included. The third check runs the answer on
two gloo ranks under torchrun, so these tests do too."""

import sys
from contextlib import nullcontext

import nbformat
import numpy as np
import pytest
import torch.nn.functional as F

from gpulab import distributed
from gpulab.questions import lesson07
from gpulab.questions.lesson07 import expected_bytes

from .conftest import ROOT, checker_values, notebook_function, shown_solution

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)


def blank_function(*args, **kwargs):
    raise NotImplementedError


def judged(question, answer):
    question.check(answer)
    return question.last


# ----- q1: bus bandwidth ------------------------------------------------------------------------------

def bus_bandwidth_numpy(op, nbytes, seconds, ranks):
    """Unusual but right: a table of factors, numpy scalars, the units converted last."""
    factors = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}
    return np.float32(factors[op] * (ranks - 1) / ranks) * np.float64(nbytes) / seconds * 1e-9


def bandwidth_seen_in_the_checker(op, nbytes, seconds, ranks):
    """Stack walking, reduced to what the test needs: right only where a frame of the check holds the expected
    value while this runs (recognised by computing it here), else 0."""
    expected = distributed.bus_bandwidth(op, nbytes, seconds, ranks) / 1e9
    return expected if any(isinstance(v, float) and v == expected for v in checker_values()) else 0.0


WRONG_BANDWIDTHS = {
    "algorithm bandwidth": (lambda op, b, s, n: b / s / 1e9, "algorithm bandwidth"),
    "all-reduce factor (n-1)/n": (lambda op, b, s, n: b / s * (n - 1) / n / 1e9, "2(n−1)/n"),
    "all-reduce's factor everywhere": (lambda op, b, s, n: b / s * 2 * (n - 1) / n / 1e9, "(n−1)/n"),
    "bits": (lambda op, b, s, n: 8 * b / s * (2 if op == "all_reduce" else 1) * (n - 1) / n / 1e9, "bytes, not bits"),
    "GiB": (lambda op, b, s, n: b / s * (2 if op == "all_reduce" else 1) * (n - 1) / n / 2**30, "not 2³⁰"),
    "bytes/s": (lambda op, b, s, n: b / s * (2 if op == "all_reduce" else 1) * (n - 1) / n, "divide by 10⁹"),
    "a string": (lambda op, b, s, n: "12 GB/s", "a number"),
    "stack walking": (bandwidth_seen_in_the_checker, "the bus bandwidth is"),
}


def test_q1_accepts_right_answers():
    assert judged(lesson07.q1, shown_solution(lesson07.q1, "bus_bandwidth_gbs")).status == "correct"
    assert judged(lesson07.q1, bus_bandwidth_numpy).status == "correct"
    assert judged(lesson07.q1, blank_function).status == "not attempted"


@pytest.mark.parametrize("name", WRONG_BANDWIDTHS)
def test_q1_rejects_wrong_answers(name):
    answer, words = WRONG_BANDWIDTHS[name]
    result = judged(lesson07.q1, answer)
    assert result.status == "wrong", name
    assert words in result.message, result.message


# ----- q2: bytes per rank -----------------------------------------------------------------------------

SHARDED = {"DDP": (), "ZeRO-1": ("optimizer",), "ZeRO-2": ("gradients", "optimizer"),
           "FSDP": ("parameters", "gradients", "optimizer")}


def bytes_rounded_up(num_params, ranks, strategy):
    """Unusual but right: whole shards, rounded up the way FSDP pads a tensor that does not divide evenly."""
    out = {}
    for part, size in (("parameters", 4), ("gradients", 4), ("optimizer", 8)):
        count = -(-num_params // ranks) if part in SHARDED[strategy] else num_params
        out[part] = size * count
    return out


def bytes_seen_in_the_checker(num_params, ranks, strategy):
    """Stack walking, reduced to what the test needs: right only where a frame of the check holds the expected
    bytes while this runs (recognised by computing them here), else nothing."""
    expected = expected_bytes(num_params, ranks, strategy)
    return expected if any(isinstance(v, dict) and v == expected for v in checker_values()) else {}


def bytes_with(per_parameter, sharded=SHARDED, unit=1):
    return lambda p, n, s: {part: size * p / (n if part in sharded[s] else 1) / unit
                            for part, size in per_parameter.items()}


RIGHT_SIZES = {"parameters": 4, "gradients": 4, "optimizer": 8}
WRONG_BYTES = {
    "Adam keeps one moment": (bytes_with({**RIGHT_SIZES, "optimizer": 4}), "two float32 moments"),
    "mixed precision's 2 + 2 + 12": (bytes_with({"parameters": 2, "gradients": 2, "optimizer": 12}),
                                     "2 + 2 + 12 bytes per parameter is mixed precision"),
    "fp32 master weights in the optimizer": (bytes_with({**RIGHT_SIZES, "optimizer": 12}), "master weights"),
    "GB": (bytes_with(RIGHT_SIZES, unit=1e9), "bytes, not GB"),
    "DDP shards": (bytes_with(RIGHT_SIZES, {**SHARDED, "DDP": ("parameters", "gradients", "optimizer")}),
                   "does not shard"),
    "ZeRO-1 shards the gradients": (bytes_with(RIGHT_SIZES, {**SHARDED, "ZeRO-1": SHARDED["ZeRO-2"]}),
                                    "ZeRO-1 does not shard the gradients"),
    "ZeRO-2 shards the parameters": (bytes_with(RIGHT_SIZES, {**SHARDED, "ZeRO-2": SHARDED["FSDP"]}), "does not shard"),
    "FSDP keeps full gradients": (bytes_with(RIGHT_SIZES, {**SHARDED, "FSDP": ("parameters", "optimizer")}),
                                  "shards the gradients"),
    "a total instead of parts": (lambda p, n, s: 16 * p, "return a dict"),
    "text for a part": (lambda p, n, s: {**expected_bytes(p, n, s), "optimizer": "8 bytes each"}, "a number of bytes"),
    "stack walking": (bytes_seen_in_the_checker, "return a dict"),
}


def test_q2_accepts_right_answers():
    assert judged(lesson07.q2, shown_solution(lesson07.q2, "bytes_per_rank")).status == "correct"
    assert judged(lesson07.q2, bytes_rounded_up).status == "correct"
    assert judged(lesson07.q2, blank_function).status == "not attempted"


@pytest.mark.parametrize("name", WRONG_BYTES)
def test_q2_rejects_wrong_answers(name):
    answer, words = WRONG_BYTES[name]
    result = judged(lesson07.q2, answer)
    assert result.status == "wrong", name
    assert words in result.message, result.message


# ----- q3: accumulation with no_sync(), on one rank here and on two under torchrun ---------------------
# Module-level functions: the check reads their source to run them on two ranks, where only the names the
# exercise notebook imports exist (torch, dist, F, contextlib, nullcontext).

def accumulate_head_and_last(model, micro_batches):
    """Unusual but right: all but the last micro-batch in one no_sync() block; summed losses over the sample count."""
    *head, last = micro_batches
    samples = sum(len(y) for _, y in micro_batches)
    with model.no_sync():
        for x, y in head:
            (F.cross_entropy(model(x), y, reduction="sum") / samples).backward()
    x, y = last
    (F.cross_entropy(model(x), y, reduction="sum") / samples).backward()


def accumulate_by_hand(model, micro_batches):
    """Unusual but right: every backward inside no_sync(), then each gradient all-reduced once and averaged."""
    with model.no_sync():
        for x, y in micro_batches:
            (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # noqa: F821 (the notebook and the two ranks' script import dist)
        p.grad /= dist.get_world_size()  # noqa: F821


def accumulate_by_hand_summing(model, micro_batches):
    with model.no_sync():
        for x, y in micro_batches:
            (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # noqa: F821


def accumulate_and_all_reduce_again(model, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
    for p in model.parameters():  # "to be sure": DDP's last backward has already averaged them
        dist.all_reduce(p.grad)  # noqa: F821
        p.grad /= dist.get_world_size()  # noqa: F821


def accumulate_one_large_batch(model, micro_batches):
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    F.cross_entropy(model(x), y).backward()


def accumulate_then_one_backward(model, micro_batches):
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            losses.append(F.cross_entropy(model(x), y) / len(micro_batches))
    sum(losses).backward()


def accumulate_without_no_sync(model, micro_batches):
    for x, y in micro_batches:
        (F.cross_entropy(model(x), y) / len(micro_batches)).backward()


def accumulate_never_syncing(model, micro_batches):
    with model.no_sync():
        for x, y in micro_batches:
            (F.cross_entropy(model(x), y) / len(micro_batches)).backward()


def accumulate_sum_of_losses(model, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            F.cross_entropy(model(x), y).backward()


def accumulate_then_step(model, micro_batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def accumulate_divided_by_world(model, micro_batches):
    world = torch.distributed.get_world_size()
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            (F.cross_entropy(model(x), y) / len(micro_batches) / world).backward()


def accumulate_copying_the_reference(model, micro_batches):
    """Stack walking: backward every micro-batch (the losses not divided), then copy into .grad any list of
    tensors shaped like the parameters, but not equal to them, that a frame of the check holds."""

    params = list(model.parameters())
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            F.cross_entropy(model(x), y).backward()
    frame = sys._getframe(1)
    while frame:
        if frame.f_globals.get("__name__", "").startswith("gpulab"):
            for value in frame.f_locals.values():
                if isinstance(value, list) and len(value) == len(params) and all(
                        isinstance(t, torch.Tensor) and t.shape == p.shape and not torch.equal(t, p)
                        for t, p in zip(value, params)):
                    for p, t in zip(params, value):
                        p.grad = t.clone()
                    return
        frame = frame.f_back


import torch  # noqa: E402  (after the functions above, which must not rely on this module's names)
import torch.distributed as dist  # noqa: E402

LESSON_SNIPPET = """
def accumulate(model, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
"""  # lesson 07's section 3.4, without its optimizer.step()


def in_the_exercise(source: str):
    """The function ``accumulate`` that ``source`` defines in a cell of the exercise notebook, after its imports."""
    notebook = nbformat.read(ROOT / "solutions" / "07_multi_gpu.ipynb", as_version=4)
    imports = next(c.source for c in notebook.cells if "from gpulab.questions.lesson07 import" in c.source)
    scope = {}
    exec(imports, scope)
    return notebook_function(source, "accumulate", **scope)


WRONG_ACCUMULATIONS = {  # answer: words of the message
    accumulate_one_large_batch: "one forward pass on all 12 samples",
    accumulate_then_one_backward: "the forwards of 4 micro-batches ran before their backward passes",
    accumulate_without_no_sync: "inside `with model.no_sync():`",
    accumulate_never_syncing: "never all-reduced",
    accumulate_and_all_reduce_again: "2× the gradients' bytes were all-reduced",
    accumulate_sum_of_losses: "4× too large",
    accumulate_then_step: "the weights changed",
    accumulate_copying_the_reference: "(on 1 rank) the gradients are 4× too large",
    accumulate_divided_by_world: "(on 2 ranks) the gradients are 2× too small",
    accumulate_by_hand_summing: "(on 2 ranks) the gradients are 2× too large: all_reduce sums",
}


@pytest.mark.parametrize("answer", [
    lambda: in_the_exercise(LESSON_SNIPPET),
    lambda: accumulate_head_and_last,
    lambda: accumulate_by_hand,
], ids=["the lesson's snippet", "one no_sync() block", "all-reduced by hand"])
def test_q3_accepts_right_answers_on_two_ranks(answer):
    """Right answers other than the shown solution, which the solution notebook holds (a test below) and the grader
    runs on two ranks (test_grading_solutions.py)."""
    result = judged(lesson07.q3, answer())
    assert result.status == "correct", result.message


def test_q3_blank_and_sourceless_answers():
    assert judged(lesson07.q3, blank_function).status == "not attempted"
    assert "your function itself" in judged(lesson07.q3, "accumulate").message
    scope = {"F": F, "nullcontext": nullcontext}
    exec(lesson07.q3.solution_text, scope)  # defined without a source the check can read
    result = judged(lesson07.q3, scope["accumulate"])
    assert result.status == "wrong" and "define it with `def`" in result.message


@pytest.mark.parametrize("answer", WRONG_ACCUMULATIONS, ids=lambda f: f.__name__)
def test_q3_rejects_wrong_answers(answer):
    result = judged(lesson07.q3, answer)
    assert result.status == "wrong", answer.__name__
    assert WRONG_ACCUMULATIONS[answer] in result.message, result.message


# ----- the solution notebook ---------------------------------------------------------------------------------

def code_lines(source: str) -> list[str]:
    """The lines of code in ``source``: no comments, blank lines, solution markers or placeholders."""
    return [line.split("#")[0].rstrip() for line in source.splitlines()
            if line.split("#")[0].strip() and "= ____" not in line]


@pytest.mark.parametrize("question", [lesson07.q1, lesson07.q2, lesson07.q3], ids=lambda q: q.name)
def test_the_solution_notebook_holds_the_solution_each_question_shows(question):
    notebook = nbformat.read(ROOT / "solutions" / "07_multi_gpu.ipynb", as_version=4)
    answers = [code_lines(c.source) for c in notebook.cells if "### BEGIN SOLUTION" in c.source]
    assert code_lines(question.solution_text) in answers
