"""Lesson 07's exercise checks: each accepts the solution it shows and an unusual right answer, calls a blank
answer "not attempted", and rejects plausible wrong answers with a message that names the mistake. The third
check runs the answer on two gloo ranks under torchrun, so these tests do too."""

from contextlib import nullcontext

import numpy as np
import pytest
import torch.nn.functional as F

from gpulab.questions import lesson07

from .conftest import shown_solution


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


WRONG_BANDWIDTHS = {
    "algorithm bandwidth": (lambda op, b, s, n: b / s / 1e9, "algorithm bandwidth"),
    "all-reduce factor (n-1)/n": (lambda op, b, s, n: b / s * (n - 1) / n / 1e9, "2(n−1)/n"),
    "all-reduce's factor everywhere": (lambda op, b, s, n: b / s * 2 * (n - 1) / n / 1e9, "(n−1)/n"),
    "bits": (lambda op, b, s, n: 8 * b / s * (2 if op == "all_reduce" else 1) * (n - 1) / n / 1e9, "bytes, not bits"),
    "GiB": (lambda op, b, s, n: b / s * (2 if op == "all_reduce" else 1) * (n - 1) / n / 2**30, "not 2³⁰"),
    "a string": (lambda op, b, s, n: "12 GB/s", "a number"),
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


def bytes_with(per_parameter, sharded=SHARDED):
    return lambda p, n, s: {part: size * p / (n if part in sharded[s] else 1) for part, size in per_parameter.items()}


RIGHT_SIZES = {"parameters": 4, "gradients": 4, "optimizer": 8}
WRONG_BYTES = {
    "Adam keeps one moment": (bytes_with({**RIGHT_SIZES, "optimizer": 4}), "two float32 moments"),
    "DDP shards": (bytes_with(RIGHT_SIZES, {**SHARDED, "DDP": ("parameters", "gradients", "optimizer")}),
                   "does not shard"),
    "ZeRO-2 shards the parameters": (bytes_with(RIGHT_SIZES, {**SHARDED, "ZeRO-2": SHARDED["FSDP"]}), "does not shard"),
    "FSDP keeps full gradients": (bytes_with(RIGHT_SIZES, {**SHARDED, "FSDP": ("parameters", "optimizer")}),
                                  "shards the gradients"),
    "a total instead of parts": (lambda p, n, s: 16 * p, "return a dict"),
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
# Module-level functions: the check reads their source to run them on two ranks. Only torch, F and
# nullcontext are available there, as the exercise says.

def accumulate_head_and_last(model, micro_batches):
    """Unusual but right: all but the last micro-batch in one no_sync() block; summed losses over the sample count."""
    *head, last = micro_batches
    samples = sum(len(y) for _, y in micro_batches)
    with model.no_sync():
        for x, y in head:
            (F.cross_entropy(model(x), y, reduction="sum") / samples).backward()
    x, y = last
    (F.cross_entropy(model(x), y, reduction="sum") / samples).backward()


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
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: F821 (torch is there when it runs)
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def accumulate_divided_by_world(model, micro_batches):
    world = torch.distributed.get_world_size()  # noqa: F821
    for i, (x, y) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            (F.cross_entropy(model(x), y) / len(micro_batches) / world).backward()


import torch  # noqa: E402  (after the functions above, which must not rely on this module's names)

WRONG_ACCUMULATIONS = {  # answer: words of the message
    accumulate_without_no_sync: "inside `with model.no_sync():`",
    accumulate_never_syncing: "never all-reduced",
    accumulate_sum_of_losses: "4× too large",
    accumulate_then_step: "the weights changed",
    accumulate_divided_by_world: "2× too small",
}


def test_q3_accepts_the_solution_and_an_unusual_right_answer():
    solution = shown_solution(lesson07.q3, "accumulate", F=F, nullcontext=nullcontext)
    assert judged(lesson07.q3, accumulate_head_and_last).status == "correct", lesson07.q3.last.message
    assert judged(lesson07.q3, blank_function).status == "not attempted"
    # the shown solution is exec'd text: the check cannot read its source, and says so
    result = judged(lesson07.q3, solution)
    assert result.status == "wrong" and "define it with `def`" in result.message


@pytest.mark.parametrize("answer", WRONG_ACCUMULATIONS, ids=lambda f: f.__name__)
def test_q3_rejects_wrong_answers(answer):
    result = judged(lesson07.q3, answer)
    assert result.status == "wrong", answer.__name__
    assert WRONG_ACCUMULATIONS[answer] in result.message, result.message
