"""Lesson 10's plan: the GPT's waterfall sized from the card, its races within one budget, and the memory each of its
configurations needs.

Every card trains the same GPT (``gpt.FULL``); the tokens of a training step (``micro`` sequences a micro-batch,
``accum`` micro-batches) are the most of ``BATCHES`` for which the naive step stays far from what the card does in
16-bit with SDPA, every race of the path and the head-to-head fit the budget with room to spare, and a race at the
larger micro-batch fits the card's memory. The budget is the lesson's minutes less its other parts: the waterfall's
races, their noise (each race's interleaved pairs) and the head-to-head race stop there, whatever the rates turn out
to be (``step_races.Limits``, planned with ``race_s`` and ``startup_s`` from the step times measured so far). A
configuration whose race would not fit the card's memory (``race_gb``: the larger micro-batch with attention written
out in fp32, where SDPA or autocast was not kept) is not raced, with one line saying why. Quick mode keeps its small
sizes; the precision (bf16, or fp16 with a GradScaler) follows the card in both modes.
"""

import math

from . import gpt
from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .plan04 import CEILING_S
from .predict import compare_s

TITLE = "The GPT made fast: the waterfall, torch.compile and CUDA graphs"
FEATURES = ("bf16", "tf32", "flash attention", "gpm")
BATCHES = ((4, 8), (2, 8), (1, 8), (1, 4))  # (micro, accum) of a training step, most tokens first
LARGER = 4  # the larger micro-batch step: this many times the sequences a micro-batch, as many times fewer of them
PADDED_VOCAB = 320
PAIRS, BUSY_STEPS = 5, 5
QUICK = dict(waterfall=dict(micro=1, accum=4, pairs=PAIRS, lr=2e-3, busy_steps=3), breaks_min_time=0.1)
# A first torch.compile of the GPT, and a later one in the same kernel (any mode: its Triton kernels cached, its graphs
# traced again): the 2026-11-27 H200 run's waterfall (quick mode, nine lessons sharing its 16 cores) took 20.4 s to start
# its torch.compile step and 8.8 s for its CUDA graphs step after it. Fewer cores compile for longer (an estimate).
COMPILE_S, COMPILE_AGAIN_S = 20.0, 8.8
BLOCK_COMPILE_S = 3.0  # section 3's blocks compiled by Inductor: 5.7 s and 3.0 s on the same H200, contended
COUNT_S = 1.0  # FlopCounterMode over one sequence's step, once per shape and precision (estimate)
FAR = 3.0  # the naive step at least this many times the planned end of the eager path: a waterfall worth racing
GPU_BOUND = 5.0  # the naive step's GPU work at least this many times its launches: its MFU means something
FILL = 0.85  # the races planned to fill at most this share of the budget: room for rates below the plan
PROFILED, TRACE_S = 1.6, 1.0  # a profiled step's time over an unprofiled one (lesson 06's plan); reading a trace
FIXED_S = {"start": 15.0, "torch.compile's breaks explained and the recompiles counted": 8.0, "figures": 10.0}


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    amp = card.amp_precision if card.is_gpu else "bf16"  # a CPU's autocast runs bf16
    usable = card.usable_gb() if card.is_gpu else math.inf
    compiles = {"compile_s": round(COMPILE_S * gpt.compile_scale(card), 1),
                "compile_again_s": round(COMPILE_AGAIN_S * gpt.compile_scale(card), 1)}
    if quick:
        sizes = dict(gpt=gpt.QUICK, text_bytes=1_000_000, **QUICK, budget_s=math.inf, **compiles, amp=amp,
                     usable_gb=usable)
        return LessonPlan("10", TITLE, card, True, sizes, features=FEATURES)
    options = [full(card, amp, micro, accum, compiles, usable) for micro, accum in BATCHES]
    fitting = [p for p in options if p.minutes <= p.target_minutes and all(r.holds for r in p.regimes)]
    return (fitting or options[-1:])[0]


def full(card: Card, amp: str, micro: int, accum: int, compiles: dict, usable: float) -> LessonPlan:
    minutes = target_minutes(card, long=True)
    waterfall = dict(micro=micro, accum=accum, pairs=PAIRS, lr=6e-4, busy_steps=BUSY_STEPS)
    sizes = dict(gpt=gpt.FULL, text_bytes=None, waterfall=waterfall, breaks_min_time=0.5, budget_s=0.0, **compiles,
                 amp=amp, usable_gb=round(usable, 2))
    fixed = fixed_parts(card, sizes)
    sizes["budget_s"] = budget_s = math.floor(10 * (60 * minutes - sum(p.seconds for p in fixed))) / 10
    path = path_seconds(card, sizes)
    planned = sum(s for _, s in path)
    parts = (*fixed[:2], Part("the waterfall's races and the head-to-head", budget_s,
                              f"at most: each race is planned before it starts and refused past the budget; planned "
                              f"at {planned:.0f} s as if every step were kept ({', '.join(f'{n} {s:.0f} s' for n, s in path)})"),
             *fixed[2:])
    why = {"waterfall": f"the most tokens a step (of {', '.join(f'{m} × {a}' for m, a in BATCHES)} sequences) whose "
                        "races fit the budget, whose naive step is far from the card's 16-bit one and whose larger "
                        "micro-batch fits the card's memory",
           "budget_s": f"the races stop there: the lesson's {minutes:g} minutes less its other parts",
           "compile_s": f"a first torch.compile of the GPT on {card.cpu_cores} CPU cores (estimate)",
           "compile_again_s": "a later compile of the GPT in the same kernel, any mode (estimate)",
           "amp": "native bf16" if amp == "bf16" else "no native bf16: fp16 autocast, with a GradScaler",
           "usable_gb": "a configuration whose race would need more is not raced, and says so"}
    memory = max(race_gb(gpt.FULL, o) for _, o in kept_path(card, sizes))
    return LessonPlan("10", TITLE, card, False, sizes, why, parts, memory, regimes(card, sizes, planned), minutes,
                      FEATURES)


# ---- the path -------------------------------------------------------------------------------------------------------

BASE = dict(tf32=False, amp=False, attention="manual", compile=None, padded_vocab=0, fused=False)


def steps(card: Card, micro: int, accum: int, amp: str) -> list[tuple[str, dict]]:
    """The waterfall's steps on a GPU, (name, the options it adds) each, as lesson 10's cell lists them (the TF32 step
    only where the card has TF32)."""
    larger = dict(micro=LARGER * micro, accum=accum // LARGER)
    return [*([("TF32", dict(tf32=True))] if card.tf32 else []),
            (f"autocast {dict(bf16='bfloat16', fp16='float16')[amp]}", dict(amp=True)),
            ("SDPA", dict(attention="sdpa")),
            (f"vocabulary 257 → {PADDED_VOCAB}", dict(padded_vocab=PADDED_VOCAB)),
            ("fused AdamW", dict(fused=True)),
            (f"micro-batch {larger['micro']} × {larger['accum']}", larger),
            ("torch.compile", dict(compile="default")),
            ("CUDA graphs", dict(compile="reduce-overhead"))]


def kept_path(card: Card, sizes: dict) -> list[tuple[str, dict]]:
    """The naive configuration, then each step's whole configuration as if every step were kept."""
    w = sizes["waterfall"]
    configs, options = [("naive fp32", dict(BASE, micro=w["micro"], accum=w["accum"]))], {}
    for name, added in steps(card, w["micro"], w["accum"], sizes["amp"]):
        options = {**options, **added}
        configs.append((name, {**configs[0][1], **options}))
    return configs


def precision(options: dict, amp: str) -> str:
    """The precision a configuration's matmuls run in: autocast's, else TF32 where switched on, else fp32."""
    return amp if options["amp"] else "tf32" if options["tf32"] else "fp32"


def config_step_s(card: Card, options: dict, amp: str, size: dict = gpt.FULL) -> float:
    """A configuration's training step, predicted (compiled ones planned at the eager step's time: an upper bound)."""
    vocab = max(options["padded_vocab"], gpt.text.VOCAB)
    return gpt.step_s(card, size, options["micro"], options["accum"], precision(options, amp), options["attention"],
                      vocab=vocab)


def race_s(kept_s: float, candidate_s: float, pairs: int) -> float:
    """A race's steps: a first step of each side (timed apart), ``pairs`` interleaved pairs, one more step of each for
    its memory."""
    return (pairs + 2) * (kept_s + candidate_s)


def startup_s(kept: dict, candidate: dict, compiled: bool, compile_s: float, again_s: float) -> float:
    """The compiles a race starts with: each side that compiles, the first of this kernel cold (``compiled``: the GPT
    was compiled before, in any mode), the others again (their Triton kernels cached)."""
    total = 0.0
    for options in (kept, candidate):
        if options.get("compile"):
            total += again_s if compiled else compile_s
            compiled = True
    return total


def path_seconds(card: Card, sizes: dict) -> list[tuple[str, float]]:
    """Each race as if every step were kept (both sides at their predicted step times, a count of each new shape's
    FLOPs, the compiles), then the head-to-head race of the naive configuration against the last."""
    amp, pairs = sizes["amp"], sizes["waterfall"]["pairs"]
    configs, compiled, counted, rows = kept_path(card, sizes), False, set(), []
    for (_, kept), (name, candidate) in zip(configs, configs[1:]):
        shape = (candidate["attention"], candidate["padded_vocab"], candidate["amp"])
        count = 0.0 if shape in counted else COUNT_S
        counted.add(shape)
        start = startup_s(kept, candidate, compiled, sizes["compile_s"], sizes["compile_again_s"])
        compiled = compiled or bool(kept["compile"] or candidate["compile"])
        rows.append((name, race_s(config_step_s(card, kept, amp), config_step_s(card, candidate, amp), pairs)
                     + start + count))
    naive, final = configs[0][1], configs[-1][1]
    rows.append(("head-to-head", race_s(config_step_s(card, naive, amp), config_step_s(card, final, amp), pairs)
                 + startup_s(naive, final, compiled, sizes["compile_s"], sizes["compile_again_s"])))
    return rows


def race_gb(size: dict, options: dict) -> float:
    """A race's device memory, predicted: two runs of the configuration (``options``: its micro-batch, attention,
    autocast and vocabulary), each with its weights, gradients, AdamW's moments and a micro-batch's activations (a run
    with CUDA graphs keeps them in its graphs' pool between steps)."""
    vocab = max(options.get("padded_vocab", 0), gpt.text.VOCAB)
    return 2 * gpt.training_gb(size, options["micro"], options["attention"], bool(options["amp"]), vocab=vocab)


# ---- the rest of the lesson -----------------------------------------------------------------------------------------

def fixed_parts(card: Card, sizes: dict) -> list[Part]:
    """The lesson's parts outside the budget, in its order: the start, the ceilings, each end's busy share, section 3,
    the figures."""
    amp, w = sizes["amp"], sizes["waterfall"]
    configs = kept_path(card, sizes)
    ends = [config_step_s(card, configs[0][1], amp), config_step_s(card, configs[-1][1], amp)]
    precisions = ["fp32", *(["tf32"] if card.tf32 else []), amp]
    block = gpt.micro_batch_s(card, dict(gpt.FULL, n_layer=1), w["micro"], amp, "sdpa")
    (start, start_s), (section3, section3_s), (figures, figures_s) = FIXED_S.items()
    return [
        Part(start, start_s, "imports, the text, one step's FLOPs counted (estimate)"),
        Part("the card's ceilings", CEILING_S * len(precisions),
             f"flops.ceiling's search of {', '.join(precisions)}, {CEILING_S:g} s each (estimate)"),
        Part("each end's busy share", sum((1 + w["busy_steps"]) * s * PROFILED + TRACE_S for s in ends),
             f"{w['busy_steps']} profiled steps of the naive and the final configuration"),
        Part("graph breaks raced", 2 * BLOCK_COMPILE_S * gpt.compile_scale(card)
             + compare_s(block, block, min_time=sizes["breaks_min_time"]),
             f"two blocks compiled ({BLOCK_COMPILE_S:g} s each on the H200, more on fewer cores), "
             f"{sizes['breaks_min_time']:g} s of pairs"),
        Part(section3, section3_s, "Dynamo's explain, its logs and a counting backend (estimate)"),
        Part(figures, figures_s, "estimate"),
    ]


def regimes(card: Card, sizes: dict, planned: float) -> tuple[Regime, ...]:
    amp, w, budget_s = sizes["amp"], sizes["waterfall"], sizes["budget_s"]
    configs = dict(kept_path(card, sizes))
    naive = configs["naive fp32"]
    eager_end = configs[f"micro-batch {LARGER * w['micro']} × {w['accum'] // LARGER}"]
    naive_s, end_s = config_step_s(card, naive, amp), config_step_s(card, eager_end, amp)
    micro_s = gpt.micro_batch_s(card, gpt.FULL, w["micro"], "fp32", "manual")
    launches = gpt.launches_s(card, gpt.FULL, "manual")
    larger, worst = race_gb(gpt.FULL, eager_end), race_gb(gpt.FULL, {**eager_end, "amp": False, "attention": "manual"})
    skipped = ("" if worst <= card.usable_gb() else f"; with attention written out in fp32 (SDPA or autocast not kept) "
               f"it would need {worst:.1f} GB: the lesson does not race it, and says so")
    return (
        Regime("the naive step leaves most of the card unused", bool(naive_s >= FAR * end_s),
               f"the naive step (fp32, attention written out) {naive_s:.2f} s predicted, the eager path's end ({amp}, "
               f"SDPA, micro-batch {LARGER * w['micro']}) {end_s:.2f} s: {naive_s / end_s:.1f}× (at least {FAR:g}×); "
               f"their MFU over the dense {amp} peak, {card.sheet.tflops[amp]:g} TFLOP/s, for the 16-bit steps"),
        Regime("MFU means something: the naive step is the GPU's arithmetic", bool(micro_s >= GPU_BOUND * launches),
               f"a micro-batch of {w['micro']} × {gpt.FULL['seq_len']} tokens in fp32: {micro_s * 1e3:.0f} ms of the "
               f"GPU's work predicted against {launches * 1e3:.1f} ms of launches (at least {GPU_BOUND:g}×)"),
        Regime("every step races within the budget", bool(planned <= FILL * budget_s),
               f"the races and the head-to-head planned at {planned:.0f} s of the {budget_s:.0f} s budget (at most "
               f"{FILL:.0%}: room for rates below the plan)"),
        Regime("the larger micro-batch fits the card's memory", bool(larger <= card.usable_gb()),
               f"a race at micro-batch {LARGER * w['micro']} in {amp} with SDPA: {larger:.1f} GB of "
               f"{card.usable_gb():.1f} GB usable{skipped}"),
    )
