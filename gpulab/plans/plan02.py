"""Lesson 02's plan: copies sized from the card's PCIe link, the prefetcher's batches and the hazard's queue from its
rates, and the input pipeline's model and crop chosen so that the naive pipeline starves this card's GPU.

The input pipeline's point is a GPU that waits for its data. Its cost is the CPU's: one augmented image costs the
host a few milliseconds whatever the card, while the card's training step shrinks with the card. So the workload is
the heaviest of ``WORKLOADS`` (ResNet-50 at 128² on an H100, ResNet-18 at 128² on a T4) whose naive pipeline
(``num_workers=0``: the training process augments each image, one core) the card trains at least ``STARVE`` times
faster than it is fed. A training step with its data on the device is predicted in two parts: its FLOPs
(``FlopCounterMode`` on the meta device) at the card's achievable fp32 rate (TF32 on tensor cores where the card has
it: cuDNN's convolutions use it by default; CUDA cores elsewhere), and the rest of the step (normalisation,
activations, the optimizer, the convolutions' shortfall from a matmul's rate) as memory traffic at the card's
bandwidth: the bytes the H100's shipped ResNet-50 step moved beyond its arithmetic, per byte of its activations. A
share of the H100's TF32 rate applied to every card would make a CUDA-core card's step (a T4's) about 3× too slow.
The fix that feeds the card follows from the host's cores: the loader's workers where every core augmenting keeps up
with the card, else the batches augmented on the GPU, or the data set on the device (a Colab T4 has 2 vCPUs: more
workers can buy at most twice the naive rate there). Quick mode keeps its small fixed sizes.
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision

from .. import flops
from ..memory import MemoryTracker
from ..results import reference
from ..transfers import KiB, MiB
from ..transfers import sizes as copy_sizes
from .card import MEASURED_ON, Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .predict import Launches, bench_s, compare_s, matmul_s

TITLE = "Host↔device transfers and the input pipeline"
FEATURES = ("tf32", "gpm")
QUICK = dict(compare_min_time=0.2, compare_pairs=5, copy_bytes=16 * MiB, sweep_min_time=0.05,
             prefetch_batch_bytes=4 * MiB, prefetch_batches=4, hazard_floats=2**20, hazard_side=1024, hazard_matmuls=5,
             model="squeezenet1_1", image_size=48, crop=32, batch_size=8, batches_per_epoch=3, step_repeats=3,
             busy_steps=3, min_steady=3, workers=[0, 2], nvml_seconds=0.2)

# ---- copies -------------------------------------------------------------------------------------------------------
COPY_S = 1e-3  # the largest copy lasts at least this long at the card's pinned rate: ~100 launches, so the sweep's
# last points show the link's rate and not a copy's fixed cost; the prefetcher's batches are as long
COPY_LADDER = copy_sizes(16 * MiB, 256 * MiB)  # the sweep's sizes go up by 4×: 16, 64, 256 MiB
PREFETCH_BATCHES = 8
MATMUL_WIDTH = 1024  # the prefetcher's compute: (rows × 1024) @ (1024 × 1024) and a tanh, fp32
HOLD_S = 0.2  # the hazard's queue of matmuls before its copy: about ten times the host's read of 64 MB (estimate)
HAZARD_SIDE, HAZARD_FLOATS = 4096, 2**24
HOST_FILL_GBS = 0.2  # random_() on the host: the H100 VM's 2026-11-22 sweep spent about 5 s filling its 1 GiB buffer
PIN_GBS = 2.0  # pinning (page-locking) host memory (estimate)

# ---- the input pipeline -------------------------------------------------------------------------------------------
# (model, crop), heaviest first (FLOPs per image: tests/test_lesson02_plan.py keeps the order); the image is 5/4 of it
WORKLOADS = (("resnet50", 128), ("resnet50", 96), ("resnet18", 128), ("resnet50", 64), ("resnet18", 96),
             ("resnet18", 64), ("squeezenet1_1", 128), ("squeezenet1_1", 96), ("squeezenet1_1", 64))
BATCH, BATCHES_PER_EPOCH, BUSY_STEPS, MIN_STEADY = 64, 10, 10, 20
STARVE = 2.0  # the card trains at least this many times faster than the naive pipeline feeds it: idle half the time
# One 32×32 augmented sample of a 48² image on one core of the 2026-11-28 H200's host (lesson 02 alone, quick mode:
# "One 32×32 augmented sample costs 1.72 ms of one CPU core"). The other end, at the crop of the shipped H100 rows, is
# read from them (``_anchors``); between the two, the cost is affine in the crop's pixels (estimate).
SMALL_CROP, SMALL_IMAGE_S = 32, 1.72e-3
RAW_IMAGE_S = 0.3e-3  # a worker's raw uint8 image made and collated, no augmentation (estimate)
GPU_AUGMENT_PASSES = 8  # the GPU's crop, conversion, normalisation and flip: passes over a float batch (estimate)
START_S = 10.0  # imports, device facts, NVML (estimate)
WORKER_START_S = 0.05  # a DataLoader worker started (forked) for an epoch (estimate)
PROFILED = 1.2  # a profiled step's time over an unprofiled one (estimate)
PROFILE_S = 1.0  # busy.measure's profiler started, its trace exported and read (estimate)
NVML_S = 1.0  # busy.measure's unprofiled steps read by NVML, seconds (full mode)
FIGURES_S = 8.0  # tables and figures (estimate)


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    if quick:
        return LessonPlan("02", TITLE, card, True, dict(QUICK), features=FEATURES)
    copy_bytes = next((n for n in COPY_LADDER if n / (card.host_gbs * 1e9) >= COPY_S), COPY_LADDER[-1])
    hold = matmul_s(card, HAZARD_SIDE)
    cores = card.cpu_cores
    common = dict(compare_min_time=1.0, compare_pairs=None, copy_bytes=copy_bytes, sweep_min_time=0.1,
                  prefetch_batch_bytes=copy_bytes, prefetch_batches=PREFETCH_BATCHES, hazard_floats=HAZARD_FLOATS,
                  hazard_side=HAZARD_SIDE, hazard_matmuls=max(1, math.ceil(HOLD_S / hold)), batch_size=BATCH,
                  batches_per_epoch=BATCHES_PER_EPOCH, step_repeats=None, busy_steps=BUSY_STEPS, min_steady=MIN_STEADY,
                  workers=sorted({0, 2, max(2, cores // 2), max(2, cores - 1)}), nvml_seconds=NVML_S)
    candidates = (_full(card, Pipeline.of(card, model, crop), common) for model, crop in WORKLOADS)
    last = None
    for last in candidates:
        if last.regimes[0].holds and last.memory_gb <= card.usable_gb() and last.minutes <= last.target_minutes:
            return last
    return last  # none starves this card within its memory and minutes: its regime says NO, and why


@dataclass(frozen=True)
class Network:
    """A torchvision model at one crop as the plan sees it: training FLOPs and activation bytes of one image, the
    kernels a forward and backward pass launches (``Launches``), its parameters."""

    name: str
    crop: int
    flops: float
    activation_bytes: float
    ops: int
    params: int


@functools.cache
def network(name: str, crop: int) -> Network:
    """``name`` of torchvision.models with 10 classes, one image at ``crop`` through a training step on the meta device
    (no memory, no time): FLOPs (``gpulab.flops.training_flops``), the tensors alive at the step's peak less the
    gradients (``gpulab.memory.MemoryTracker``), the kernels launched. Counted at each crop: a network's strides
    and pools round (SqueezeNet's FLOPs at 128² are not four times its FLOPs at 64²)."""
    with torch.device("meta"):
        model = getattr(torchvision.models, name)(num_classes=10)
        x, y = torch.empty(1, 3, crop, crop), torch.zeros(1, dtype=torch.long)
    params = sum(p.numel() for p in model.parameters())
    tracker, ops = MemoryTracker(), Launches()
    with tracker, ops:
        count = flops.training_flops(model, x, y, F.cross_entropy)
    return Network(name, crop, float(count.total), float(tracker.peak - 4 * params), ops.count, params)


@functools.cache
def _anchors() -> tuple[int, float, float]:
    """From the shipped H100 rows of lesson 02's loader sweep (``gpulab/reference/02_dataloader``): their crop, the
    naive pipeline's seconds an image there (the ``num_workers=0`` rate less the data-on-device rate's share) and the
    bytes its ResNet-50 step with the data on the device moved beyond its arithmetic (its time less its FLOPs at the
    H100's achievable TF32 rate, at the H100's copy bandwidth) per byte of the step's activations."""
    rows = reference("02_dataloader").query("device_name == @MEASURED_ON")
    naive = rows[rows["num_workers"] == 0].iloc[-1]
    crop, ceiling = int(naive["crop"]), float(naive["ceiling_samples_per_s"])
    net, h100 = network(naive["model"], crop), Card.named(MEASURED_ON)
    rest_s = 1 / ceiling - net.flops / (h100.tflops("tf32") * 1e12)
    return crop, 1 / float(naive["samples_per_s"]) - 1 / ceiling, rest_s * h100.copy_gbs * 1e9 / net.activation_bytes


@functools.cache
def pageable_gbs() -> float:
    """Pageable host-to-device copies of 256 MiB on the H100's VM (``gpulab/reference/02_transfer_bandwidth``): the
    host's memcpy into the driver's staging buffers sets their rate, whatever the card's link."""
    rows = reference("02_transfer_bandwidth").query(
        "device_name == @MEASURED_ON and direction == 'H2D' and memory == 'pageable' and nbytes == @MiB * 256")
    return float(rows["gbps"].iloc[-1])


def image_s(crop: int) -> float:
    """One augmented image on one core: affine in the crop's pixels between the H200's 32² and the H100 rows' crop."""
    big_crop, big_s, _ = _anchors()
    return SMALL_IMAGE_S + (big_s - SMALL_IMAGE_S) * (crop**2 - SMALL_CROP**2) / (big_crop**2 - SMALL_CROP**2)


def moved_per_activation_byte() -> float:
    return _anchors()[2]


@dataclass(frozen=True)
class Pipeline:
    """A workload on a card, predicted: the model at ``crop`` in batches of ``BATCH``, its training step with the data on
    the device, and the seconds the host takes to augment an image on one core."""

    card: Card
    net: Network
    image_size: int
    # what the card's convolutions run fp32 in: "tf32" where it has TF32, else "fp32". cuDNN may use TF32 unless told
    # not to (aten/src/ATen/Context.h: allow_tf32_cudnn = true, torch 2.6 to 2.14); the lesson leaves it so
    precision: str
    image_s: float

    @classmethod
    def of(cls, card: Card, model: str, crop: int) -> "Pipeline":
        return cls(card, network(model, crop), crop * 5 // 4, "tf32" if card.tf32 else "fp32", image_s(crop))

    @property
    def arithmetic_s(self) -> float:
        """A step's FLOPs at the card's achievable rate in its precision."""
        return BATCH * self.net.flops / (self.card.tflops(self.precision) * 1e12)

    @property
    def rest_s(self) -> float:
        """The rest of a step, as memory traffic: the H100's bytes per byte of activations, at this card's bandwidth."""
        return BATCH * moved_per_activation_byte() * self.net.activation_bytes / (self.card.copy_gbs * 1e9)

    @property
    def step_s(self) -> float:
        """A training step with its data on the device: its arithmetic and the rest, or its launches where they take
        longer."""
        return max(self.arithmetic_s + self.rest_s, self.launches_s)

    @property
    def launches_s(self) -> float:
        return self.net.ops * self.card.launch_s

    @property
    def gpu_rate(self) -> float:
        """Images a second the card trains with its data on the device."""
        return BATCH / self.step_s

    @property
    def naive_batch_s(self) -> float:
        """A batch of the naive pipeline: the training process augments it, copies it from pageable memory (which waits
        for the step before) and launches the step, which runs while the next batch is augmented."""
        copy = BATCH * 3 * self.net.crop**2 * 4 / (pageable_gbs() * 1e9)
        return max(BATCH * self.image_s + copy + self.launches_s, self.step_s)

    @property
    def naive_rate(self) -> float:
        return BATCH / self.naive_batch_s

    @property
    def host_rate(self) -> float:
        """Images a second the host could augment with every core but the training process's at it (at least one):
        what more workers can buy at most."""
        return self.worker_cores / self.image_s

    @property
    def worker_cores(self) -> int:
        return max(1, self.card.cpu_cores - 1)

    def loader_rate(self, workers: int) -> float:
        """A loader's images a second: the naive pipeline without workers; else its workers, one core each, the training
        process keeping one for itself (at least one worker's), and never faster than the card trains."""
        if workers == 0:
            return self.naive_rate
        return min(self.gpu_rate, min(workers, self.worker_cores) / self.image_s)

    @property
    def gpu_augment_s(self) -> float:
        """A batch augmented on the GPU: a few passes over its float32 pixels at the card's copy bandwidth."""
        return GPU_AUGMENT_PASSES * BATCH * 3 * self.net.crop**2 * 4 / (self.card.copy_gbs * 1e9)

    @property
    def memory_gb(self) -> float:
        """The model's weights, gradients and momentum (with room), one step's activations (1.5× what the meta
        device's step held at its peak) and the data set on the device, as uint8."""
        dataset = BATCH * BATCHES_PER_EPOCH * 3 * self.image_size**2
        return (16 * self.net.params + 1.5 * BATCH * self.net.activation_bytes + dataset) / 1e9

    @property
    def name(self) -> str:
        return f"{self.net.name} at {self.net.crop}²"


def _full(card: Card, pipe: Pipeline, common: dict) -> LessonPlan:
    sizes = dict(common, model=pipe.net.name, image_size=pipe.image_size, crop=pipe.net.crop)
    parts = (Part("start", START_S, "imports, device facts, NVML (estimate)"), *copy_parts(card, sizes),
             *pipeline_parts(pipe, sizes), Part("tables and figures", FIGURES_S, "estimate"))
    regimes = (starving(pipe), feeding(pipe), *copy_regimes(card, sizes))
    copy = sizes["copy_bytes"]
    why = {"copy_bytes": f"the size (16, 64 or 256 MiB) whose pinned copy lasts at least {COPY_S * 1e3:g} ms at this "
                         f"card's {card.host_gbs:.0f} GB/s",
           "prefetch_batch_bytes": "a batch's copy as long as the sweep's largest",
           "hazard_matmuls": f"about {HOLD_S:g} s of {HAZARD_SIDE}² fp32 products queued before the copy (about ten "
                             f"times the host's read of its {HAZARD_FLOATS * 4 // MiB} MiB, an estimate): the read "
                             "begins while the copy waits; the lesson prints whether it had",
           "model": f"the heaviest workload whose naive pipeline this card trains at least {STARVE:g}× faster than "
                    "it is fed",
           "workers": f"0, 2, half and all but one of the host's {card.cpu_cores} cores"}
    memory = max(pipe.memory_gb, (2 * copy + (HAZARD_SIDE**2 + HAZARD_FLOATS) * 4) / 1e9)
    return LessonPlan("02", TITLE, card, False, sizes, why, parts, memory, regimes, target_minutes(card), FEATURES)


# ---- the regimes ----------------------------------------------------------------------------------------------------

def starving(pipe: Pipeline) -> Regime:
    """The naive pipeline leaves the GPU idle: the card trains at least ``STARVE`` times faster than it is fed."""
    ratio = pipe.gpu_rate / pipe.naive_rate
    cores = "tensor cores" if pipe.precision == "tf32" else "CUDA cores"
    return Regime("the naive pipeline starves the GPU", bool(ratio >= STARVE),
                  f"{pipe.name}: the naive pipeline (one core, {pipe.image_s * 1e3:.2f} ms an image, estimated) feeds "
                  f"{pipe.naive_rate:,.0f} images/s; with its data on the device this card trains {pipe.gpu_rate:,.0f} "
                  f"({cores}: the FLOPs at its {pipe.precision} rate {pipe.arithmetic_s / pipe.step_s:.0%} of a step, "
                  f"the rest at its memory bandwidth as the H100's ResNet-50 step moved it: an estimate): "
                  f"{ratio:.1f}× (at least {STARVE:g}×), the GPU idle {1 - 1 / ratio:.0%} of the time")


def feeding(pipe: Pipeline) -> Regime:
    """A fix the lesson runs feeds the card: the workers, where every core augmenting keeps up with it; else the
    pipeline on the GPU, whose augmentation costs the step little."""
    host, gpu = pipe.host_rate, pipe.gpu_rate
    cores = (f"{pipe.worker_cores} of the host's {pipe.card.cpu_cores} cores (one trains)" if pipe.card.cpu_cores > 1
             else "the host's one core")
    if host >= gpu:
        return Regime("a fixed pipeline feeds the GPU", True,
                      f"the loader's workers: {cores} augment up to {host:,.0f} images/s, the card trains "
                      f"{gpu:,.0f}")
    share = pipe.gpu_augment_s / pipe.step_s
    return Regime("a fixed pipeline feeds the GPU", bool(share <= 0.1),
                  f"not the workers: {cores} augment at most {host:,.0f} images/s ({host / pipe.naive_rate:.1f}× "
                  f"the naive pipeline), the card trains {gpu:,.0f}, so more workers cannot feed it; the batches "
                  f"augmented on the GPU and the data set on the device do (augmenting a batch there takes "
                  f"{share:.1%} of its step)")


def copy_regimes(card: Card, sizes: dict) -> tuple[Regime, ...]:
    copy = sizes["copy_bytes"]
    copy_s = copy / (card.host_gbs * 1e9)
    step_s = matmul_s(card, MATMUL_WIDTH, m=copy // (4 * MATMUL_WIDTH), k=MATMUL_WIDTH)  # (rows × 1024) @ (1024²)
    steps = max(1, round(copy_s / step_s))
    return (
        Regime("the largest copy shows the link's rate", bool(copy_s >= 100 * card.launch_s),
               f"{copy // MiB} MiB pinned: {copy_s * 1e3:.2f} ms at {card.host_gbs:.0f} GB/s, "
               f"{copy_s / card.launch_s:.0f} launches long"),
        Regime("the prefetcher's compute matches its copy", bool(abs(steps * step_s - copy_s) <= 0.5 * copy_s),
               f"{steps} matmul step(s) of {step_s * 1e3:.2f} ms against a {copy_s * 1e3:.2f} ms copy (the lesson "
               "measures both and chooses the steps)"),
    )


# ---- the minutes ----------------------------------------------------------------------------------------------------

def copy_parts(card: Card, sizes: dict) -> list[Part]:
    """Sections 1 and 2: the copies, the sweep, non-blocking copies, the prefetcher and the hazard."""
    top, minimum = sizes["copy_bytes"], sizes["sweep_min_time"]

    def pinned(n):
        return n / (card.host_gbs * 1e9) + card.launch_s

    def pageable(n):
        return n / (min(card.host_gbs, pageable_gbs()) * 1e9) + card.launch_s

    def fill(n):
        return n / (HOST_FILL_GBS * 1e9)

    points = sizes_of(top)
    sweep = sum(2 * bench_s(pinned(n), min_time=minimum) + 2 * bench_s(pageable(n), min_time=minimum)
                + 2 * fill(n) + n / (PIN_GBS * 1e9) for n in points)
    batch, batches = sizes["prefetch_batch_bytes"], sizes["prefetch_batches"]
    serial = batches * 2 * pinned(batch)  # the compute is chosen as long as the copy
    return [
        Part("a copy timed three ways", top / (PIN_GBS * 1e9) + 15 * pinned(top), f"{top // MiB} MiB, 15 copies"),
        Part("bandwidth sweep, pinned against pageable", sweep + 2 * fill(top) + compare_s(pageable(top), pinned(top)),
             f"{len(points)} sizes up to {top // MiB} MiB × 2 directions × 2 memories, {minimum:g} s each; random "
             f"host data made at {HOST_FILL_GBS:g} GB/s (the H100's VM); 1 s of interleaved pairs"),
        Part("non-blocking copies", fill(top) + 6 * (pinned(top) + pageable(top)), "5 tries of each"),
        Part("the prefetcher", batches * fill(batch) + 4 * bench_s(pinned(batch)) + 2 * bench_s(serial)
             + compare_s(serial, serial / 2) + 2 * serial, f"{batches} batches of {batch // MiB} MiB"),
        Part("the hazard", sizes["hazard_matmuls"] * matmul_s(card, HAZARD_SIDE) + 0.1,
             f"{sizes['hazard_matmuls']} queued products, the copy and two reads"),
    ]


def sizes_of(top: int) -> list[int]:
    """The sweep's sizes, as the lesson asks ``gpulab.transfers.sizes`` for them."""
    return copy_sizes(4 * KiB, top)


def pipeline_parts(pipe: Pipeline, sizes: dict) -> list[Part]:
    """Section 3: the rates, the loader sweep, the comparisons of epochs, the monitor's cost and the GPU's pipelines."""
    per_epoch, workers = sizes["batches_per_epoch"], sizes["workers"]
    step, tuned = pipe.step_s, workers[-1]

    def batch_s(w):
        return BATCH / pipe.loader_rate(w)

    def busy(one_step, steps):
        return (4 + steps) * one_step * PROFILED + PROFILE_S + max(sizes["nvml_seconds"], one_step)

    def epoch(w, persistent=False):
        return per_epoch * batch_s(w) + (0 if persistent else w * WORKER_START_S)

    def steady(w, prefetch, persistent=False):
        skip = 2 * min(w * prefetch, per_epoch) + 1
        measured = skip + max(skip, sizes["min_steady"])
        return measured * batch_s(w) + (measured / per_epoch) * (0 if persistent else w * WORKER_START_S)

    sweep = sum(steady(w, 2) + busy(batch_s(w), sizes["busy_steps"]) for w in workers)
    sweep += steady(tuned, 4, True) + busy(batch_s(tuned), sizes["busy_steps"]) + tuned * WORKER_START_S
    tuned_epoch, device_epoch = epoch(tuned, True), per_epoch * step
    uint8_rate = min(pipe.gpu_rate, min(tuned, pipe.worker_cores) / RAW_IMAGE_S)
    uint8_epoch = per_epoch * BATCH / uint8_rate
    fed = (2 * BATCH * per_epoch * RAW_IMAGE_S + 2 * (21 * step + busy(step, sizes["busy_steps"]))
           + compare_s(tuned_epoch, device_epoch, pairs=5) + compare_s(tuned_epoch, uint8_epoch, pairs=5))
    rates = f"{pipe.name}: {pipe.naive_rate:,.0f} images/s naive, {pipe.gpu_rate:,.0f} with the data on the device"
    return [
        Part("one augmented sample, the step with data on the device",
             bench_s(pipe.image_s, min_time=0.3) + bench_s(step, min_time=1.0) + busy(step, 20),
             f"{pipe.image_s * 1e3:.2f} ms an image (estimate), {step * 1e3:.0f} ms a step (predicted), 20 profiled"),
        Part("the loader sweep", sweep, f"{len(workers) + 1} configurations, each {sizes['min_steady']}+ batches "
             f"steady and {sizes['busy_steps']} profiled; {rates}"),
        Part("epochs compared", compare_s(epoch(0), tuned_epoch, pairs=5) + compare_s(tuned_epoch, device_epoch, pairs=5),
             f"5 interleaved pairs of {per_epoch}-batch epochs, twice"),
        Part("the monitor's cost", 2 * compare_s(tuned_epoch, tuned_epoch, pairs=5), "two comparisons of epochs"),
        Part("feeding the GPU", fed, "uint8 batches augmented on the GPU, the data set on the device; two comparisons"),
    ]
