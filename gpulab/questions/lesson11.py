"""Lesson 11, a transformer's memory and FP8: one block's activation memory worked out on paper, and a tensor scaled
into fp8.

Neither check times the learner's code. q1 compares the learner's formula with the bytes autograd keeps for one block
of the lessons' GPT, measured on this machine's CPU (a MemoryTracker over the forward pass: two blocks less one)
after the learner's function has returned; q2 checks what the learner's scaling returns against the fp8 format
itself (its largest value, and the input given back within the format's rounding)."""

import functools
import math
import numbers
import random

import torch

from .. import text
from ..check import Question, Wrong
from ..memory import MemoryTracker
from .on_paper import TensorOperations

# ----- q1: one block's activation memory -------------------------------------------------------------------------------

# (batch, seq_len, n_embd, n_head, attention): written out and fused, one sequence or several, narrow and wide heads
_CONFIGS = [(2, 64, 64, 4, "manual"), (2, 64, 64, 4, "sdpa"), (1, 128, 32, 2, "manual"), (3, 32, 48, 6, "sdpa")]
TOLERANCE = 0.03  # the lesson's count is within 0.1 % of the measurement; the LayerNorms' statistics are 0.1 %


@functools.lru_cache(maxsize=64)
def measured_bytes(batch, seq_len, n_embd, n_head, attention) -> int:
    """The bytes autograd keeps for one block of the lessons' GPT (``gpulab.text.GPT``) in fp32, training mode: what
    its forward pass leaves alive with two blocks, less what it leaves with one, counted by a MemoryTracker on the
    CPU."""
    kept = []
    for layers in (1, 2):
        cfg = text.GPTConfig(seq_len=seq_len, n_layer=layers, n_head=n_head, n_embd=n_embd, attention=attention)
        model = text.GPT(cfg)
        idx = torch.randint(0, text.VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(0))
        with MemoryTracker() as tracker:
            loss = model(idx, idx)
        kept.append(tracker.current)
        del loss
    return kept[1] - kept[0]


def _mistakes(batch, seq_len, n_embd, n_head, attention) -> dict[str, float]:
    """Bytes that plausible mistakes give, and what each gets wrong."""
    tokens, manual = batch * seq_len, attention == "manual"
    mask = seq_len * seq_len if manual else 0
    own = n_head * seq_len if manual else n_head  # attention's own numbers per token
    found = {
        "that counts numbers, not bytes: in fp32 each number is 4 bytes": tokens * (16 * n_embd + 4 + own) + mask,
        "that misses the MLP's hidden layer, kept before and after GELU: 4·d numbers each":
            tokens * 4 * (8 * n_embd + 4 + own) + mask,
    }
    if manual:
        found["that leaves out attention's probabilities: written out, it keeps heads·T numbers per token (a T×T "
              "matrix per head and sequence)"] = tokens * 4 * (16 * n_embd + 4) + mask
        found["the probabilities are heads·T numbers per token (T² per head per sequence), not T² per token"] = (
            tokens * 4 * (16 * n_embd + 4 + seq_len * seq_len) + mask)
    else:
        found["fused attention (SDPA) never keeps the probabilities: one log-sum-exp per head and token, heads "
              "numbers, not heads·T"] = tokens * 4 * (16 * n_embd + 4 + n_head * seq_len)
    return found


def _check_activation_bytes(activation_bytes) -> str:
    if not callable(activation_bytes):
        raise Wrong("pass your function itself: `q1.check(activation_bytes)`")
    rng = random.Random()
    heads = rng.choice([2, 4])
    configs = _CONFIGS + [(rng.randint(1, 3), rng.choice([32, 48, 96]), heads * rng.choice([8, 16]), heads,
                           rng.choice(["manual", "sdpa"]))]  # and one drawn at random each time
    for cfg in configs:
        call = "activation_bytes(batch={}, seq_len={}, n_embd={}, n_head={}, attention={!r})".format(*cfg)
        with TensorOperations() as operations:
            got = activation_bytes(*cfg)
        if operations.ran:
            raise Wrong(f"{call} ran {operations.ran} tensor operations: work it out on paper, from the configuration "
                        "(no model, no MemoryTracker: the check measures what autograd keeps and compares)")
        if isinstance(got, bool) or not isinstance(got, (numbers.Real, torch.Tensor)) or (
                isinstance(got, torch.Tensor) and got.numel() != 1):
            raise Wrong(f"{call} returned {got!r:.80}: return a number of bytes")
        got, kept = float(got), measured_bytes(*cfg)
        if abs(got - kept) <= TOLERANCE * kept:
            continue
        hint = next((why for why, value in _mistakes(*cfg).items() if abs(got - value) <= TOLERANCE * value), "")
        if not hint and math.isclose(got * cfg[0] * cfg[1], kept, rel_tol=TOLERANCE):
            hint = "that is per token: multiply by the batch × seq_len tokens"
        raise Wrong(f"{call} = {got:,.0f}; autograd keeps {kept:,.0f} bytes for one block" + (f": {hint}." if hint else
                    ". Count what the block keeps for its backward pass, per token: its input, the two LayerNorms' "
                    "outputs and statistics, q, k and v, the attention output, the residual stream, the MLP's hidden "
                    "layer before and after GELU, and attention's own."))
    cfg = configs[0]
    return (f"within {TOLERANCE:.0%} of what autograd keeps on {len(configs)} configurations; written out, a block of "
            f"width {cfg[2]} keeps {measured_bytes(*cfg) / (cfg[0] * cfg[1]):,.0f} bytes per token at T = {cfg[1]}.")


# ----- q2: a tensor scaled into fp8 ------------------------------------------------------------------------------------

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
BOUND = {torch.float8_e4m3fn: 0.06, torch.float8_e5m2: 0.12}  # relative error of a round trip: 3 and 2 mantissa bits


def _tensors():
    """Inputs of every kind: ordinary, large (past e4m3's range unscaled), small (below its smallest), a largest
    magnitude that is negative, and all zero."""
    g = torch.Generator().manual_seed(11)
    ordinary = torch.randn(64, 32, generator=g) * 3
    negative = torch.randn(64, 32, generator=g)
    negative[5, 7] = -40.0
    return {"ordinary": ordinary, "large": torch.randn(64, 32, generator=g) * 1e4,
            "small": torch.randn(64, 32, generator=g) * 1e-5, "negative": negative, "zero": torch.zeros(64, 32)}


def fp8_scaled(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The check's reference: ``t`` scaled so that its largest magnitude is the largest ``dtype`` holds, cast, and the
    factor that undoes the scale."""
    scale = torch.finfo(dtype).max / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()


def _fp8_mistakes(t: torch.Tensor, dtype: torch.dtype) -> dict:
    """(fp8 tensor, scale) that plausible mistakes give, and what each gets wrong."""
    scale = torch.finfo(dtype).max / t.abs().amax().float().clamp(min=1e-12)
    signed = torch.finfo(dtype).max / t.amax().float().clamp(min=1e-12)
    e4m3 = torch.finfo(torch.float8_e4m3fn).max / t.abs().amax().float().clamp(min=1e-12)
    return {
        "that casts without scaling: large values saturate at the format's largest, small ones round to zero. Scale "
        "by torch.finfo(dtype).max / t.abs().amax() first": (t.to(dtype), torch.ones(())),
        "that scales by the largest value, not the largest magnitude: a large negative value lands beyond the "
        "format's range (use t.abs().amax())": ((t.float() * signed).to(dtype), signed.reciprocal()),
        "that returns the scale itself: return the factor that undoes it, its reciprocal, so that t ≈ t8 × it":
            ((t.float() * scale).to(dtype), scale),
        "that scales to e4m3's largest (448) for every format: scale to the largest of the dtype passed in, "
        "torch.finfo(dtype).max (57344 for e5m2)": ((t.float() * e4m3).to(dtype), e4m3.reciprocal()),
    }


def _same(got: tuple, expected: tuple) -> bool:
    return (torch.equal(got[0].float(), expected[0].float()) and
            math.isclose(float(got[1]), float(expected[1]), rel_tol=1e-5))


def _check_to_fp8(to_fp8) -> str:
    if not callable(to_fp8):
        raise Wrong("pass your function itself: `q2.check(to_fp8)`")
    for dtype in FP8:
        name, largest = str(dtype).removeprefix("torch."), torch.finfo(dtype).max
        for kind, t in _tensors().items():
            call = f"to_fp8(<{kind} tensor>, torch.{name})"
            got = to_fp8(t.clone(), dtype)
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)):
                raise Wrong(f"{call} returned {type(got).__name__}: return two things, (the fp8 tensor, the factor "
                            "that undoes the scale)")
            t8, inverse = got
            if t8.dtype != dtype or t8.shape != t.shape:
                raise Wrong(f"{call} returned a {str(t8.dtype).removeprefix('torch.')} tensor of shape "
                            f"{tuple(t8.shape)}: cast to {name}, the input's shape {tuple(t.shape)}")
            if isinstance(inverse, bool) or not (isinstance(inverse, numbers.Real) or (
                    isinstance(inverse, torch.Tensor) and inverse.numel() == 1)):
                raise Wrong(f"{call} returned {inverse!r:.60} as its second value: return one number, the factor "
                            "that undoes the scale")
            back = t8.float() * float(inverse)
            if kind == "zero":
                if not (torch.isfinite(back).all() and not back.any()):
                    raise Wrong(f"{call} gives back {back.flatten()[0].item()} for an all-zero tensor: its largest "
                                "magnitude is 0, so clamp it before dividing (.clamp(min=1e-12))")
                continue
            error = (torch.linalg.norm(back - t) / torch.linalg.norm(t)).item()
            peak = t8.float().abs().max().item()
            if error <= BOUND[dtype] and peak == largest:
                continue
            right = fp8_scaled(t, dtype)
            hint = next((why for why, wrong in _fp8_mistakes(t, dtype).items() if _same(got, wrong)
                         and not _same(wrong, right)), "")
            raise Wrong(f"{call}: the largest magnitude of your fp8 tensor is {peak:g} (the format's largest is "
                        f"{largest:g}), and t8 × your factor gives t back within {error:.1%} (at most "
                        f"{BOUND[dtype]:.0%} for {name})" + (f": {hint}." if hint else "."))
    return ("right for e4m3 and e5m2 on ordinary, large, small and all-zero tensors, and one whose largest magnitude "
            "is negative: each tensor fills the format's range, and comes back within its rounding.")


# ----- the questions ------------------------------------------------------------------------------------------------

q1 = Question(
    lesson="11", number=1, title="a block's activation memory, on paper", checker=_check_activation_bytes,
    hint_text="Per token, in fp32 (4 bytes a number): the block's input (d), the two LayerNorms' outputs (d each) and "
              "their statistics (a mean and a reciprocal standard deviation each), q, k and v (3d), the attention "
              "output (d), the residual stream after attention (d), the MLP's hidden layer before and after GELU (4d "
              "each): 16·d + 4 numbers. Written out, attention adds its probabilities, heads·T numbers per token, and "
              "a T×T mask of one byte per element; fused (SDPA), one log-sum-exp per head: heads numbers.",
    solution_text="""
def activation_bytes(batch, seq_len, n_embd, n_head, attention):
    tokens = batch * seq_len
    own = n_head * seq_len if attention == "manual" else n_head   # probabilities, or one log-sum-exp per head
    mask = seq_len * seq_len if attention == "manual" else 0       # bool, one byte each
    return tokens * 4 * (16 * n_embd + 4 + own) + mask
""",
)

q2 = Question(
    lesson="11", number=2, title="a tensor scaled into fp8", checker=_check_to_fp8,
    hint_text="Scale so that the largest magnitude lands on the format's largest value: scale = torch.finfo(dtype).max "
              "/ t.abs().amax(), with the amax clamped away from zero; cast (t.float() * scale).to(dtype); return it "
              "with 1 / scale, which undoes it: t ≈ t8.float() * (1 / scale).",
    solution_text="""
def to_fp8(t, dtype):
    scale = torch.finfo(dtype).max / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()
""",
)
