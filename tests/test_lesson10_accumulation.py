"""Lesson 10's training steps (the waterfall: lesson 09's section 4 until lesson 09 was split) accumulate gradients
into stable ``.grad`` buffers, zeroed in place, in every configuration of the waterfall: the recipe torch gives for
gradient accumulation with CUDA graphs. The 2026-11-28 H200 run crashed at the "CUDA graphs" step
(``torch.compile(mode="reduce-overhead")``, 8 micro-batches a step): "accessing tensor output of CUDAGraphs that
has been overwritten by a subsequent run".

What a CPU can show runs here: the buffers are the same tensors at every micro-batch and step, zeroed in place at
each step's start; the gradients and the training are bit for bit those of ``zero_grad(set_to_none=True)``; and with
reduce-overhead's output reuse played on the CPU (``ReplayedGraphs``: the mechanism, never a CUDA graph), every
micro-batch and accumulation count the path can reach trains as the eager step does. Capturing and replaying the
graphs, and torch's freeing of a generation's outputs, need a GPU (the GPU-only list in the report and
``tests/test_gpu_only_surface.py``)."""

import itertools

import pytest
import torch
from torch._dynamo.utils import counters

from gpulab import plans, text

from . import test_lesson10_gpu_path as gpu_path
from .test_lesson10_gpu_path import define, run
from .test_plans import CARDS

lesson, waterfall = gpu_path.lesson, gpu_path.waterfall  # the lesson's fixtures, by name in the tests below

STEPS_RUN = 3  # optimizer steps per run: the first made the buffers, the next two reuse them


class _StaticGradient(torch.autograd.Function):
    """A parameter as a compiled graph sees it: its gradient comes back in ``buffer``, which every backward writes
    again (a replayed graph's output lives at the same address each replay)."""

    @staticmethod
    def forward(ctx, parameter, buffer):
        ctx.buffer = buffer
        return parameter.view_as(parameter)

    @staticmethod
    def backward(ctx, grad):
        ctx.buffer.copy_(grad)
        return ctx.buffer, None


class ReplayedGraphs:
    """``torch.compile(mode="reduce-overhead")``'s output reuse, played on the CPU. The backward's gradients come back
    in one static buffer per parameter, marked as CUDA graph trees mark their outputs (``torch._C._add_cached_tensor``
    in torch/_inductor/cudagraph_trees.py, ``CUDAGraphNode._initialize_cached_tensors``), so that autograd's
    AccumulateGrad may keep one as ``.grad`` when ``.grad`` is None (accumulate_grad.h, Case 1.1, which counts the
    cache's reference out). ``torch.compiler.cudagraph_mark_step_begin()`` starts a new generation, whose replay takes
    that memory back (``dealloc_current_path_weakrefs`` frees it; here it is filled with NaN, then overwritten by the
    next backward). Nothing is captured: this proves how the lesson's loop uses the outputs, never the graphs."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []  # every compiled model's, for mark_step_begin

    def compile(self, model, mode=None, **options):
        if mode != "reduce-overhead":
            return model
        buffers = {name: self._buffer(p) for name, p in model.named_parameters()}

        def forward(*args):
            params = {name: _StaticGradient.apply(p, buffers[name]) for name, p in model.named_parameters()}
            return torch.func.functional_call(model, params, args)
        return forward

    def _buffer(self, parameter):
        buffer = torch.empty_like(parameter)
        torch._C._add_cached_tensor(buffer)
        self.buffers.append(buffer)
        return buffer

    def mark_step_begin(self):
        for buffer in self.buffers:
            buffer.fill_(float("nan"))  # the previous generation's outputs are gone


@pytest.fixture
def replayed(monkeypatch):
    graphs = ReplayedGraphs()
    monkeypatch.setattr(torch, "compile", graphs.compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", graphs.mark_step_begin)
    torch._C._set_cached_tensors_enabled(True)
    yield graphs
    for buffer in graphs.buffers:
        torch._C._remove_cached_tensor(buffer)
    torch._C._set_cached_tensors_enabled(False)


def trained(waterfall, options, steps=STEPS_RUN):
    """``run_steps(options)`` for ``steps`` steps: (model, losses); the model's ``.grad`` holds the last step's."""
    run_steps, losses = waterfall["run_steps"](options), []
    for _ in range(steps):
        model, loss = next(run_steps)
        losses.append(loss)
    return model, torch.stack(losses)


def set_to_none_reference(waterfall, options, steps=STEPS_RUN):
    """The same training written with ``zero_grad(set_to_none=True)`` (the lesson before the fix, eager)."""
    o = {**waterfall["STEP_BASE"], **options}
    model = waterfall["GPT"](waterfall["GPTConfig"](**waterfall["SIZE"]), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=waterfall["LR"])
    data, losses = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(o["accum"]):
            x, y = text.batch(waterfall["train_tokens"], o["micro"], waterfall["cfg"].seq_len, data, "cpu")
            loss = model(x, y) / o["accum"]
            loss.backward()
            step_loss = step_loss + loss.detach()
        optimizer.step()
        losses.append(step_loss)
    return model, torch.stack(losses)


def test_every_micro_batch_and_step_accumulates_into_the_same_grad_tensors_zeroed_in_place(waterfall, monkeypatch):
    """At each micro-batch the parameters' ``.grad`` are the tensors made before training: zero at the first
    micro-batch of each step, holding the sum so far at the others. Before the fix they were None at each step's start
    (set_to_none), so a CUDA graph's output became ``.grad``."""
    made, seen = [], []

    class Recorded(waterfall["GPT"]):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    real_batch = text.batch

    def batch(*args, **kwargs):
        grads = [p.grad for p in made[-1].parameters()]
        seen.append(([id(g) for g in grads], all(g is not None and not g.any() for g in grads)))
        return real_batch(*args, **kwargs)

    waterfall["GPT"] = Recorded
    monkeypatch.setattr(text, "batch", batch)
    accum = waterfall["STEP_BASE"]["accum"]
    model, _ = trained(waterfall, {})
    assert accum > 1 and len(seen) == STEPS_RUN * accum
    buffers = [id(p.grad) for p in model.parameters()]
    assert all(ids == buffers for ids, _ in seen), "a .grad tensor was replaced between micro-batches or steps"
    assert [zero for _, zero in seen] == [i % accum == 0 for i in range(len(seen))]


def test_the_gradients_and_the_training_are_bit_for_bit_those_of_set_to_none(waterfall):
    """Zero plus a gradient is that gradient: the loss gap between two configurations is unchanged by the recipe."""
    model, losses = trained(waterfall, {})
    reference, reference_losses = set_to_none_reference(waterfall, {})
    assert torch.equal(losses, reference_losses)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, "the last step's gradients were not kept in .grad"
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def reachable_batches(waterfall) -> set:
    """Every (micro-batch, accumulation steps) the CUDA graphs step can be raced with: the lesson's STEPS and
    STEP_BASE as each card's plan (the six cards learners bring, in full mode) and quick mode size them, walked over
    every subset of the steps before it that a run can keep."""
    found = set()
    cards = [plans.Card.named(name) for name in CARDS]
    for plan in [plans.plan_for("10", card) for card in cards] + [plans.plan_for("10", cards[0], quick=True)]:
        scope = {name: waterfall[name] for name in ("cfg", "info", "amp_dtype")}
        scope.update(on_gpu=True, quick_mode=lambda quick=plan.quick: quick, per_token=1.0, WATERFALL=plan.waterfall)
        define(scope, "def run_steps", "STEP_BASE")
        define(scope, "cpu_quick = ", "cpu_quick", "larger", "STEPS")
        steps = [options for _, options, _ in scope["STEPS"]]
        graphs = next(i for i, (_, options, _) in enumerate(scope["STEPS"]) if options.get("compile") == "reduce-overhead")
        for kept in itertools.chain.from_iterable(itertools.combinations(steps[:graphs], k) for k in range(graphs + 1)):
            o = {**scope["STEP_BASE"]}
            for options in kept:
                o |= options
            found.add((o["micro"], o["accum"]))
    return found


def test_with_cuda_graphs_output_reuse_every_batch_the_path_can_reach_trains_as_the_eager_step(waterfall, replayed):
    """The waterfall walked over every subset of kept steps before "CUDA graphs": its micro-batch and accumulation
    are STEP_BASE's or the larger micro-batch's, as each card's plan sizes them (an H100's and an H200's 4 × 8, 16 × 2:
    the H200's crash; a T4's 2 × 8, 8 × 2) and in quick mode (1 × 4; 4 × 1, which hid the crash on 2026-11-27). Each,
    with every earlier switch on, trains with reduce-overhead's output reuse exactly as the eager step; before the fix
    only 4 × 1 did."""
    batches = reachable_batches(waterfall)
    assert {(4, 8), (16, 2), (2, 8), (8, 2), (1, 4), (4, 1)} <= batches, batches
    every_switch = {"amp": True, "attention": "sdpa", "padded_vocab": 320, "fused": True}
    differs = []
    for micro, accum in batches:
        options = {**every_switch, "micro": micro, "accum": accum}
        eager_model, eager = trained(waterfall, options, steps=2)
        graphs_model, graphs = trained(waterfall, {**options, "compile": "reduce-overhead"}, steps=2)
        same = torch.equal(eager, graphs) and all(
            torch.equal(p, q) for p, q in zip(eager_model.parameters(), graphs_model.parameters(), strict=True))
        if not same:
            differs.append(f"{micro} × {accum}: losses {eager.tolist()} eager, {graphs.tolist()} with the graphs' reuse")
    assert replayed.buffers, "the compiled forward never ran"
    assert not differs, differs


def graph_pool_bytes() -> int:
    """Bytes in the CUDA allocator's segments outside its default pool (0, 0): the private pools CUDA graphs record in
    (``torch.cuda.memory_snapshot()``'s ``segment_pool_id``)."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0))


@pytest.mark.gpu
def test_on_a_gpu_reduce_overhead_adds_every_micro_batch_into_the_same_grad_tensors(monkeypatch, results_dir):
    """What no CPU can show, for the next GPU run: CUDA graph trees record and replay the compiled forward and backward
    for each of 4 micro-batches a step (quick sizes), and every replay's gradients add up into the ``.grad`` tensors
    made before training, with no "overwritten by a subsequent run" (the H200 raised it on 2026-11-28); the training
    stays within the waterfall's loss gap of the eager step's. It fails where the step ran without graphs (inductor's
    ``cudagraph_skips`` counter, bumped by torch/_inductor/cudagraph_utils.py's ``log_cudagraph_skip_and_bump_counter``,
    or no private pool): a step that skipped them would prove nothing."""
    monkeypatch.setenv("GPULAB_QUICK", "1")
    scope = {"__name__": "__main__", "device": torch.device("cuda"), "gpulab": gpu_path.gpulab,
             "display": lambda *args: None}
    before = torch.get_float32_matmul_precision()
    try:
        run(scope, 'plans.lesson("10")', "import itertools")
        scope["train_tokens"], _ = text.split(text.python_source(max_bytes=200_000))
        scope.update(cfg=scope["GPTConfig"](**scope["SIZE"]), per_token=1.0)
        run(scope, "def run_steps")
        options = {"amp": True, "attention": "sdpa", "micro": 1, "accum": 4}
        eager = scope["run_steps"](options)
        eager_losses = torch.stack([next(eager)[1] for _ in range(4)]).float().cpu()
        counters.clear()
        graphs = scope["run_steps"]({**options, "compile": "reduce-overhead"})
        model, first = next(graphs)
        buffers = [p.grad for p in model.parameters()]
        graph_losses = torch.stack([first, *(next(graphs)[1] for _ in range(3))]).float().cpu()
        assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled step ran without CUDA graphs"
        assert graph_pool_bytes() > 0, "no CUDA graph was recorded"
        assert all(p.grad is buffer for p, buffer in zip(model.parameters(), buffers, strict=True))
        assert (graph_losses - eager_losses).abs().max() <= max(0.05, 0.02 * graph_losses[-1].abs())
    finally:
        torch.set_float32_matmul_precision(before)
        torch._dynamo.reset()


def test_a_t4s_fp16_step_scales_its_loss_and_trains_with_cuda_graphs_output_reuse_as_the_eager_step(
        waterfall, replayed, monkeypatch):
    """A T4 has no native bf16: autocast runs fp16 and a GradScaler scales the loss, unscales the gradients in the
    kept .grad buffers and steps (torch/amp/grad_scaler.py). At the T4's planned batches, with every earlier switch on,
    the CUDA graphs step with reduce-overhead's output reuse trains as the eager step, the scaler enabled in both."""
    scalers = []

    class Recorded(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            scalers.append(self)

    monkeypatch.setattr(torch.amp, "GradScaler", Recorded)
    waterfall["amp_dtype"] = torch.float16
    w = plans.plan_for("10", plans.Card.named("Tesla T4")).waterfall
    for micro, accum in ((w["micro"], w["accum"]), (4 * w["micro"], w["accum"] // 4)):
        options = {"amp": True, "attention": "sdpa", "padded_vocab": 320, "fused": True, "micro": micro, "accum": accum}
        eager_model, eager = trained(waterfall, options, steps=2)
        graphs_model, graphs = trained(waterfall, {**options, "compile": "reduce-overhead"}, steps=2)
        assert torch.equal(eager, graphs) and torch.isfinite(eager).all(), (micro, accum)
        assert all(torch.equal(p, q) for p, q in zip(eager_model.parameters(), graphs_model.parameters(), strict=True))
    assert len(scalers) == 4 and all(s.is_enabled() and s.get_scale() > 1 for s in scalers)
