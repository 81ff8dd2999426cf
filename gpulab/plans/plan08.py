"""Lesson 08's plan: the capstone job sized from the card, and the noise and the path's races inside one budget.

The job is the widest network and the most training images (``WIDTHS``, ``IMAGES``, largest first) for which, on this
card, the naive job stays far from the card's limit (its per-sample CPU pipeline, not the GPU, sets its pace, and the
card trains the network in mixed precision several times faster than the naive job does), the noise and every race of
the path fit the budget with room to spare, and the larger batch fits the card's memory. The budget is the lesson's
minutes less its fixed parts: the lesson stops the noise and the races there, whatever the rates turn out to be. Quick
mode keeps ``capstone.QUICK_SIZES``; the precision (bf16, or fp16 with a GradScaler) follows the card in both modes.
"""

import math
from dataclasses import dataclass, replace

from .. import capstone
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
FILL = 0.85  # the noise and the races planned to fill at most this share of the budget: room for slower rates
COMPILE_S = 25.0  # a first torch.compile of the network: 22.7 s on the 2026-11-28 H200's 16 cores (quick mode's
# network: its operators, not their widths, set it); fewer cores compile for longer (inductor's workers): an estimate
COMPILE_AGAIN_S = 10.0  # estimate: a retry compiles the same network again and reuses what is cached (dynamo's guards
# hold for a new model of the same class, torch/_dynamo/config.py inline_inbuilt_nn_modules; inductor's FX graphs and
# Triton kernels on disk)
FIXED_S = {"start, data, FLOPs, reference tables": 15.0, "ceilings, busy windows, figures": 30.0}  # estimates; the
# start: the 2026-11-28 H200 run's first GPU memory appeared 15 s into the part
FEATURES = ("bf16", "tf32", "gpm")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    amp = card.amp_precision if card.is_gpu else "bf16"  # a CPU's autocast runs bf16
    if quick:
        sizes = dict(job=capstone.QUICK_SIZES, amp=amp, budget_s=math.inf, compile_s=COMPILE_S)
        return LessonPlan("08", TITLE, card, True, sizes, features=FEATURES)
    minutes = target_minutes(card, long=True)
    budget_s, compile_s = 60 * minutes - sum(FIXED_S.values()), round(compile_seconds(card), 1)
    options = []
    for widths in WIDTHS:
        for n_train in IMAGES:
            job = replace(capstone.FULL_SIZES, widths=widths, n_train=n_train)
            rates = Rates.planned(card, job, amp)
            path = path_seconds(steps(job, amp), rates.of, job, compile_s)
            options.append((job, rates, path, regimes(card, job, rates, path, budget_s)))
    job, rates, path, chosen = next((o for o in options if all(r.holds for r in o[3])), options[-1])
    (start, start_s), (finish, finish_s) = FIXED_S.items()
    parts = (Part(start, start_s, "estimate"), *(Part(name, s, basis(name, job, rates, compile_s)) for name, s in path),
             Part(finish, finish_s, "estimate"))
    sizes = dict(job=job, amp=amp, budget_s=budget_s, compile_s=compile_s)
    why = {"job": f"the widest network and the most images (of {len(WIDTHS)} widths × {len(IMAGES)} sizes) whose naive "
                  "job stays far from this card's limit, whose noise and races fit the budget and whose larger batch "
                  "fits the card's memory",
           "amp": "native bf16" if amp == "bf16" else "no native bf16: fp16 autocast, with a GradScaler",
           "budget_s": f"the noise and the races stop there: the lesson's {minutes:g} minutes less its fixed parts",
           "compile_s": f"a first torch.compile on {card.cpu_cores} CPU cores (estimate)"}
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
        return cls(1 / (1 / PIPELINE_PER_S + 1 / device), device, mixed)

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
    is ``noise_seeds`` runs of the job with its data on the device; a race is each side's images over ``rate(options)``
    (images/s; options None: the naive job), another seed's first round of the configuration before it (the race's
    yardstick), ``compile_s`` where a step compiles first, and each run's evaluations (after every epoch, the test
    images forward, a third of a training step's FLOPs, at the rate of the job with its data on the device: the lesson
    evaluates every model there)."""
    def run_s(options) -> float:
        return replace(job, batch=(options or {}).get("batch", job.batch)).images_per_run / rate(options)

    device_job = {"pipeline": "device"}
    evaluations = job.epochs * job.n_test / (3 * rate(device_job))
    rows = [(noise_part(noise_seeds), len(noise_seeds) * (run_s(device_job) + evaluations))]
    kept = None
    for name, options in steps:
        candidate = {**(kept or {}), **options}
        startup = compile_s if candidate.get("compile") and not (kept or {}).get("compile") else 0.0
        rows.append((f"race: {name}", run_s(kept) + run_s(candidate) + 2 * evaluations
                     + job.images_per_round / rate(kept) + startup))
        kept = candidate
    return rows


def noise_part(seeds=capstone.NOISE_SEEDS) -> str:
    return f"noise: seeds {', '.join(map(str, seeds))} of the job, data on the device"


def regimes(card: Card, job: capstone.Sizes, rates: Rates, path, budget_s: float) -> tuple[Regime, ...]:
    """What the lesson needs of this job on this card: the naive job far from the card's limit, the input pipeline
    setting its pace, every step raced within the budget, the larger batch within the card's memory."""
    amp, planned_s = card.amp_precision, sum(s for _, s in path)
    return (
        Regime("the naive job far from the card's limit", bool(rates.amp >= FAR * rates.naive),
               f"the naive job {rates.naive:,.0f} images/s planned, this network in {amp} with its data on the device "
               f"{rates.amp:,.0f}: {rates.amp / rates.naive:.1f}× (at least {FAR:g}×)"),
        Regime("the input pipeline sets the naive job's pace", bool(PIPELINE_PER_S < rates.device),
               f"the per-sample pipeline {1e3 / PIPELINE_PER_S:.2f} ms an image on one core, the card's float32 step "
               f"{1e3 / rates.device:.2f} ms: the GPU waits for the CPU, which data on the GPU removes"),
        Regime("every step races within the budget", bool(planned_s <= FILL * budget_s),
               f"the noise and {len(path) - 1} races planned at {planned_s:.0f} s of the {budget_s:.0f} s budget "
               f"(at most {FILL:.0%}: room for rates below the plan)"),
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


def compile_seconds(card: Card) -> float:
    """A first torch.compile of the network on the card's host: ``COMPILE_S`` on 16 cores, longer on fewer (inductor
    compiles its kernels in parallel, the rest on one core: the square root of the ratio, an estimate)."""
    return COMPILE_S * math.sqrt(max(16 / max(card.cpu_cores, 1), 1.0))


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
