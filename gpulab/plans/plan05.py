"""Lesson 05's plan: every experiment sized from the card's memory with the lesson's own byte accounting, the
checkpointed model from the card's rates.

Every byte an experiment holds is predicted here as section 1 predicts a step on paper: parameters, gradients, Adam's
two moments, and the activations each layer saves for the backward (a ``ResidualBlock`` saves ten of its width per
sample: its input, LayerNorm's output, the wide layer's output before and after GELU, and LayerNorm's two statistics;
tests/test_lesson05_plan.py measures them with ``gpulab.memory.MemoryTracker`` on the meta device). What stays alive
from section 4 on (the checkpointed model with its Adam state and batch, the leak's model, the OOM demo's model) is
counted under every later experiment, and the fragmentation script's process beside it. So each experiment fits the
card with a margin, the OOM demo's cap (``torch.cuda.set_per_process_memory_fraction``) leaves the rest of the card to
others, and checkpointing's cut of the step's peak is not hidden by ``optimizer.step()``'s temporaries (foreach Adam
keeps one model-sized list of them on a GPU: a model too large for its batch shows the optimizer's peak, not the
activations'). The checkpointed model is the smallest of ``CHECKPOINTED`` whose step is the card's arithmetic rather
than its launches and checkpoint calls, so that what checkpointing costs there is the recomputation. Quick mode keeps
its small fixed sizes; the precision of the autocast remedy (bf16, or fp16 with a GradScaler) follows the card in both
modes.
"""

import functools
import math

import torch
import torch.nn.functional as F

from .. import models
from ..memory import MemoryTracker
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .predict import compare_s, step_launches

TITLE = "GPU memory: where it goes, how to see it, how to make a model fit"
FEATURES = ("bf16",)
QUICK = dict(width=512, batch_size=64, compare_min_time=0.5, block_mib=256, cnn_width=8,
             activation_batches=[8, 16, 32, 64], mlp_width=64, mlp_depth=8, ckpt_batch=256, ckpt_k=[1, 2, 4, 8],
             leak_steps=20, leak_width=256, val_batch=256, oom_mib=64, fragmentation_mib=512)

IMAGE = 3 * 32 * 32  # the images' features (WideMLP, SmallCNN, the OOM demo's ResidualMLP flatten them)
CLASSES = 10
WIDTHS = (4096, 2048, 1024)  # section 1's WideMLP, widest first
DEPTH = 3  # section 1's WideMLP: three hidden layers
CNN_WIDTHS = (32, 16, 8)  # section 3's SmallCNN, widest first
ACTIVATION_BATCHES = [64, 128, 256, 512, 1024]  # section 3's sweep
BLOCKS_MIB = (1024, 512, 256)  # section 2's block
# Section 4's ResidualMLP (also sections 3, 7 and 9) and its batch, least work first: the first that shows what
# checkpointing costs (its step the card's arithmetic) is taken. The batch is at least 16 widths: the activations,
# not the weights and the optimizer's temporaries, fill the step.
CHECKPOINTED = ((256, 4096), (256, 8192), (512, 8192), (512, 16384), (1024, 16384))
CKPT_DEPTH = 16
LEAK_WIDTHS, LEAK_STEPS, VAL_BATCH = (2048, 1024, 512), 60, 1024
OOM_MIB = (1024, 512, 256)
FRAGMENTATION_MIB = (2048, 1024, 512)
MEMORY_SHARE = 8  # an experiment that is not the lesson's largest takes at most this fraction of the usable memory
CUT = 0.4  # checkpointing one block at a time cuts the step's peak by at least this much
ARITHMETIC = 2.0  # the checkpointed step's kernels outlast its CPU time (launches, checkpoint calls) this many times
CONTEXT_GB = 0.78  # the memory a process holds outside PyTorch's allocator (its CUDA context): the H200 printed 742 MiB
# for this lesson's process (2026-11-28, quick mode); the fragmentation script's process holds as much
# Bytes a ResidualBlock's LayerNorm, GELU and residual add read and write per sample, forward and backward, in widths
# of float32: about 40 passes over its width (estimate); Adam reads and writes about 10 model-sized tensors
ELEMENTWISE_WIDTHS, ADAM_PASSES = 40, 10
# One checkpoint call's bookkeeping on the CPU (saving the RNG state, a hook per saved tensor, the recomputation
# started from Python): the 2026-11-27 H200 quick run's 8 segments took 5.7 ms a step more than 1 (0.8 ms a call,
# its host shared by eight lessons at once: an upper estimate)
CHECKPOINT_CALL_S = 0.8e-3
START_S = 10.0  # imports, device facts, NVML (estimate)
SMALL_PARTS_S = 8.0  # sections 1-3: a few steps and forwards of small models, their tables (estimate)
SNAPSHOT_S = 3.0  # recording three steps' history and writing the snapshot with Python stacks (estimate)
TRACKER_OP_S = 50e-6  # an operator under the tracker's Python dispatch mode (estimate)
PROCESS_S = 8.0  # a fresh Python process that imports torch and starts CUDA (estimate)
FIGURES_S = 10.0  # tables and figures (estimate)


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    amp = card.amp_precision if card.is_gpu else "bf16"  # a CPU's autocast runs bf16
    if quick:
        return LessonPlan("05", TITLE, card, True, dict(QUICK, amp_precision=amp), features=FEATURES)
    usable = card.usable_gb() * 1e9
    share = usable / MEMORY_SHARE
    width = next((w for w in WIDTHS if wide_step_bytes(w, 1024) <= share), WIDTHS[-1])
    cnn_width = next((w for w in CNN_WIDTHS if cnn_forward_bytes(w, ACTIVATION_BATCHES[-1]) <= share), CNN_WIDTHS[-1])
    leak_width = next((w for w in LEAK_WIDTHS if LEAK_STEPS * leak_bytes(w, VAL_BATCH) <= share), LEAK_WIDTHS[-1])
    sizes = dict(width=width, batch_size=1024, compare_min_time=1.0,
                 block_mib=next((m for m in BLOCKS_MIB if m * 2**20 <= share / 2), BLOCKS_MIB[-1]),
                 cnn_width=cnn_width, activation_batches=ACTIVATION_BATCHES, mlp_width=0, mlp_depth=CKPT_DEPTH,
                 ckpt_batch=0, ckpt_k=[1, 2, 4, 8, 16], leak_steps=LEAK_STEPS, leak_width=leak_width,
                 val_batch=VAL_BATCH, oom_mib=next((m for m in OOM_MIB if m * 2**20 <= share), OOM_MIB[-1]),
                 fragmentation_mib=0, amp_precision=amp)
    candidates = [_full(card, sizes, w, b) for w, b in CHECKPOINTED]
    return next((c for c in candidates if c.memory_gb <= card.usable_gb() and c.minutes <= c.target_minutes
                 and all(r.holds for r in c.regimes)), candidates[-1])


def _full(card: Card, common: dict, mlp_width: int, ckpt_batch: int) -> LessonPlan:
    sizes = dict(common, mlp_width=mlp_width, ckpt_batch=ckpt_batch)
    room = card.usable_gb() * 1e9 - kept_bytes(sizes) - 2 * CONTEXT_GB * 1e9  # the lesson's and the script's
    sizes["fragmentation_mib"] = next((m for m in FRAGMENTATION_MIB if m * 2**20 <= room / 2), FRAGMENTATION_MIB[-1])
    memory = lesson_bytes(sizes, gpu=card.is_gpu) / 1e9
    parts = lesson_parts(card, sizes)
    why = {"width": f"the widest of {', '.join(map(str, WIDTHS))} whose Adam step (with autocast's copies) takes at "
                    f"most 1/{MEMORY_SHARE} of the usable memory",
           "block_mib": "the largest of 1024, 512, 256 MiB within a sixteenth of the usable memory",
           "cnn_width": f"the widest SmallCNN whose activations at batch {ACTIVATION_BATCHES[-1]} take at most "
                        f"1/{MEMORY_SHARE} of the usable memory",
           "mlp_width": f"the least work of {len(CHECKPOINTED)} (width, batch) pairs whose checkpointed step is this "
                        "card's arithmetic, not its launches, and fits its memory and minutes",
           "ckpt_batch": f"{ckpt_batch // mlp_width} times the width: activations, not weights, fill the step",
           "leak_width": f"the widest whose {LEAK_STEPS} kept validation graphs take at most 1/{MEMORY_SHARE} of the "
                         f"usable memory (each {leak_bytes(sizes['leak_width'], VAL_BATCH) / 2**20:.1f} MiB: at the "
                         f"narrowest, {leak_bytes(LEAK_WIDTHS[-1], VAL_BATCH) / 2**20:.1f} MiB, still far above the "
                         "allocator's rounding)",
           "oom_mib": f"the largest of 1024, 512, 256 MiB within 1/{MEMORY_SHARE} of the usable memory: the demo's "
                      "cap is what the process holds plus this",
           "fragmentation_mib": "the largest of 2048, 1024, 512 MiB within half of what the lesson's process and the "
                                "script's (each with its CUDA context) leave of the usable memory",
           "amp_precision": "native bf16" if sizes["amp_precision"] == "bf16" else
                            "no native bf16: fp16 autocast, with a GradScaler"}
    return LessonPlan("05", TITLE, card, False, sizes, why, parts, memory, regimes(card, sizes),
                      target_minutes(card), FEATURES)


# ---- bytes, predicted as section 1 predicts them ------------------------------------------------------------------

def residual_params(width: int, depth: int, in_features: int) -> int:
    """A ResidualMLP's parameters: the embedding, ``depth`` blocks (LayerNorm, width → 4·width → width) and the head."""
    block = 2 * width + (width * 4 * width + 4 * width) + (4 * width * width + width)
    return in_features * width + width + depth * block + width * CLASSES + CLASSES


def residual_saved(width: int, depth: int) -> int:
    """Bytes a ResidualMLP's forward saves for the backward, per sample (float32): each block ten of its width and
    LayerNorm's two statistics, the head's input and cross_entropy's log-softmax."""
    return 4 * (depth * (10 * width + 2) + width + CLASSES)


TRANSIENT_WIDTHS = 12  # gradients of a block's activations alive at once in its backward, in widths, per sample
SMALL = 2**16  # scalars and small tensors alive beside them (the loss, bias gradients in flight), bytes at most


def residual_peak(width: int, depth: int, batch: int, k: int | None, *, gpu: bool) -> tuple[float, float]:
    """Bounds on the peak bytes of one training step of section 4's model (in_features = width) above its weights and
    Adam's state, with its blocks checkpointed ``k`` at a time (None: not at all): (lower, upper). The forward keeps
    everything it saves (no checkpointing) or each segment's input, and the backward brings back one segment at a
    time; the gradients arrive during the backward; on a GPU, foreach Adam's ``step()`` keeps a model-sized list of
    temporaries beside the gradients (torch/optim/adam.py, ``_multi_tensor_adam``: ``exp_avg_sq_sqrt``, 2.6-2.14), on a
    CPU Adam's loop a parameter's (``_single_tensor_adam``: ``denom``)."""
    grads = 4 * residual_params(width, depth, width)
    largest = 4 * 4 * width * width  # a block's wide weight, in bytes
    update = (2 * grads + largest if gpu else grads + 2 * largest) + SMALL  # and temporaries of the largest parameter
    extra = width + 2 * CLASSES + TRANSIENT_WIDTHS * width
    if k is None:
        kept = residual_saved(width, depth) * batch
        return max(kept, 2 * grads if gpu else grads), max(grads + kept + 4 * extra * batch, update)
    segments = math.ceil(depth / k)
    upper = grads + 4 * batch * (segments * width + k * (10 * width + 2) + extra)
    return float(2 * grads if gpu else grads), max(upper, update)


def wide_step_bytes(width: int, batch: int) -> float:
    """Section 1's largest step: a WideMLP's weights, gradients and Adam's moments, autocast's half-precision copies
    of its weights and its activations (at most 4 bytes each), and the batch."""
    params = IMAGE * width + DEPTH * width + (DEPTH - 1) * (width * width + width) + width * CLASSES + CLASSES
    return 4 * params * 4 + 2 * params + batch * 4 * (DEPTH * width + CLASSES + IMAGE)


@functools.cache
def cnn_saved(width: int) -> int:
    """Bytes SmallCNN(width)'s forward saves per sample, counted by ``MemoryTracker`` on the meta device."""
    with torch.device("meta"):
        model = models.SmallCNN(width=width)
        x = torch.empty(1, 3, 32, 32)
    with MemoryTracker() as tracker:
        out = model(x)
        saved = tracker.current
    del out
    return saved


def cnn_forward_bytes(width: int, batch: int) -> float:
    return batch * (cnn_saved(width) + 4 * IMAGE)


def leak_bytes(width: int, val_batch: int) -> int:
    """What a validation loss kept with its graph holds: the WideMLP(depth 2) forward's saved activations."""
    return val_batch * 4 * (2 * width + 2 * CLASSES)


def kept_bytes(sizes: dict) -> float:
    """What stays alive from section 4 to the end: its model, Adam's state and batch (and the blocks' input), the
    leak's model and batches, the OOM demo's model."""
    w, depth, batch = sizes["mlp_width"], sizes["mlp_depth"], sizes["ckpt_batch"]
    model = 4 * residual_params(w, depth, w)
    leak_w = sizes["leak_width"]
    leak = 4 * (IMAGE * leak_w + leak_w * leak_w + leak_w * CLASSES) + 4 * (sizes["val_batch"] + 64) * IMAGE
    oom = 4 * residual_params(w, depth, IMAGE)
    return 3 * model + 2 * 4 * batch * w + 8 * batch + leak + oom


def lesson_bytes(sizes: dict, *, gpu: bool) -> float:
    """The lesson's largest moment on the device: sections 1-3 alone, or what stays alive from section 4 on with the
    largest experiment on top (a step of section 4's model, the remedies' two more Adam states, the leak's kept
    graphs, the OOM demo's budget, or the fragmentation script's process)."""
    w, depth, batch = sizes["mlp_width"], sizes["mlp_depth"], sizes["ckpt_batch"]
    step = residual_peak(w, depth, batch, None, gpu=gpu)[1]
    model = 4 * residual_params(w, depth, w)
    before = max(wide_step_bytes(sizes["width"], sizes["batch_size"]),
                 cnn_forward_bytes(sizes["cnn_width"], sizes["activation_batches"][-1]),
                 4 * residual_params(w, depth, IMAGE) + sizes["activation_batches"][-1]
                 * (residual_saved(w, depth) + 4 * IMAGE))
    on_top = max(step, 4 * model + step, sizes["leak_steps"] * leak_bytes(sizes["leak_width"], sizes["val_batch"]),
                 sizes["oom_mib"] * 2**20, CONTEXT_GB * 1e9 + sizes["fragmentation_mib"] * 2**20)
    return max(before, kept_bytes(sizes) + on_top)


# ---- seconds -------------------------------------------------------------------------------------------------------

def residual_step(card: Card, width: int, depth: int, batch: int, *, k: int | None = None,
                  precision: str = "fp32", micro_batches: int = 1) -> tuple[float, float]:
    """One training step of section 4's model on the card, predicted: (its kernels' seconds, its CPU's seconds). The
    kernels: its matmuls at the card's rate in ``precision``, LayerNorm, GELU, the residual adds and Adam at the card's
    copy bandwidth, a forward of the blocks again where they are checkpointed. The CPU: a launch per operator, and
    each checkpoint call's bookkeeping (estimates)."""
    params = residual_params(width, depth, width)
    matmuls = 6 * batch * (params - depth * 7 * width)
    traffic = 4 * batch * depth * ELEMENTWISE_WIDTHS * width
    again = 1 / 3 if k else 0.0  # a forward is about a third of a step's work
    kernels = ((1 + again) * matmuls / (card.tflops(precision) * 1e12)
               + ((1 + again) * traffic + 4 * ADAM_PASSES * params) / (card.copy_gbs * 1e9))
    segments = math.ceil(depth / k) if k else 0
    per_block, fixed = residual_launches()
    ops = micro_batches * (per_block * depth * (1 + again)) + fixed
    return kernels, ops * card.launch_s + segments * CHECKPOINT_CALL_S


def _launches(model: torch.nn.Module, optimizer, features: int, validation: bool = False) -> int:
    """The kernels a training step of ``model`` (on the meta device) launches, and a validation forward after it."""
    with torch.device("meta"):
        x, y = torch.empty(4, features), torch.zeros(4, dtype=torch.long)

    def step():
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if validation:
            F.cross_entropy(model(x), y)
    return step_launches(step)


@functools.cache
def residual_launches() -> tuple[int, int]:
    """The kernels a training step of section 4's model launches: (a ResidualBlock's, the rest's: the embedding, the
    head, the loss and Adam's foreach update), counted on the meta device at one block and two."""
    def counted(depth):
        with torch.device("meta"):
            model = models.ResidualMLP(in_features=16, width=16, depth=depth)
        return _launches(model, torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True), 16)
    one, two = counted(1), counted(2)
    return two - one, 2 * one - two


@functools.cache
def leak_launches() -> int:
    """The kernels a step of the leak's WideMLP (depth 2, SGD) and its validation forward launch (meta device)."""
    with torch.device("meta"):
        model = models.WideMLP(width=16, depth=2)
    return _launches(model, torch.optim.SGD(model.parameters(), lr=0.01), IMAGE, validation=True)


def step_s(card: Card, sizes: dict, **options) -> float:
    kernels, cpu = residual_step(card, sizes["mlp_width"], sizes["mlp_depth"], sizes["ckpt_batch"], **options)
    return max(kernels, cpu)


def lesson_parts(card: Card, sizes: dict) -> tuple[Part, ...]:
    minimum = sizes["compare_min_time"]
    plain = step_s(card, sizes)
    ckpt = {k: step_s(card, sizes, k=k) for k in sizes["ckpt_k"]}
    forward = plain / 3
    depth = sizes["mlp_depth"]
    remedies = [step_s(card, sizes, precision=sizes["amp_precision"]), ckpt.get(2, step_s(card, sizes, k=2)),
                step_s(card, sizes, micro_batches=4), plain + 8 * depth * 10 * card.launch_s, plain, plain]
    leak_w = sizes["leak_width"]
    weights = IMAGE * leak_w + leak_w * leak_w + leak_w * CLASSES
    train, val = 6 * 64 * weights, 2 * sizes["val_batch"] * weights  # FLOPs of a step at batch 64, of a validation
    leak = sizes["leak_steps"] * (3 * train + 2 * val) / (card.tflops("fp32") * 1e12) + sizes["leak_steps"] * 3 * (
        2 * leak_launches() * card.launch_s)
    per_block, fixed = residual_launches()
    tracker = 2 * (per_block * 2 + fixed) * TRACKER_OP_S
    rows = (
        Part("start", START_S, "imports, device facts, NVML (estimate)"),
        Part("sections 1-3: a step on paper and measured, the allocator, activations", SMALL_PARTS_S,
             "small models (estimate)"),
        Part("checkpointing, k at a time", sum(compare_s(plain, ckpt[k], min_time=minimum) + ckpt[k]
                                               for k in sizes["ckpt_k"]),
             f"{len(sizes['ckpt_k'])} comparisons against a step of {plain * 1e3:.0f} ms (predicted: an estimate)"),
        Part("checkpointing's cost, explained", compare_s(plain, forward, min_time=minimum)
             + compare_s(ckpt[depth], ckpt[1], min_time=minimum), "two comparisons"),
        Part("the leak", leak, f"{sizes['leak_steps']} steps of three loops, two with a validation forward"),
        Part("snapshot and the tracker's timeline", SNAPSHOT_S + 3 * plain + tracker, "three steps, the dump, two "
             "small steps under the tracker (estimate)"),
        Part("out of memory, fragmentation", 1.0 + 2 * PROCESS_S, f"the fragmentation script in two fresh processes, "
             f"{PROCESS_S:g} s each (estimate)"),
        Part("the remedies", sum(compare_s(plain, r, min_time=minimum) + 3 * r for r in remedies) + 3 * plain,
             f"{len(remedies)} comparisons against the plain step, each remedy's peaks"),
        Part("tables and figures", FIGURES_S, "estimate"),
    )
    return rows


# ---- the regimes --------------------------------------------------------------------------------------------------

def regimes(card: Card, sizes: dict) -> tuple[Regime, ...]:
    w, depth, batch, gpu = sizes["mlp_width"], sizes["mlp_depth"], sizes["ckpt_batch"], card.is_gpu
    deep = ACTIVATION_BATCHES[-1] * residual_saved(w, depth)
    weights = 4 * residual_params(w, depth, IMAGE)
    plain_low = residual_peak(w, depth, batch, None, gpu=gpu)[0]
    one_high = residual_peak(w, depth, batch, 1, gpu=gpu)[1]
    cut = 1 - one_high / plain_low
    kernels, cpu = residual_step(card, w, depth, batch, k=1)
    held = (kept_bytes(sizes) + CONTEXT_GB * 1e9) / 1e9
    cap = held + sizes["oom_mib"] * 2**20 / 1e9
    beside = held + CONTEXT_GB + sizes["fragmentation_mib"] * 2**20 / 1e9
    mib = 2**20
    return (
        Regime("activations outgrow the weights within section 3's batches", bool(deep >= weights),
               f"the {depth}-block ResidualMLP's activations at batch {ACTIVATION_BATCHES[-1]}: {deep / mib:,.0f} MiB "
               f"predicted, its weights {weights / mib:,.0f} MiB"),
        Regime("checkpointing cuts the step's peak", bool(cut >= CUT),
               f"width {w}, batch {batch}: one block at a time peaks at most {one_high / mib:,.0f} MiB above the weights "
               f"and Adam's state, no checkpointing at least {plain_low / mib:,.0f} MiB"
               f"{' (with foreach Adam temporaries)' if gpu else ''}: at least {cut:.0%} lower (at least {CUT:.0%})"),
        Regime("checkpointing's cost is the recomputation, not launches", bool(kernels >= ARITHMETIC * cpu),
               f"one block at a time, the step's kernels {kernels * 1e3:.1f} ms predicted, its launches and "
               f"{depth} checkpoint calls {cpu * 1e3:.1f} ms of CPU (at least {ARITHMETIC:g}×: estimates)"),
        Regime("the OOM demo runs out inside its cap, leaving the rest of the card", bool(cap <= card.usable_gb()),
               f"the cap: what the lesson holds by then (about {held:.1f} GB with its CUDA context) plus "
               f"{sizes['oom_mib']} MiB, {cap:.1f} GB of {card.usable_gb():.1f} usable; the step asks for twice the "
               "budget"),
        Regime("the fragmentation script's process fits beside the lesson's", bool(beside <= card.usable_gb()),
               f"the lesson's {held:.1f} GB, the script's CUDA context ({CONTEXT_GB:g} GB) and its budget of "
               f"{sizes['fragmentation_mib']} MiB: {beside:.1f} GB of {card.usable_gb():.1f} usable"),
    )
