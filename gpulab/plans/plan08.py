"""Lesson 08's plan: the capstone job sized from the card, and the noise and the path's races inside one budget.

The job is the widest network and the most training images (``WIDTHS``, ``IMAGES``, largest first) for which, on this
card, the naive job stays far from the card's limit (its per-sample CPU pipeline, not the GPU, sets its pace, and the
card trains the network in mixed precision several times faster than the naive job does), the noise and every race of
the path fit the budget even where the card trains at ``SLOWER`` of the planned rates, and the larger batch fits the
card's memory. Each race is planned as the lesson plans it before it starts (``race_seconds``). The budget is the
lesson's minutes less its fixed parts: the lesson stops the noise and the races there, whatever the rates turn out to
be, so the minutes a plan gives are the most the lesson takes (the expected seconds of each part beside them). Quick
mode keeps ``capstone.QUICK_SIZES``; the precision (bf16, or fp16 with a GradScaler) follows the card in both modes.
"""

import math
from dataclasses import dataclass, replace

from .. import capstone, racing
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes

TITLE = "Capstone: a training job taken to the GPU's limit"
WIDTHS = ((64, 256, 512, 1024), (32, 128, 256, 512), (16, 64, 128, 256), (8, 32, 64, 128))  # the network, widest first
IMAGES = (16_384, 12_288, 8_192)  # the training images, most first
# The naive job's per-sample pipeline: 3,250 images/s, measured on one core of the 2026-11-28 H200's host (quick mode,
# where the network's work is negligible: "data on the GPU" 11,491 images/s, 3.53x the naive job). It runs in the
# training process: one core, whatever the host has (a Colab vCPU is likely slower: an estimate there).
PIPELINE_PER_S = 11_491 / 3.53
# The share of the card's achievable matmul rate (``Card.tflops``) a training step of this network reaches, planned
# before it is measured: on an H100 it gives the rates the lesson planned with before (float32 with TF32 convolutions
# at 10 % of the dense bf16 peak, bf16 at 20 %), estimates below what the lesson aims for (40 % MFU at the end).
STEP_SHARE = 0.28
FAR = 4.0  # the naive job "far from the card's limit": the card trains the network at least this many times faster
# The share of the planned GPU rates at which the noise and every race must still fit the budget: a card below an
# A100 reaches less of its peak than the H100 the rates are scaled from (plans/card.py: a T4 at its 70 W limit, a
# laptop's card at its power budget), and the lesson's rates are estimates (``STEP_SHARE``)
SLOWER = 0.7
COMPILE_S = 25.0  # a first torch.compile of the network: 22.7 s on the 2026-11-28 H200's 16 cores (quick mode's
# network: its operators, not their widths, set it); fewer cores compile for longer (inductor's workers): an estimate
COMPILE_AGAIN_S = 10.0  # estimate, on 16 cores as COMPILE_S: a retry compiles the same network again and reuses what
# is cached (dynamo's guards hold for a new model of the same class, torch/_dynamo/config.py inline_inbuilt_nn_modules;
# inductor's FX graphs and Triton kernels on disk)
FIXED_S = {"start, data, FLOPs, reference tables": 15.0, "ceilings, busy windows, figures": 30.0}  # estimates; the
# start: the 2026-11-28 H200 run's first GPU memory appeared 15 s into the part
FEATURES = ("bf16", "tf32", "gpm")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    amp = card.amp_precision if card.is_gpu else "bf16"  # a CPU's autocast runs bf16
    if quick:
        sizes = dict(job=capstone.QUICK_SIZES, amp=amp, budget_s=math.inf, compile_s=COMPILE_S,
                     compile_again_s=COMPILE_AGAIN_S, rates=None)
        return LessonPlan("08", TITLE, card, True, sizes, features=FEATURES)
    minutes = target_minutes(card, long=True)
    budget_s = 60 * minutes - sum(FIXED_S.values())
    compile_s, compile_again_s = (round(s * compile_scale(card), 1) for s in (COMPILE_S, COMPILE_AGAIN_S))
    options = []
    for widths in WIDTHS:
        for n_train in IMAGES:
            job = replace(capstone.FULL_SIZES, widths=widths, n_train=n_train)
            rates = Rates.planned(card, job, amp)
            path = path_seconds(steps(job, amp), rates.of, job, compile_s)
            slow = path_seconds(steps(job, amp), rates.slower(SLOWER).of, job, compile_s)
            options.append((job, rates, path, regimes(card, job, rates, slow, budget_s)))
    job, rates, path, chosen = next((o for o in options if all(r.holds for r in o[3])), options[-1])
    (start, start_s), (finish, finish_s) = FIXED_S.items()
    room = budget_s - sum(s for _, s in path)
    parts = (Part(start, start_s, "estimate"), *(Part(name, s, basis(name, job, rates, compile_s)) for name, s in path),
             Part("the budget's room", room, f"the noise and the races are expected to take {budget_s - room:.0f} s "
                  f"(above); the budget ({budget_s:.0f} s) holds them at rates below the plan, and a step tried again, "
                  "and stops them at its end"),
             Part(finish, finish_s, "estimate"))
    sizes = dict(job=job, amp=amp, budget_s=budget_s, compile_s=compile_s, compile_again_s=compile_again_s,
                 rates=rates)
    why = {"job": f"the widest network and the most images (of {len(WIDTHS)} widths × {len(IMAGES)} sizes) whose naive "
                  "job stays far from this card's limit, whose noise and races fit the budget and whose larger batch "
                  "fits the card's memory",
           "amp": "native bf16" if amp == "bf16" else "no native bf16: fp16 autocast, with a GradScaler",
           "budget_s": f"the noise and the races stop there: the lesson's {minutes:g} minutes less its fixed parts",
           "compile_s": f"a first torch.compile on {card.cpu_cores} CPU cores (estimate)",
           "compile_again_s": f"a step's torch.compile tried again, on {card.cpu_cores} CPU cores (estimate)",
           "rates": f"images/s: the card's rate × {STEP_SHARE} over the job's FLOPs an image (estimates); the races "
                    "plan with them until they are measured"}
    return LessonPlan("08", TITLE, card, False, sizes, why, parts, memory_gb(job), chosen, minutes, FEATURES)


@dataclass(frozen=True)
class Rates:
    """A job's training images/s on a card, planned: the naive job (the per-sample pipeline, then the float32 step:
    the per-step ``.item()`` and the in-process loader overlap neither), the job with its data on the device (float32,
    TF32 convolutions where the card has them) and the same in mixed precision."""

    naive: float
    device: float
    amp: float

    @classmethod
    def planned(cls, card: Card, job: capstone.Sizes, amp: str) -> "Rates":
        flops = training_flops(job.widths)
        device, mixed = (STEP_SHARE * card.tflops(p) * 1e12 / flops for p in ("tf32" if card.tf32 else "fp32", amp))
        return cls.on_gpu(device, mixed)

    @classmethod
    def on_gpu(cls, device: float, amp: float) -> "Rates":
        """The rates where the GPU trains the job at ``device`` images/s in float32, ``amp`` in mixed precision: the
        naive job's from those and the per-sample pipeline's."""
        return cls(1 / (1 / PIPELINE_PER_S + 1 / device), device, amp)

    def slower(self, share: float) -> "Rates":
        """The rates where the GPU reaches ``share`` of the planned ones (the per-sample pipeline on the CPU as
        planned)."""
        return Rates.on_gpu(share * self.device, share * self.amp)

    def __str__(self) -> str:
        return (f"naive job {self.naive:,.0f}, data on the device {self.device:,.0f}, mixed precision "
                f"{self.amp:,.0f} images/s")

    def of(self, options: dict | None) -> float:
        """The rate of a configuration (``options``; None: the naive job)."""
        if options is None or options.get("pipeline", "per-sample") == "per-sample":
            return self.naive
        return self.amp if options.get("amp") else self.device


def steps(job: capstone.Sizes, amp: str) -> list[tuple[str, dict]]:
    """The path's steps, (name, the options it adds) each, as lesson 08 races them on a GPU."""
    big = job.larger * job.batch
    return [("data on the GPU", dict(pipeline="device")),
            (f"channels_last + autocast {DTYPE_NAMES[amp]}", dict(channels_last=True, amp=True)),
            (f"batch {big}, lr ×{job.larger}", dict(batch=big, lr=job.larger * job.lr)),
            ("no per-step sync", dict(sync_each_step=False)),
            ("fused SGD", dict(fused=True)),
            ("torch.compile", dict(compile="default")),
            ("whole step in a CUDA graph", dict(cuda_graph=True, fused=True, sync_each_step=False))]


def path_seconds(steps, rate, job: capstone.Sizes, compile_s: float,
                 noise_seeds=capstone.NOISE_SEEDS) -> list[tuple[str, float]]:
    """The noise and each race of ``steps`` ((name, options) each), in seconds, as if every step were kept: the noise
    is ``noise_seeds`` runs of the job with its data on the device, each with its evaluations; a race is planned as the
    lesson plans it before it starts (``race_seconds``), at the rate of the configuration it races
    (``rate(options)``, images/s; options None: the naive job), with ``compile_s`` where a step compiles first."""
    device_job = {"pipeline": "device"}
    evaluations = evaluation_s(job.epochs, job.n_test, rate(device_job))
    rows = [(noise_part(noise_seeds), len(noise_seeds) * (job.images_per_run / rate(device_job) + evaluations))]
    kept = None
    for name, options in steps:
        candidate = {**(kept or {}), **options}
        startup = compile_s if candidate.get("compile") and not (kept or {}).get("compile") else 0.0
        big = replace(job, batch=candidate.get("batch", job.batch))
        rows.append((f"race: {name}", race_seconds(big.images_per_run, big.images_per_round, rate(kept),
                                                   startup + 2 * evaluations)))
        kept = candidate
    return rows


def race_seconds(images_per_run: int, images_per_round: int, rate: float, other_s: float) -> float:
    """A race's seconds, planned before it starts: both sides' images and another seed's first round of the
    configuration it races (the race's yardstick), all at ``rate``, that configuration's images/s (the candidate, meant
    to be faster, is not measured yet), plus ``other_s`` (start-up and the evaluations)."""
    return racing.planned_seconds([images_per_run, images_per_run, images_per_round], [rate] * 3, other_s)


def evaluation_s(epochs: int, n_test: int, device_rate: float) -> float:
    """One run's evaluations: after every epoch, the test images forward (a third of a training step's FLOPs) at the
    rate of the job with its data on the device (the lesson evaluates every model there)."""
    return epochs * n_test / (3 * device_rate)


def noise_part(seeds=capstone.NOISE_SEEDS) -> str:
    return f"noise: seeds {', '.join(map(str, seeds))} of the job, data on the device"


def regimes(card: Card, job: capstone.Sizes, rates: Rates, slow_path, budget_s: float) -> tuple[Regime, ...]:
    """What the lesson needs of this job on this card: the naive job far from the card's limit, the input pipeline
    setting its pace, every step raced within the budget (``slow_path``: the noise and the races at ``SLOWER`` of the
    planned rates), the larger batch within the card's memory."""
    amp, slow_s = card.amp_precision, sum(s for _, s in slow_path)
    return (
        Regime("the naive job far from the card's limit", bool(rates.amp >= FAR * rates.naive),
               f"the naive job {rates.naive:,.0f} images/s planned, this network in {amp} with its data on the device "
               f"{rates.amp:,.0f}: {rates.amp / rates.naive:.1f}× (at least {FAR:g}×)"),
        Regime("the input pipeline sets the naive job's pace", bool(PIPELINE_PER_S < rates.device),
               f"the per-sample pipeline {1e3 / PIPELINE_PER_S:.2f} ms an image on one core, the card's float32 step "
               f"{1e3 / rates.device:.2f} ms: the GPU waits for the CPU, which data on the GPU removes"),
        Regime("every step races within the budget", bool(slow_s <= budget_s),
               f"the noise and {len(slow_path) - 1} races planned at {slow_s:.0f} s of the {budget_s:.0f} s budget "
               f"where the GPU trains at {SLOWER:.0%} of the planned rates"),
        Regime("the larger batch fits the card's memory", bool(memory_gb(job) <= card.usable_gb()),
               f"{memory_gb(job):.1f} GB for a race at batch {job.larger * job.batch} in float32 of "
               f"{card.usable_gb():.1f} GB usable"),
    )


def basis(part: str, job: capstone.Sizes, rates: Rates, compile_s: float) -> str:
    if part.startswith("noise"):
        return (f"{job.images_per_run:,} images a run at {rates.device:,.0f} images/s (float32, the card's rate × "
                f"{STEP_SHARE}: an estimate), and its evaluations")
    compiles = f"; a first compile, {compile_s:.0f} s" if "compile" in part else ""
    return f"each side's {job.images_per_run:,} images at the planned rates, another seed's round, evaluations{compiles}"


def compile_scale(card: Card) -> float:
    """A torch.compile of the network on the card's host against 16 cores (``COMPILE_S``, ``COMPILE_AGAIN_S``): longer
    on fewer (inductor compiles its kernels in parallel, the rest on one core: the square root of the ratio, an
    estimate, as lessons 06 and 10 scale theirs)."""
    return math.sqrt(max(16 / max(card.cpu_cores, 1), 1.0))


def training_flops(widths: tuple) -> float:
    """FLOPs of one training image through ``models.SpeedrunNet(widths)``: every convolution (2·9·C_in·C_out per output
    pixel) and the classifier, forward and backward (three times the forward, less the first convolution's input
    gradient, which nothing needs); tests/test_lesson08_plan.py checks it against FlopCounterMode."""
    stem, *blocks = widths
    convs, size, c_in = [(3, stem, 32)], 32, stem
    for c_out in blocks:  # a block: a convolution at its input size, a 2x2 max-pool, a convolution at half that size
        convs += [(c_in, c_out, size), (c_out, c_out, size // 2)]
        size, c_in = size // 2, c_out
    forward = [2 * 9 * a * b * s * s for a, b, s in convs] + [2 * widths[-1] * 10]
    return 3 * sum(forward) - forward[0]


# Bytes a training step keeps per activation element it saves for backward, and the share more that backward's
# gradients and the allocator's caching add at the peak: tests/test_lesson08_plan.py bounds a measured step with them.
SAVED_BYTES, PEAK_FACTOR = 4, 1.5


def memory_gb(job: capstone.Sizes) -> float:
    """The device memory of the largest experiment, predicted: a race at the larger batch in float32 (two jobs, each
    with the padded uint8 images on the device and its weights, gradients and momentum; one step's activations at a
    time). Activations: every layer's input that backward needs (a convolution's, BatchNorm's, GELU's, a max-pool's
    with its indices), three of the network's widths at each resolution."""
    stem, *blocks = job.widths
    saved = 3 * 32 * 32 + 3 * stem * 32 * 32 + sum(3 * c * s * s for c, s in zip(blocks, (32, 16, 8)))
    params = 27 * stem + sum(9 * a * b + 9 * b * b for a, b in zip((stem, *blocks), blocks)) + 10 * blocks[-1]
    activations = PEAK_FACTOR * SAVED_BYTES * saved * job.larger * job.batch
    per_job = job.n_train * 3 * 40 * 40 + 3 * 4 * params
    return (2 * per_job + activations) / 1e9
