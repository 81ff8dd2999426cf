"""Lesson 01's plan: every size from the card's rates, so that each section stays in the regime it shows there.

A kernel launch costs the host about ``card.launch_s`` whatever the kernel does, and the GPU runs even the smallest
kernel for about ``KERNEL_GPU_S``; a kernel that moves ``b`` bytes needs about ``b / card.copy_gbs`` on the GPU. The
copies of section 1 are each timed alone between CUDA events behind an untimed hold, which leaves the launch out: a
copy is **fixed-cost-bound** where its bytes take a tenth of ``KERNEL_GPU_S`` or less, and **bandwidth-bound** where
they take ten times it or more. The copy sweep runs from a fixed-cost-bound copy to one bandwidth-bound and eight
times the card's L2 (``datasheets``: the L2 as CUDA reports it). The adds of section 4 are timed back to back on the
host's clock, launch included: an add is **launch-bound** where its bytes take a tenth of a launch or less, and the
launch sweep runs from a one-element add to a bandwidth-bound one. The twenty matmuls of section 3 each run far
longer than their launch; the training loops of "a sync in a loop" span widths from a step the GPU runs much faster
than Python queues it to one it runs much slower, through the width where the two take about as long, where a sync
every step costs most. Quick mode keeps its small fixed sizes; on a GPU (the CUDA stand-in too) the copies and the
vector add still reach past the L2, and the matmuls are the smallest that outlast their launches.
"""

import functools
import math

import torch

from .. import flops
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .predict import bench_s, compare_s, matmul_s

TITLE = "CUDA basics"
FEATURES = ()
FIXED_BOUND, BANDWIDTH_BOUND = 0.1, 10.0  # bytes against a fixed cost (a launch, a kernel's own time): ≤ a tenth, ≥ ten
# The GPU's own time for a small kernel between CUDA events (estimate: no shipped row times a small kernel alone; the
# H200's 0.25 MB cold copies took 3.9 µs between events on 2026-11-28, quick mode, bytes and a cold start included).
# With the lower figure, a copy judged fixed-cost-bound stays so where the kernel takes longer; the sweep's
# bandwidth-bound end is set by the L2 on every planned card, far past ten times either figure.
KERNEL_GPU_S = 2e-6
MiB = 2**20
UNLISTED_L2 = 128 * MiB  # a card whose datasheet gives no L2: larger than any listed, so the copies still pass it
FLUSH_BYTES = 256 * MiB  # the least a cold copy's flush writes (gpulab.bench, as triton's do_bench)

# ---- section 1: copies, from fixed-cost-bound to bandwidth-bound and 8× the L2 --------------------------------------
COPY_LADDER = [2.0**k for k in range(-6, 12)]  # MB per copy (source; the destination as much): 1/64 ... 2048
PAST_L2 = 8  # the largest copy's source and destination together: at least this many times the L2
HOLD_S = 2**21 / 1.5e9  # the untimed hold before each warm copy timed alone (gpulab.timing.HOLD_CYCLES at 1.5 GHz)
RUN_OVERHEAD_S = 50e-6  # a run's events, their synchronisation and Python (estimate)

# ---- section 3: twenty matmuls far longer to run than to queue ----------------------------------------------------
MATMUL_LADDER = (1024, 2048, 4096, 8192)
OUTLASTS = {True: 10, False: 50}  # each product's arithmetic against its launch: quick mode, full mode
WORKS = 45  # work() calls in section 3: 2 × its pairs, the events' runs, 5 calls × 5 pairs of the sync points, warm-ups
CHILD_S = 5.0  # a Python process that imports torch and starts CUDA: the H200's took 4.9 s (2026-11-28, lessons sharing)

# ---- the sync in a loop ------------------------------------------------------------------------------------------
WIDTH_LADDER = [2**k for k in range(6, 14)]  # 64 ... 8192
BATCH, STEPS = 512, 50
STEP_LAUNCHES = 25  # a training step of the MLP: about 20 kernels and its Python, each about a launch (estimate)
SPAN = 8.0  # the widest step runs at most this many times longer on the GPU than Python takes to queue it
WIDTHS = 4  # widths in the sweep: each twice the last, about 4× the GPU's time per step
SPLIT_CALLS = 10  # steps queued and run to split a step into Python's and the GPU's time (gpulab.timing.queue_and_run)

# ---- section 4 and 5 ------------------------------------------------------------------------------------------------
LAUNCH_LADDER = [4**k for k in range(15)]  # elements: 1 ... 4^14
CHUNK, COUNT = 1024, 4096  # many small muls and one big one
VECTOR_N, PAST_L2_ARRAY = 2**26, 4  # the vector add's elements; each array at least 4× the L2
TANH_CPU_S = 2e-9  # the CPU's tanh, seconds per element and core (estimate)

START_S = 10.0  # imports, device facts (estimate)
TRITON_S = 5.0  # Triton's first compilation of the kernel (estimate)
BUILD_S = 30.0  # nvcc builds the CUDA C extension once: the H200's host took 27 s (2026-11-28, lessons sharing it)
FIGURES_S = 8.0  # figures and tables (estimate)

QUICK = dict(min_time=0.05, compare_min_time=0.2, compare_pairs=5, copy_mb=[0.25, 1, 4, 16, 64], copy_runs=5,
             cache_pairs=5, tanh_sizes=[4**k for k in range(5, 11)], matmul_n=256, sync_pairs=6,
             widths=[64, 128], batch_size=64, steps=20, launch_sizes=[4**k for k in range(10)], chunk=1024, count=256,
             check_sizes=[1, 1000, 1024, 4097, 98_765], vector_n=2**20)


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    if quick:
        return LessonPlan("01", TITLE, card, True, _quick(card), _why(card, quick=True), features=FEATURES)
    copy_mb = _copies(card)
    adds = [n for n in LAUNCH_LADDER if 3 * 4 * n <= card.usable_gb() * 1e9]
    last = next((n for n in adds if n >= 4**10 and _launches(card, 12 * n) >= BANDWIDTH_BOUND), adds[-1])
    launch_sizes = [n for n in adds if n <= last]
    sizes = dict(min_time=0.2, compare_min_time=0.5, compare_pairs=None, copy_mb=copy_mb, copy_runs=20, cache_pairs=6,
                 tanh_sizes=[4**k for k in range(5, 13)], matmul_n=_matmul_n(card, quick=False), sync_pairs=10,
                 widths=_widths(card), batch_size=BATCH, steps=STEPS, launch_sizes=launch_sizes, chunk=CHUNK,
                 count=COUNT, check_sizes=[1, 1000, 1024, 98_765, 2**24 + 3], vector_n=_vector_n(card, VECTOR_N))
    return LessonPlan("01", TITLE, card, False, sizes, _why(card, quick=False), _parts(card, sizes),
                      memory_gb=_memory_gb(card, sizes), regimes=regimes(card, sizes), target_minutes=target_minutes(card),
                      features=FEATURES)


def _quick(card: Card) -> dict:
    """Today's quick sizes; on a GPU the copies and the vector add still pass the L2, and the matmuls outlast their
    launches."""
    sizes = {k: list(v) if isinstance(v, list) else v for k, v in QUICK.items()}
    if card.is_gpu:
        while 2 * sizes["copy_mb"][-1] * 1e6 < PAST_L2 * l2_bytes(card):
            sizes["copy_mb"].append(sizes["copy_mb"][-1] * 4)
        sizes["vector_n"] = _vector_n(card, sizes["vector_n"])
        sizes["matmul_n"] = _matmul_n(card, quick=True)
    return sizes


def _why(card: Card, *, quick: bool) -> dict:
    if not card.is_gpu:
        return {}
    why = {"copy_mb": f"past {PAST_L2}× the L2 ({l2_bytes(card) / MiB:g} MiB)",
           "vector_n": f"each array at least {PAST_L2_ARRAY}× the L2",
           "matmul_n": f"each product's arithmetic at least {OUTLASTS[quick]}× its launch"}
    if not quick:
        why["copy_mb"] = f"from a fixed-cost-bound copy to one bandwidth-bound and {why['copy_mb']}"
        why["widths"] = ("from a step the GPU runs much faster than Python queues it to one it runs up to "
                         f"{SPAN:g}× slower")
        why["launch_sizes"] = "from one element to a bandwidth-bound add"
    return why


def l2_bytes(card: Card) -> float:
    """The card's L2 in bytes, from its datasheet (``UNLISTED_L2`` where the sheet gives none)."""
    mib = card.sheet.l2_mib if card.sheet else math.nan
    return UNLISTED_L2 if math.isnan(mib) else mib * MiB


def _launches(card: Card, nbytes: float) -> float:
    """A kernel's bytes in launches: the seconds they take at the card's copy bandwidth over a launch's (the host's
    cost of a call timed back to back)."""
    return nbytes / (card.copy_gbs * 1e9) / card.launch_s


def _kernel_times(card: Card, nbytes: float) -> float:
    """A kernel's bytes in its fixed time on the GPU: the seconds they take at the card's copy bandwidth over
    ``KERNEL_GPU_S`` (the cost of a call timed alone between events, its launch left out)."""
    return nbytes / (card.copy_gbs * 1e9) / KERNEL_GPU_S


def _copies(card: Card) -> list[float]:
    """MB per copy, ×2 apart: from the largest fixed-cost-bound copy (at most 1 MB) to the first bandwidth-bound one
    past ``PAST_L2``× the L2 that fits in memory with the flush."""
    start = max((mb for mb in COPY_LADDER if mb <= 1 and _kernel_times(card, 2 * mb * 1e6) <= FIXED_BOUND),
                default=COPY_LADDER[0])
    fits = [mb for mb in COPY_LADDER if mb >= start and 2 * mb * 1e6 + _flush_bytes(card) <= card.usable_gb() * 1e9]
    end = next((mb for mb in fits if 2 * mb * 1e6 >= PAST_L2 * l2_bytes(card)
                and _kernel_times(card, 2 * mb * 1e6) >= BANDWIDTH_BOUND), fits[-1])
    return [mb for mb in fits if mb <= end]


def _flush_bytes(card: Card) -> float:
    return max(2 * l2_bytes(card), FLUSH_BYTES)


def _vector_n(card: Card, n: int) -> int:
    while n * 4 < PAST_L2_ARRAY * l2_bytes(card):
        n *= 2
    return n


def _matmul_n(card: Card, *, quick: bool) -> int:
    """The smallest side whose product's arithmetic takes ``OUTLASTS`` launches (in fp32, as the lesson runs it)."""
    return next((n for n in MATMUL_LADDER if matmul_s(card, n) - card.launch_s >= OUTLASTS[quick] * card.launch_s),
                MATMUL_LADDER[-1])


# ---- the sync in a loop ------------------------------------------------------------------------------------------

def mlp(width: int) -> torch.nn.Module:
    """The lesson's model at ``width`` (``make_model`` in the notebook), on the meta device: no memory, no time."""
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                   torch.nn.ReLU(), torch.nn.Linear(width, 1))


@functools.cache
def step_flops(width: int, batch: int) -> float:
    """One training step's FLOPs (forward and backward, ``gpulab.flops.training_flops``)."""
    with torch.device("meta"):
        xb, yb = torch.empty(batch, width), torch.empty(batch, 1)
    return float(flops.training_flops(mlp(width), xb, yb, torch.nn.functional.mse_loss).total)


def step_queue_s(card: Card) -> float:
    """Python's time to queue one training step (estimate: its kernels and Python, each about a launch)."""
    return STEP_LAUNCHES * card.launch_s


def step_gpu_s(card: Card, width: int, batch: int = BATCH) -> float:
    """The GPU's time for one training step: its FLOPs at the card's fp32 rate and each kernel's fixed time."""
    return step_flops(width, batch) / (card.tflops("fp32") * 1e12) + STEP_LAUNCHES * KERNEL_GPU_S


def _widths(card: Card) -> list[int]:
    """The ``WIDTHS`` largest widths whose step the GPU runs in at most ``SPAN`` times Python's time to queue it."""
    within = [w for w in WIDTH_LADDER if step_gpu_s(card, w) <= SPAN * step_queue_s(card)]
    return within[-WIDTHS:] if within else WIDTH_LADDER[:1]


# ---- what the plan predicts --------------------------------------------------------------------------------------

def regimes(card: Card, sizes: dict) -> tuple[Regime, ...]:
    """Each section's condition on this card, from its rates and the sizes chosen."""
    copy_mb, launch_sizes, widths = sizes["copy_mb"], sizes["launch_sizes"], sizes["widths"]
    smallest, largest = (_kernel_times(card, 2 * mb * 1e6) for mb in (copy_mb[0], copy_mb[-1]))
    launch_bound = [n for n in launch_sizes if _launches(card, 12 * n) <= FIXED_BOUND]
    top = _launches(card, 12 * launch_sizes[-1])
    ratios = {w: step_gpu_s(card, w) / step_queue_s(card) for w in widths}
    near = [w for w, r in ratios.items() if 0.5 <= r <= 2]
    products = (matmul_s(card, sizes["matmul_n"]) - card.launch_s) / card.launch_s
    return (
        Regime("the copies run from fixed-cost-bound to bandwidth-bound",
               smallest <= FIXED_BOUND and largest >= BANDWIDTH_BOUND,
               f"{copy_mb[0]:g} MB copied in {smallest:.2g} times a small kernel's own GPU time "
               f"({KERNEL_GPU_S * 1e6:g} µs, estimate), {copy_mb[-1]:g} MB in {largest:.3g}"),
        Regime("the copies pass the L2", 2 * copy_mb[-1] * 1e6 >= PAST_L2 * l2_bytes(card),
               f"the largest copy's source and destination: {2 * copy_mb[-1] * 1e6 / l2_bytes(card):.3g}× the L2 "
               f"({l2_bytes(card) / MiB:g} MiB)"),
        Regime("twenty matmuls run far longer than they take to queue", products >= OUTLASTS[False],
               f"each {sizes['matmul_n']}² fp32 product's arithmetic: {products:.0f} launches"),
        Regime("the loop's widths span launch-bound to GPU-bound", ratios[widths[0]] <= 0.5 and ratios[widths[-1]] >= 2,
               "the GPU's time per step over Python's, predicted: "
               + ", ".join(f"{r:.2g} at width {w}" for w, r in ratios.items())),
        Regime("a width where Python and the GPU take about as long per step", bool(near),
               f"width {near[0]} (a sync each step costs most there)" if near else "none within 2× of each other"),
        Regime("the smallest adds are launch-bound, the largest bandwidth-bound",
               len(launch_bound) >= 4 and top >= BANDWIDTH_BOUND,
               f"{len(launch_bound)} adds of at most {launch_bound[-1] if launch_bound else 0:,} elements take a tenth "
               f"of a launch or less; {launch_sizes[-1]:,} elements take {top:.3g} launches"),
        Regime("the vector add reads device memory", sizes["vector_n"] * 4 >= PAST_L2_ARRAY * l2_bytes(card)
               and _launches(card, 12 * sizes["vector_n"]) >= BANDWIDTH_BOUND,
               f"each array {sizes['vector_n'] * 4 / l2_bytes(card):.3g}× the L2, the add "
               f"{_launches(card, 12 * sizes['vector_n']):.3g} launches long"),
    )


def _memory_gb(card: Card, sizes: dict) -> float:
    copies = 2 * sizes["copy_mb"][-1] * 1e6 + _flush_bytes(card)
    adds = 3 * 4 * sizes["launch_sizes"][-1]
    vector = 4 * 4 * sizes["vector_n"]  # x, y, out and the new tensor of x + y
    matmuls = 3 * 4 * sizes["matmul_n"] ** 2
    width = sizes["widths"][-1]
    loop = 3 * 4 * (2 * width**2) + 4 * 4 * sizes["batch_size"] * width  # weights, grads, updates; activations
    return max(copies, adds, vector, matmuls, loop) / 1e9


def _parts(card: Card, sizes: dict) -> tuple[Part, ...]:
    launch, gbs = card.launch_s, card.copy_gbs * 1e9
    copy_s = [2 * mb * 1e6 / gbs + launch for mb in sizes["copy_mb"]]
    flush_s = _flush_bytes(card) / gbs
    sweep = sum(sizes["copy_runs"] * (2 * s + HOLD_S + 2 * RUN_OVERHEAD_S + flush_s) for s in copy_s)
    pairs = 2 * sizes["cache_pairs"] * 3 * (copy_s[-1] * 2 + HOLD_S + flush_s + 2 * RUN_OVERHEAD_S)
    tanh_gpu = [max(launch, 8 * n / gbs) for n in sizes["tanh_sizes"]]
    tanh_cpu = [n * TANH_CPU_S / card.cpu_cores for n in sizes["tanh_sizes"]]
    tanh_copies = [8 * n / (card.host_gbs * 1e9) + 3 * launch for n in sizes["tanh_sizes"]]
    tanh = sum(bench_s(c, min_time=sizes["min_time"]) + bench_s(g, min_time=sizes["min_time"])
               + bench_s(c + x, min_time=sizes["min_time"]) + compare_s(c, g, min_time=sizes["compare_min_time"])
               + compare_s(c, g + x, min_time=sizes["compare_min_time"])
               for c, g, x in zip(tanh_cpu, tanh_gpu, tanh_copies))
    work = 20 * matmul_s(card, sizes["matmul_n"])
    queue, loops = step_queue_s(card), 0.0
    for width in sizes["widths"]:
        gpu = step_gpu_s(card, width, sizes["batch_size"])
        once, synced = sizes["steps"] * max(queue, gpu), sizes["steps"] * (queue + gpu)
        loops += (1 + 2 * SPLIT_CALLS) * max(queue, gpu) + compare_s(synced, once, min_time=sizes["compare_min_time"])
    adds = sum(bench_s(max(launch, 12 * n / gbs), min_time=sizes["min_time"]) for n in sizes["launch_sizes"])
    small = compare_s(sizes["count"] * launch, max(launch, 8 * sizes["chunk"] * sizes["count"] / gbs),
                      min_time=sizes["compare_min_time"])
    vector_s = 12 * sizes["vector_n"] / gbs + launch
    vector = 4 * bench_s(vector_s, min_time=sizes["min_time"]) + 3 * compare_s(vector_s, vector_s,
                                                                              min_time=sizes["compare_min_time"])
    return (
        Part("start", START_S, "imports, device facts (estimate)"),
        Part("copy bandwidth, warm and cold", sweep + pairs,
             f"{len(copy_s)} sizes × {sizes['copy_runs']} copies each way, each alone; warm against cold at two sizes"),
        Part("tanh on the CPU and the GPU", tanh, f"{len(tanh_gpu)} sizes, three ways, two comparisons each (the CPU's "
             "tanh: an estimate)"),
        Part("asynchronous execution and sync points", WORKS * work,
             f"about {WORKS} runs of twenty {sizes['matmul_n']}² fp32 matmuls"),
        Part("CUDA_LAUNCH_BLOCKING", 2 * CHILD_S, "two Python processes that start CUDA (estimate)"),
        Part("a sync in a loop", loops, f"{len(sizes['widths'])} widths, two loops of {sizes['steps']} steps in "
             "interleaved pairs (Python's time per step: an estimate)"),
        Part("launch overhead and many small ops", adds + small, f"{len(sizes['launch_sizes'])} add sizes, "
             f"{sizes['count']} small muls against one"),
        Part("Triton and CUDA C kernels", TRITON_S + BUILD_S, "Triton's first compilation and nvcc's build (estimates; "
             "the build is cached after its first time)"),
        Part("vector add against the copy", vector, f"{sizes['vector_n']:,} elements per array"),
        Part("figures and tables", FIGURES_S, "estimate"),
    )
