"""Lesson 03's plan: the throughput sweep past each model's knee, the largest-batch searches bounded by the card's
memory and time, gradient accumulation across the knee, and the convergence runs, sized from the card.

A training step at batch ``b`` is planned as a fixed cost ``c`` (the launches and Python of one step, whatever the
batch) plus ``b`` times a per-sample cost ``s``: its FLOPs (``FlopCounterMode`` on the meta device) at the card's
achievable rate in the precision the step runs in (TF32 for the CNN's convolutions where the card has it, fp32
otherwise), plus the rest of the step (normalisation, activations, the optimizer), which moves memory, at the card's
bandwidth. ``c`` and the rest's share are read from the H100's shipped rows of this sweep
(``gpulab/reference/03_throughput``, the same models and step), when this module is imported: ``c`` is the step at
the smallest batch less its per-sample work, in tiny launches (``card.launch_s``) a step.

The **knee** is then where the fixed cost is a tenth of the step, ``9·c/s``: throughput within 90 % of its limit even
if none of the launches overlapped the GPU's work. The launches do overlap it, so the measured knee lies below: on
the H100 at batch 1024 and 2048, where this estimate gives about 2,900 and 3,100. The sweep goes on to at least twice
the estimate. Its lower bound is ``c/s``, the batch whose arithmetic lasts as long as the fixed cost: below it a step
under-uses the card however well its launches overlap the arithmetic. Gradient accumulation's micro-batches are
sized from that bound (on the H100 the knee measured at 3.2× it). Quick mode keeps its small fixed sizes.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import flops, models
from ..memory import MemoryTracker
from ..results import reference
from .card import MEASURED_ON, Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .predict import bench_s, compare_s

TITLE = "Batching: the throughput curve, the largest batch that fits, gradient accumulation"
FEATURES = ("tf32",)
QUICK = dict(cnn_width=16, mlp_width=1024, batch_sizes=[4, 8, 16, 32, 64, 128], repeats=3, warmup=1,
             compare_min_time=0.2, compare_pairs=5, budget_mib=64, cap_gb=None, search_max_batch=2**12,
             granularity=8, effective_batch=64, accumulation_steps=[1, 2, 4], input_features=32, n_train=100_000,
             n_test=4_096, student_width=128, train_seconds=1.0, convergence_batches=[16, 64, 256, 1024, 4096],
             base_lr=0.004)
CNN_WIDTH, MLP_WIDTH = 32, 4096  # the models of the shipped H100 rows
FIRST_BATCH = 8
PAST_KNEE = 2  # the sweep's largest batch is at least this many times the knee's estimate
STEP_S = 0.5  # no step of the sweep takes longer: a batch past it adds seconds, not insight
ACCUMULATION_STEPS = [1, 2, 4, 8]
TRIAL_S = 0.5  # a search's trial at the largest batch it tries lasts at most this long (else a smaller cap)
SEARCH_BUILD_S = 0.01  # a trial builds its model and optimizer (estimate)
SEARCHES = 3  # the naive doubling, the one written out, find_max_batch
FEATURES_IN, N_TRAIN, N_TEST, STUDENT_WIDTH = 256, 500_000, 4_096, 1024
CONVERGENCE_BATCHES, BASE_LR, EVALS = [64, 256, 1024, 4096, 16384], 0.016, 8
MIN_UPDATES = 100  # the largest batch's run makes at least this many updates: its loss says something
SECONDS, MAX_SECONDS = 4.0, 10.0  # each convergence run's training seconds: more where the largest batch needs them
# for its updates, up to the most the lesson's minutes allow six runs
START_S = 10.0  # imports, device facts (estimate)
CEILING_S = 9.0  # flops.ceiling's search, per precision (as lesson 04's plan)
TRACKED = 3.0  # a step counted by a MemoryTracker (a dispatch mode, Python per operator) over the step (estimate)
DATA_S = 2.0  # the teacher's labels for the points and the student's FLOP count (estimate)
FIGURES_S = 10.0  # tables and figures, the reference rows (estimate)


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    if quick:
        return LessonPlan("03", TITLE, card, True, dict(QUICK), features=FEATURES)
    cnn, mlp = Step.of(card, "SmallCNN"), Step.of(card, "WideMLP")
    top = 2 ** math.ceil(math.log2(PAST_KNEE * max(cnn.knee, mlp.knee)))
    fits = [b for b in powers(FIRST_BATCH, top) if all(m.memory_gb(b) <= card.usable_gb() and m.seconds(b) <= STEP_S
                                                     for m in (cnn, mlp))] or [FIRST_BATCH]
    micro = 2 ** math.floor(math.log2(cnn.knee_at_least))  # the most micro-batches' size: below the knee
    effective = ACCUMULATION_STEPS[-1] * micro
    cap_gb = math.floor(10 * min(card.usable_gb(), cnn.memory_gb(cnn.batch_within(TRIAL_S)))) / 10
    fill = cnn.batch_within_gb(cap_gb)
    fill_if_lighter = dataclasses.replace(cnn, sample_bytes=cnn.sample_bytes / 2).batch_within_gb(cap_gb)
    student = Step.student(card)
    seconds = min(MAX_SECONDS, max(SECONDS, math.ceil(1.2 * MIN_UPDATES * student.seconds(CONVERGENCE_BATCHES[-1]))))
    sizes = dict(cnn_width=CNN_WIDTH, mlp_width=MLP_WIDTH, batch_sizes=fits, repeats=None, warmup=3,
                 compare_min_time=1.0, compare_pairs=None, budget_mib=64, cap_gb=cap_gb,
                 search_max_batch=2 ** math.ceil(math.log2(fill_if_lighter + 1)), granularity=64,
                 effective_batch=effective,
                 accumulation_steps=ACCUMULATION_STEPS, input_features=FEATURES_IN, n_train=N_TRAIN, n_test=N_TEST,
                 student_width=STUDENT_WIDTH, train_seconds=seconds, convergence_batches=CONVERGENCE_BATCHES,
                 base_lr=BASE_LR)
    why = {"batch_sizes": f"powers of two up to at least {PAST_KNEE}× each model's knee (estimated: SmallCNN "
                          f"{cnn.knee:,.0f}, WideMLP {mlp.knee:,.0f}), each step within {STEP_S:g} s and the card's "
                          "memory",
           "cap_gb": f"the searches' cap on this card's memory (set_per_process_memory_fraction): at most the "
                     f"{card.usable_gb():.0f} GB a plan may fill, and a trial at the largest batch within {TRIAL_S:g} s",
           "budget_mib": "without a GPU to cap: an emulated card of the step's tensors (a CPU has no out-of-memory "
                         "error to catch)",
           "search_max_batch": f"past the batch that would fill the cap if a sample held half the bytes predicted "
                               f"(about {fill_if_lighter:,}; {fill:,} at the caching allocator's "
                               f"{cnn.sample_bytes / 2**20:.2f} MiB a sample on the H100, cuDNN's workspaces "
                               "included): the searches meet the cap's out-of-memory error even then",
           "effective_batch": f"{ACCUMULATION_STEPS[-1]} micro-batches of {micro:,}, at most the batch whose arithmetic "
                              f"lasts as long as a step's fixed cost (SmallCNN's {cnn.knee_at_least:,.0f}): below its "
                              "knee however well the launches overlap the arithmetic; a batch of all of them is "
                              f"{effective / cnn.knee_at_least:.1f}× it, past the knee the H100 measured (at "
                              f"{_h100_knee('SmallCNN') / Step.of(Card.named(MEASURED_ON), 'SmallCNN').knee_at_least:.1f}"
                              "× it there)",
           "train_seconds": f"the largest batch makes at least {MIN_UPDATES} updates in them (at most "
                            f"{MAX_SECONDS:g})"}
    parts = parts_of(card, sizes, cnn, mlp, student, fill)
    memory = max(cnn.memory_gb(fits[-1]), mlp.memory_gb(fits[-1]), sizes["cap_gb"], cnn.memory_gb(effective),
                 (N_TRAIN + N_TEST) * FEATURES_IN * 4 / 1e9)
    return LessonPlan("03", TITLE, card, False, sizes, why, parts, memory, regimes(sizes, cnn, mlp, student),
                      target_minutes(card), FEATURES)


def powers(first: int, last: int) -> list[int]:
    return [2**i for i in range(int(math.log2(first)), int(math.log2(last)) + 1)]


# ---- one training step, predicted ------------------------------------------------------------------------------

@functools.cache
def _counted(name: str, width: int) -> tuple[float, float, float, int]:
    """A model of the lesson on the meta device (no memory, no time): training FLOPs of one sample, the tensors of a
    forward and backward pass (bytes at batch 0 and per sample, ``MemoryTracker``), its parameters."""
    peaks = []
    for batch in (1, 65):
        with torch.device("meta"):
            model = _model(name, width)
            x = torch.empty(batch, *((FEATURES_IN,) if name == "student" else (3, 32, 32)))
            y = torch.zeros(batch, dtype=torch.long)
        with MemoryTracker() as tracker:
            count = flops.training_flops(model, x, y, F.cross_entropy)
        peaks.append(tracker.peak)
    per_sample = (peaks[1] - peaks[0]) / 64
    return count.total / 65, peaks[0] - per_sample, per_sample, sum(p.numel() for p in model.parameters())


def _model(name: str, width: int):
    if name == "SmallCNN":
        return models.SmallCNN(width=width)
    if name == "WideMLP":
        return models.WideMLP(width=width)
    return models.WideMLP(in_features=FEATURES_IN, width=width, depth=2)


def _precision(card: Card, name: str) -> str:
    """cuDNN's convolutions run fp32 in TF32 where the card has it (on by default); fp32 matmuls do not."""
    return "tf32" if name == "SmallCNN" and card.tf32 else "fp32"


@functools.cache
def _h100(name: str) -> tuple[float, float, float]:
    """From the H100's shipped rows of ``name``: the fixed cost of a step in tiny launches, the seconds a sample that
    its arithmetic does not explain (the rest of the step, moving memory) and the allocator's bytes a sample (its
    peak at the two largest batches: cuDNN's workspaces included) over the tensors' (MemoryTracker's count)."""
    rows = reference("03_throughput").query("device_name == @MEASURED_ON and model == @name").sort_values("batch_size")
    small, half, top = rows.iloc[0], rows.iloc[-2], rows.iloc[-1]
    s = (top.median_s - half.median_s) / (top.batch_size - half.batch_size)
    card, width = Card.named(MEASURED_ON), CNN_WIDTH if name == "SmallCNN" else MLP_WIDTH
    work, _, tensors, _ = _counted(name, width)
    arithmetic = work / (card.tflops(_precision(card, name)) * 1e12)
    allocator = (top.peak_MiB - half.peak_MiB) * 2**20 / (top.batch_size - half.batch_size)
    return (float((small.median_s - small.batch_size * s) / card.launch_s),
            float(max(s - arithmetic, 0.0) * card.copy_gbs * 1e9), float(allocator / tensors))


@functools.cache
def _h100_knee(name: str) -> int:
    """The knee of ``name`` in the H100's shipped rows, as the lesson finds it: the smallest batch within 90 % of the
    best samples/s."""
    rows = reference("03_throughput").query("device_name == @MEASURED_ON and model == @name")
    return int(rows.loc[rows.samples_per_s >= 0.9 * rows.samples_per_s.max(), "batch_size"].min())


@dataclass(frozen=True)
class Step:
    """A training step of one of the lesson's models on a card: ``c + b·s`` seconds at batch ``b``."""

    name: str
    c: float  # seconds a step, whatever its batch
    s: float  # seconds a sample
    fixed_bytes: float  # weights, gradients and SGD's momentum
    sample_bytes: float  # what the caching allocator holds a sample at the step's peak

    @classmethod
    def of(cls, card: Card, name: str, width: int | None = None) -> "Step":
        """SmallCNN or WideMLP at the width of the H100's rows, or the convergence runs' student ("student")."""
        launches, rest_bytes, over_tensors = _h100("WideMLP" if name == "student" else name)
        width = width or {"SmallCNN": CNN_WIDTH, "WideMLP": MLP_WIDTH, "student": STUDENT_WIDTH}[name]
        work, fixed, tensors, params = _counted(name, width)
        arithmetic = work / (card.tflops(_precision(card, name)) * 1e12)
        rest = rest_bytes / (card.copy_gbs * 1e9) if name != "student" else 0.0
        return cls(name, launches * card.launch_s, arithmetic + rest, fixed + 8 * params, tensors * over_tensors)

    @classmethod
    def student(cls, card: Card) -> "Step":
        return cls.of(card, "student")

    def seconds(self, batch: int) -> float:
        return self.c + batch * self.s

    @property
    def knee(self) -> float:
        """The batch whose step spends a tenth of its time on the fixed cost (an upper estimate of the knee)."""
        return 9 * self.c / self.s

    @property
    def knee_at_least(self) -> float:
        """The batch whose arithmetic lasts as long as the fixed cost (a lower bound of the knee: below it the step
        under-uses the card even if its launches hide entirely behind the arithmetic)."""
        return self.c / self.s

    def memory_gb(self, batch: int) -> float:
        return (self.fixed_bytes + batch * self.sample_bytes) / 1e9

    def batch_within(self, seconds: float) -> int:
        return max(1, int((seconds - self.c) / self.s))

    def batch_within_gb(self, gb: float) -> int:
        return max(1, int((gb * 1e9 - self.fixed_bytes) / self.sample_bytes))


# ---- the minutes -------------------------------------------------------------------------------------------------

def search_batches(fill: int, max_batch: int, granularity: int) -> list[int]:
    """The batches ``batch_finder.find_max_batch`` tries (from 1) when every batch up to ``fill`` fits."""
    tried, fit, fail, batch = [], 0, None, 1
    while fail is None:
        tried.append(batch)
        if batch > fill:
            fail = batch
        elif batch == max_batch:
            return tried
        else:
            fit, batch = batch, min(2 * batch, max_batch)
    while fail - fit > granularity:
        middle = fit + max(granularity, (fail - fit) // 2 // granularity * granularity)
        tried.append(middle)
        fit, fail = (middle, fail) if middle <= fill else (fit, middle)
    return tried


def parts_of(card: Card, sizes: dict, cnn: Step, mlp: Step, student: Step, fill: int) -> tuple[Part, ...]:
    batches, warmup, minimum = sizes["batch_sizes"], sizes["warmup"], sizes["compare_min_time"]

    def bench(step: Step, b: int) -> float:
        return bench_s(step.seconds(b), warmup=warmup) + TRACKED * step.seconds(b)

    def knee_pair(step: Step) -> float:
        top = batches[-1]
        at = min(2 ** math.ceil(math.log2(step.knee)), top // 2)
        return compare_s(step.seconds(at), step.seconds(top), min_time=minimum)

    precisions = {_precision(card, n) for n in ("SmallCNN", "WideMLP")}
    trials = search_batches(fill, sizes["search_max_batch"], sizes["granularity"])
    searching = SEARCHES * sum(SEARCH_BUILD_S + cnn.seconds(b) for b in trials)
    workspace = 2 * sum(SEARCH_BUILD_S + cnn.seconds(b) for b in trials if 2 * b <= fill)
    effective, ks = sizes["effective_batch"], sizes["accumulation_steps"]

    def accumulation(k: int) -> float:
        return k * cnn.c + effective * cnn.s

    largest, other = CONVERGENCE_BATCHES[-1], CONVERGENCE_BATCHES[-2]
    runs = len(CONVERGENCE_BATCHES) + 1
    return (
        Part("start", START_S, "imports, device facts (estimate)"),
        Part("FLOPs counted, ceilings measured", CEILING_S * len(precisions),
             f"flops.ceiling's search in {' and '.join(sorted(precisions))}, {CEILING_S:g} s each (estimate)"),
        Part("throughput sweep", sum(bench(m, b) for m in (cnn, mlp) for b in batches),
             f"2 models × {len(batches)} batches, each step timed and its tensors counted (predicted steps: "
             f"SmallCNN {cnn.c * 1e3:.1f} ms + {cnn.s * 1e6:.1f} µs a sample, WideMLP {mlp.c * 1e3:.1f} ms + "
             f"{mlp.s * 1e6:.1f} µs)"),
        Part("the knee, in interleaved pairs", knee_pair(cnn) + knee_pair(mlp), f"{minimum:g} s of pairs a model"),
        Part("the largest batch", searching + workspace,
             f"{SEARCHES} searches of {len(trials)} trials up to batch {trials[-1]:,}, then the workspace measured "
             "twice for each batch up to half the largest"),
        Part("gradient accumulation", sum(bench_s(accumulation(k), warmup=warmup) + TRACKED * accumulation(k)
                                          for k in ks) + compare_s(accumulation(1), accumulation(ks[-1]),
                                                                   min_time=minimum),
             f"an effective batch of {effective:,} in {', '.join(map(str, ks))} micro-batches, then 1 against "
             f"{ks[-1]} in pairs"),
        Part("convergence", DATA_S + runs * sizes["train_seconds"] + compare_s(student.seconds(other),
                                                                         student.seconds(largest), min_time=minimum),
             f"{runs} runs of {sizes['train_seconds']:g} s, then two batch sizes' steps in pairs"),
        Part("tables and figures", FIGURES_S, "estimate"),
    )


# ---- the regimes -------------------------------------------------------------------------------------------------

def regimes(sizes: dict, cnn: Step, mlp: Step, student: Step) -> tuple[Regime, ...]:
    """What the card's rates decide. The searches' out-of-memory error and accumulation's micro-batches below the
    knee are not among them: their sizes are derived to hold them (``why``)."""
    top, largest = sizes["batch_sizes"][-1], sizes["convergence_batches"][-1]
    updates = sizes["train_seconds"] / student.seconds(largest)
    return (
        *(Regime(f"the sweep goes past {m.name}'s knee", bool(top >= PAST_KNEE * m.knee),
                 f"its step {m.c * 1e3:.1f} ms + {m.s * 1e6:.2f} µs a sample: the fixed cost a tenth of the step "
                 f"from batch {m.knee:,.0f} (the knee, an upper estimate); the sweep goes to {top:,} (at least "
                 f"{PAST_KNEE}×)") for m in (cnn, mlp)),
        Regime("the largest batch makes enough updates", bool(updates >= MIN_UPDATES),
               f"batch {largest:,}: {student.seconds(largest) * 1e3:.1f} ms a step, {updates:,.0f} updates in "
               f"{sizes['train_seconds']:g} s (at least {MIN_UPDATES})"),
    )
