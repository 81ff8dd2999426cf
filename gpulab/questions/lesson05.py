"""Lesson 05, GPU memory: the bytes of a model's training state, a leak found by its growth per step, and
activation checkpointing placed to meet a memory target.

The checks measure on the CPU with ``gpulab.memory.MemoryTracker``, whose byte counts do not depend on the
hardware, so they hold whatever device the learner has. Each expected value is computed only once the learner's
function has returned, from objects of its own: an answer that looks through its callers' frames finds none."""

import operator
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..check import Question, Wrong
from ..memory import MemoryTracker
from ..models import ResidualMLP, SmallCNN, WideMLP, seeded

# ----- q1: the bytes of parameters, gradients and optimizer state -----------------------------------

STATE_TENSORS = {"sgd": 0, "momentum": 1, "adam": 2}  # optimizer state: tensors the size of each trained parameter


def training_state_bytes(model: nn.Module, optimizer: str) -> int:
    """Parameters, plus a gradient and the optimizer's state for every parameter that is trained."""
    params = list(model.parameters())  # each parameter once, even where layers share it
    weights = sum(p.numel() * p.element_size() for p in params)
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return weights + trained * (1 + STATE_TENSORS[optimizer])


def _tied() -> nn.Module:
    shared = nn.Linear(64, 64)
    return nn.Sequential(shared, nn.ReLU(), shared)  # one layer used twice: its weights exist once


def _frozen() -> nn.Module:
    model = WideMLP(in_features=64, width=128, depth=2, seed=1)
    model.net[1].requires_grad_(False)  # the first layer is frozen (fine-tuning the rest)
    return model


_STATE_CASES = [  # (what, model factory, optimizer)
    ("an MLP in float32", lambda: WideMLP(in_features=64, width=128, depth=2), "sgd"),
    ("an MLP in float32", lambda: WideMLP(in_features=64, width=128, depth=2), "momentum"),
    ("an MLP in float32", lambda: WideMLP(in_features=64, width=128, depth=2), "adam"),
    ("a CNN with BatchNorm (its running statistics are buffers, not parameters)", lambda: SmallCNN(width=8), "adam"),
    ("an MLP in bfloat16", lambda: WideMLP(in_features=64, width=128, depth=2).to(torch.bfloat16), "adam"),
    ("an MLP whose first layer is frozen", _frozen, "momentum"),
    ("a network that uses one layer twice", _tied, "adam"),
]


def _check_state_bytes(state_bytes) -> str:
    if not callable(state_bytes):
        raise Wrong("pass your function itself: `q1.check(state_bytes)`")
    answers = [state_bytes(make(), optimizer) for _, make, optimizer in _STATE_CASES]  # before any expected value exists
    for (what, make, optimizer), got in zip(_STATE_CASES, answers):
        if isinstance(got, bool) or not isinstance(got, (int, float)) and not hasattr(got, "__float__"):
            raise Wrong(f"state_bytes should return a number of bytes, got {type(got).__name__}")
        got, expected = float(got), training_state_bytes(make(), optimizer)
        if abs(got - expected) > 0.01 * expected:
            raise Wrong(f"for {what} with optimizer {optimizer!r}: {expected:,} bytes, your function said {got:,.0f}."
                        + _likely_mistake(make(), optimizer, got))
    return "parameters, gradients and optimizer state, byte for byte, for every dtype, frozen and shared layer."


def _likely_mistake(model: nn.Module, optimizer: str, got: float) -> str:
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    k = STATE_TENSORS[optimizer]
    close = lambda value: abs(got - value) <= 0.01 * value
    if any(p.element_size() != 4 for p in params) and close(sum(p.numel() for p in params) * 4 * (2 + k)):
        return " Every parameter at 4 bytes? Use each parameter's own p.element_size()."
    if trained < weights and close(weights * (2 + k)):
        return " Frozen parameters (requires_grad=False) get no gradient and no optimizer state."
    state_dict = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if close(state_dict + trained * (1 + k)) or close(state_dict * (2 + k)):
        return (" model.state_dict() also holds buffers (BatchNorm's running statistics) and lists a shared layer "
                "twice: count model.parameters().")
    extra = (got - weights) / trained
    if abs(extra - round(extra)) < 0.01:
        return (f" That is the parameters plus {round(extra)} copies of the trained parameters; a step keeps {1 + k}: "
                f"their gradient and {k} of optimizer state for {optimizer!r} (SGD none, momentum one, Adam two).")
    return ""


# ----- q2: a leak, found and fixed -----------------------------------------------------------------

LEAK_STEPS = 12
LEAK_LIMIT = 1024  # bytes per step: a number per step is nothing; a kept graph is a whole forward's activations
TRAIN_BATCH, VAL_BATCH = 64, 256
LEAK_SEED = 0  # the global random stream (dropout's) that the learner's run and the reference both start from


def _leak_setup():
    """A fresh model with dropout (so that its mode matters), its optimizer, the training batches and the
    validation batch."""
    with seeded(LEAK_SEED):
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 256), nn.ReLU(),
                              nn.Dropout(0.2), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(LEAK_SEED)
    batches = [(torch.randn(TRAIN_BATCH, 32, generator=gen), torch.randint(0, 10, (TRAIN_BATCH,), generator=gen))
               for _ in range(LEAK_STEPS)]
    val_batch = (torch.randn(VAL_BATCH, 32, generator=gen), torch.randint(0, 10, (VAL_BATCH,), generator=gen))
    return model, optimizer, batches, val_batch


def _reference_losses() -> tuple[list[float], list[float]]:
    """The losses of the right loop, on a model of its own: called only once the learner's loop has returned."""
    model, optimizer, batches, (x_val, y_val) = _leak_setup()
    train_losses, val_losses = [], []
    with seeded(LEAK_SEED):
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            train_losses.append(loss.item())
            model.eval()
            with torch.no_grad():
                val_losses.append(F.cross_entropy(model(x_val), y_val).item())
            model.train()
    return train_losses, val_losses


def growth_per_step(alive: list[int]) -> float:
    """Bytes alive after each step → their growth per step (least-squares slope), skipping the first step,
    which allocates what every step reuses (gradients, optimizer state)."""
    points = list(enumerate(alive))[1:]
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


def _check_train(train) -> str:
    if not callable(train):
        raise Wrong("pass your function itself: `q2.check(train)`")
    model, optimizer, batches, val_batch = _leak_setup()
    tracker, alive, modes = MemoryTracker(), [], []
    optimizer.register_step_post_hook(lambda *args: alive.append(tracker.current))
    model.register_forward_pre_hook(lambda module, args: modes.append((len(args[0]), module.training)))
    with seeded(LEAK_SEED), tracker:
        result = train(model, optimizer, batches, val_batch)
    if len(alive) != LEAK_STEPS:
        raise Wrong(f"train should call optimizer.step() once per batch: {len(alive)} calls for {LEAK_STEPS} batches")
    growth = growth_per_step(alive)
    if growth > LEAK_LIMIT:
        raise Wrong(f"memory still grows by {growth / 1024:,.0f} KiB per step: something keeps a graph alive every step "
                    "(a loss with a grad_fn, in a list or a sum). A loss that is never backpropagated keeps all the "
                    "activations of its forward; model.eval() does not stop autograd, torch.no_grad() does.")
    _judge_modes(modes, model.training)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise Wrong("train should return two lists: (train_losses, val_losses)")
    for what, losses, right in zip(("training", "validation"), result, _reference_losses()):
        values = _numbers(losses, what)
        if len(values) != LEAK_STEPS or any(abs(a - b) > 1e-4 * max(1.0, abs(b)) for a, b in zip(values, right)):
            raise Wrong(f"the {what} losses should be one per step, measured as in the loop you were given (the "
                        f"validation loss after each step): first {right[0]:.4f}, last {right[-1]:.4f}; yours: "
                        f"{', '.join(f'{v:.4f}' for v in values[:3])}{' ...' if len(values) > 3 else ''}")
    return (f"memory grows by {growth:,.0f} bytes per step (the leaky loop kept a whole validation forward per step), "
            "validation ran in eval mode and training in train mode, and the losses are right.")


def _judge_modes(modes: list[tuple[int, bool]], training_at_the_end: bool) -> None:
    """Raise Wrong unless validation ran in eval mode, training in train mode, and the model was left training."""
    if any(size == VAL_BATCH and training for size, training in modes):
        raise Wrong("the validation forward ran in training mode, with dropout on: call model.eval() before "
                    "validating, and model.train() after, as the loop you were given does")
    if any(size == TRAIN_BATCH and not training for size, training in modes):
        raise Wrong("training steps ran in eval mode, with dropout off: call model.train() after each validation, as "
                    "the loop you were given does")
    if not training_at_the_end:
        raise Wrong("train returned the model in eval mode: call model.train() after the last validation too, so "
                    "that whoever trains it next trains with dropout on")


def _numbers(losses, what: str) -> list[float]:
    if isinstance(losses, torch.Tensor):
        losses = losses.detach().flatten()
    try:
        values = list(losses)
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            raise Wrong(f"the {what} losses you return still carry their graphs: return loss.item() or loss.detach()")
        return [float(v) for v in values]
    except (TypeError, ValueError, RuntimeError):
        raise Wrong(f"the {what} losses should be a list of numbers (loss.item()) or of detached tensors") from None


# ----- q3: checkpointing placed to meet a memory target ---------------------------------------------

TARGET_CUT = 0.6  # the checkpointed step's peak must be at most 40% of the plain step's
DEPTH = 16


def _ckpt_setup():
    model = ResidualMLP(in_features=32, width=32, depth=DEPTH, seed=5)
    gen = torch.Generator().manual_seed(5)
    return model, torch.randn(256, 32, generator=gen), torch.randint(0, 10, (256,), generator=gen)


class _Step(NamedTuple):
    """What one training step of the question's model did."""

    peak: int  # bytes
    grads: list
    out: torch.Tensor
    calls: int  # block forwards, recomputations included
    reentrant: bool  # a checkpoint(..., use_reentrant=True) in the graph
    warned: bool  # torch warned that use_reentrant was not passed


def _step(forward) -> _Step:
    """A training step of a fresh copy of the question's model, with the output ``forward(model, x)``."""
    model, x, y = _ckpt_setup()
    calls = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *args: calls.append(1))
    with warnings.catch_warnings(record=True) as caught, MemoryTracker() as tracker:
        warnings.simplefilter("always")
        out = forward(model, x)
        if not isinstance(out, torch.Tensor):
            raise Wrong(f"checkpointed_forward should return the model's output, a tensor, not {type(out).__name__}")
        reentrant = _reentrant(out)
        F.cross_entropy(out, y).backward()
    return _Step(tracker.peak, [p.grad for p in model.parameters()], out.detach(), len(calls), reentrant,
                 any("use_reentrant" in str(w.message) for w in caught))


def _reentrant(out: torch.Tensor) -> bool:
    """Whether the graph that made ``out`` holds a reentrant checkpoint (its CheckpointFunction)."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if node.name() == "CheckpointFunctionBackward":
            return True
        seen.add(node)
        todo += [parent for parent, _ in node.next_functions]
    return False


def _check_checkpointing(checkpointed_forward, segment) -> str:
    if not callable(checkpointed_forward):
        raise Wrong("pass your function and your segment length: `q3.check(checkpointed_forward, segment)`")
    if isinstance(segment, bool) or not hasattr(segment, "__index__") or not 1 <= operator.index(segment) <= DEPTH:
        raise Wrong(f"segment should be a whole number of blocks from 1 to {DEPTH}, got {segment!r}")
    segment = operator.index(segment)  # numpy's integers too
    lengths = sorted({1, 3, DEPTH // 2, segment})  # 3 leaves a shorter last segment
    steps = {n: _step(lambda model, x, n=n: checkpointed_forward(model, x, n)) for n in lengths}
    plain = _step(lambda model, x: model(x))  # the reference, made only once the learner's code has returned
    for length, step in steps.items():
        _judge_step(length, step, plain)
    if steps[1].peak >= steps[DEPTH // 2].peak:
        raise Wrong(f"segments of 1 block did not give a lower peak than segments of {DEPTH // 2}: checkpoint the "
                    "blocks `segment` at a time, as the function's argument says")
    cut = 1 - steps[segment].peak / plain.peak
    if cut < TARGET_CUT:
        raise Wrong(f"with segments of {_blocks(segment)} the step's peak memory fell by {cut:.1%}, the target is "
                    f"{TARGET_CUT:.0%}: a segment keeps all of its blocks' activations during its backward")
    return f"segments of {_blocks(segment)}: the step's peak memory fell by {cut:.0%} (target {TARGET_CUT:.0%})."


def _judge_step(length: int, step: _Step, plain: _Step) -> None:
    """Raise Wrong unless the step with segments of ``length`` checkpointed, once, and computed what ``plain`` did."""
    if step.warned:
        raise Wrong("torch warned that use_reentrant was not passed: always pass it, "
                    "checkpoint(..., use_reentrant=False)")
    if step.reentrant:
        raise Wrong("checkpoint(..., use_reentrant=True) is the older variant, which torch recommends against: it gives "
                    "a segment no gradients when none of its inputs requires grad, and works with backward() only, "
                    "not torch.autograd.grad. Pass use_reentrant=False, as the lesson does")
    if not torch.allclose(step.out, plain.out, atol=1e-5):
        raise Wrong(f"with segment={length} the output differs from model(x): run every block, in order "
                    f"({DEPTH} blocks; the last segment may be shorter)")
    if any(g is None for g in step.grads) or not all(torch.allclose(g, e, atol=1e-5)
                                                     for g, e in zip(step.grads, plain.grads)):
        raise Wrong(f"with segment={length} the gradients differ from the plain model's: checkpoint keeps gradients "
                    "flowing (no detach(), no torch.no_grad())")
    if step.calls > 2 * DEPTH:
        raise Wrong(f"with segment={length} the blocks ran {step.calls} times for {DEPTH} blocks: each should run once "
                    "forward and at most once more in the backward (no nested checkpoints)")
    if step.calls == DEPTH:
        raise Wrong(f"with segment={length} no block ran a second time: nothing was checkpointed")


def _blocks(n: int) -> str:
    return f"{n} block" + ("s" if n != 1 else "")


q1 = Question(
    lesson="05", number=1, title="the bytes of the training state",
    checker=_check_state_bytes,
    hint_text="Walk over `model.parameters()` (each parameter once): a parameter takes `p.numel() * p.element_size()` "
              "bytes. Only parameters with `p.requires_grad` get a gradient of the same size, and optimizer state: "
              "none for SGD, one tensor for momentum, two for Adam.",
    solution_text="""
def state_bytes(model, optimizer):
    per_parameter = {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]
    total = 0
    for p in model.parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes                                   # the parameter
        if p.requires_grad:
            total += nbytes * (1 + per_parameter)         # its gradient and its optimizer state
    return total
""",
)

q2 = Question(
    lesson="05", number=2, title="find and fix the leak",
    checker=_check_train,
    hint_text="backward() frees what a loss's graph saved; a loss that is never backpropagated keeps it for as long "
              "as you keep the loss. Evaluate under `torch.no_grad()`: `model.eval()` turns dropout off but does not "
              "stop autograd, so keep it, and `model.train()` after. Keep `loss.item()` or `loss.detach()`.",
    solution_text="""
def train(model, optimizer, batches, val_batch):
    x_val, y_val = val_batch
    train_losses, val_losses = [], []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_losses.append(loss.item())
        model.eval()                              # dropout off for validation
        with torch.no_grad():                     # no graph: nothing is saved for a backward that never comes
            val_losses.append(F.cross_entropy(model(x_val), y_val).item())
        model.train()                             # and on again for the next step
    return train_losses, val_losses
""",
)

q3 = Question(
    lesson="05", number=3, title="place the checkpoints",
    checker=_check_checkpointing,
    hint_text="`h = model.embed(x)`, then for `i in range(0, len(model.blocks), segment)`: "
              "`h = checkpoint(model.blocks[i:i + segment], h, use_reentrant=False)`, then `model.head(h)`. "
              "During the backward a segment's activations all come back at once: shorter segments, lower peak.",
    solution_text="""
def checkpointed_forward(model, x, segment):
    h = model.embed(x)
    for i in range(0, len(model.blocks), segment):
        h = checkpoint(model.blocks[i:i + segment], h, use_reentrant=False)
    return model.head(h)

segment = 2   # any length from 1 to 4 cuts this model's peak by at least 60%
""",
)
