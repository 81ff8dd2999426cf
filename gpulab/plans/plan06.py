"""Lesson 06's plan: the slow loop, its fixes raced as a path within a budget, the patterns, the launch-bound step, the
claims and the profiler's cost, sized from the card.

The slow loop's pace is its per-image CPU pipeline on one core, whatever the card, so its batch is the host's: the
profile of the slow loop records about a thousand events an image, and the lesson reads that trace a dozen times. The
network's width is the card's: the widest ``TutorialCNN`` (up to 32×) whose training step the card runs within the
CPU's time for a step of the loop with every fix, so that the late fixes (no per-step sync, mixed precision) get as
much GPU work to act on as this card can give them at that pace, while the slow loop still waits for its data. The
path's races stop at the budget: the lesson's minutes less its other parts. Quick mode keeps its small fixed sizes; the
precision (bf16, or fp16 with a GradScaler) follows the card in both modes.
"""

import functools
import math

import torch
import torch.nn.functional as F

from .. import flops, models
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .predict import bench_s, compare_s

TITLE = "Profiling: find the bottleneck, fix it, prove it"
FEATURES = ("bf16", "tf32", "gpm")
WIDTHS = (32, 16, 8, 4, 2, 1)  # TutorialCNN's width multiplier, widest first
# The slow loop's per-image pipeline (crop, flip and colour jitter of a 36² uint8 image on the CPU, then four launches
# to standardise it on the device): 20.1 ms a step of 16 images on the 2026-11-28 H200 in quick mode (06_fixes.csv,
# its 'slow' row; the host shared with seven other lessons). One core runs it, whatever the host has.
IMAGE_S = 20.1e-3 / 16
# The CPU's time for a step of the loop with every fix (data on the device, compiled, replayed as CUDA graphs): 3.23 ms
# unprofiled on the same run. It launches the same operators whatever the width.
FIXED_CPU_S = 3.2e-3
# Later configurations, planned at the H200's '+ augment on the device' step (7.54 ms for 16 images, same run) scaled
# by the batch: an upper bound, each kept fix makes the next race shorter.
AUGMENTED_IMAGE_S = 7.54e-3 / 16
STEP_SHARE = 0.28  # of the card's achievable matmul rate, what this small network's training step reaches (estimate,
# as lesson 08's plan)
PROFILED = 1.6  # a profiled step's time over an unprofiled one: 6.5 ms against 4.0 for the fused-optimizer loop (H200)
PROFILED_SLOW = 2.3  # ... with shapes and memory recorded: the slow loop's 47 ms against 20 (H200)
TRACE_READ_S = 0.6  # seconds of reading an image's share of the slow loop's trace: the H200's trace cells (profile,
# tables, timeline, busy, HTA) took 9.7 s for 16 images, contended (estimate)
TRACE_S = 0.5  # exporting and reading a path configuration's trace (estimate)
COMPILE_S, COMPILE_AGAIN_S = 15.0, 8.0  # the path's torch.compile with CUDA graphs, first and again, on 16 cores: the
# H200's cell of the last two fixes took 16.4 s (estimate)
SMALL_COMPILE_S = 7.7  # section 7's two compiles of the tutorial's network: 5.0 s and 2.7 s on the H200
AUTOTUNE_S = 1.6  # a first step at a new shape with cudnn.benchmark=True: 1596 ms (median) on the H200
NCU_S = 8.0  # Nsight Compute's run of one kernel (where ncu is installed): 7.9 s on the H200
START_S = 10.0  # imports, device facts, the data (estimate; the H200's setup and imports took 11.6 s, contended)
PROFILER_START_S = 0.15  # starting and stopping a profiler around a loop (estimate)
SMALL_BATCH, SMALL_KERNELS = 16, 73  # section 7's step: 73 CUDA runtime calls at batch 16 on the H200
COPY_S = 5e-3  # the pageable copy of the memcpy pattern lasts about this long at the card's pinned rate
SYNC_SHARE = 0.1  # the kernels' time a step, against the fixed loop's CPU time, that a per-step .item() waits for
# and its removal gives back: a tenth, five times the smallest change a comparison calls (2 %)
FILL = 0.85  # the path's first tries planned to fill at most this share of its budget: room for slower rates
QUICK = dict(batch_size=16, width=1, steps=4, repeats=3, compare_min_time=0.3, compare_pairs=5, start_pairs=5,
             chunks=300, host_mb=4, cnn_batch=16, cnn_pairs=5, budget_s=math.inf, compile_s=COMPILE_S,
             compile_again_s=COMPILE_AGAIN_S)


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    amp = card.amp_precision
    if quick:
        return LessonPlan("06", TITLE, card, True, dict(QUICK, amp_precision=amp), features=FEATURES)
    minutes, batch, steps = target_minutes(card), 32, 6
    width = next((w for w in WIDTHS if gpu_step_s(card, w, batch) <= FIXED_CPU_S and memory_gb(w, batch, 0)
                  <= card.usable_gb()), 1)
    host_mb = min(256, max(8, 2 ** round(math.log2(COPY_S * card.host_gbs * 1e3))))
    compile_s = COMPILE_S * compile_scale(card)
    sizes = dict(batch_size=batch, width=width, steps=steps, repeats=3, compare_min_time=0.5, compare_pairs=None,
                 start_pairs=5, chunks=2000, host_mb=host_mb, cnn_batch=64, cnn_pairs=6, budget_s=0.0,
                 compile_s=round(compile_s, 1), compile_again_s=round(COMPILE_AGAIN_S * compile_scale(card), 1),
                 amp_precision=amp)
    others = other_parts(card, sizes)
    sizes["budget_s"] = budget_s = math.floor(10 * (60 * minutes - sum(p.seconds for p in others))) / 10
    first_tries = path_seconds(card, sizes)
    parts = (*others[:4], Part("the fixes raced as a path", budget_s, "at most: each race is planned before it starts "
                               f"and refused past the budget; the first tries planned at {first_tries:.0f} s"),
             *others[4:])
    g = gpu_step_s(card, width, batch)
    why = {"batch_size": f"the slow loop's per-image pipeline ({IMAGE_S * 1e3:.2f} ms an image on one core) and its "
                         "profile (about a thousand events an image) set it, not the card",
           "width": f"the widest network (up to {WIDTHS[0]}×) whose training step this card runs within the CPU's "
                    f"{FIXED_CPU_S * 1e3:.1f} ms for a step of the fixed loop: {g * 1e3:.2f} ms predicted",
           "host_mb": f"a pageable copy of about {COPY_S * 1e3:g} ms at this card's pinned rate ({card.host_gbs:.0f} GB/s)",
           "budget_s": f"the races stop there: the lesson's {minutes:g} minutes less its other parts",
           "amp_precision": "native bf16" if amp == "bf16" else "no native bf16: fp16 autocast, with a GradScaler"}
    return LessonPlan("06", TITLE, card, False, sizes, why, parts, memory_gb(width, batch, host_mb),
                      regimes(card, sizes, first_tries), minutes, FEATURES)


@functools.cache
def network(width: int) -> tuple[float, int]:
    """Training FLOPs of one image through ``TutorialCNN(width)`` (FlopCounterMode on the meta device, no memory) and
    its parameters."""
    with torch.device("meta"):
        model = models.TutorialCNN(width=width)
        x, y = torch.empty(1, 3, 32, 32), torch.zeros(1, dtype=torch.long)
    return flops.training_flops(model, x, y, F.cross_entropy).total, sum(p.numel() for p in model.parameters())


def gpu_step_s(card: Card, width: int, batch: int) -> float:
    """A training step's kernels at ``batch`` on the card, fp32 with TF32 where the card has it (the lesson's)."""
    rate = float(card.tflops("tf32" if card.tf32 else "fp32")) * STEP_SHARE * 1e12
    return network(width)[0] * batch / rate


def memory_gb(width: int, batch: int, host_mb: float) -> float:
    """The largest experiment's device memory: two runs of the loop alive in a race (weights, gradients, Adam's two
    moments in fp32; activations, three of the convolutions' outputs an image), or the memcpy pattern's copy."""
    run = 16 * network(width)[1] + 3 * 4 * batch * (6 * width * 28 * 28 + 16 * width * 10 * 10)
    return max(2 * run, host_mb * 2**20) / 1e9


def compile_scale(card: Card) -> float:
    """A compile on the card's host against 16 cores: inductor compiles its kernels in parallel, the rest on one core
    (the square root of the ratio, an estimate, as lesson 08's plan)."""
    return math.sqrt(max(16 / max(card.cpu_cores, 1), 1.0))


def slow_step_s(card: Card, sizes: dict) -> float:
    """A step of the slow loop: the per-image pipeline, then the step's kernels (its per-step ``.item()`` waits)."""
    return sizes["batch_size"] * IMAGE_S + gpu_step_s(card, sizes["width"], sizes["batch_size"])


def other_parts(card: Card, sizes: dict) -> list[Part]:
    """Every part of the lesson but the path, in the lesson's order."""
    batch, steps = sizes["batch_size"], sizes["steps"]
    slow, fixed = slow_step_s(card, sizes), max(FIXED_CPU_S, gpu_step_s(card, sizes["width"], batch))
    profiled = compare_s(PROFILER_START_S + steps * fixed * PROFILED, steps * fixed, min_time=0.5)
    small = SMALL_KERNELS * card.launch_s
    return [
        Part("start", START_S, "imports, device facts, the data (estimate)"),
        Part("the slow loop timed", bench_s(steps * slow, repeats=3, warmup=1),
             f"{steps} steps of {batch} images at {IMAGE_S * 1e3:.2f} ms an image (the H200's, 2026-11-28)"),
        Part("the slow loop profiled, its trace read", 4 * slow * PROFILED_SLOW + batch * TRACE_READ_S,
             f"4 steps with shapes and memory, {TRACE_READ_S:g} s of reading an image's events (estimate)"),
        Part("NVML over the slow loop", 2 * steps * slow, "two runs, unprofiled"),
        Part("the four patterns", 5.0 + 2 * compare_s(small, small, min_time=0.5), "five short profiles (estimate), "
             "two comparisons"),
        Part("launch-bound step: compiled, CUDA graphs", SMALL_COMPILE_S * compile_scale(card)
             + 2 * compare_s(small, small, min_time=0.5), "two compiles (the H200's 7.7 s), two comparisons"),
        Part("cudnn.benchmark", sizes["cnn_pairs"] * (AUTOTUNE_S + small) + compare_s(small, small, min_time=0.5),
             f"a first step at each of {sizes['cnn_pairs']} new shapes ({AUTOTUNE_S:g} s on the H200), the steady state"),
        Part("activations", 2 * compare_s(fixed, fixed, min_time=0.5, warmup=2), "two comparisons of a step"),
        Part("the profiler's cost", 3 * profiled, "three comparisons of profiled and unprofiled runs"),
        Part("Nsight Compute on one kernel", NCU_S, "where ncu is installed (the H200's 7.9 s)"),
    ]


def path_seconds(card: Card, sizes: dict) -> float:
    """The path's first tries, as if every fix were kept: the slow loop profiled, then each race's profile of its
    candidate and its interleaved pairs (against the slow loop, ``start_pairs`` runs of each; later at the augmented
    loop's time, an upper bound), and the compile of the step that compiles."""
    batch, steps = sizes["batch_size"], sizes["steps"]
    slow, later = slow_step_s(card, sizes), max(batch * AUGMENTED_IMAGE_S, gpu_step_s(card, sizes["width"], batch))

    def profile_s(step_s: float) -> float:
        return 4 * step_s * PROFILED + TRACE_S

    first = profile_s(slow) + profile_s(later) + compare_s(steps * slow, steps * slow, pairs=sizes["start_pairs"])
    rest = 7 * (profile_s(later) + compare_s(steps * later, steps * later, min_time=sizes["compare_min_time"]))
    return first + rest + sizes["compile_s"]


def regimes(card: Card, sizes: dict, first_tries: float) -> tuple[Regime, ...]:
    batch, width = sizes["batch_size"], sizes["width"]
    data, g = batch * IMAGE_S, gpu_step_s(card, width, batch)
    small = network(1)[0] * SMALL_BATCH / (card.tflops("tf32" if card.tf32 else "fp32") * STEP_SHARE * 1e12)
    copy = sizes["host_mb"] * 2**20 / (card.host_gbs * 1e9)
    return (
        Regime("the slow loop waits for its data", bool(data >= 10 * g),
               f"its per-image pipeline {data * 1e3:.0f} ms a step on one core, the step's kernels {g * 1e3:.2f} ms "
               f"predicted: {data / g:.0f}× (at least 10×)"),
        Regime("section 7's step is launch-bound", bool(small < SMALL_KERNELS * card.launch_s),
               f"the tutorial's network at batch {SMALL_BATCH}: {small * 1e6:.0f} µs of kernels predicted against "
               f"{SMALL_KERNELS} launches of {card.launch_s * 1e6:.1f} µs"),
        Regime("pageable copies show as memcpy time", bool(copy >= 1e-3),
               f"{sizes['host_mb']} MB at most {card.host_gbs:.0f} GB/s: at least {copy * 1e3:.1f} ms a copy"),
        Regime("the per-step sync has GPU work to wait for", bool(g >= SYNC_SHARE * FIXED_CPU_S),
               f"the loop's kernels {g * 1e3:.2f} ms a step predicted against the CPU's {FIXED_CPU_S * 1e3:.1f} ms "
               f"for the fixed loop (at least {SYNC_SHARE:.0%}): once launches are cheap, .item() waits for them, and "
               "removing it can give up to that much"),
        Regime("every fix races within the budget", bool(first_tries <= FILL * sizes["budget_s"]),
               f"the first tries planned at {first_tries:.0f} s of the {sizes['budget_s']:.0f} s budget (at most "
               f"{FILL:.0%}); a retry runs where time is left"),
    )
