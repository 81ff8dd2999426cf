"""Lesson 11's plan: activation memory measured, checkpointing raced, and FP8's crossover only where the card has FP8,
sized from the card.

Every card measures the same GPT (``gpt.FULL``). Checkpointing is raced at a micro-batch whose step is the GPU's
arithmetic, so that its recomputation costs time there. FP8 (sm_89 and newer) times a linear layer's three training
matmuls from n = 1024 up to the largest n whose bf16 and fp8 calls fit the card's memory and take at most ``PAIR_S``
together, where fp8 is predicted to beat bf16 (its matmuls at the card's fp8 rate, its scaling at the card's memory
bandwidth); the whole GPT's fp8 race takes the largest micro-batch whose two runs fit. A card without FP8 times none of
it and says so. Quick mode keeps its small sizes.
"""

from . import gpt
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .plan04 import CEILING_S
from .plan10 import COMPILE_AGAIN_S, COMPILE_S
from .predict import compare_s

TITLE = "A transformer's activation memory, checkpointing and FP8"
FEATURES = ("bf16", "fp8")
QUICK = dict(memory_batch=4, checkpointing=dict(micro=1, pairs=6),
             fp8=dict(n=[512, 1024, 2048], min_time=0.1, micro=16, pairs=5, lr=6e-4))
MEMORY_BATCH, CHECKPOINT_PAIRS = 2, 8
CHECKPOINT_MICROS = (4, 8, 16, 32)  # the checkpointing race's micro-batch: the fewest sequences whose step is the GPU's
FP8_SIZES = [2**i for i in range(10, 16)]  # 1024 ... 32768: a linear layer of n×n weights on n tokens
PAIR_S = 0.5  # no size of the crossover whose bf16 and fp8 calls take longer together
FP8_MICROS = (16, 8, 4)  # the whole GPT's fp8 race: its micro-batch, most first
# Scaling a tensor into fp8, compiled: its amax (a read), then the scaled cast written in both layouts (a read, two
# one-byte writes): 6 bytes an element of a 16-bit tensor (estimate). The 2026-11-27 H200 run, quick mode and nine lessons
# sharing the card, measured the crossover at n = 16384: scaling cost more there.
CAST_BYTES = 6
CAST_LAUNCHES = 30  # three tensors scaled (an amax, a cast, a transpose each), three _scaled_mm, autograd's bookkeeping
CAST_COMPILE_S = 8.0  # compiling the cast for both fp8 formats (estimate)
GPU_BOUND = 5.0  # the checkpointing race's step: the GPU's work at least this many times its launches
START_S = 10.0  # imports, the text, the GPT's code (estimate)
BUILD_S = 0.5  # a GPT of one to three blocks made and run forward once (estimate)
FIGURES_S = 5.0


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    amp = card.amp_precision if card.is_gpu else "bf16"  # a CPU's autocast runs bf16
    if quick:
        return LessonPlan("11", TITLE, card, True, dict(gpt=gpt.QUICK, text_bytes=1_000_000, **QUICK, amp=amp,
                                                        fp8_here=card.fp8), features=FEATURES)
    fp8_sizes = [n for n in FP8_SIZES if crossover_gb(n) <= card.usable_gb() and pair_s(card, n) <= PAIR_S]
    fp8 = dict(n=fp8_sizes if card.fp8 else [], min_time=0.3,
               micro=gpt.largest_micro(card, gpt.FULL, FP8_MICROS, "sdpa", amp=True, models=2), pairs=5, lr=6e-4)
    micro = checkpoint_micro(card, amp)
    sizes = dict(gpt=gpt.FULL, text_bytes=None, memory_batch=MEMORY_BATCH,
                 checkpointing=dict(micro=micro, pairs=CHECKPOINT_PAIRS), fp8=fp8, amp=amp, fp8_here=card.fp8)
    parts = (
        Part("start", START_S, "imports, the text (estimate)"),
        Part("activation memory, 5 ways × 1, 2 and 3 blocks", 15 * BUILD_S, f"{BUILD_S:g} s each (estimate)"),
        Part(f"the {amp} ceiling", CEILING_S, "flops.ceiling's search (estimate)"),
        Part("checkpointing raced", checkpointing_s(card, amp, micro), f"{CHECKPOINT_PAIRS} pairs of steps of "
             f"{micro} × {gpt.FULL['seq_len']} tokens, each step's FLOPs counted"),
        *fp8_parts(card, fp8),
        Part("figures", FIGURES_S, "estimate"),
    )
    memory = [gpt.training_gb(gpt.FULL, micro, "sdpa", True, models=2)]
    if fp8["n"]:
        memory += [crossover_gb(fp8["n"][-1]), gpt.training_gb(gpt.FULL, fp8["micro"], "sdpa", True, models=2)]
    why = {"checkpointing": f"the fewest sequences (of {', '.join(map(str, CHECKPOINT_MICROS))}) whose step is the "
                            "GPU's arithmetic, not its launches, and fits the card's memory",
           "fp8": ("no FP8 on this card: nothing timed" if not card.fp8 else
                   f"n up to the largest whose bf16 and fp8 calls fit the card's memory and take at most {PAIR_S:g} s "
                   f"together; the GPT's race at the largest micro-batch (of {', '.join(map(str, FP8_MICROS))}) whose "
                   "two runs fit"),
           "amp": "native bf16" if amp == "bf16" else "no native bf16: the 16-bit runs in fp16",
           "fp8_here": "FP8 tensor cores: sm_89 and newer"}
    return LessonPlan("11", TITLE, card, False, sizes, why, parts, max(memory), regimes(card, amp, micro, fp8),
                      target_minutes(card), FEATURES)


def checkpoint_micro(card: Card, amp: str) -> int:
    """The checkpointing race's micro-batch: the fewest sequences whose step outlasts its launches ``GPU_BOUND``
    times, among those whose race fits the card's memory (the most that fit where none outlasts them)."""
    fits = [m for m in CHECKPOINT_MICROS if gpt.training_gb(gpt.FULL, m, "sdpa", True, models=2) <= card.usable_gb()]
    launches = gpt.launches_s(card, gpt.FULL, "sdpa")
    bound = [m for m in fits if gpt.micro_batch_s(card, gpt.FULL, m, amp, "sdpa") >= GPU_BOUND * launches]
    return (bound or fits[-1:] or [CHECKPOINT_MICROS[0]])[0]


def checkpointing_s(card: Card, amp: str, micro: int) -> float:
    """Two GPTs made, a warm-up and ``CHECKPOINT_PAIRS`` pairs of a step with and without checkpointing (a third more
    work in the blocks), each step's FLOPs counted once."""
    step = gpt.step_s(card, gpt.FULL, micro, 1, amp, "sdpa")
    return 2 * BUILD_S * 4 + (CHECKPOINT_PAIRS + 1) * step * (1 + 4 / 3) + 2 * step * 4 / 3


def bf16_s(card: Card, n: int) -> float:
    """A linear layer's three training matmuls on n×n operands in bf16."""
    return 3 * 2 * n**3 / (card.tflops("bf16") * 1e12) + 3 * card.launch_s


def fp8_s(card: Card, n: int) -> float:
    """The same three in fp8: the matmuls at the card's fp8 rate, the three tensors scaled at its bandwidth."""
    return (3 * 2 * n**3 / (card.tflops("fp8") * 1e12) + 3 * CAST_BYTES * n * n / (card.copy_gbs * 1e9)
            + CAST_LAUNCHES * card.launch_s)


def pair_s(card: Card, n: int) -> float:
    return bf16_s(card, n) + fp8_s(card, n) if card.fp8 else 0.0


def crossover_gb(n: int) -> float:
    """Both runs of one size alive: bf16 input, weight and gradient each (the fp8 run's weight a copy), their three
    results each, and the fp8 copies of three tensors in two layouts."""
    return (2 * n * n * (3 + 1 + 2 * 3) + 6 * n * n) / 1e9


def fp8_parts(card: Card, fp8: dict) -> list[Part]:
    if not card.fp8:
        return []
    sizes, scale = fp8["n"], gpt.compile_scale(card)
    crossover = sum(3 * pair_s(card, n) + compare_s(bf16_s(card, n), fp8_s(card, n), min_time=fp8["min_time"])
                    for n in sizes)
    step = gpt.step_s(card, gpt.FULL, fp8["micro"], 1, "bf16", "sdpa")
    return [Part("FP8's crossover", CAST_COMPILE_S * scale + crossover,
                 f"the cast compiled, then n = {sizes[0]} … {sizes[-1]}: each call once for its error, "
                 f"{fp8['min_time']:g} s of pairs"),
            Part("the GPT with its MLP in fp8 (where torchao is installed)",
                 (COMPILE_S + COMPILE_AGAIN_S) * scale + (fp8["pairs"] + 2) * 2 * step,
                 f"two compiles, {fp8['pairs']} pairs of steps of {fp8['micro']} × {gpt.FULL['seq_len']} tokens")]


def regimes(card: Card, amp: str, micro: int, fp8: dict) -> tuple[Regime, ...]:
    micro_s = gpt.micro_batch_s(card, gpt.FULL, micro, amp, "sdpa")
    launches = gpt.launches_s(card, gpt.FULL, "sdpa")
    found = (Regime("checkpointing's recomputation costs time", bool(micro_s >= GPU_BOUND * launches),
                    f"a step of {micro} × {gpt.FULL['seq_len']} tokens in {amp} with SDPA: "
                    f"{micro_s * 1e3:.0f} ms of the GPU's work predicted against {launches * 1e3:.1f} ms of launches "
                    f"(at least {GPU_BOUND:g}×): a third more work in the blocks shows in its time"),)
    if card.fp8 and fp8["n"]:
        n = fp8["n"][-1]
        found += (Regime("FP8 beats bf16 within the crossover's sizes", bool(fp8_s(card, n) < bf16_s(card, n)),
                         f"at n = {n}: fp8's three matmuls and scaling {fp8_s(card, n) * 1e3:.2f} ms predicted against "
                         f"bf16's {bf16_s(card, n) * 1e3:.2f} ms (the scaling at {CAST_BYTES} bytes an element: an "
                         "estimate)"),)
    return found
