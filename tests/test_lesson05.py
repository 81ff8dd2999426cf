"""Lesson 05's exercise checks: each question accepts the solution it shows and an unusual right answer, calls a
blank answer "not attempted", and rejects plausible wrong answers with a message that names the mistake, an answer
that looks through the checker's frames for the expected values included."""

import json
import math
import os
import subprocess
import sys

import nbformat
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from gpulab import models
from gpulab.check import ____
from gpulab.questions import lesson05
from gpulab.questions.lesson05 import growth_per_step, training_state_bytes

from .conftest import ROOT, checker_values, shown_solution

STATE = {"sgd": 0, "momentum": 1, "adam": 2}


def blank_function(*args, **kwargs):
    raise NotImplementedError


# ----- the helpers the checks rely on ---------------------------------------------------------------

def test_training_state_bytes_of_a_small_layer():
    layer = nn.Linear(10, 10)  # 110 parameters of 4 bytes
    assert training_state_bytes(layer, "sgd") == 440 * 2
    assert training_state_bytes(layer, "momentum") == 440 * 3
    assert training_state_bytes(layer, "adam") == 440 * 4
    layer.bias.requires_grad_(False)  # 40 bytes frozen: no gradient, no state
    assert training_state_bytes(layer, "adam") == 440 + 400 * 3


def test_residual_mlp_is_seeded_and_its_blocks_can_be_run_in_segments():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b = models.ResidualMLP(width=32, depth=4, seed=0), models.ResidualMLP(width=32, depth=4, seed=0)
    assert torch.equal(torch.rand(1), expected_next)  # the global random stream is left alone
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    x = torch.randn(2, 3, 32, 32)
    assert a(x).shape == (2, 10)
    h = a.embed(x)
    for i in range(0, 4, 3):  # segments of 3 and 1 blocks give the same as the whole
        h = a.blocks[i:i + 3](h)
    assert torch.allclose(a.head(h), a(x))
    vectors = models.ResidualMLP(in_features=16, width=8, depth=1)
    assert vectors(torch.randn(5, 16)).shape == (5, 10)


def test_growth_per_step_skips_the_first_step():
    assert growth_per_step([1000, 1100, 1200, 1300]) == pytest.approx(100)
    assert growth_per_step([0, 5000, 5000, 5000]) == pytest.approx(0)  # the first step allocates once


# ----- q1: the bytes of the training state ----------------------------------------------------------

def state_by_measuring(model, optimizer):
    """Unusual but right: build the optimizer, take one step with zero gradients, count what exists."""
    trained = [p for p in model.parameters() if p.requires_grad]
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
            "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adam": lambda ps: torch.optim.Adam(ps, lr=0.1)}[optimizer]
    opt = make(trained)
    for p in trained:
        p.grad = torch.zeros_like(p)
    opt.step()
    state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return sum(p.nbytes for p in model.parameters()) + sum(p.grad.nbytes for p in trained) + state


def four_bytes_each(model, optimizer):
    return sum(p.numel() for p in model.parameters()) * 4 * (2 + STATE[optimizer])


def frozen_counted(model, optimizer):
    return sum(p.numel() * p.element_size() for p in model.parameters()) * (2 + STATE[optimizer])


def from_state_dict(model, optimizer):
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) * (2 + STATE[optimizer])


def three_adam_tensors(model, optimizer):
    k = {"sgd": 0, "momentum": 1, "adam": 3}[optimizer]
    return sum(p.numel() * p.element_size() * (1 + (1 + k) * p.requires_grad) for p in model.parameters())


def no_gradients(model, optimizer):
    return sum(p.numel() * p.element_size() * (1 + STATE[optimizer] * p.requires_grad) for p in model.parameters())


def bytes_seen_in_the_checker(model, optimizer):
    """Stack walking, reduced to what the test needs: right only where a frame of the check holds the expected
    bytes while this runs (recognised by computing them here), else 0."""
    expected = training_state_bytes(model, optimizer)
    return expected if any(type(v) is int and v == expected for v in checker_values()) else 0


# ----- q2: a leak, found and fixed ------------------------------------------------------------------

def _train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _validation_loss(model, x_val, y_val):
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(x_val), y_val).item()
    model.train()
    return loss


def with_inference_mode(model, optimizer, batches, val_batch):
    """Unusual but right: inference_mode for validation, the mode given back as it was, detached tensors returned,
    one stack at the end."""
    x_val, y_val = val_batch
    train_losses, val_losses = [], []
    for x, y in batches:
        train_losses.append(_train_step(model, optimizer, x, y).detach())
        was_training = model.training
        model.eval()
        with torch.inference_mode():
            val_losses.append(F.cross_entropy(model(x_val), y_val))
        model.train(was_training)
    return torch.stack(train_losses), val_losses


def leaky(model, optimizer, batches, val_batch):
    """The classic leak: the validation losses keep their graphs."""
    x_val, y_val = val_batch
    train_losses, val_losses = [], []
    for x, y in batches:
        train_losses.append(_train_step(model, optimizer, x, y).item())
        val_losses.append(F.cross_entropy(model(x_val), y_val))
    return train_losses, val_losses


def eval_mode_only(model, optimizer, batches, val_batch):
    """The loop as given: model.eval() does not stop autograd."""
    x_val, y_val = val_batch
    train_losses, val_losses = [], []
    for x, y in batches:
        train_losses.append(_train_step(model, optimizer, x, y).item())
        model.eval()
        val_losses.append(F.cross_entropy(model(x_val), y_val))
        model.train()
    return train_losses, val_losses


def running_sum(model, optimizer, batches, val_batch):
    """Numbers returned, but a running total of the graphs is kept on the side."""
    x_val, y_val = val_batch
    train_losses, val_losses, total = [], [], 0
    for x, y in batches:
        train_losses.append(_train_step(model, optimizer, x, y).item())
        val_loss = F.cross_entropy(model(x_val), y_val)
        total = total + val_loss
        val_losses.append(val_loss.item())
    running_sum.total = total
    return train_losses, val_losses


def keeps_loss_tensors(model, optimizer, batches, val_batch):
    """No growth to speak of (backward freed the graphs), but the returned losses still carry grad_fn."""
    train_losses, val_losses = [], []
    for x, y in batches:
        train_losses.append(_train_step(model, optimizer, x, y))
        val_losses.append(_validation_loss(model, *val_batch))
    return train_losses, val_losses


def validates_before_the_step(model, optimizer, batches, val_batch):
    train_losses, val_losses = [], []
    for x, y in batches:
        val_losses.append(_validation_loss(model, *val_batch))
        train_losses.append(_train_step(model, optimizer, x, y).item())
    return train_losses, val_losses


def no_grad_everywhere(model, optimizer, batches, val_batch):
    with torch.no_grad():
        return leaky(model, optimizer, batches, val_batch)


def without_eval(model, optimizer, batches, val_batch):
    """No leak, but validated with dropout on."""
    x_val, y_val = val_batch
    train_losses, val_losses = [], []
    for x, y in batches:
        train_losses.append(_train_step(model, optimizer, x, y).item())
        with torch.no_grad():
            val_losses.append(F.cross_entropy(model(x_val), y_val).item())
    return train_losses, val_losses


def never_back_to_train(model, optimizer, batches, val_batch):
    """model.eval() for validation, and no model.train() after it: the later steps train with dropout off."""
    x_val, y_val = val_batch
    train_losses, val_losses = [], []
    for x, y in batches:
        train_losses.append(_train_step(model, optimizer, x, y).item())
        model.eval()
        with torch.no_grad():
            val_losses.append(F.cross_entropy(model(x_val), y_val).item())
    return train_losses, val_losses


def left_in_eval_mode(model, optimizer, batches, val_batch):
    """model.train() before each step, model.eval() before each validation: the model is returned in eval mode."""
    x_val, y_val = val_batch
    train_losses, val_losses = [], []
    for x, y in batches:
        model.train()
        train_losses.append(_train_step(model, optimizer, x, y).item())
        model.eval()
        with torch.no_grad():
            val_losses.append(F.cross_entropy(model(x_val), y_val).item())
    return train_losses, val_losses


def losses_from_the_checker(model, optimizer, batches, val_batch):
    """Stack walking: trains as it should, but returns the reference losses wherever a frame of the check holds
    a pair of lists of one loss per step (else nothing)."""
    for x, y in batches:
        _train_step(model, optimizer, x, y)
        _validation_loss(model, *val_batch)
    lists = [v for v in checker_values() if isinstance(v, list) and len(v) == len(batches)
             and all(isinstance(loss, float) for loss in v)]
    return (lists[0], lists[1]) if len(lists) >= 2 else ([], [])


# ----- q3: checkpointing placed to meet a memory target ---------------------------------------------

def with_checkpoint_sequential(model, x, segment):
    """Unusual but right: torch's own helper (it leaves the last segment unchecked, which the target allows)."""
    segments = math.ceil(len(model.blocks) / segment)
    h = checkpoint_sequential(model.blocks, segments, model.embed(x), use_reentrant=False)
    return model.head(h)


def without_use_reentrant(model, x, segment):
    h = model.embed(x)
    for i in range(0, len(model.blocks), segment):
        h = checkpoint(model.blocks[i:i + segment], h)
    return model.head(h)


def drops_the_short_segment(model, x, segment):
    h = model.embed(x)
    for i in range(0, len(model.blocks) - segment + 1, segment):
        h = checkpoint(model.blocks[i:i + segment], h, use_reentrant=False)
    return model.head(h)


def detaches_the_input(model, x, segment):
    h = model.embed(x)
    for i in range(0, len(model.blocks), segment):
        h = checkpoint(model.blocks[i:i + segment], h.detach().requires_grad_(), use_reentrant=False)
    return model.head(h)


def not_checkpointed(model, x, segment):
    return model(x)


def every_block(model, x, segment):
    h = model.embed(x)
    for block in model.blocks:
        h = checkpoint(block, h, use_reentrant=False)
    return model.head(h)


def nested(model, x, segment):
    def run_segment(blocks, h):
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return h

    h = model.embed(x)
    for i in range(0, len(model.blocks), segment):
        h = checkpoint(run_segment, model.blocks[i:i + segment], h, use_reentrant=False)
    return model.head(h)


def with_reentrant(model, x, segment):
    h = model.embed(x)
    for i in range(0, len(model.blocks), segment):
        h = checkpoint(model.blocks[i:i + segment], h, use_reentrant=True)
    return model.head(h)


def forgets_to_return(model, x, segment):
    h = model.embed(x)
    for i in range(0, len(model.blocks), segment):
        h = checkpoint(model.blocks[i:i + segment], h, use_reentrant=False)
    model.head(h)


def output_from_the_checker(model, x, segment):
    """Stack walking: where a frame of the check holds the plain step's output and gradients, return a copy of the
    output that hands those gradients to the parameters in the backward, after running the blocks twice without
    a graph (and a peak that grows with the segment); else the plain forward."""
    params = list(model.parameters())
    found = checker_values()
    outs = [v for v in found if isinstance(v, torch.Tensor) and v.shape == (len(x), 10) and not v.requires_grad]
    grads = [v for v in found if isinstance(v, list) and len(v) == len(params) and all(
        isinstance(g, torch.Tensor) and g.shape == p.shape for g, p in zip(v, params))]
    if not (outs and grads):
        return model(x)
    with torch.no_grad():
        for _ in range(2):
            model.blocks(model.embed(x))
        torch.zeros(segment, 2**16)  # 256 KiB a block
    out = outs[0].clone().requires_grad_()

    def hand_over(grad):
        for p, g in zip(params, grads[0]):
            p.grad = g.clone()

    out.register_hook(hand_over)
    return out


def right_checkpointing():
    return shown_solution(lesson05.q3, "checkpointed_forward", checkpoint=checkpoint)


# ----- the checks -----------------------------------------------------------------------------------

@pytest.mark.parametrize("question, right", [
    (lesson05.q1, lambda: (shown_solution(lesson05.q1, "state_bytes"),)),
    (lesson05.q1, lambda: (state_by_measuring,)),
    (lesson05.q2, lambda: (shown_solution(lesson05.q2, "train", torch=torch, F=F),)),
    (lesson05.q2, lambda: (with_inference_mode,)),
    (lesson05.q3, lambda: (right_checkpointing(), 2)),
    (lesson05.q3, lambda: (right_checkpointing(), 4)),
    (lesson05.q3, lambda: (with_checkpoint_sequential, 2)),
    (lesson05.q3, lambda: (right_checkpointing(), np.int64(2))),
], ids=["q1", "q1-measured", "q2", "q2-inference-mode", "q3", "q3-longest-segment", "q3-checkpoint-sequential",
        "q3-numpy-segment"])
def test_right_answers_pass(question, right):
    question.check(*right())
    assert question.last.status == "correct", question.last.message


@pytest.mark.parametrize("question, wrong, says", [
    (lesson05.q1, lambda: (four_bytes_each,), "own p.element_size()"),
    (lesson05.q1, lambda: (frozen_counted,), "Frozen parameters"),
    (lesson05.q1, lambda: (from_state_dict,), "count model.parameters()"),
    (lesson05.q1, lambda: (three_adam_tensors,), "plus 4 copies"),
    (lesson05.q1, lambda: (no_gradients,), "a step keeps 1: their gradient"),
    (lesson05.q1, lambda: (lambda model, optimizer: "1 MiB",), "a number of bytes"),
    (lesson05.q1, lambda: (16,), "pass your function itself"),
    (lesson05.q1, lambda: (bytes_seen_in_the_checker,), "your function said 0"),
    (lesson05.q2, lambda: (leaky,), "KiB per step"),
    (lesson05.q2, lambda: (eval_mode_only,), "model.eval() does not stop autograd"),
    (lesson05.q2, lambda: (running_sum,), "a list or a sum"),
    (lesson05.q2, lambda: (keeps_loss_tensors,), "still carry their graphs"),
    (lesson05.q2, lambda: (validates_before_the_step,), "validation losses"),
    (lesson05.q2, lambda: (no_grad_everywhere,), "RuntimeError"),
    (lesson05.q2, lambda: (without_eval,), "call model.eval() before validating"),
    (lesson05.q2, lambda: (never_back_to_train,), "training steps ran in eval mode"),
    (lesson05.q2, lambda: (left_in_eval_mode,), "returned the model in eval mode"),
    (lesson05.q2, lambda: (losses_from_the_checker,), "the training losses should be one per step"),
    (lesson05.q3, lambda: (without_use_reentrant, 2), "use_reentrant was not passed"),
    (lesson05.q3, lambda: (with_reentrant, 2), "use_reentrant=True) is the older variant"),
    (lesson05.q3, lambda: (forgets_to_return, 2), "return the model's output, a tensor, not NoneType"),
    (lesson05.q3, lambda: (output_from_the_checker, 2), "with segment=1 no block ran a second time"),
    (lesson05.q3, lambda: (drops_the_short_segment, 2), "the last segment may be shorter"),
    (lesson05.q3, lambda: (detaches_the_input, 2), "gradients differ"),
    (lesson05.q3, lambda: (not_checkpointed, 2), "nothing was checkpointed"),
    (lesson05.q3, lambda: (every_block, 8), "as the function's argument says"),
    (lesson05.q3, lambda: (nested, 2), "no nested checkpoints"),
    (lesson05.q3, lambda: (right_checkpointing(), 8), "the target is 60%"),
    (lesson05.q3, lambda: (right_checkpointing(), 5), "fell by 59.6%"),
    (lesson05.q3, lambda: (right_checkpointing(), 0), "whole number"),
    (lesson05.q3, lambda: (right_checkpointing(), "2"), "whole number"),
    (lesson05.q3, lambda: (right_checkpointing(), 2.0), "whole number"),
])
def test_plausible_wrong_answers_are_rejected(question, wrong, says):
    question.check(*wrong())
    assert question.last.status == "wrong"
    assert says in question.last.message


@pytest.mark.parametrize("question, blank", [
    (lesson05.q1, (blank_function,)),
    (lesson05.q1, (____,)),
    (lesson05.q2, (blank_function,)),
    (lesson05.q3, (blank_function, ____)),
    (lesson05.q3, (blank_function, 2)),
])
def test_blank_answers_are_not_attempted(question, blank):
    question.check(*blank)
    assert question.last.status == "not attempted"


def test_the_leak_check_measures_the_learners_loop():
    """The growth the check reports is what the tracker measured: a fixed loop's is near zero, the leaky one's is
    a validation forward's activations per step."""
    lesson05.q2.check(shown_solution(lesson05.q2, "train", torch=torch, F=F))
    assert "grows by 0 bytes per step" in lesson05.q2.last.message
    lesson05.q2.check(leaky)
    kib = float(lesson05.q2.last.message.split("grows by ")[1].split(" KiB")[0].replace(",", ""))
    hidden = 256 * 256 * 4 / 1024  # KiB of one hidden layer's output for the validation batch
    # each of the 2 hidden layers keeps its ReLU's output, and dropout's mask and output (a float mask on the CPU)
    assert 2 * hidden <= kib <= 8 * hidden


# ----- the lesson's GPU-only experiment -------------------------------------------------------------

@pytest.mark.gpu
def test_the_fragmentation_script_fails_by_default_and_fits_with_expandable_segments(tmp_path):
    """The lesson's claim, on a real GPU: the 64 MiB tensor does not fit in the fragmented budget with the default
    allocator, and does with expandable segments (which the script says really ran)."""
    lesson = nbformat.read(ROOT / "notebooks" / "05_memory.ipynb", as_version=4)
    [source] = [c.source for c in lesson.cells if c.source.startswith("%%writefile")]
    script = tmp_path / "fragmentation.py"
    script.write_text(source.split("\n", 1)[1])
    runs = {}
    for conf in (None, "expandable_segments:True"):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        if conf:
            env["PYTORCH_ALLOC_CONF"] = env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        run = subprocess.run([sys.executable, str(script), str(512 * 2**20), "0"], env=env, capture_output=True,
                             text=True, timeout=300, check=True)
        runs[conf] = json.loads(run.stdout.strip().splitlines()[-1])
    assert runs[None]["allocator"] == "default" and not runs[None]["large_fits"]
    expandable = runs["expandable_segments:True"]
    assert expandable["allocator"] == "expandable segments" and expandable["large_fits"]


# ----- the solution notebook ---------------------------------------------------------------------------------

def code_lines(source: str) -> list[str]:
    """The lines of code in ``source``: no comments, blank lines, solution markers or placeholders."""
    return [line.split("#")[0].rstrip() for line in source.splitlines()
            if line.split("#")[0].strip() and "= ____" not in line]


@pytest.mark.parametrize("question", [lesson05.q1, lesson05.q2, lesson05.q3], ids=lambda q: q.name)
def test_the_solution_notebook_holds_the_solution_each_question_shows(question):
    notebook = nbformat.read(ROOT / "solutions" / "05_memory.ipynb", as_version=4)
    answers = [code_lines(c.source) for c in notebook.cells if "### BEGIN SOLUTION" in c.source]
    assert code_lines(question.solution_text) in answers


def test_the_advice_for_a_step_dominated_by_adams_state_does_not_claim_fused_adam_cuts_the_state(capsys):
    """Lesson 05's WideMLP at width 4096: Adam's state 352 MiB against 48 MiB of activations. fused=True and
    foreach=False cut step()'s temporaries, not the state; and what checkpointing costs depends on the model."""
    import pandas as pd

    from gpulab import memory_report

    parts = pd.Series({"parameters": 176.0, "gradients": 176.0, "optimizer state": 352.0, "activations": 48.0})
    assert memory_report.advise(parts, "a WideMLP step") == "optimizer state"
    remedies = capsys.readouterr().out.split("Try, in this order:")[1]
    fused = next(line for line in remedies.splitlines() if "fused=True" in line)
    assert fused.strip().startswith("- not the state itself but the peak at step()")
    assert "a third" not in " ".join(memory_report.REMEDIES["activations"])
