"""Lesson 04's plan: the matmul sweep in each precision the card runs natively, its ceilings, the MLP trained in each
precision, the GradScaler's demonstrations and fp16's underflow.

The card chooses the precisions (bf16 and TF32 only where native: fp16 with a GradScaler on a T4) in every mode. In full
mode the MLP's width is the largest that fits the card's memory and the lesson's minutes; its step time is predicted
from its FLOPs at the card's matmul rate plus the rest of the step (AdamW, LayerNorm, GELU, the casts), which moves
memory: the bytes per element the H100's shipped step times imply (``gpulab/reference/04_training_precision``, read
when this module is imported). What only a GPU shows (the tensor cores' roof, MFU) is kept to sizes where it holds.
"""

import functools

import torch
import torch.nn.functional as F

from .. import tasks
from ..precision import precision_support
from ..results import reference
from .card import MEASURED_ON, Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .predict import bench_s, compare_s, matmul_s, step_launches

TITLE = "Mixed precision"
LADDER = [2**i for i in range(8, 14)]  # 256 ... 8192: the sweep's squares
CALL_S = 0.25  # no fp32 product of the sweep takes longer
WIDTHS = (4096, 2048, 1024)  # the MLP's widths tried, widest first
DEPTH, BATCH, STEPS, POINTS = 3, 4096, 400, 500_000
UNDERFLOW_POINTS = (16384, 8192, 4096)  # the mean loss of section 4: over the most of these that fit
START_S = 10.0  # imports, device facts, the task's 500,000 points (estimate)
CEILING_S = 9.0  # flops.ceiling's search, per precision: 1 s warm-up, twelve shapes of ~0.55 s, 1 s rest (estimate)
GPU_BOUND = 2.0  # a step whose GPU work outlasts its launches this many times is the GPU's work: MFU means something
TENSOR_CORE_ROOF = 2.0  # a product this many times past the ridge point, and 10 launches long, runs at the roof
FEATURES = ("bf16", "tf32")  # what the lesson turns on where the card has it
PRECISIONS_WHY = "those this card runs natively: TF32 and bf16 from sm_80, fp16 (with a GradScaler) on any GPU"


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    precisions = [p for p, s in precision_support(card.compute_capability if card.is_gpu else None).items()
                  if s.available]
    amp = card.amp_precision if card.is_gpu else "bf16"
    if quick:
        sizes = dict(precisions=precisions, sweep_sizes=[32, 64, 128], sweep_min_time=0.02,
                     copy_elements=1 << 28 if card.is_gpu else 1 << 22, compare_min_time=0.2, compare_pairs=5,
                     aligned_n=256, width=128, depth=2, batch=256, steps=150, points=8192, step_min_time=0.05,
                     underflow_points=8192, scaler_steps=40, growth_interval=3)
        sizes["mfu"] = _gpu_bound(card, amp, sizes)
        why = {"precisions": PRECISIONS_WHY, "mfu": _mfu_why(card, amp, sizes)}
        return LessonPlan("04", TITLE, card, True, sizes, why, features=FEATURES)
    sweep = [n for n in LADDER if 3 * n * n * 4 <= card.usable_gb() * 1e9 and matmul_s(card, n) <= CALL_S]
    common = dict(precisions=precisions, sweep_sizes=sweep, sweep_min_time=0.2, copy_elements=1 << 28,
                  compare_min_time=1.0, compare_pairs=None, aligned_n=min(4096, sweep[-1]), depth=DEPTH, batch=BATCH,
                  steps=STEPS, points=POINTS, step_min_time=0.5, scaler_steps=300, growth_interval=20)
    candidates = [_full(card, amp, {**common, "width": w}) for w in WIDTHS]
    fitting = [c for c in candidates if c.memory_gb <= card.usable_gb() and c.minutes <= c.target_minutes]
    return (fitting or candidates[-1:])[0]


def _full(card: Card, amp: str, sizes: dict) -> LessonPlan:
    sizes = {**sizes, "underflow_points": _underflow_points(card, sizes)}
    sizes["mfu"] = _gpu_bound(card, amp, sizes)
    width, precisions = sizes["width"], sizes["precisions"]
    largest, aligned = sizes["sweep_sizes"][-1], sizes["aligned_n"]
    step = {p: step_s(card, p, sizes) for p in precisions}
    parts = (
        Part("start", START_S, "imports, device facts, the task's points (estimate)"),
        Part("matmul sweep", sum(bench_s(matmul_s(card, n, p), min_time=0.2) for p in precisions
                                 for n in sizes["sweep_sizes"]),
             f"{len(precisions)} precisions × {len(sizes['sweep_sizes'])} sizes, 0.2 s each"),
        Part("ceilings", CEILING_S * len(precisions), f"flops.ceiling's search, {CEILING_S:g} s a precision (estimate)"),
        Part("against fp32, and n against n - 1", sum(compare_s(matmul_s(card, largest), matmul_s(card, largest, p))
                                                      for p in precisions[1:])
             + compare_s(matmul_s(card, aligned, amp), matmul_s(card, aligned - 1, amp)),
             f"interleaved pairs at n = {largest} and n = {aligned}, 1 s each"),
        Part("training in each precision", sum(
            (sizes["steps"] + 4) * step[p] + bench_s(step[p], min_time=0.5)
            + (compare_s(step["fp32"], step[p]) if p != "fp32" else 0) for p in precisions),
            f"{sizes['steps']} steps of the width-{width} MLP per precision, its bench and pairs against fp32 "
            "(predicted step times)"),
        Part("fp16's underflow", 3 * step["fp32"] * sizes["underflow_points"] / sizes["batch"],
             f"three backward passes over {sizes['underflow_points']} points (predicted step times)"),
        Part("the GradScaler at work", (sizes["scaler_steps"] + 20) * step.get("fp16", step["fp32"]),
             f"{sizes['scaler_steps']} fp16 steps and a forced overflow"),
    )
    regimes = (
        _roof("the sweep's largest products reach the tensor cores' roof", card, amp, largest),
        _roof("n against n - 1 runs on the tensor cores", card, amp, aligned),
        Regime("the MLP's step is the GPU's work, not launches: its MFU means something", sizes["mfu"],
               _mfu_why(card, amp, sizes)),
    )
    why = {"precisions": PRECISIONS_WHY,
           "width": f"the widest of {', '.join(map(str, WIDTHS))} that fits the memory and the lesson's minutes",
           "sweep_sizes": f"up to the largest fp32 product that takes at most {CALL_S} s here and fits its memory",
           "underflow_points": f"the most of {', '.join(map(str, UNDERFLOW_POINTS))} points whose activations fit a "
                               "quarter of the memory",
           "mfu": _mfu_why(card, amp, sizes)}
    kept = len(precisions) * _params(sizes) * 16  # each precision's trained model and AdamW state stay alive
    memory = kept + max(_training_bytes(sizes), _underflow_bytes(sizes, sizes["underflow_points"]),
                        3 * largest**2 * 4, 2 * sizes["copy_elements"] * 4)
    return LessonPlan("04", TITLE, card, False, sizes, why, parts, memory_gb=memory / 1e9, regimes=regimes,
                      target_minutes=target_minutes(card), features=FEATURES)


# ---- the MLP's step, predicted ------------------------------------------------------------------------------------

DIM, CLASSES = 32, 10  # the teacher task's points and labels (gpulab.tasks.teacher_task)


def _weights(sizes: dict) -> int:
    """The MLP's matmul weights (gpulab.tasks.student_mlp): DIM → width, (depth - 1) × width → width, width → CLASSES."""
    width, depth = sizes["width"], sizes["depth"]
    return DIM * width + (depth - 1) * width * width + width * CLASSES


def _params(sizes: dict) -> int:
    """Every parameter: the weights, each Linear's bias and each LayerNorm's weight and bias."""
    return _weights(sizes) + 3 * sizes["depth"] * sizes["width"] + CLASSES


def step_flops(sizes: dict) -> float:
    """One training step's FLOPs as FlopCounterMode counts them: forward 2 per weight and point, backward twice that,
    less the first layer's input gradient, which backward does not compute."""
    return sizes["batch"] * (6 * _weights(sizes) - 2 * DIM * sizes["width"])


def _elements(sizes: dict) -> int:
    """What the rest of a step moves, per byte-per-element: each layer's activations and every parameter."""
    return sizes["batch"] * sizes["width"] * sizes["depth"] + _params(sizes)


@functools.cache
def _bytes_per_element() -> dict[str, float]:
    """The bytes the rest of a step moves per activation and weight, per precision: the H100's shipped step time less
    its matmuls at the H100's achievable rate, times its copy bandwidth, over ``_elements``."""
    h100 = Card.named(MEASURED_ON)
    rows = reference("04_training_precision").query("device_name == @MEASURED_ON")
    return {row.precision: float((row.median_s - matmul_flops_s(h100, row.precision, row._asdict())) * h100.copy_gbs
                                 * 1e9 / _elements(row._asdict())) for row in rows.itertuples()}


def matmul_flops_s(card: Card, precision: str, sizes: dict) -> float:
    return step_flops(sizes) / (card.tflops(precision) * 1e12)


def gpu_s(card: Card, precision: str, sizes: dict) -> float:
    """The GPU's work in one training step: its matmuls at the card's rate, the rest at its copy bandwidth."""
    rest = _bytes_per_element()[precision] * _elements(sizes) / (card.copy_gbs * 1e9)
    return matmul_flops_s(card, precision, sizes) + rest


@functools.cache
def launches(depth: int) -> int:
    """The kernels one of the lesson's training steps launches (bf16 autocast, AdamW with foreach, as on a GPU),
    counted on tiny CPU tensors: autocast has no meta device, and the CPU's casts the Linear layers as CUDA's does."""
    model = tasks.student_mlp(DIM, 16, depth, CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.zeros(4, DIM), torch.zeros(4, dtype=torch.long)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step_launches(step)


def launches_s(card: Card, sizes: dict) -> float:
    return launches(sizes["depth"]) * card.launch_s


def step_s(card: Card, precision: str, sizes: dict) -> float:
    """One training step: the GPU's work, or the launches where they take longer (the GPU then waits for them)."""
    return max(gpu_s(card, precision, sizes), launches_s(card, sizes))


def _gpu_bound(card: Card, amp: str, sizes: dict) -> bool:
    return bool(card.is_gpu and gpu_s(card, amp, sizes) >= GPU_BOUND * launches_s(card, sizes))


def _mfu_why(card: Card, amp: str, sizes: dict) -> str:
    model = f"the {_params(sizes):,}-parameter MLP"
    if not card.is_gpu:
        return f"{model} on a CPU: no vendor peak to divide by, and a toy's step is set by its launches: speed-ups only"
    gpu, launches = gpu_s(card, amp, sizes), launches_s(card, sizes)
    said = f"its {amp} step's GPU work {gpu * 1e3:.3g} ms against {launches * 1e3:.2g} ms of launches (predicted)"
    if gpu >= GPU_BOUND * launches:
        return f"{model}: {said}: MFU, beside the dense datasheet peak"
    return f"{model} is a toy here: {said}: the launches set its time, so speed-ups only, no MFU"


def _roof(name: str, card: Card, amp: str, n: int) -> Regime:
    """An n×n product in ``amp`` at the tensor cores' roof: its intensity (n/3 FLOP per byte in 2-byte numbers) past the
    card's ridge point (its matmul rate over its memory bandwidth), and long beside a launch."""
    ridge = card.tflops(amp) * 1e12 / (card.copy_gbs * 1e9)
    seconds = matmul_s(card, n, amp)
    holds = bool(n / 3 >= TENSOR_CORE_ROOF * ridge and seconds >= 10 * card.launch_s)
    return Regime(name, holds, f"n = {n} in {amp}: {n / 3:.0f} FLOP/byte against the ridge's {ridge:.0f}, "
                               f"{seconds * 1e6:.0f} µs a product against a {card.launch_s * 1e6:.0f} µs launch")


# ---- memory ---------------------------------------------------------------------------------------------------------

ACTIVATION_BYTES = 16  # per activation element in training: the tensors kept for backward (estimate)
UNDERFLOW_BYTES = 28  # per element in section 4: fp32 and fp16 outputs, kept gradients, LayerNorm's and GELU's (estimate)


def _training_bytes(sizes: dict) -> float:
    return _params(sizes) * 16 + sizes["batch"] * sizes["width"] * sizes["depth"] * ACTIVATION_BYTES


def _underflow_bytes(sizes: dict, points: int) -> float:
    return points * sizes["width"] * sizes["depth"] * UNDERFLOW_BYTES


def _underflow_points(card: Card, sizes: dict) -> int:
    return next((n for n in UNDERFLOW_POINTS if _underflow_bytes(sizes, n) <= card.usable_gb() / 4 * 1e9),
                UNDERFLOW_POINTS[-1])
