"""The GPT of lessons 09, 10 and 11 (``gpulab.text.GPT``) as their plans see it: its FLOPs per token
(``gpulab.flops.gpt_flops_per_token``), the operators a training step dispatches, a training step's seconds on a card
and the device memory it holds (lesson 11's activations per layer, on paper).

A step's seconds: its matmuls at the card's achievable rate (``Card.tflops``) times the share the GPT's own step
reached; attention written out moves its T×T scores through device memory at the card's copy rate; fused attention
(SDPA) runs its causal half at a share of the matmul rate; the launches of its operators bound it from below. The
shares come from the one full-mode run of this GPT, an NVIDIA H200's of 2026-11-28 (``tests/data/lesson09``); where
nothing measured them they are estimates and say so.
"""

import functools
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import flops, text
from .card import Card

FULL = dict(seq_len=1024, n_layer=8, n_head=12, n_embd=768)  # the GPT every card trains in full mode: 57.7 M parameters
QUICK = dict(seq_len=64, n_layer=2, n_head=4, n_embd=64)  # quick mode's

# Attention written out, the H200's sweep of 2026-11-28: forward and backward of 4 × 12 heads at T = 8192 in bf16 took
# 63.7 ms, at the H200's copy rate as Card prices it (4,305 GB/s) 85 bytes moved for each score (the scores, the mask,
# softmax's pass in fp32, the probabilities and their gradients). fp32 moves each of those tensors at twice the width
# (estimate). Forced to its math kernel the same call took 124 ms: twice the traffic.
SCORE_BYTES = {"16-bit": 0.063678 * 4304.9e9 / (4 * 12 * 8192**2), "fp32": 2 * 0.063678 * 4304.9e9 / (4 * 12 * 8192**2)}
MATH_OVER_WRITTEN_OUT = 0.123812 / 0.063678
# The share of the card's achievable matmul rate a training step's matmuls reach, the rest of the step (LayerNorm, GELU,
# the optimizer) folded in. fp32: the same run's first training run, 8 × 1024 tokens with attention written out, 100.9 ms
# a step: less its attention's traffic (31.8 ms, above) its 3.41 TFLOP ran at 95 % of the H200's fp32 rate. TF32 and the
# 16-bit precisions: estimates (a GPT of width 768 multiplies matrices too small for the tensor cores' best).
MATMUL_SHARE = {"fp32": 0.95, "tf32": 0.7, "fp16": 0.6, "bf16": 0.6}
# Fused causal attention: flash forced at T = 8192 on the same H200 ran its causal half (1.44 TFLOP: 7·T²·d a layer and
# sequence, forward and backward) in 5.83 ms; memory-efficient on a card without flash attention: the same share of its
# rate (estimate).
H200_FLASH = (1.443e12, 5.831e-3)  # FLOPs run, seconds
STATE_BYTES = 16  # per parameter: fp32 weights, their gradients, AdamW's two moments
PEAK_FACTOR = 1.25  # the activations' peak in backward over what the forward kept: the gradients of the layer being
# differentiated beside what is still kept (tests/test_lesson10_plan.py bounds a measured step with it)


def size_of(size: dict) -> tuple[int, int, int, int]:
    """(T, layers, heads, width) of a GPT's ``size`` (``FULL``'s keys)."""
    return size["seq_len"], size["n_layer"], size["n_head"], size["n_embd"]


def parameters(size: dict, vocab: int = text.VOCAB) -> int:
    """Every parameter of ``text.GPT`` of ``size`` (the tied embedding once): embeddings, blocks, the last LayerNorm."""
    T, L, _, d = size_of(size)
    return vocab * d + T * d + L * (12 * d * d + 13 * d) + 2 * d


def flops_per_token(size: dict, vocab: int = text.VOCAB) -> float:
    """The model FLOPs of a training step per token (every matmul, attention's over the whole T×T square)."""
    T, L, _, d = size_of(size)
    return float(flops.gpt_flops_per_token(L, d, T, vocab))


def attention_flops_per_token(size: dict) -> float:
    """The part of ``flops_per_token`` that is attention's two matmuls over the scores (12·L·d·T for training)."""
    T, L, _, d = size_of(size)
    return 12.0 * L * d * T


def scores(size: dict, sequences: float) -> float:
    """The T×T scores of every head and layer over ``sequences`` sequences."""
    T, L, heads, _ = size_of(size)
    return sequences * L * heads * T * T


class _Kernels(TorchDispatchMode):
    """Counts the operators dispatched that launch a kernel on a GPU (a view launches none)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


@functools.cache
def operators(seq_len: int, n_layer: int, n_head: int, n_embd: int, attention: str) -> int:
    """The operators one micro-batch's forward and backward dispatches that launch a kernel, counted on the meta device
    (no memory, no time; SDPA runs its math decomposition there: an upper bound for its fused kernels)."""
    cfg = text.GPTConfig(seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd, attention=attention)
    with torch.device("meta"):
        model = text.GPT(cfg)
        idx = torch.zeros(1, seq_len, dtype=torch.long)
    ops = _Kernels()
    with ops:
        model(idx, idx).backward()
    return ops.count


OPTIMIZER_OPS = 40  # AdamW's foreach step and zero_grad over the GPT's tensors (estimate)


def precision_bytes(precision: str) -> str:
    return "16-bit" if precision in ("fp16", "bf16") else "fp32"


def micro_batch_s(card: Card, size: dict, sequences: int, precision: str, attention: str, *,
                  vocab: int = text.VOCAB) -> float:
    """The GPU's seconds for one micro-batch's forward and backward over ``sequences`` sequences, its matmuls in
    ``precision`` ('fp32', 'tf32', 'fp16', 'bf16'), its attention ``attention`` ('manual' or 'sdpa')."""
    tokens = sequences * size["seq_len"]
    rate = card.tflops(precision) * 1e12
    weights = tokens * (flops_per_token(size, vocab) - attention_flops_per_token(size)) / (rate * MATMUL_SHARE[precision])
    if attention == "manual":
        attend = (tokens * attention_flops_per_token(size) / (rate * MATMUL_SHARE[precision])
                  + scores(size, sequences) * SCORE_BYTES[precision_bytes(precision)] / (card.copy_gbs * 1e9))
    else:  # what the kernels run: 7·T²·d a layer and sequence, at the fused share of the rate (fp32 where not 16-bit)
        fused_rate = card.tflops(precision if precision in ("fp16", "bf16") else "fp32") * 1e12 * fused_share()
        attend = tokens * attention_flops_per_token(size) * 7 / 12 / fused_rate
    return weights + attend


@functools.cache
def fused_share() -> float:
    """The share of its achievable 16-bit rate the H200's flash kernel reached (``H200_FLASH``)."""
    ran, seconds = H200_FLASH
    return ran / seconds / (Card.named("NVIDIA H200").tflops("bf16") * 1e12)


def launches_s(card: Card, size: dict, attention: str, micro_batches: int = 1) -> float:
    """The CPU's seconds launching a step of ``micro_batches`` micro-batches and its optimizer (eager)."""
    ops = operators(*size_of(size), attention)
    return (micro_batches * ops + OPTIMIZER_OPS) * card.launch_s


def step_s(card: Card, size: dict, micro: int, accum: int, precision: str, attention: str, *,
           vocab: int = text.VOCAB) -> float:
    """A training step of ``accum`` micro-batches of ``micro`` sequences and its AdamW step: the GPU's work (the
    optimizer reads and writes the weights, gradients and moments), or its launches where they take longer."""
    gpu = (accum * micro_batch_s(card, size, micro, precision, attention, vocab=vocab)
           + 28 * parameters(size, vocab) / (card.copy_gbs * 1e9))
    return max(gpu, launches_s(card, size, attention, accum))


# ---- memory ---------------------------------------------------------------------------------------------------------

def activation_bytes_per_layer(d: int, heads: int, T: int, batch: int, attention: str, amp: bool = False,
                               checkpointed: bool = False, *, gpu: bool = True) -> float:
    """Bytes one block keeps for the backward pass, on paper: lesson 11's ``predicted_per_layer``, written out there
    (a test checks that the two agree). ``gpu``: softmax keeps its fp32 output and a 16-bit copy on a GPU under
    autocast (6 bytes a probability), only the 16-bit one on a CPU (2)."""
    tokens = batch * T
    if checkpointed:
        return tokens * 4 * d
    mask = T * T if attention == "manual" else 0
    if not amp:
        return tokens * (4 * (16 * d + 4) + 4 * (heads * T if attention == "manual" else heads)) + mask
    probabilities = (6 if gpu else 2) * heads * T
    weights_16bit = 2 * (12 * d * d + 9 * d)
    return tokens * (36 * d + 16 + (probabilities if attention == "manual" else 4 * heads)) + mask + weights_16bit


def training_gb(size: dict, micro: int, attention: str, amp: bool, *, models: int = 1, vocab: int = text.VOCAB,
                checkpointed: bool = False) -> float:
    """The device memory of ``models`` runs training ``text.GPT`` of ``size`` (fp32 weights, gradients and AdamW's
    moments each) with one micro-batch of ``micro`` sequences in flight at a time: its blocks' activations
    (``activation_bytes_per_layer``), the logits and the loss's fp32 copy with their gradients, and the peak backward
    adds (``PEAK_FACTOR``)."""
    T, L, heads, d = size_of(size)
    blocks = L * activation_bytes_per_layer(d, heads, T, micro, attention, amp, checkpointed)
    logits = micro * T * (vocab * 3 * 4 + 2 * d * 4)  # logits, their fp32 copy and gradient; the embeddings' sum
    return (models * STATE_BYTES * parameters(size, vocab) + PEAK_FACTOR * (blocks + logits)) / 1e9


def largest_micro(card: Card, size: dict, ladder, attention: str, amp: bool, *, models: int = 1,
                  vocab: int = text.VOCAB) -> int:
    """The largest micro-batch of ``ladder`` whose training fits the card's usable memory (the smallest where none
    does)."""
    fits = [m for m in ladder if training_gb(size, m, attention, amp, models=models, vocab=vocab) <= card.usable_gb()]
    return max(fits) if fits else min(ladder)


def compile_scale(card: Card) -> float:
    """A compile on the card's host against 16 cores: inductor compiles its kernels in parallel, the rest on one core
    (the square root of the ratio, an estimate, as lessons 06 and 08 plan it)."""
    return math.sqrt(max(16 / max(card.cpu_cores, 1), 1.0))
