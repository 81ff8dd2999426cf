"""Lesson 07's plan: how many ranks, on which backend, and how much work each gets, from the machine's GPUs, the card
and its host.

With one GPU or none, the multi-process runs are **gloo processes on the CPU**, one core each, with CPU-sized work
(``GLOO_WORK``): the lesson says so, and what a second GPU would change. With one GPU, that GPU also trains the same
DDP step on one NCCL rank, for section 5's projection to GPU clusters: its width is the narrowest whose step is the
card's own work, not the host's (its FLOPs at the card's fp32 rate at least ``GPU_BOUND`` times the host's time for a
step), within the card's memory. With two GPUs or more, the runs are **NCCL**, one rank per GPU: the width by the same
rule, the batch the largest whose all-reduce of the gradients is still a visible share of the step over the link
between the GPUs (``gpu_link``: NVLink on SXM boards, else the card's PCIe link: an estimate of how the machine is
built), the largest collective from the card's memory. The scaling model itself (``gpulab.distributed``) predicts each
step from these inputs. Quick mode keeps its small fixed sizes.
"""

import functools
import math

import torch
from torch import nn

from ..distributed.collectives import Link, ring_allreduce_seconds
from ..distributed.scaling import ddp_step_seconds
from ..distributed.work import WorkSize, rank_counts
from ..models import WideMLP
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .predict import bench_s

TITLE = "More than one GPU: DDP, FSDP, collectives and scaling"
FEATURES = ("second gpu",)
QUICK_WORK = WorkSize(width=512, batch=64, rounds=5, calls=1, max_bytes=2**24, iters=20)
QUICK_TIME_LIMIT_S = 300
# gloo ranks on the CPU: a WideMLP of width 512, 64 samples a rank (its step about 10 ms of one core), messages up to
# 16 MiB (past gloo's crossover, ``GLOO``), 8 rounds of 2 steps per comparison
GLOO_WORK = WorkSize(width=512, batch=64, rounds=8, calls=2, max_bytes=2**24)
ROUNDS, CALLS = 16, 5  # GPU ranks: interleaved rounds per comparison, steps per timed block
WIDTHS = (1024, 2048, 4096, 8192)  # the GPU's WideMLP, narrowest first
BATCHES = (256, 128, 64)  # samples per GPU rank and step, largest first
MAX_BYTES = 2**30  # the largest collective timed on GPUs, where the memory allows it
BUCKET_CAPS = 3  # ddp_tuning.py keeps a model for each bucket_cap_mb at once

# gloo's all-reduce between two one-thread processes on one host, fitted to the 2026-11-28 H200 host's sweep (lesson
# 07, quick mode: "latency 114 µs per ring step, bandwidth 2.14 GB/s"): an estimate for any host
GLOO = Link("gloo over the loopback (estimate)", 2.14e9, 114e-6, "the 2026-11-28 H200 host's fitted all-reduce")
# One core's step of the gloo ranks' WideMLP: 9.89 ms a step of width 512, 64 samples, one thread (the 2026-11-28 H200
# host, tests/data/07_multi_gpu): its FLOPs over that, against one core of the H100 VM's matmul rate (``Card.cpu_tflops``)
H200_CPU_STEP_S = 9.89e-3
# The host's time for a DDP step of this MLP, Python and launches: the H200's one NCCL rank at width 512 took 1.64 ms a
# step, launch-bound (eight lessons shared its 16 cores: an upper estimate)
HOST_STEP_S = 1.64e-3
GPU_BOUND = 2.0  # a GPU's step planned at least this many times the host's time for it: the card's own work
VISIBLE = 0.1  # the all-reduce of the gradients at least this share of a step's compute: its cost shows
BACKWARD_SHARE = 2 / 3  # of a step's compute, the backward pass's: what DDP's buckets can hide communication behind
NVLINK_GBS = {"A100": 300, "H100": 450, "H200": 450, "B200": 900}  # NVLink 3, 4, 5: GB/s each way per GPU (vendor)
NCCL_SHARE = 0.8  # of a link's vendor bandwidth, what NCCL's bus bandwidth reaches (estimate)
NCCL_LATENCY_S = 10e-6  # per ring step (estimate: vendors publish none)
IMPORT_S = 3.0  # a Python process importing torch and gpulab (estimate; a launch on the H200 took 10 s, contended)
NCCL_START_S = 4.0  # a CUDA context and NCCL's communicator, per launch on GPUs (estimate)
RENDEZVOUS_S = 1.0  # torchrun's rendezvous and teardown (estimate)
START_S, FIGURES_S = 10.0, 10.0  # imports and device facts; tables and figures (estimates)
BARRIER_S = 2 * GLOO.latency  # ranks meeting before each timed block
TIME_LIMIT_WHY = "seconds a launch may take before all its processes are stopped: 3× the longest planned, 5 min at least"


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    ranks = rank_counts(card.gpus)
    backend = "nccl" if card.gpus >= 2 else "gloo"
    if quick:
        sizes = dict(ranks=ranks, backend=backend, work=QUICK_WORK, time_limit=QUICK_TIME_LIMIT_S)
        if card.gpus == 1:
            sizes["gpu_work"] = QUICK_WORK
        return LessonPlan("07", TITLE, card, True, sizes, features=FEATURES)
    return _gpus(card, ranks) if backend == "nccl" else _gloo(card, ranks)


# ---- the model and its rates ---------------------------------------------------------------------------------------

@functools.cache
def mlp(width: int) -> tuple[int, float]:
    """The WideMLP's parameters and the FLOPs of one sample's training step: per weight, 2 for the forward matmul, 2
    for the weight's gradient and 2 for the input's (not the first layer's: its input needs none), as
    ``gpulab.flops.training_flops`` counts them (tests/test_lesson07_plan.py compares the two; the count here takes
    no time, FlopCounterMode's first use seconds)."""
    with torch.device("meta"):
        layers = [m for m in WideMLP(width=width).modules() if isinstance(m, nn.Linear)]
    weights = [layer.weight.numel() for layer in layers]
    return sum(p.numel() for layer in layers for p in layer.parameters()), 6.0 * sum(weights) - 2.0 * weights[0]


def cpu_step_s(work: WorkSize) -> float:
    """A gloo rank's compute for one step, on one core: the H200 host's one-thread step at ``GLOO_WORK``'s sizes,
    scaled by the FLOPs (every host's core is planned alike: ``Card.cpu_tflops`` is one core's rate times the cores)."""
    return H200_CPU_STEP_S * work.batch * mlp(work.width)[1] / (GLOO_WORK.batch * mlp(GLOO_WORK.width)[1])


def compute_s(card: Card, work: WorkSize, *, gpu: bool) -> float:
    """The plan's compute for one rank's step of ``work``: on the card's GPU, or on one core of its host (gloo)."""
    return gpu_step_s(card, work.width, work.batch) if gpu else cpu_step_s(work)


def gpu_work_s(card: Card, width: int, batch: int) -> float:
    """The FLOPs of a GPU rank's step at the card's fp32 rate (the scripts leave TF32 off: torch's default)."""
    return batch * mlp(width)[1] / (card.tflops("fp32") * 1e12)


def gpu_step_s(card: Card, width: int, batch: int) -> float:
    return max(gpu_work_s(card, width, batch), HOST_STEP_S)


def gpu_link(card: Card) -> Link:
    """The link between two of the machine's GPUs, as the plan guesses it: NVLink on SXM boards (its generation's
    vendor bandwidth), the card's PCIe link otherwise (at the share pinned copies reach), each at NCCL's share."""
    name = card.sheet.name
    family = next((f for f in NVLINK_GBS if name.startswith(f)), None)
    if family and ("SXM" in name or family == "B200"):
        return Link(f"NVLink ({name}, estimate)", NVLINK_GBS[family] * 1e9 * NCCL_SHARE, NCCL_LATENCY_S,
                    f"vendor: {NVLINK_GBS[family]} GB/s each way, {NCCL_SHARE:.0%} of it reached (estimate)")
    generation, lanes = card.sheet.pcie
    return Link(f"PCIe Gen{generation} x{lanes} (estimate)", card.host_gbs * 1e9, NCCL_LATENCY_S,
                "the card's PCIe link at the share pinned copies reach (estimate)")


def grad_bytes(width: int) -> float:
    return 4.0 * mlp(width)[0]


# ---- the plans -------------------------------------------------------------------------------------------------------

def _gloo(card: Card, ranks: list[int]) -> LessonPlan:
    """One GPU or none: gloo processes on the CPU; with one GPU, one NCCL rank on it for the projection."""
    work, n = GLOO_WORK, max(ranks)
    compute = cpu_step_s(work)
    sizes = dict(ranks=ranks, backend="gloo", work=work)
    why = {"work": f"gloo ranks, one core each: a step of about {compute * 1e3:.0f} ms of compute, gradients of "
                   f"{grad_bytes(work.width) / 2**20:.1f} MiB"}
    launches = _launches(card, n, nccl=False)
    parts = [Part("start", START_S, "imports, device facts (estimate)"),
             Part("launching: hello, a failing rank, mp.spawn", 2 * launches + IMPORT_S * 2 + RENDEZVOUS_S,
                  f"torchrun on {n} gloo ranks twice and mp.spawn: each process imports torch (estimate)"),
             Part("collectives", launches + collectives_s(work, n, GLOO), f"3 collectives × 13 sizes up to "
                  f"{work.max_bytes // 2**20} MiB on {n} gloo ranks, at {GLOO.bandwidth / 1e9:.2f} GB/s (estimate)"),
             *_ddp_parts(work, ranks, compute, GLOO, 0.0, launches, "gloo ranks")]
    regimes = [_sweep(work, n, GLOO), _visible(work.width, compute, GLOO, "gloo ranks")]
    memory = 0.0
    if card.gpus == 1:
        batch = BATCHES[0]
        gpu = WorkSize(width=_width(card, batch, lambda w: _model_gb(w, batch)), batch=batch, rounds=ROUNDS,
                       calls=CALLS, max_bytes=0)  # one rank: no collectives
        sizes["gpu_work"] = gpu
        why["gpu_work"] = _width_why(card, gpu)
        step = gpu_step_s(card, gpu.width, gpu.batch)
        parts.append(Part("DDP on the GPU, one NCCL rank", _launches(card, 1, nccl=True) + ddp_train_s(gpu, [1], step,
                          GLOO, 0.0), f"width {gpu.width}: {step * 1e3:.1f} ms a step at fp32 {card.tflops('fp32'):.1f} "
                          "TFLOP/s (predicted)"))
        regimes.append(_gpu_bound(card, gpu))
        memory = _model_gb(gpu.width, gpu.batch)
    parts += [Part("FSDP's bytes", launches + 2.0, f"{n} gloo ranks, three small steps (estimate)"),
              Part("tables and figures", FIGURES_S, "estimate")]
    sizes["time_limit"] = _time_limit(parts)
    why["time_limit"] = TIME_LIMIT_WHY
    return LessonPlan("07", TITLE, card, False, sizes, why, tuple(parts), memory, tuple(regimes), target_minutes(card),
                      FEATURES)


def _gpus(card: Card, ranks: list[int]) -> LessonPlan:
    """Two GPUs or more: NCCL, one rank per GPU, sized from the card's rate, memory and link."""
    link, n = gpu_link(card), max(ranks)
    widths = {b: _width(card, b, lambda w, b=b: _gpus_gb(w, b, ranks, 0)) for b in BATCHES}
    batch = next((b for b in BATCHES if _share(card, widths[b], b, link) >= VISIBLE), BATCHES[-1])
    width = widths[batch]
    max_bytes = MAX_BYTES
    while _gpus_gb(width, batch, ranks, max_bytes) > card.usable_gb() and max_bytes > 2**24:
        max_bytes //= 2
    work = WorkSize(width=width, batch=batch, rounds=ROUNDS, calls=CALLS, max_bytes=max_bytes)
    compute = gpu_step_s(card, width, batch)
    launches = _launches(card, n, nccl=True)
    why = {"work": _width_why(card, work) + f"; {batch} samples a rank: the largest of {BATCHES} whose all-reduce over "
                   f"{link.name} is at least {VISIBLE:.0%} of a step's compute",
           "time_limit": TIME_LIMIT_WHY}
    if max_bytes < MAX_BYTES:
        why["work"] += f"; collectives up to {max_bytes // 2**20} MiB: three buffers of it fit the card's memory"
    dp_s = bench_s(2 * ddp_step_seconds(compute, grad_bytes(width), n, link, BACKWARD_SHARE) * CALLS, repeats=ROUNDS)
    parts = [Part("start", START_S, "imports, device facts (estimate)"),
             Part("launching: hello, a failing rank, CUDA_VISIBLE_DEVICES, mp.spawn",
                  2 * launches + _launches(card, 1, nccl=True) + 2 * IMPORT_S + RENDEZVOUS_S,
                  f"torchrun on {n} GPUs twice, on one, and mp.spawn (estimate)"),
             Part("collectives", launches + collectives_s(work, n, link), f"3 collectives × sizes up to "
                  f"{max_bytes // 2**20} MiB on {n} GPUs over {link.name}"),
             *_ddp_parts(work, ranks, compute, link, BACKWARD_SHARE, launches, "GPUs"),
             Part("DataParallel", dp_s, f"{ROUNDS} blocks of {CALLS} steps on {n} GPUs (estimate: twice DDP's step)"),
             Part("FSDP's bytes", launches + 2.0, f"{n} NCCL ranks, three steps (estimate)"),
             Part("tables and figures", FIGURES_S, "estimate")]
    regimes = (_sweep(work, n, link), _visible(width, compute, link, "GPUs"), _gpu_bound(card, work))
    sizes = dict(ranks=ranks, backend="nccl", work=work, time_limit=_time_limit(parts))
    return LessonPlan("07", TITLE, card, False, sizes, why, tuple(parts), _gpus_gb(width, batch, ranks, max_bytes),
                      regimes, target_minutes(card), FEATURES)


def _width(card: Card, batch: int, memory_gb) -> int:
    """The narrowest width whose step is the card's own work (``GPU_BOUND``), among those that fit its memory."""
    fits = [w for w in WIDTHS if memory_gb(w) <= card.usable_gb()] or [WIDTHS[0]]
    return next((w for w in fits if gpu_work_s(card, w, batch) >= GPU_BOUND * HOST_STEP_S), fits[-1])


def _width_why(card: Card, work: WorkSize) -> str:
    step, bound = gpu_work_s(card, work.width, work.batch), GPU_BOUND * HOST_STEP_S
    if step >= bound:
        return (f"width {work.width}: the narrowest of {WIDTHS} whose step ({step * 1e3:.1f} ms at fp32) is at least "
                f"{GPU_BOUND:g}× the host's {HOST_STEP_S * 1e3:.2f} ms for it")
    return (f"width {work.width}: the widest of {WIDTHS} that fits the card's memory; its step ({step * 1e3:.1f} ms at "
            f"fp32) is short of {GPU_BOUND:g}× the host's {HOST_STEP_S * 1e3:.2f} ms")


def _share(card: Card, width: int, batch: int, link: Link) -> float:
    return ring_allreduce_seconds(grad_bytes(width), 2, link) / gpu_step_s(card, width, batch)


# ---- memory -----------------------------------------------------------------------------------------------------------

def _model_gb(width: int, batch: int) -> float:
    """A DDP model with SGD: its weights, gradients and DDP's buckets (4 bytes a parameter each), and one step's
    activations (about ten floats a sample and unit, estimate)."""
    return (12 * mlp(width)[0] + 10 * 4 * batch * width) / 1e9


def _gpus_gb(width: int, batch: int, ranks: list[int], max_bytes: int) -> float:
    """On GPU 0, the most at once: rank 0's model for each rank count (ddp_train.py) or for each bucket cap
    (ddp_tuning.py), FSDP's script (AdamW: 20 bytes a parameter), with the kernel's DataParallel model beside them; or
    three buffers of the largest collective."""
    models = max(len(_counts(max(ranks))), BUCKET_CAPS) * _model_gb(width, batch)
    return max(models + _model_gb(width, batch * max(ranks)), 20 * mlp(width)[0] / 1e9, 3 * max_bytes / 1e9)


# ---- the seconds --------------------------------------------------------------------------------------------------------

def _launches(card: Card, nproc: int, *, nccl: bool) -> float:
    """One torchrun launch: the launcher and its ranks import torch (as many at once as the host has cores), NCCL
    starts on GPUs, the ranks meet and part."""
    return IMPORT_S * (1 + math.ceil(nproc / card.cpu_cores)) + (NCCL_START_S if nccl else 0.0) + RENDEZVOUS_S


def _counts(world: int) -> list[int]:
    """The rank counts ddp_train.py times: 1, 2, 4, ... and every rank."""
    return sorted({*(2**i for i in range(world.bit_length()) if 2**i <= world), world})


def collectives_s(work: WorkSize, n: int, link: Link) -> float:
    """collectives.py: each collective at each size, 2 warm-up calls and 3 timed rounds of ``iters`` calls."""
    total = 0.0
    for k in range(12, work.max_bytes.bit_length()):
        nbytes, iters = 2**k, max(2, min(work.iters, 2**22 // 2**k))
        one_way = (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth  # all-gather, reduce-scatter
        total += (2 + 3 * iters) * (ring_allreduce_seconds(nbytes, n, link) + 2 * one_way + 3 * BARRIER_S / iters)
    return total


def ddp_train_s(work: WorkSize, counts: list[int], compute: float, link: Link, overlap: float) -> float:
    """ddp_train.py's scaling: a step and the same step inside no_sync() on each rank count, and a forward pass, each
    called twice untimed, then in ``rounds`` blocks of ``calls``."""
    steps = sum(ddp_step_seconds(compute, grad_bytes(work.width), k, link, overlap) for k in counts)
    per_call = steps + len(counts) * compute + compute / 3
    return (2 + work.rounds * work.calls) * per_call + work.rounds * (2 * len(counts) + 1) * BARRIER_S


def ddp_tuning_s(work: WorkSize, n: int, compute: float, link: Link, overlap: float) -> float:
    """ddp_tuning.py: three bucket caps (two settling steps, two untimed, the blocks), then accumulation three ways
    (no all-reduce, one, four) over four micro-batches."""
    step = ddp_step_seconds(compute, grad_bytes(work.width), n, link, overlap)
    reduce = ring_allreduce_seconds(grad_bytes(work.width), n, link)
    calls = 3 + work.rounds * work.calls
    accumulation = sum(calls * (compute + r * reduce) for r in (0, 1, 4))
    return BUCKET_CAPS * (4 + work.rounds * work.calls) * step + 2 * step + accumulation


def _ddp_parts(work, ranks, compute, link, overlap, launches, where) -> list[Part]:
    n = max(ranks)
    step = ddp_step_seconds(compute, grad_bytes(work.width), n, link, overlap)
    return [Part("DDP: gradients and scaling", launches + ddp_train_s(work, _counts(n), compute, link, overlap),
                 f"{where}: {compute * 1e3:.1f} ms of compute a step, {step * 1e3:.1f} ms a DDP step on {n} (the "
                 f"scaling model's estimate); {work.rounds} rounds of {work.calls}"),
            Part("DDP: buckets and accumulation", launches + ddp_tuning_s(work, n, compute, link, overlap),
                 f"3 bucket caps and 3 ways of accumulating, {work.rounds} rounds of {work.calls}")]


def _time_limit(parts: list[Part]) -> int:
    longest = max(p.seconds for p in parts if p.name not in ("start", "tables and figures"))
    return int(max(300, 3 * longest))


# ---- the regimes --------------------------------------------------------------------------------------------------------

def _sweep(work: WorkSize, n: int, link: Link) -> Regime:
    """The collectives' sweep reaches both regimes: its smallest message well under the crossover, its largest well
    over it."""
    crossover = link.crossover_bytes(n)
    holds = 4 * 2**12 <= crossover <= work.max_bytes / 4
    return Regime("the collectives' sweep spans both regimes", bool(holds),
                  f"{link.name}: latency and bandwidth cost the same at {crossover / 2**10:,.0f} KiB on {n} ranks; "
                  f"the sweep runs from 4 KiB to {work.max_bytes / 2**20:,.0f} MiB (at least 4× each side)")


def _visible(width: int, compute: float, link: Link, where: str) -> Regime:
    """The all-reduce of the gradients is a visible share of a step (the scaling model's inputs from the plan): the
    cost of scaling, of small buckets and of accumulating without no_sync() shows against the step's noise."""
    reduce = ring_allreduce_seconds(grad_bytes(width), 2, link)
    return Regime("the all-reduce is a visible share of a step", bool(reduce >= VISIBLE * compute),
                  f"{where}: the all-reduce of {grad_bytes(width) / 2**20:.1f} MiB of gradients on 2 ranks takes "
                  f"{reduce * 1e3:.2f} ms against {compute * 1e3:.2f} ms of compute a step ({reduce / compute:.0%}; at "
                  f"least {VISIBLE:.0%})")


def _gpu_bound(card: Card, work: WorkSize) -> Regime:
    """The GPU's step is its own work, not the host's: the projection's compute is the card's."""
    gpu = gpu_work_s(card, work.width, work.batch)
    return Regime("the GPU's step is the card's work", bool(gpu >= GPU_BOUND * HOST_STEP_S),
                  f"width {work.width}, {work.batch} samples: {gpu * 1e3:.2f} ms of FLOPs at fp32 against the host's "
                  f"{HOST_STEP_S * 1e3:.2f} ms for a step (at least {GPU_BOUND:g}×)")
