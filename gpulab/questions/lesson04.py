"""Lesson 04 (mixed precision): TFLOP/s of a matmul, a training step with autocast and a GradScaler,
fp16 underflow, and AMP with gradient accumulation and clipping (observed: autocast dtypes, host reads, the
scaler's calls, the gradients the optimizer sees)."""

import copy
import itertools
import math
import numbers
import warnings

import torch
import torch.nn.functional as F

from ..check import Question, Wrong, expect_close
from ..models import seeded
from .observe import observe
from .stand_in import positive, ratio_is

# ---- q1: TFLOP/s from a timing -------------------------------------------------------------------------------


def _check_tflops(tflops, m, n, k, seconds) -> str:
    m, n, k = (int(positive(v, name)) for v, name in ((m, "M"), (n, "N"), (k, "K")))
    seconds = positive(seconds, "seconds")
    expected = 2 * m * n * k / seconds / 1e12
    if isinstance(tflops, torch.Tensor) and tflops.numel() == 1:
        tflops = tflops.item()
    if not ratio_is(tflops, expected, 1):
        dims = {"M": m, "N": n, "K": k}
        other = {2 * math.prod(dims[d] for d in combo) / seconds / 1e12 for combo in
                 itertools.combinations_with_replacement("MNK", 3)} - {expected}
        for ratio, why in ((0.5, "you counted M·N·K operations: each multiply-add is 2 FLOPs"),
                           (1e3, "that looks like GFLOP/s: divide by 1e12 for TFLOP/s"),
                           (1e12, "that is FLOP/s: divide by 1e12 for TFLOP/s"),
                           (1e-3, "`seconds` is in seconds: do not divide it by 1000"),
                           (1e12 / 2**40, "1 TFLOP/s is 1e12 FLOP/s, not 2⁴⁰"),
                           *((value / expected, "the matrices are (M×K) @ (K×N), not square: count 2·M·N·K")
                             for value in sorted(other))):
            if ratio_is(tflops, expected, ratio):
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
    """Stands in for torch.amp.GradScaler and records how the training step uses it.

    Like the real one it multiplies by its scale, unscales the gradients once (in ``unscale_`` or else in ``step``),
    refuses a second ``unscale_`` before ``update``, and steps the optimizer. It reads no value back to Python,
    so a check can count the host reads of the learner's own code.
    """

    def __init__(self, optimizer, scale: float = 1024.0):
        self.scale_value, self.optimizer = scale, optimizer
        self.calls, self.scaled_losses = optimizer.calls, []  # one list: the scaler's calls and zero_grad
        self.raw_grads = self.grads_at_step = None
        self.unscaled = False

    def scale(self, loss):
        self.calls.append("scale")
        self.scaled_losses.append(loss.detach() * self.scale_value)
        return loss * self.scale_value

    def unscale_(self, optimizer):
        if self.unscaled:  # the real GradScaler raises a RuntimeError here
            raise Wrong("`scaler.unscale_(optimizer)` was called again before `scaler.update()` (a real GradScaler "
                        "raises a RuntimeError): unscale once per optimizer step, after the last backward")
        self.calls.append("unscale_")
        self._unscale()

    def step(self, optimizer, *args, **kwargs):
        self.calls.append("step")
        if not self.unscaled:
            self._unscale()
        self.grads_at_step = [None if p.grad is None else p.grad.detach().clone() for p in self._params()]
        self.optimizer.inside_scaler = True
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            self.optimizer.inside_scaler = False

    def update(self, new_scale=None):
        self.calls.append("update")
        self.unscaled = False

    def get_scale(self) -> float:
        return self.scale_value

    def is_enabled(self) -> bool:
        return True

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _unscale(self):
        params = self._params()
        self.raw_grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale_value)
        self.unscaled = True


class _SpySGD(torch.optim.SGD):
    """SGD that counts its steps, knows whether the scaler called it, and notes each zero_grad() in ``calls``."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.inside_scaler, self.steps, self.direct_steps, self.calls = False, 0, 0, []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append("zero_grad")
        super().zero_grad(set_to_none)

    def step(self, closure=None):
        self.steps += 1
        self.direct_steps += not self.inside_scaler
        return super().step(closure)


def _small_model(device="cpu") -> torch.nn.Module:
    with seeded(0):
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(4, (n,), generator=g)


def _spied_run(fn, model, *args, device_type, dtype, lr=0.1, junk=100.0):
    """Run a learner's step on ``model`` with a spy scaler and optimizer, the gradients pre-filled with ``junk``,
    while observing it; returns (its result, what was observed, the scaler, the optimizer)."""
    optimizer = _SpySGD(model.parameters(), lr=lr)
    scaler = _SpyScaler(optimizer)
    for p in model.parameters():  # left over from an earlier step: a correct step clears them first
        p.grad = torch.full_like(p, junk)
    with warnings.catch_warnings():  # autocast for a device type that is not here warns, and is a no-op
        warnings.filterwarnings("ignore", message=".*(not available|Disabling autocast)", category=UserWarning)
        with observe() as seen:
            result = fn(model, optimizer, scaler, *args, device_type, dtype)
    return result, seen, scaler, optimizer


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_autocast(seen, device_type: str, dtype, expected) -> None:
    """The matrix products ran in ``expected`` (what autocast(device_type, dtype) gives these tensors)."""
    dtypes = set(seen.product_dtypes)
    if not dtypes:
        raise Wrong("your step never ran the model: compute `loss = F.cross_entropy(model(x), y)`")
    if dtypes == {expected}:
        return
    got = ", ".join(sorted(_name(d) for d in dtypes))
    if expected == torch.float32:
        raise Wrong(f"asked for autocast on '{device_type}' with tensors on the CPU, your matrix products ran in {got}: "
                    f"you ignored `device_type` (autocast for '{device_type}' leaves CPU operations alone). Use "
                    "`torch.autocast(device_type, dtype=dtype)` with the arguments you are given")
    if dtypes == {torch.float32}:
        raise Wrong(f"your matrix products ran in float32, not {_name(expected)}: run the forward pass inside "
                    "`with torch.autocast(device_type, dtype=dtype):`")
    raise Wrong(f"asked for {_name(dtype)}, your matrix products ran in {got}: use the `dtype` you are given, "
                "`torch.autocast(device_type, dtype=dtype)`")


def _check_no_host_reads(seen, what: str) -> None:
    reads = seen.host_reads + seen.syncs
    if reads:
        raise Wrong(f"{what} read values back to Python ({', '.join(dict.fromkeys(reads))}): on a GPU each read makes "
                    "the host wait for all queued work. Keep the loss a tensor (return `loss.detach()`) and read it "
                    "only when you log, every few hundred steps")


def _check_dtype_and_device(fn, make_args) -> None:
    """Autocast follows the requested dtype and device type: fp16 on the CPU, autocast for 'cuda' leaves CPU
    operations in fp32, and where a GPU exists fp16 on the GPU. ``make_args(device)``: fn's arguments there."""
    probes = [("cpu", torch.float16, torch.float16, "cpu"), ("cuda", torch.bfloat16, torch.float32, "cpu")]
    if torch.cuda.is_available():  # the probe makes CUDA tensors: torch's question, not gpulab.on_gpu's (a stand-in's
        probes.append(("cuda", torch.float16, torch.float16, "cuda"))  # tensors stay on the CPU)
    for device_type, dtype, expected, where in probes:
        _, seen, _, _ = _spied_run(fn, _small_model(where), *make_args(where), device_type=device_type, dtype=dtype)
        _check_autocast(seen, device_type, dtype, expected)
        _check_no_host_reads(seen, "your step")


def _reference_grads(model, micro_batches, dtype):
    """Gradients of the mean loss over micro-batches (autocast forward on the CPU), and the mean loss."""
    model = copy.deepcopy(model)
    losses = []
    for x, y in micro_batches:
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    return [p.grad.detach().clone() for p in model.parameters()], torch.stack(losses).float().mean()


def _close(grads, expected, rtol=1e-2, atol=1e-4) -> bool:
    return all(g is not None and torch.allclose(g.float(), e.float(), rtol=rtol, atol=atol) for g, e in zip(grads, expected))


def _norm(grads) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()


def _check_train_step(train_step) -> str:
    if not callable(train_step):
        raise Wrong("pass your function itself: `q2.check(train_step)`")
    model, dtype, lr = _small_model(), torch.bfloat16, 0.1
    loss, seen, scaler, optimizer = _spied_run(train_step, model, *_batch(16, seed=0), device_type="cpu", dtype=dtype,
                                               lr=lr)
    _check_autocast(seen, "cpu", dtype, dtype)
    _check_no_host_reads(seen, "your step")
    ref_grads, ref_loss = _reference_grads(_small_model(), [_batch(16, seed=0)], dtype)  # only now: nothing to find
    _check_step_calls(scaler, optimizer, ref_loss)
    _check_step_grads(scaler, ref_grads)
    with torch.no_grad():
        ref_after = [p - lr * g for p, g in zip(_small_model().parameters(), ref_grads)]
    if not all(torch.allclose(p, a, rtol=1e-3, atol=1e-5) for p, a in zip(model.parameters(), ref_after)):
        raise Wrong("the weights after your step differ from one SGD step on the unscaled gradients")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise Wrong(f"return the loss as a one-element tensor (`loss` or `loss.detach()`), got {type(loss).__name__}")
    expect_close(loss.detach().float(), ref_loss.item(), rel=1e-2, what="the returned loss")
    _check_dtype_and_device(train_step, lambda where: tuple(t.to(where) for t in _batch(16, seed=0)))
    return ("autocast(device_type, dtype) forward, scaled backward, scaler.step(optimizer), scaler.update(), and no "
            "value read back to Python: the whole recipe.")


def _check_step_calls(scaler, optimizer, ref_loss) -> None:
    calls = scaler.calls
    if "scale" not in calls:
        raise Wrong("the loss was never scaled: call `scaler.scale(loss).backward()`")
    if not torch.allclose(scaler.scaled_losses[0].float() / scaler.scale_value, ref_loss, rtol=1e-3):
        raise Wrong("scaler.scale() got a different loss than `F.cross_entropy(model(x), y)` under autocast")
    if optimizer.direct_steps:
        raise Wrong("you called optimizer.step() yourself: call `scaler.step(optimizer)` instead, which unscales "
                    "the gradients and skips the step when they overflowed")
    if "step" not in calls:
        raise Wrong("the optimizer never stepped: call `scaler.step(optimizer)` after the backward pass")
    if optimizer.steps != 1:
        raise Wrong(f"the optimizer stepped {optimizer.steps} times in one training step: once is enough")
    if "zero_grad" in calls[calls.index("scale"):calls.index("step")]:
        raise Wrong("optimizer.zero_grad() ran after the backward pass and erased its gradients: clear them before "
                    "`scaler.scale(loss).backward()`")
    if "update" not in calls or calls.index("update") < calls.index("step"):
        raise Wrong("call `scaler.update()` after `scaler.step(optimizer)`: it adapts the scale for the next step")


def _check_step_grads(scaler, ref_grads) -> None:
    raw = scaler.raw_grads
    if any(g is None for g in raw):
        raise Wrong("some weights had no gradient when the optimizer stepped: call `.backward()` on the scaled "
                    "loss before `scaler.step(optimizer)`")
    scaled = [r * scaler.scale_value for r in ref_grads]
    if _close(raw, [e + 100.0 for e in scaled]) or _close(raw, [r + 100.0 for r in ref_grads]):
        raise Wrong("the gradients of the previous step were added to the new ones: call "
                    "`optimizer.zero_grad()` before the backward pass")
    if _close(raw, ref_grads):
        raise Wrong("backward() ran on the unscaled loss: call `scaler.scale(loss).backward()`, so that small "
                    "fp16 gradients survive")
    if not _close(raw, scaled):
        raise Wrong("the gradients at the optimizer step are not those of the scaled loss: zero the gradients, "
                    "then `scaler.scale(loss).backward()`, then `scaler.step(optimizer)`")


q2 = Question(
    lesson="04", number=2, title="A training step with autocast and a GradScaler",
    checker=_check_train_step,
    hint_text="Four pieces, in this order: the forward pass and the loss inside `with torch.autocast(device_type, "
              "dtype=dtype):` (the arguments, not fixed values); `optimizer.zero_grad()`; "
              "`scaler.scale(loss).backward()`; then `scaler.step(optimizer)` (never `optimizer.step()` yourself) and "
              "`scaler.update()`. Return `loss.detach()`: no `.item()`, no `print(loss)`.",
    solution_text="""
def train_step(model, optimizer, scaler, x, y, device_type, dtype):
    with torch.autocast(device_type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()
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


def _share(grads: torch.Tensor, lost: torch.Tensor, of=None) -> float:
    """The share of ``of`` (default: the non-zero gradients) that ``lost`` marks."""
    of = grads != 0 if of is None else of
    return (lost & of).sum().item() / of.sum().item()


def _underflow_mistake(got: float, grads: torch.Tensor, scale: float) -> str | None:
    """What a wrong share computed, when it is a known mistake."""
    nonzero, tiny = grads != 0, torch.finfo(torch.float16).tiny
    mistakes = (
        (_share(grads, (grads * scale).half() == 0, torch.ones_like(nonzero)),
         "count only the gradients that were non-zero before the cast: exact zeros did not underflow, they were zero "
         "already"),
        (_share(grads, (grads * scale).half() == 0) * nonzero.float().mean().item(),
         "divide by the number of non-zero gradients, not by all of them"),
        (_share(grads, (grads * scale).abs() < tiny),
         "that is the share below fp16's smallest *normal* number: those become subnormal, not zero. Cast "
         "(`.half()`) and compare with 0"),
        (_share(grads, grads.half() == 0), "multiply the gradients by `scale` before the cast"),
        (_share(grads, (grads * scale).bfloat16() == 0), "cast to fp16 (`.half()`): bf16 keeps fp32's range, so "
                                                         "almost nothing underflows there"),
        (100 * _true_share(grads, scale), "return a share between 0 and 1, not a percentage"),
    )
    return next((why for value, why in mistakes if abs(got - value) <= 1e-6), None)


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
        expected = _true_share(grads, scale)  # computed only now: nothing to find while your function ran
        if abs(got - expected) > 1e-6:
            raise Wrong(_underflow_mistake(got, grads, scale) or
                        f"with scale = {scale:g} your share is {got:.4g}, but {expected:.4g} of the non-zero "
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

# ---- q4: AMP with gradient accumulation and clipping -------------------------------------------------------


def _micro_batches(k: int = 4, size: int = 8, seed: int = 1) -> list:
    return [_batch(size, seed=seed + i) for i in range(k)]


def _check_accumulation_step(accumulation_step) -> str:
    if not callable(accumulation_step):
        raise Wrong("pass your function itself: `q4.check(accumulation_step)`")
    dtype, lr, k = torch.bfloat16, 0.1, len(_micro_batches())
    true_norm = _norm(_reference_grads(_small_model(), _micro_batches(), dtype)[0])
    for max_norm in (100.0 * true_norm, 0.3 * true_norm):  # a bound far above the gradients' norm, then one that clips
        loss, seen, scaler, optimizer = _spied_run(accumulation_step, _small_model(), _micro_batches(), max_norm,
                                                   device_type="cpu", dtype=dtype, lr=lr, junk=float("nan"))
        _check_autocast(seen, "cpu", dtype, dtype)
        _check_no_host_reads(seen, "your accumulation step")
        _check_accumulation_calls(scaler, optimizer, k)
        _check_accumulated_grads(scaler.grads_at_step, _micro_batches(), dtype, max_norm, scaler.scale_value)
        _check_mean_loss(loss, _micro_batches(), dtype)
    _check_dtype_and_device(accumulation_step, lambda where: ([(x.to(where), y.to(where)) for x, y in _micro_batches()],
                                                              1e6))
    _check_with_a_real_scaler(accumulation_step, _micro_batches(), true_norm)
    return (f"{k} scaled backward passes, one unscale_, the true gradients clipped, one scaler.step and one update, "
            "no value read back: AMP with accumulation and clipping. (Without a GPU this check sees what your code "
            "does, not how long a GPU would wait.)")


def _check_mean_loss(loss, micro: list, dtype) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise Wrong(f"return the mean loss as a one-element tensor, got {type(loss).__name__}")
    k, got = len(micro), loss.detach().float().item()
    mean_loss = _reference_grads(_small_model(), micro, dtype)[1].item()
    last_loss = _reference_grads(_small_model(), micro[-1:], dtype)[1].item()
    for value, why in ((k * mean_loss, f"you returned the sum of the {k} micro-batches' losses: return their mean"),
                       (mean_loss / k, "you returned the mean of `loss / k`: keep the undivided losses for the mean"),
                       (last_loss, "you returned the last micro-batch's loss: return the mean over all of them")):
        if math.isclose(got, value, rel_tol=1e-2) and not math.isclose(got, mean_loss, rel_tol=1e-2):
            raise Wrong(why)
    expect_close(loss.detach().float(), mean_loss, rel=1e-2, what="the returned mean loss")


def _check_accumulation_calls(scaler, optimizer, k: int) -> None:
    calls = scaler.calls
    scales = calls.count("scale")
    if scales == 1 and k > 1:
        raise Wrong(f"one scaled backward for {k} micro-batches: summing the losses and calling backward() once keeps "
                    "every micro-batch's activations alive, which is what accumulation avoids. Call "
                    "`scaler.scale(loss / k).backward()` inside the loop, once per micro-batch")
    if scales != k:
        raise Wrong(f"`scaler.scale(...)` ran {scales} times for {k} micro-batches: once per micro-batch")
    if optimizer.direct_steps:
        raise Wrong("you called optimizer.step() yourself: call `scaler.step(optimizer)`, which skips the step when "
                    "the gradients overflowed")
    if optimizer.steps != 1 or calls.count("step") != 1:
        raise Wrong(f"the optimizer stepped {optimizer.steps} times for {k} micro-batches: step once, after the last "
                    "micro-batch's backward, with `scaler.step(optimizer)`")
    if calls.count("update") != 1 or calls.index("update") < calls.index("step"):
        raise Wrong("call `scaler.update()` once per optimizer step, after `scaler.step(optimizer)`")
    last_scale = len(calls) - 1 - calls[::-1].index("scale")
    if "unscale_" in calls and calls.index("unscale_") < last_scale:
        raise Wrong("`scaler.unscale_(optimizer)` ran before the last micro-batch's backward: the gradients added "
                    "after it stay scaled. Unscale once, after the loop, right before clipping")


def _check_accumulated_grads(grads, micro, dtype, max_norm, scale) -> None:
    k = len(micro)
    if grads is None or any(g is None for g in grads):
        raise Wrong("some weights had no gradient at the optimizer step: backward every micro-batch's scaled loss")
    mean_grads = _reference_grads(_small_model(), micro, dtype)[0]  # computed only now: nothing to find before
    clipped = [g * min(1.0, max_norm / (_norm(mean_grads) + 1e-6)) for g in mean_grads]
    if _close(grads, clipped):
        return
    if any(g.isnan().any() for g in grads):  # the check filled the old gradients with NaN
        raise Wrong("the gradients of the previous step were still there: call `optimizer.zero_grad()` before the "
                    "first micro-batch")
    if _close(grads, [k * g for g in clipped]):
        raise Wrong(f"your gradients are {k}× too large: divide each micro-batch's loss by the number of "
                    "micro-batches before backward(), since backward() adds the gradients up")
    last, _ = _reference_grads(_small_model(), micro[-1:], dtype)
    if any(_close(grads, [g * c for g in last]) for c in (1 / k, 1)):
        raise Wrong("only the last micro-batch's gradients reached the optimizer: clear the gradients once, before "
                    "the loop, never inside it")
    if math.isclose(_norm(grads), max_norm / scale, rel_tol=0.05):
        raise Wrong("you clipped the *scaled* gradients (their norm is multiplied by the loss scale), so they were "
                    "cut far too short: call `scaler.unscale_(optimizer)` before `clip_grad_norm_`")
    if _close(grads, mean_grads) and _norm(mean_grads) > max_norm:
        raise Wrong(f"the gradients were not clipped: their norm was {_norm(mean_grads):.3g}, above max_norm = "
                    f"{max_norm:.3g}. Call `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` after "
                    "`scaler.unscale_(optimizer)`")
    raise Wrong("the gradients at the optimizer step are not the clipped mean gradient of the micro-batches: zero "
                "once, a scaled backward of loss / k per micro-batch, then unscale_, clip_grad_norm_, scaler.step, "
                "scaler.update")


def _check_with_a_real_scaler(accumulation_step, micro, max_norm) -> None:
    """With torch.amp.GradScaler on the CPU: an fp16 overflow is skipped and the scale halved once; a normal step
    moves the weights (a second unscale_ before update() would raise here)."""
    model = _small_model()
    before = [p.detach().clone() for p in model.parameters()]
    hot = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # far too high: the fp16 backward overflows
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulation_step(model, optimizer, hot, micro, max_norm, "cpu", torch.float16)
    if not all(torch.equal(b, p) for b, p in zip(before, model.parameters())):
        raise Wrong("with a real GradScaler and an fp16 overflow (scale 2^40) the weights moved: the step must go "
                    "through `scaler.step(optimizer)`, which skips it when a gradient is inf or NaN")
    if hot.get_scale() != 2.0**39:
        raise Wrong(f"with a real GradScaler, one overflowing accumulation step should halve the scale once (2^40 → "
                    f"2^39); it is now 2^{math.log2(hot.get_scale()):.0f}: call `scaler.update()` once per optimizer "
                    "step")
    accumulation_step(model, optimizer, torch.amp.GradScaler("cpu"), micro, max_norm, "cpu", torch.bfloat16)
    if all(torch.equal(b, p) for b, p in zip(before, model.parameters())):
        raise Wrong("with a real GradScaler and no overflow the weights did not move: step with `scaler.step(optimizer)`")


q4 = Question(
    lesson="04", number=4, title="AMP with gradient accumulation and clipping",
    checker=_check_accumulation_step,
    hint_text="Clear the gradients once. For each (x, y): forward and loss under `torch.autocast(device_type, "
              "dtype=dtype)`, then `scaler.scale(loss / k).backward()`; keep `loss.detach()` for the mean. After the "
              "loop: `scaler.unscale_(optimizer)` (the gradients are still multiplied by the scale), "
              "`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, `scaler.step(optimizer)`, "
              "`scaler.update()`. Return `torch.stack(losses).mean()`.",
    solution_text="""
def accumulation_step(model, optimizer, scaler, micro_batches, max_norm, device_type, dtype):
    k = len(micro_batches)
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for x, y in micro_batches:
        with torch.autocast(device_type, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss / k).backward()   # the gradients add up: / k makes them the mean's
        losses.append(loss.detach())        # no .item(): no wait for the GPU
    scaler.unscale_(optimizer)              # the true gradients, before anything looks at their size
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)                  # skipped if unscale_ found an inf or NaN
    scaler.update()
    return torch.stack(losses).mean()
""",
)
