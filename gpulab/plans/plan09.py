"""Lesson 09's plan: the GPT's first run, its FLOPs, the card's ceilings, and attention against sequence length, sized
from the card.

The GPT is the full one on every card (``gpt.FULL``: 57.7 M parameters at T = 1024), large enough that its training
step is the GPU's arithmetic, not its launches, so that its MFU means something. The first run (fp32, attention written
out) takes the largest micro-batch (8 at most) that fits the card's memory, and the most steps the lesson's minutes
allow. The attention sweep goes up to the longest sequence at which its hungriest way (SDPA forced to its math kernel)
fits the card's memory and the minutes still hold: there written-out attention's T² scores cost it several times the
fused kernels' time and memory. Quick mode keeps its small sizes; the 16-bit precision (bf16, or fp16 where bf16 is not
native) follows the card in both modes.
"""

from . import gpt
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .plan04 import CEILING_S
from .predict import bench_s, compare_s

TITLE = "MFU, the card's ceilings and attention kernels"
FEATURES = ("bf16", "tf32", "flash attention")
QUICK = dict(first_run=dict(text_bytes=1_000_000, micro=4, steps=64, stretch=16, lr=2e-3, val_batches=4),
             attention=dict(batch=4, lengths=[64, 128, 256, 512], sweep_batch=2, min_time=0.03))
MICROS = (8, 4, 2, 1)  # the first run's micro-batch, most first
RUNS = ((60, 20), (45, 15), (30, 10))  # the first run's (steps, stretch), most first: a stretch warms up, two are timed
LENGTHS = (512, 1024, 2048, 4096, 8192)  # the attention sweep's sequence lengths, up to the longest that fits
ATTENTION_BATCH, SWEEP_BATCH, SWEEP_MIN_TIME, VAL_BATCH = 8, 4, 0.1, 8
# The sweep's peaks above its inputs on the H200 (2026-11-28, bf16, 4 × 12 heads at T = 8192): written out 24,688 MiB,
# forced to math 49,440 MiB (bytes per score); SDPA's own choice 339 MiB (bytes per row of a head).
WRITTEN_OUT_PEAK, MATH_PEAK = (mib * 2**20 / (4 * 12 * 8192**2) for mib in (24688.0, 49440.0))
FUSED_PEAK = 339.0 * 2**20 / (4 * 12 * 8192)
GPU_BOUND = 5.0  # a step whose GPU work outlasts its launches this many times is the GPU's arithmetic
APART = 3.0  # at the longest length, written-out attention at least this many times the fused kernels' time
START_S = 10.0  # imports, the text (about 10 MB of Python), the model on the device (estimate)
COUNT_S = 5.0  # FlopCounterMode over one step, and three configurations on the meta device (estimate)
PROFILE_S = 0.5  # starting, stopping and reading a profile of one attention call (estimate)
FIGURES_S = 10.0  # the loss curve, the tables and the figures (estimate)


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    amp = card.amp_precision if card.is_gpu else "bf16"  # a CPU's autocast runs bf16
    if quick:
        return LessonPlan("09", TITLE, card, True, dict(gpt=gpt.QUICK, **QUICK, amp=amp), features=FEATURES)
    micro = gpt.largest_micro(card, gpt.FULL, MICROS, "manual", amp=False)
    longest = [T for T in LENGTHS if sweep_gb(T) <= card.usable_gb()]
    options = [full(card, amp, micro, steps, stretch, longest[: i + 1]) for steps, stretch in RUNS
               for i in reversed(range(2, len(longest)))]
    fitting = [p for p in options if p.minutes <= p.target_minutes and all(r.holds for r in p.regimes)]
    return (fitting or options[-1:])[0]


def full(card: Card, amp: str, micro: int, steps: int, stretch: int, lengths: list) -> LessonPlan:
    first_run = dict(text_bytes=None, micro=micro, steps=steps, stretch=stretch, lr=6e-4, val_batches=8)
    attention = dict(batch=ATTENTION_BATCH, lengths=lengths, sweep_batch=SWEEP_BATCH, min_time=SWEEP_MIN_TIME)
    sizes = dict(gpt=gpt.FULL, first_run=first_run, attention=attention, amp=amp)
    step = gpt.step_s(card, gpt.FULL, micro, 1, "fp32", "manual")
    evaluations = (steps // stretch + 1) * first_run["val_batches"] * first_run_forward_s(card)
    seq_len = gpt.FULL["seq_len"]
    written, fused = (attention_s(card, amp, seq_len, ATTENTION_BATCH, way) for way in ("written out", "fused"))
    precisions = ["fp32", *(["tf32"] if card.tf32 else []), amp]
    parts = (
        Part("start", START_S, "imports, the text, the model (estimate)"),
        Part("the first run", steps * step + evaluations,
             f"{steps} steps of {micro} × {seq_len} tokens in fp32, attention written out, {step * 1e3:.0f} ms each "
             f"(predicted), and {steps // stretch + 1} evaluations"),
        Part("FLOPs counted", COUNT_S, "one step under FlopCounterMode, three configurations on meta (estimate)"),
        Part("the card's ceilings", CEILING_S * len(precisions),
             f"flops.ceiling's search of {', '.join(precisions)}, {CEILING_S:g} s each (estimate)"),
        Part("attention written out against SDPA", compare_s(written, fused),
             f"forward and backward at T = {seq_len}, {ATTENTION_BATCH} sequences: 1 s of interleaved pairs"),
        Part("the backends proven from traces", (1 + len(forced(card))) * (fused + PROFILE_S),
             f"{1 + len(forced(card))} profiles of one call (estimate)"),
        Part("time and memory against T", sweep_s(card, amp, lengths),
             f"{len(ways(card))} ways at T = {lengths[0]} … {lengths[-1]}, {SWEEP_BATCH} sequences, "
             f"{SWEEP_MIN_TIME:g} s each"),
        Part("figures", FIGURES_S, "estimate"),
    )
    memory = max(gpt.training_gb(gpt.FULL, micro, "manual", amp=False), sweep_gb(lengths[-1]),
                 WRITTEN_OUT_PEAK * ATTENTION_BATCH * gpt.FULL["n_head"] * seq_len**2 / 1e9)
    why = {"first_run": f"the largest micro-batch (of {', '.join(map(str, MICROS))}) whose fp32 step with attention "
                        "written out fits the card's memory, and the most steps the lesson's minutes allow",
           "attention": f"up to the longest T (of {LENGTHS[0]} … {LENGTHS[-1]}) at which SDPA's math kernel fits the "
                        "card's memory and the lesson its minutes",
           "amp": "native bf16" if amp == "bf16" else "no native bf16: attention and the 16-bit peak in fp16"}
    return LessonPlan("09", TITLE, card, False, sizes, why, parts, memory, regimes(card, amp, micro, lengths),
                      target_minutes(card), FEATURES)


def first_run_forward_s(card: Card) -> float:
    """One held-out batch's forward: a third of a training step's work, fp32, attention written out."""
    return gpt.micro_batch_s(card, gpt.FULL, VAL_BATCH, "fp32", "manual") / 3


def forced(card: Card) -> list[str]:
    """The SDPA backends that run when forced on this card: flash and cuDNN from sm_80 (torch's sdp_utils.cpp,
    ``check_sm_version``), memory-efficient and math on any GPU."""
    return [*(["flash", "cuDNN"] if card.flash_attention else []), "memory-efficient", "math"]


def ways(card: Card) -> list[str]:
    """The ways the sweep times on this card: written out, SDPA's own choice, each backend forced."""
    return ["written out", "fused", *forced(card)]


def attention_s(card: Card, precision: str, T: int, batch: int, way: str) -> float:
    """One forward and backward of causal attention on ``batch`` × the GPT's heads at length ``T``: written out (its
    matmuls and its scores' traffic), a fused kernel (its causal half), or forced to math (twice the written-out
    traffic, as the H200 measured)."""
    size = dict(gpt.FULL, seq_len=T, n_layer=1)
    if way in ("written out", "math"):
        once = gpt.micro_batch_s(card, size, batch, precision, "manual") - _weights_s(card, size, batch, precision)
        return once * (gpt.MATH_OVER_WRITTEN_OUT if way == "math" else 1.0)
    return gpt.micro_batch_s(card, size, batch, precision, "sdpa") - _weights_s(card, size, batch, precision)


def _weights_s(card: Card, size: dict, batch: int, precision: str) -> float:
    """The layer's own matmuls (not attention's): what ``attention_s`` takes out of a layer's time."""
    tokens = batch * size["seq_len"]
    weights = gpt.flops_per_token(size) - gpt.attention_flops_per_token(size)
    return tokens * weights / (card.tflops(precision) * 1e12 * gpt.MATMUL_SHARE[precision])


def sweep_s(card: Card, precision: str, lengths: list) -> float:
    """Each way at each length: one call for its peak, then ``gpulab.bench`` (a warm-up call, at least five timed)."""
    total = 0.0
    for T in lengths:
        for way in ways(card):
            call = attention_s(card, precision, T, SWEEP_BATCH, "fused" if way in ("flash", "cuDNN", "memory-efficient")
                               else way)
            total += call + bench_s(call, min_time=SWEEP_MIN_TIME, warmup=1)
    return total


def sweep_gb(T: int) -> float:
    """The sweep's largest experiment at length ``T``: SDPA forced to its math kernel."""
    return MATH_PEAK * SWEEP_BATCH * gpt.FULL["n_head"] * T**2 / 1e9


def regimes(card: Card, amp: str, micro: int, lengths: list) -> tuple[Regime, ...]:
    step = gpt.micro_batch_s(card, gpt.FULL, micro, "fp32", "manual")
    launches = gpt.launches_s(card, gpt.FULL, "manual")
    T = lengths[-1]
    written, fused = (attention_s(card, amp, T, SWEEP_BATCH, way) for way in ("written out", "fused"))
    memory = WRITTEN_OUT_PEAK * T / FUSED_PEAK
    return (
        Regime("MFU means something: the first run's step is the GPU's arithmetic", bool(step >= GPU_BOUND * launches),
               f"{micro} × {gpt.FULL['seq_len']} tokens in fp32: {step * 1e3:.0f} ms of the GPU's work predicted "
               f"against {launches * 1e3:.1f} ms of launches (at least {GPU_BOUND:g}×)"),
        Regime("the sweep's longest length sets fused attention apart", bool(written >= APART * fused and memory >= 10),
               f"at T = {T} in {amp}: written out {written * 1e3:.1f} ms against the fused kernel's {fused * 1e3:.1f} "
               f"ms (at least {APART:g}×), and {memory:.0f}× its memory (the T×T scores of every head)"),
        Regime("every way of the sweep fits the card's memory", bool(sweep_gb(T) <= card.usable_gb()),
               f"SDPA forced to math at T = {T}: {sweep_gb(T):.1f} GB of {card.usable_gb():.1f} GB usable"),
    )
