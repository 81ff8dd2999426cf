"""Lesson 04 (mixed precision): TFLOP/s of a matmul, a training step with autocast and a GradScaler,
fp16 underflow, and the precision to choose for a GPU."""

import copy
import numbers

import torch
import torch.nn.functional as F

from ..check import Question, Wrong, expect_close
from .lesson00 import _positive

# ---- q1: TFLOP/s from a timing -------------------------------------------------------------------------------


def _check_tflops(tflops, m, n, k, seconds) -> str:
    m, n, k = (int(_positive(v, name)) for v, name in ((m, "M"), (n, "N"), (k, "K")))
    seconds = _positive(seconds, "seconds")
    expected = 2 * m * n * k / seconds / 1e12
    if isinstance(tflops, torch.Tensor) and tflops.numel() == 1:
        tflops = tflops.item()
    if isinstance(tflops, numbers.Real) and not isinstance(tflops, bool) and tflops > 0:
        for value, why in ((expected / 2, "you counted M·N·K operations: each multiply-add is 2 FLOPs"),
                           (expected * 1e3, "that looks like GFLOP/s: divide by 1e12 for TFLOP/s"),
                           (expected * 1e12, "that is FLOP/s: divide by 1e12 for TFLOP/s"),
                           (2 * m**3 / seconds / 1e12, "the matrices are not square: count 2·M·N·K, not 2·M³")):
            if abs(tflops - value) <= 0.02 * value and abs(tflops - expected) > 0.02 * expected:
                raise Wrong(why)
    expect_close(tflops, expected, rel=0.02, what="the throughput", unit="TFLOP/s")
    return f"2·M·N·K / seconds = {expected:.3g} TFLOP/s for this ({m}×{k}) @ ({k}×{n}) matmul."


q1 = Question(
    lesson="04", number=1, title="TFLOP/s of a matmul",
    checker=_check_tflops,
    hint_text="An (M×K) @ (K×N) matmul computes M·N output elements, each a sum of K products: one multiply and "
              "one add per term. Divide the FLOPs by the seconds, then by 10¹² for TFLOP/s.",
    solution_text="tflops = 2 * M * N * K / seconds / 1e12",
)

# ---- q2: a training step with autocast and a GradScaler ------------------------------------------------------


class _SpyScaler:
    """Stands in for torch.amp.GradScaler and records how the training step uses it."""

    def __init__(self, optimizer, scale: float = 1024.0):
        self.scale_value, self.optimizer = scale, optimizer
        self.calls, self.scaled_loss, self.raw_grads, self.unscaled = [], None, None, False

    def scale(self, loss):
        self.calls.append("scale")
        self.scaled_loss = loss * self.scale_value
        return self.scaled_loss

    def unscale_(self, optimizer):
        self.calls.append("unscale_")
        self._unscale()

    def step(self, optimizer, *args, **kwargs):
        self.calls.append("step")
        self._unscale()
        self.optimizer.inside_scaler = True
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            self.optimizer.inside_scaler = False

    def update(self, new_scale=None):
        self.calls.append("update")

    def get_scale(self) -> float:
        return self.scale_value

    def is_enabled(self) -> bool:
        return True

    def _unscale(self):
        if self.unscaled:
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.raw_grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale_value)
        self.unscaled = True


class _SpySGD(torch.optim.SGD):
    """SGD that counts its steps and knows whether the scaler called it."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.inside_scaler, self.steps, self.direct_steps = False, 0, 0

    def step(self, closure=None):
        self.steps += 1
        self.direct_steps += not self.inside_scaler
        return super().step(closure)


def _reference_step(model, x, y, dtype, lr):
    """Loss and gradients of a correct step (autocast forward, fp32 loss), and the weights after it."""
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        after = [p - lr * g for p, g in zip(model.parameters(), grads)]
    return loss.detach(), grads, after


def _check_train_step(train_step) -> str:
    if not callable(train_step):
        raise Wrong("pass your function itself: `q2.check(train_step)`")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x, y, dtype, lr = torch.randn(16, 8), torch.randint(4, (16,)), torch.bfloat16, 0.1
    ref_loss, ref_grads, ref_after = _reference_step(model, x, y, dtype, lr)

    optimizer = _SpySGD(model.parameters(), lr=lr)
    scaler = _SpyScaler(optimizer)
    for p in model.parameters():  # left over from an earlier step: a correct step clears them first
        p.grad = torch.full_like(p, 100.0)
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    loss = train_step(model, optimizer, scaler, x, y, "cpu", dtype)

    if not seen:
        raise Wrong("your step never ran the model: compute `loss = F.cross_entropy(model(x), y)`")
    if seen[0] != dtype:
        raise Wrong(f"the model's first layer ran in {seen[0]}, not {dtype}: run the forward pass inside "
                    "`with torch.autocast(device_type, dtype=dtype):`")
    if "scale" not in scaler.calls:
        raise Wrong("the loss was never scaled: call `scaler.scale(loss).backward()`")
    if scaler.scaled_loss is None or not torch.allclose(scaler.scaled_loss.detach().float() / scaler.scale_value,
                                                        ref_loss.float(), rtol=1e-3):
        raise Wrong("scaler.scale() got a different loss than `F.cross_entropy(model(x), y)` under autocast")
    if optimizer.direct_steps:
        raise Wrong("you called optimizer.step() yourself: call `scaler.step(optimizer)` instead, which unscales "
                    "the gradients and skips the step when they overflowed")
    if "step" not in scaler.calls:
        raise Wrong("the optimizer never stepped: call `scaler.step(optimizer)` after the backward pass")
    if optimizer.steps != 1:
        raise Wrong(f"the optimizer stepped {optimizer.steps} times in one training step: once is enough")
    raw = scaler.raw_grads
    if any(g is None for g in raw):
        raise Wrong("some weights had no gradient when the optimizer stepped: call `.backward()` on the scaled "
                    "loss before `scaler.step(optimizer)`")
    scaled = [r * scaler.scale_value for r in ref_grads]

    def raw_is(expected) -> bool:
        return all(torch.allclose(g, e, rtol=1e-2, atol=1e-3) for g, e in zip(raw, expected))

    if raw_is([e + 100.0 for e in scaled]) or raw_is([r + 100.0 for r in ref_grads]):
        raise Wrong("the gradients of the previous step were added to the new ones: call "
                    "`optimizer.zero_grad()` before the backward pass")
    if raw_is(ref_grads):
        raise Wrong("backward() ran on the unscaled loss: call `scaler.scale(loss).backward()`, so that small "
                    "fp16 gradients survive")
    if not raw_is(scaled):
        raise Wrong("the gradients at the optimizer step are not those of the scaled loss: zero the gradients, "
                    "then `scaler.scale(loss).backward()`, then `scaler.step(optimizer)`")
    if "update" not in scaler.calls or scaler.calls.index("update") < scaler.calls.index("step"):
        raise Wrong("call `scaler.update()` after `scaler.step(optimizer)`: it adapts the scale for the next step")
    if not all(torch.allclose(p, a, rtol=1e-3, atol=1e-5) for p, a in zip(model.parameters(), ref_after)):
        raise Wrong("the weights after your step differ from one SGD step on the unscaled gradients")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        loss = loss.detach().item()
    if not isinstance(loss, numbers.Real):
        raise Wrong(f"return the loss (a tensor or a number), got {type(loss).__name__}")
    expect_close(loss, ref_loss.item(), rel=1e-2, what="the returned loss")
    return "autocast forward, scaled backward, scaler.step(optimizer), scaler.update(): the whole recipe."


q2 = Question(
    lesson="04", number=2, title="A training step with autocast and a GradScaler",
    checker=_check_train_step,
    hint_text="Four pieces, in this order: the forward pass and the loss inside `with torch.autocast(device_type, "
              "dtype=dtype):`; `optimizer.zero_grad()`; `scaler.scale(loss).backward()`; then "
              "`scaler.step(optimizer)` (never `optimizer.step()` yourself) and `scaler.update()`.",
    solution_text="""
def train_step(model, optimizer, scaler, x, y, device_type, dtype):
    with torch.autocast(device_type, dtype=dtype):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
""",
)

# ---- q3: the share of gradients that underflow in fp16 ------------------------------------------------------


def _true_share(grads: torch.Tensor, scale: float) -> float:
    nonzero = grads != 0
    return (((grads * scale).half() == 0) & nonzero).sum().item() / nonzero.sum().item()


def _test_gradients() -> torch.Tensor:
    """Gradients around fp16's limits: exact zeros, values that underflow, round up, or are subnormal."""
    g = torch.Generator().manual_seed(4)
    parts = [torch.zeros(300),                                     # exact zeros (e.g. dead ReLUs)
             2.0 ** torch.empty(400).uniform_(-40, -26, generator=g),  # below half the smallest subnormal: → 0
             2.0 ** torch.empty(200).uniform_(-24.9, -24.1, generator=g),  # just under 2^-24: round up to 2^-24
             2.0 ** torch.empty(400).uniform_(-23, -15, generator=g),  # subnormal: kept, imprecise
             2.0 ** torch.empty(700).uniform_(-14, -2, generator=g)]   # normal
    grads = torch.cat(parts)
    signs = torch.where(torch.rand(len(grads), generator=g) < 0.5, -1.0, 1.0)
    return (grads * signs)[torch.randperm(len(grads), generator=g)]


def _check_underflow_share(underflow_share) -> str:
    if not callable(underflow_share):
        raise Wrong("pass your function itself: `q3.check(underflow_share)`")
    grads = _test_gradients()
    results = []
    for scale in (1.0, 2.0**-4, 2.0**16):
        got = underflow_share(grads.clone(), scale)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise Wrong(f"return the share as a number between 0 and 1, got {type(got).__name__}")
        expected = _true_share(grads, scale)
        if abs(got - expected) > 1e-6:
            zeros_counted = (((grads * scale).half() == 0).float().mean().item())
            if abs(got - zeros_counted) <= 1e-6:
                raise Wrong("count only the gradients that were non-zero before the cast: exact zeros did not "
                            "underflow, they were zero already")
            if scale == 1.0 and abs(got - ((grads != 0) & (grads.abs() < torch.finfo(torch.float16).tiny)).sum()
                                    .item() / (grads != 0).sum().item()) <= 1e-6:
                raise Wrong("that is the share below fp16's smallest *normal* number: those become subnormal, not "
                            "zero. Cast (`.half()`) and compare with 0")
            raise Wrong(f"with scale = {scale:g} your share is {got:.4g}, but {expected:.4g} of the non-zero "
                        "gradients become 0 when `(grads * scale).half()` is computed. Cast, then compare with 0: "
                        "fp16 rounds to the nearest value, so numbers just under 2⁻²⁴ round up, not to 0")
        results.append(f"{expected:.1%} at scale {scale:g}")
    return "shares of non-zero gradients lost to fp16: " + ", ".join(results) + "."


q3 = Question(
    lesson="04", number=3, title="Gradients that underflow in fp16",
    checker=_check_underflow_share,
    hint_text="Multiply by the scale, cast with `.half()`, and compare with 0. Count only the gradients that "
              "were non-zero in fp32, and divide by how many of those there are.",
    solution_text="""
def underflow_share(grads, scale):
    nonzero = grads != 0
    became_zero = (grads * scale).half() == 0
    return ((became_zero & nonzero).sum() / nonzero.sum()).item()
""",
)

# ---- q4: the precision to choose for a GPU ------------------------------------------------------------------

_GPUS = {(7, 0): "V100", (7, 5): "T4", (8, 0): "A100", (8, 6): "A10 / RTX 3090", (8, 9): "L4",
         (9, 0): "H100", (10, 0): "B200", (12, 0): "RTX 50xx"}
_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          "fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
          "fp32": "fp32", "float32": "fp32", "float": "fp32"}


def _check_choose_precision(choose_precision) -> str:
    if not callable(choose_precision):
        raise Wrong("pass your function itself: `q4.check(choose_precision)`")
    for cc, gpu in _GPUS.items():
        answer = choose_precision(cc)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise Wrong(f"return a pair (dtype, use_scaler), e.g. (torch.float16, True); got {answer!r}")
        dtype, use_scaler = answer
        key = dtype.lower() if isinstance(dtype, str) else dtype
        name = _NAMES.get(key) if isinstance(key, (str, torch.dtype)) else None
        if name is None:
            raise Wrong(f"for {gpu} the dtype {dtype!r} is not one of torch.float16, torch.bfloat16")
        where = f"{gpu} (compute capability {cc[0]}.{cc[1]})"
        native_bf16 = cc >= (8, 0)
        if name == "fp32":
            raise Wrong(f"{where} has tensor cores: choose a 16-bit autocast dtype, not fp32")
        if name == "bf16" and not native_bf16:
            raise Wrong(f"{where} has no native bf16 (it needs 8.0+): PyTorch would emulate it, slowly. "
                        "Use fp16 there")
        if name == "fp16" and native_bf16:
            raise Wrong(f"{where} supports bf16 natively: prefer it, it has fp32's range and needs no GradScaler")
        if bool(use_scaler) != (name == "fp16"):
            raise Wrong(f"for {where} with {name}: " + (
                "fp16 needs a GradScaler, or small gradients underflow to zero" if name == "fp16"
                else "bf16 has fp32's exponent range, so it needs no GradScaler"))
    return "bf16 without a scaler from compute capability 8.0, fp16 with a GradScaler before."


q4 = Question(
    lesson="04", number=4, title="Which precision for which GPU?",
    checker=_check_choose_precision,
    hint_text="Native bf16 (and TF32) came with compute capability 8.0 (Ampere). Tuples compare element by "
              "element: `(8, 6) >= (8, 0)` is True. Only fp16 needs a GradScaler.",
    solution_text="""
def choose_precision(compute_capability):
    if compute_capability >= (8, 0):
        return torch.bfloat16, False
    return torch.float16, True
""",
)
