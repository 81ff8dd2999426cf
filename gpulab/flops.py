"""MFU done right: the FLOPs of a step counted by ``torch.utils.flop_counter.FlopCounterMode``, cross-checked against
the analytic rule for transformers, divided by the vendor's **dense** peak of the precision the step really ran in,
with the ceiling **measured** on this card beside it.

Model FLOPs utilisation (MFU) is the model's FLOPs per second over the card's peak. As PaLM, Megatron-LM,
torchtitan and nanoGPT report it, the peak is the vendor's dense datasheet figure of the precision used
(``gpulab.datasheets``), so that one MFU compares with another; beside it, "of achievable" divides by the best this
card measurably reaches in that precision (ml-engineering's MAMF finder: an H100 SXM reaches about 792 of its 989
bf16 TFLOP/s). It goes wrong in known ways, and each has its guard here:

- the FLOPs: counted by ``count`` (``FlopCounterMode``, never a hand-written counter) and cross-checked against the
  analytic rule (``gpt_flops_per_token``: every matmul of a GPT, and ``rule_flops_per_token``: 6·N + 12·L·d·T per
  token, PaLM's appendix B and nanoGPT's ``estimate_mfu``);
- the peak's card and precision: ``precision_of`` says which precision a step's matmuls ran in (bf16 under bf16
  autocast, whatever the TF32 switch says), and ``mfu`` refuses to divide a step by another precision's ceiling
  (torchtitan #668 divided bf16 runs by the TF32 peak); the datasheet peak is this card's own (nanoGPT's 104 % in
  PR #464 divided an H100 run by the A100's peak), dense, never a sparse one ("with sparsity" figures are twice the
  dense ones);
- the ceiling itself: ``ceiling`` measures the best matmul this device reaches in that precision, by a search over
  shapes as the MAMF finder does, each timed long enough at steady clocks (the **sustained** rate: held at its power
  limit, a GPU lowers its clocks under back-to-back dense products), then the fastest shape again in a short
  **burst** from a rested card, at its top clock; each with the clocks and power it ran at. "Of achievable" divides
  by the burst, the best a matmul reaches at the clock a training step that stays under the power limit runs at (the
  sustained rate is shown beside it). A step that beats its ceiling shows the ceiling was not this machine's best
  (measured while the CPU was busy, say): ``mfu`` measures it again, and a figure above 100 % is never shown as a
  result (``Utilisation.warning``);
- recomputation: FLOPs that run twice (activation checkpointing, flash attention's backward) are hardware FLOPs. MFU
  counts the model's FLOPs once; HFU (hardware FLOPs utilisation) counts what ran, and is shown beside it.

    >>> step = flops.count(lambda: model(x, y).backward())          # FLOPs of a training step, as run
    >>> peak = flops.ceiling("bf16")                                  # measured here, kept for the process
    >>> print(flops.mfu(step.total, seconds_per_step, peak, precision="bf16"))
"""

import functools
import math
import statistics
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import pandas as pd
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from . import datasheets
from .conditions import POWER, Conditions, Watch
from .device import device_info, get_device, on_gpu
from .mode import by_mode
from .precision import calls_to_fill, matmul_flops, timed_calls

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8": getattr(torch, "float8_e4m3fn", None)}
# ----- which precision a step's matmuls ran in ---------------------------------------------------------------------

def tf32_enabled(convolutions: bool = False) -> bool:
    """Whether fp32 matmuls (or, with ``convolutions=True``, cuDNN's fp32 convolutions) may use TF32 tensor cores.

    Read as the course sets it, with ``torch.set_float32_matmul_precision`` ("high": TF32), which keeps torch's
    legacy and per-backend flags in step; setting only the per-backend ``fp32_precision`` makes the legacy readers
    (torch's compiler among them) raise an error about "a mix of the legacy and new APIs"."""
    if convolutions:
        return torch.backends.cudnn.allow_tf32
    return torch.get_float32_matmul_precision() != "highest"


def precision_of(autocast_dtype: torch.dtype | None = None, *, tf32: bool | None = None, convolutions: bool = False,
                 device=None) -> str:
    """The precision whose ceiling a step is measured against: "bf16" or "fp16" under autocast to that dtype (its
    matmuls run in it, whatever the TF32 switch says); otherwise "tf32" when fp32 matmuls may use TF32 on a GPU that
    has it (``tf32``: that switch, read from torch when None; ``convolutions=True`` reads cuDNN's switch, which is on
    by default, for a step dominated by convolutions), else "fp32"."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    if autocast_dtype in names:
        return names[autocast_dtype]
    if autocast_dtype not in (None, torch.float32):
        raise ValueError(f"autocast runs matmuls in bf16 or fp16, not {autocast_dtype}")
    info = device_info(get_device(device))
    if not info.tf32:  # a CPU, or a GPU older than Ampere: no TF32
        return "fp32"
    return "tf32" if (tf32_enabled(convolutions) if tf32 is None else tf32) else "fp32"


def precisions_here(device=None) -> list[str]:
    """The precisions this device runs matmuls in natively: fp32 and bf16 on a CPU; on a GPU fp32 and fp16, tf32
    and bf16 from compute capability 8.0, fp8 from 8.9 (where torch has float8 types)."""
    info = device_info(get_device(device))
    if info.compute_capability is None:
        return ["fp32", "bf16"]
    cc = tuple(info.compute_capability)
    found = ["fp32"] + (["tf32"] if cc >= (8, 0) else []) + ["fp16"] + (["bf16"] if cc >= (8, 0) else [])
    return found + (["fp8"] if cc >= (8, 9) and DTYPES["fp8"] is not None else [])


def datasheet(name: str, precision: str) -> float | None:
    """The vendor's dense datasheet peak in TFLOP/s for a device name and precision (None where not listed: CPUs, and
    GPUs the course has no figure for; see ``gpulab.datasheets``). Dense: never the "with sparsity" figure."""
    return datasheets.peak(name, precision)


# ----- counting FLOPs ----------------------------------------------------------------------------------------------

def _cpu_flash(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# FlopCounterMode has formulas for the GPU's attention kernels but not for the CPU's flash kernel, which it would
# count as zero: the same formulas, for the CPU's operators.
CPU_ATTENTION_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


@dataclass(frozen=True)
class Count:
    """FLOPs counted by FlopCounterMode: ``total``, and per module and operator (``by_module["Global"]`` is all)."""

    total: int
    by_module: dict = field(default_factory=dict)

    def by_operator(self) -> dict:
        """FLOPs per operator (mm, addmm, bmm, convolution, attention kernels, ...)."""
        return {str(op).removeprefix("aten."): n for op, n in self.by_module.get("Global", {}).items()}

    def table(self, depth: int = 2) -> pd.DataFrame:
        """FLOPs per module, the total first, then the submodules down to ``depth`` levels below the model
        (``GPT.blocks.0`` is two), each with its share of the total. (The model's own row is the total: the module
        tracker attributes the backward pass to the submodules only.)"""
        rows = [{"module": "total", "flops": self.total, "share": 1.0}]
        rows += [{"module": name, "flops": sum(ops.values()), "share": sum(ops.values()) / self.total if self.total else 0}
                 for name, ops in self.by_module.items() if name != "Global" and 1 <= name.count(".") <= depth]
        return pd.DataFrame(rows, columns=["module", "flops", "share"])

    def per(self, n: float) -> float:
        """FLOPs per ``n`` units (tokens, samples)."""
        return self.total / n


def count(fn, *args, **kwargs) -> Count:
    """The FLOPs of ``fn(*args, **kwargs)`` as it runs: ``FlopCounterMode`` over the call (matmuls, convolutions and
    attention kernels; element-wise work counts nothing), with formulas for the CPU's flash attention added.

    What ran is what is counted: flash and memory-efficient attention's backward recomputes the attention scores,
    activation checkpointing recomputes the forward. Those are hardware FLOPs; for the model's FLOPs count a step
    without checkpointing under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``, or use the analytic rule."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FORMULAS) as counter:
        fn(*args, **kwargs)
    return Count(total=counter.get_total_flops(), by_module=counter.get_flop_counts())


def training_flops(model: torch.nn.Module, inputs, targets, loss_fn=None) -> Count:
    """The FLOPs of one forward and backward pass of ``model`` on a batch: ``loss_fn(model(inputs), targets)``, or
    ``model(inputs, targets)`` when the model returns its loss (an optimizer's step has no matmul). The parameters'
    ``.grad`` are left as they were."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        def step():
            loss = loss_fn(model(inputs), targets) if loss_fn is not None else model(inputs, targets)
            loss.backward()
        return count(step)
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


def gpt_flops_per_token(n_layer: int, n_embd: int, seq_len: int, vocab_size: int, *, training: bool = True,
                        mlp_ratio: int = 4) -> int:
    """Every matmul of a GPT (nanoGPT's shape: fused q/k/v, output projection, an MLP ``mlp_ratio`` times wider, a head
    over the vocabulary), per token: 2 FLOPs per weight of a matmul, plus attention's scores and weighted sum over all
    ``seq_len`` positions (4·T·d per layer; the causal mask is not discounted, as in PaLM and FlopCounterMode). A
    training step runs each matmul three times (forward; gradients of inputs and of weights): 3× the forward."""
    weights = n_layer * (3 + 1 + 2 * mlp_ratio) * n_embd**2 + n_embd * vocab_size
    forward = 2 * weights + 4 * n_layer * seq_len * n_embd
    return 3 * forward if training else forward


def rule_flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """The rule of thumb for training a transformer: 6·N + 12·L·d·T FLOPs per token (N parameters without the
    position embedding; PaLM's appendix B, nanoGPT's ``estimate_mfu``)."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len


FUSED_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def kernel_flops(count: Count, seq_len: int) -> float:
    """The FLOPs the kernels of a counted step run, its attention causal (lesson 09 writes this out): FlopCounterMode
    counts each fused attention kernel over the whole T×T square; they skip the tiles above the diagonal, so count
    the lower triangle, (T + 1) / 2T of it (the least they run: whole tiles on the diagonal add a few percent)."""
    fused = sum(n for op, n in count.by_operator().items() if op.removesuffix("_backward") in FUSED_ATTENTION)
    return count.total - fused * (1 - (seq_len + 1) / (2 * seq_len))


# ----- the ceiling: the best matmul this device reaches in a precision -----------------------------------------------

@dataclass(frozen=True)
class Timed:
    """One way the fastest shape was timed: its median TFLOP/s and the machine's state meanwhile."""

    tflops: float
    conditions: Conditions | None = None

    def row(self, prefix: str) -> dict:
        """``{prefix}_tflops`` and the clock and power columns of its state, each named with ``prefix``."""
        state = self.conditions.row() if self.conditions else {}
        return {f"{prefix}_tflops": self.tflops, **{f"{prefix}_{k}": state[k] for k in TIMED_COLUMNS if k in state}}

    def __str__(self) -> str:
        state = self.conditions
        clocks = state.clocks() if state else ""
        power = (f", {state.gpu_power_w:.0f} W of {state.gpu_power_limit_w:.0f}" if state and
                 state.gpu_power_w == state.gpu_power_w and state.gpu_power_limit_w == state.gpu_power_limit_w else "")
        limited = f", {', '.join(state.throttle)}" if state and state.throttle else ""
        return f"{self.tflops:.4g} TFLOP/s" + (f" at SM clock {clocks}{power}{limited}" if clocks else "")


TIMED_COLUMNS = ("sm_clock_mhz", "sm_clock_low_mhz", "sm_clock_high_mhz", "gpu_power_w", "throttle")


@dataclass(frozen=True)
class Ceiling:
    """The measured matmul ceiling of one precision on one device, at the fastest shape searched: ``tflops``, what
    "of achievable" divides by, is the better of that shape's **burst** (a short run from a rested card, at its top
    clock) and its **sustained** rate (the search's median once the clocks had settled under the precision's load,
    held down where the card reached its power limit); ``conditions`` is the machine's state over the one it is (its
    SM clock range, power, any power or thermal limit). ``burst`` and ``sustained`` keep both, each with its state."""

    precision: str
    tflops: float
    shape: tuple = ()  # (m, n, k) of the fastest shape
    by_shape: dict = field(default_factory=dict)  # {(m, n, k): sustained median TFLOP/s}
    device_name: str = ""
    datasheet_tflops: float | None = None  # the vendor's dense peak (None where unknown)
    conditions: Conditions | None = None  # over the timed products that gave ``tflops``
    key: tuple | None = field(default=None, repr=False, compare=False)  # how ``ceiling`` measured it, to measure again
    burst: Timed | None = None  # the fastest shape from a rested card, at its top clock
    sustained: Timed | None = None  # the fastest shape in the search, the clocks settled under load

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}: one of {', '.join(PRECISIONS)}")
        if not (self.tflops > 0 and math.isfinite(self.tflops)):
            raise ValueError(f"a ceiling is a positive number of TFLOP/s, got {self.tflops!r}")

    def __float__(self) -> float:
        return float(self.tflops)

    def row(self) -> dict:
        """The results row: the ceiling with its state's columns, then the burst's and the sustained rate's (each
        with its clocks and power: ``burst_sm_clock_low_mhz``, ``sustained_gpu_power_w``, ...)."""
        m, n, k = self.shape or (None, None, None)
        state = self.conditions.row() if self.conditions else {}
        timed = {**(self.burst.row("burst") if self.burst else {}),
                 **(self.sustained.row("sustained") if self.sustained else {})}
        return {"precision": self.precision, "ceiling_tflops": self.tflops, "m": m, "n": n, "k": k,
                "datasheet_tflops": self.datasheet_tflops, "of_datasheet": self.of_datasheet, **state, **timed}

    @property
    def of_datasheet(self) -> float | None:
        """The ceiling over the datasheet's dense peak; None where there is no peak, or the ceiling is above it
        (impossible: the datasheet row is not this card's or this precision's)."""
        share = self.tflops / self.datasheet_tflops if self.datasheet_tflops else None
        return share if share is not None and share <= 1 else None

    def __str__(self) -> str:
        shape = f" at {'×'.join(map(str, self.shape))}" if self.shape else ""
        clocks = self.conditions.clocks() if self.conditions else ""
        clocks = f", SM clock {clocks}" if clocks else ""
        sheet = (f"; {self.of_datasheet:.0%} of the datasheet's dense {self.datasheet_tflops:g}" if self.of_datasheet
                 else f"; above the datasheet's dense {self.datasheet_tflops:g}: impossible, so that datasheet row is "
                 "not this card's or this precision's" if self.datasheet_tflops else "")
        held = f"; sustained {self.sustained}" if self.sustained and self.sustained.tflops != self.tflops else ""
        return f"{self.precision} ceiling {self.tflops:.4g} TFLOP/s{shape}{clocks}{sheet}{held}"

    def burst_beside_sustained(self) -> str:
        """The burst and the sustained rate in words, and what the readings say of their gap: the power limit where it
        held the sustained clocks down, nothing where it did not (the ceiling is then the faster of two rates at the
        same clocks); "" where either is missing."""
        burst, sustained = self.burst, self.sustained
        if burst is None or sustained is None:
            return ""
        held = sustained.conditions
        if held is None or not held.clocks():
            return (f"{self.precision}: burst {burst.tflops:.4g}, sustained {sustained.tflops:.4g} TFLOP/s; no clock "
                    "reading here (NVML reads a GPU)")
        power_limited = held.at_power_limit and any(reason in POWER for reason in held.throttle)
        gap = 1 - sustained.tflops / burst.tflops
        if power_limited and gap > 0:
            return (f"{self.precision}: sustained {sustained}: {gap:.0%} below its burst, {burst}. Held at its power "
                    "limit, the card lowered its clocks under back-to-back dense products.")
        if power_limited:
            return (f"{self.precision}: the burst, {burst}, was no faster than the sustained rate, {sustained}: its "
                    "clocks had not come back up after the rest, and the ceiling is the sustained rate.")
        return (f"{self.precision}: burst {burst}; sustained {sustained}: no power limit held the clocks down, and the "
                "ceiling is the faster of the two.")


MAX_PRODUCT_S = 0.25  # a shape whose product would take longer than this is not tried
# The burst: the fastest shape timed for about BURST_S after REST_S idle, long enough for a GPU held at its power limit
# by the search to run at its top clock again (the H200 of 2026-11-28 read its top clock within a second of the
# search's end: tests/data/lesson09/2026-11-28-h200/monitor.csv).
REST_S, BURST_S = {"full": 1.0, "quick": 0.05}, {"full": 0.05, "quick": 0.01}


def search_shapes(device=None) -> list[tuple[int, int, int]]:
    """The (m, n, k) shapes ``ceiling`` tries: squares and the long, flat shapes where cuBLAS often does best (as
    MAMF's search finds), sized for the device and the mode."""
    if on_gpu(get_device(device)):
        full = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384),
                (8192, 8192, 2048), (16384, 8192, 1024), (4096, 16384, 4096), (16384, 4096, 8192),
                (6144, 16384, 2048), (8192, 4096, 16384), (8192, 8192, 4096), (12288, 12288, 4096)]
        quick = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 1024)]
    else:
        full = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (1024, 2048, 512), (2048, 1024, 1024)]
        quick = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (256, 128, 512)]
    return by_mode(full=full, quick=quick)


@contextmanager
def _matmul_precision(precision: str, gpu: bool):
    """fp32 matmuls in TF32 for "tf32" and in full fp32 for "fp32" inside the block (GPU; the setting is restored)."""
    if not gpu or precision not in ("fp32", "tf32"):
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _products(precision: str, m: int, n: int, k: int, device: torch.device) -> list:
    """Functions computing one (m×k) @ (k×n) product in ``precision`` on random normal data, one per kernel worth
    trying: ``torch.mm``, and on a CPU also ``F.linear``, which reaches oneDNN's bf16 and fp16 kernels where mm does
    not (up to 5× faster in bf16 on a CPU without bf16 instructions: a ceiling must be the best the device reaches,
    or a model's own layers would beat it)."""
    if precision == "fp8":  # row-major A, column-major B, float32 scales: what torch._scaled_mm wants
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return [functools.partial(torch._scaled_mm, a, b, one, one, out_dtype=torch.bfloat16)]
    dtype = DTYPES[precision]
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    found = [functools.partial(torch.mm, a, b, out=out)]
    if device.type == "cpu":
        found.append(functools.partial(torch.nn.functional.linear, a, b.t().contiguous()))
    return found


_MEASURED: dict[tuple, Ceiling] = {}  # the best ceiling measured so far, per (precision, device, shapes, seconds)
_AGAIN: set[tuple] = set()  # the ceilings measured again because a step beat them


def ceiling(precision: str, device=None, *, shapes=None, seconds: float | None = None, again: bool = False) -> Ceiling:
    """The best matmul this device reaches in ``precision``: each of ``shapes`` (default ``search_shapes``) warmed up
    (the precision's own products first, until the clocks have settled under its load), then timed for about
    ``seconds`` of back-to-back products (between CUDA events on a GPU) while the SM clock, power and throttling are
    watched: the fastest shape's median is the **sustained** rate. Then, after ``REST_S`` idle, that shape is timed
    again for about ``BURST_S``, at the top clock where the power limit had held it down: the **burst**. The ceiling
    is the better of the two (``Ceiling``). Shapes whose product would take over a quarter of a second are skipped.
    Kept for the process and device for the same arguments; ``again=True`` measures once more and keeps the better
    ceiling (one measured while the machine was busy is not its best). "tf32" and "fp32" set the TF32 switch while
    they measure, then restore it."""
    device = get_device(device)
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    here = precisions_here(device)
    if precision not in here and not (device.type == "cpu" and precision == "fp16"):
        raise ValueError(f"{precision} matmuls do not run natively on {device_info(device).name} (it has "
                         f"{', '.join(here)}): there is no {precision} ceiling to divide by here")
    shapes = tuple(tuple(int(d) for d in s) for s in (shapes or search_shapes(device)))
    seconds = by_mode(full=0.4, quick=0.01) if seconds is None else float(seconds)
    key = (precision, str(device), shapes, seconds)
    if again or key not in _MEASURED:
        measured = replace(_measure_ceiling(precision, device, shapes, seconds), key=key)
        known = _MEASURED.get(key)
        _MEASURED[key] = measured if known is None or measured.tflops > known.tflops else known
    return _MEASURED[key]


def _measure_ceiling(precision: str, device: torch.device, shapes: tuple, seconds: float) -> Ceiling:
    gpu = on_gpu(device)
    by_shape, watched, kernel = {}, {}, {}
    with _matmul_precision(precision, gpu):
        if gpu:  # the clocks settle under the precision's own load: a tensor-core product draws more power
            largest = max(shapes, key=lambda s: s[0] * s[1] * s[2])
            warm, started = _products(precision, *largest, device)[0], time.perf_counter()
            while time.perf_counter() - started < by_mode(full=1.0, quick=0.1):
                timed_calls(warm, 1, device)  # one product at a time: a slow card's largest may take a second
            del warm
        for m, n, k in sorted(shapes, key=lambda s: s[0] * s[1] * s[2]):
            flops = matmul_flops(m, n, k)
            if by_shape and flops / (max(by_shape.values()) * 1e12) > MAX_PRODUCT_S:
                continue  # too slow at this size: the others have told us the rate
            for i, product in enumerate(_products(precision, m, n, k, device)):  # the faster kernel counts
                one = timed_calls(product, 1, device)[0]  # loads the library's kernel; how long one product takes
                timed_calls(product, calls_to_fill(seconds / 3, one, 1, 1000), device)
                with Watch(device) as watch:
                    times = timed_calls(product, calls_to_fill(seconds, one, 3, 10_000), device)
                rate = flops / statistics.median(times) / 1e12
                if rate > by_shape.get((m, n, k), 0.0):
                    by_shape[(m, n, k)], watched[(m, n, k)], kernel[(m, n, k)] = rate, watch.conditions, i
                del product
        best = max(by_shape, key=by_shape.get)
        burst = _burst(_products(precision, *best, device)[kernel[best]], matmul_flops(*best), by_shape[best], device)
    sustained = Timed(by_shape[best], watched[best])
    chosen = burst if burst.tflops >= sustained.tflops else sustained  # a burst below it: clocks not back up, or noise
    name = device_info(device).name
    return Ceiling(precision, chosen.tflops, best, by_shape, name, datasheet(name, precision) if gpu else None,
                   chosen.conditions, burst=burst, sustained=sustained)


def _burst(product, flops: float, sustained_tflops: float, device: torch.device) -> Timed:
    """``product`` timed for about ``BURST_S`` after ``REST_S`` idle: a GPU the search held at its power limit has its
    top clock back by then (the power limit lowers the clocks only under sustained load)."""
    time.sleep(by_mode(**REST_S))
    one = flops / (sustained_tflops * 1e12)
    with Watch(device, interval=0.01) as watch:  # a reading every 10 ms: the burst lasts a few of them
        times = timed_calls(product, calls_to_fill(by_mode(**BURST_S), one, 3, 1000), device)
    return Timed(flops / statistics.median(times) / 1e12, watch.conditions)


def ceilings(precisions=None, device=None, **options) -> dict[str, Ceiling]:
    """``ceiling`` of each of ``precisions`` (default: every precision this device runs natively)."""
    return {p: ceiling(p, device, **options) for p in (precisions or precisions_here(device))}


def reference_peak(precisions, device=None) -> tuple[str, float]:
    """(precision, TFLOP/s) of the fastest of ``precisions`` on this device: its dense datasheet peak, or on a
    device without one (a CPU) its measured ceiling. A waterfall whose steps change precision measures every step
    against this one peak, so that its MFU curve means progress: a bf16 step at three times the tokens/s of an
    fp32 one can show a lower MFU than fp32 when each is divided by its own precision's peak."""
    device = get_device(device)
    name = device_info(device).name
    peaks = {p: datasheet(name, p) if on_gpu(device) else None for p in precisions}
    if not all(peaks.values()):
        peaks = {p: ceiling(p, device).tflops for p in precisions}
    best = max(peaks, key=lambda p: (peaks[p], p == "bf16"))  # bf16 on a tie with fp16: what training uses
    return best, peaks[best]


# ----- MFU and HFU -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Utilisation:
    """A step's model FLOPs per second over the dense datasheet peak of its precision (MFU, the field's figure) and
    over the ceiling measured on this card ("of achievable"); HFU counts the hardware FLOPs (what ran, recomputation
    included) the same two ways. NaN where the card has no datasheet figure (a CPU, a card not listed)."""

    precision: str
    model_flops: float  # per step
    seconds: float  # per step
    ceiling_tflops: float
    hardware_flops: float | None = None  # per step, where recomputation or padding adds FLOPs
    datasheet_tflops: float | None = None

    @property
    def achieved_tflops(self) -> float:
        return self.model_flops / self.seconds / 1e12

    @property
    def hardware_tflops(self) -> float:
        return (self.hardware_flops or self.model_flops) / self.seconds / 1e12

    @property
    def mfu(self) -> float:
        """The model's TFLOP/s over the vendor's dense peak of the step's precision (NaN where unknown)."""
        return self.achieved_tflops / self.datasheet_tflops if self.datasheet_tflops else math.nan

    @property
    def of_achievable(self) -> float:
        """The model's TFLOP/s over the ceiling measured on this card."""
        return self.achieved_tflops / self.ceiling_tflops

    @property
    def hfu(self) -> float:
        """The hardware FLOP/s over the dense datasheet peak (NaN where unknown)."""
        return self.hardware_tflops / self.datasheet_tflops if self.datasheet_tflops else math.nan

    @property
    def hfu_of_achievable(self) -> float:
        return self.hardware_tflops / self.ceiling_tflops

    def against(self, tflops: float) -> float:
        """The model's TFLOP/s over another peak (``reference_peak``: one peak for a waterfall across precisions)."""
        return self.achieved_tflops / tflops

    @property
    def impossible(self) -> bool:
        """Above 100 % of the measured ceiling or of the datasheet peak, in model or hardware FLOPs: not a result.
        (Hardware FLOPs can be fewer than the model's: a causal kernel skips the masked half of attention.)"""
        return any(share > 1.0 for share in (self.hfu_of_achievable, self.hfu, self.of_achievable, self.mfu))

    @property
    def warning(self) -> str:
        """What is wrong when the numbers are impossible ("" when they are not)."""
        rate = max(self.hardware_tflops, self.achieved_tflops)
        if self.hfu > 1.0 or self.mfu > 1.0:
            return (f"{rate:.3g} TFLOP/s is above the card's dense {self.precision} peak of "
                    f"{self.datasheet_tflops:g}: the FLOPs are over-counted, the peak is another card's or precision's, "
                    "or the step was timed without waiting for the GPU")
        if self.hfu_of_achievable > 1.0 or self.of_achievable > 1.0:
            return (f"{rate:.3g} TFLOP/s is above the {self.precision} ceiling measured here "
                    f"({self.ceiling_tflops:.3g}): that ceiling was not this machine's best (measured while the "
                    "machine was busy?), so no share of it is shown")
        return ""

    def row(self) -> dict:
        shown = not self.impossible
        return {"precision": self.precision, "achieved_tflops": self.achieved_tflops,
                "datasheet_tflops": self.datasheet_tflops, "mfu": self.mfu if shown else math.nan,
                "ceiling_tflops": self.ceiling_tflops, "of_achievable": self.of_achievable if shown else math.nan,
                "hfu": self.hfu if self.hardware_flops and shown else math.nan,
                "mfu_warning": self.warning}

    def __str__(self) -> str:
        if self.impossible:
            return f"MFU not shown: {self.warning}"
        if self.datasheet_tflops:
            text = (f"MFU {percent(self.mfu)} ({self.achieved_tflops:.3g} TFLOP/s of model FLOPs over the dense "
                    f"{self.precision} peak of {self.datasheet_tflops:g})")
        else:
            text = f"MFU unknown (no vendor's {self.precision} peak for this device: {self.achieved_tflops:.3g} TFLOP/s)"
        text += (f"; {percent(self.of_achievable)} of achievable (the {self.precision} ceiling measured here, "
                 f"{self.ceiling_tflops:.3g})")
        if self.hardware_flops and self.hardware_flops != self.model_flops:
            hfu = percent(self.hfu) if self.datasheet_tflops else f"{percent(self.hfu_of_achievable)} of achievable"
            text += f"; HFU {hfu} (recomputed FLOPs included)"
        return text


def percent(share: float) -> str:
    """A share as a percentage with three significant digits (41.2 %, 0.0283 %): a small model's MFU is not 0.0 %;
    "n/a" where it is unknown (NaN)."""
    return f"{share * 100:.3g} %" if share == share else "n/a"


def mfu(model_flops: float, seconds: float, ceiling: "Ceiling | Mapping[str, Ceiling]", *, precision: str | None = None,
        hardware_flops: float | None = None) -> Utilisation:
    """MFU (and HFU) of a step that does ``model_flops`` in ``seconds``: its TFLOP/s over the dense datasheet peak of
    ``precision``, the precision its matmuls ran in (``precision_of``), and over the ceiling measured here.
    ``ceiling`` is that precision's ``Ceiling``, or a mapping of precisions to ceilings (``ceilings()``) to pick it
    from. A ceiling of another precision is refused: a bf16 step over the TF32 ceiling reads twice its real share
    of achievable. A
    step faster than its measured ceiling has the ceiling measured again (once) before anything is said."""
    for name, value in (("model_flops", model_flops), ("seconds", seconds)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if isinstance(ceiling, Mapping):
        if precision is None:
            raise ValueError("pass precision=... (flops.precision_of(...)) to pick the ceiling of the step's precision")
        if precision not in ceiling:
            raise ValueError(f"no measured {precision} ceiling among {', '.join(ceiling) or 'none'}: measure it with "
                             f"flops.ceiling({precision!r}); another precision's ceiling would misstate the MFU")
        ceiling = ceiling[precision]
    if not isinstance(ceiling, Ceiling):
        raise TypeError(f"ceiling must be a flops.Ceiling (measured with flops.ceiling), got {type(ceiling).__name__}")
    if precision is not None and precision != ceiling.precision:
        raise ValueError(f"a {precision} step divided by the {ceiling.precision} ceiling: MFU divides by the ceiling of "
                         f"the precision the step ran in (flops.ceiling({precision!r}))")
    ceiling = _MEASURED.get(ceiling.key, ceiling) if ceiling.key is not None else ceiling  # the best measured so far
    ran = max(float(hardware_flops or model_flops), float(model_flops)) / seconds / 1e12
    if ran > ceiling.tflops and ceiling.key is not None:  # the ceiling was not this machine's best
        ceiling = _measured_again(ceiling)
    return Utilisation(ceiling.precision, float(model_flops), float(seconds), ceiling.tflops,
                       float(hardware_flops) if hardware_flops else None, ceiling.datasheet_tflops)


def _measured_again(known: Ceiling) -> Ceiling:
    """The ceiling ``known`` measured once more with the same search (once per process: the better of the two)."""
    if known.key not in _AGAIN:
        _AGAIN.add(known.key)
        precision, device, shapes, seconds = known.key
        return ceiling(precision, device, shapes=shapes, seconds=seconds, again=True)
    return _MEASURED.get(known.key, known)


@dataclass(frozen=True)
class StepMFU:
    """MFU of one training step's FLOPs run in several precisions (lesson 04) (``ran_in``: {run: the precision its matmuls ran
    in}): each run over the dense datasheet peak of its precision (``mfu``), with "of achievable" over the
    ceiling measured here beside it; and, where runs of different precisions are compared side by side, over one
    reference peak, the fastest precision's (``reference_peak``), so that the faster step reads the higher share.
    Made with ``measure``."""

    model_flops: float
    ran_in: dict
    ceilings: dict  # precision -> Ceiling
    reference: str  # the precision of the one reference peak
    reference_tflops: float
    from_sheet: bool  # the reference is a datasheet peak (else the ceiling measured here: a device without one)

    @classmethod
    def measure(cls, model_flops: float, ran_in: dict, device=None) -> "StepMFU":
        """Each precision's ceiling (``ceilings``: measured once per process) and the one reference peak."""
        measured = ceilings(list(dict.fromkeys(ran_in.values())), device=device)
        reference, reference_tflops = reference_peak(list(measured), device)
        from_sheet = measured[reference].datasheet_tflops == reference_tflops
        return cls(model_flops, dict(ran_in), measured, reference, reference_tflops, from_sheet)

    def of(self, run: str, seconds: float):
        """The ``Utilisation`` of run ``run``'s step taking ``seconds``."""
        return mfu(self.model_flops, seconds, self.ceilings, precision=self.ran_in[run])

    def one_peak(self, run: str, seconds: float) -> float:
        """The step's model FLOP/s over the one reference peak (NaN where its own figures are impossible)."""
        u = self.of(run, seconds)
        return math.nan if u.impossible else u.against(self.reference_tflops)

    @property
    def one_peak_name(self) -> str:
        if self.from_sheet:
            return f"MFU against the dense {self.reference} peak of {self.reference_tflops:g} TFLOP/s"
        return f"share of the {self.reference} ceiling measured here, {self.reference_tflops:.3g} TFLOP/s"

    def one_peak_text(self, run: str, seconds: float) -> str:
        """"MFU 12.3 % against the dense bf16 peak of 989.5 TFLOP/s" (without a vendor peak: the ceiling's share)."""
        share = self.one_peak(run, seconds)
        shown = f"{share * 100:.3g} %" if share == share else "n/a"
        return f"MFU {shown} against the dense {self.reference} peak" if self.from_sheet else \
            f"{shown} of the measured {self.reference} ceiling"

    def row(self, run: str, seconds: float) -> dict:
        """The results columns of run ``run``'s step: MFU and of achievable with both denominators, and the one peak."""
        u = self.of(run, seconds)
        return {**{k: v for k, v in u.row().items() if k != "precision"}, "ceiling_precision": u.precision,
                "mfu_one_peak": self.one_peak(run, seconds), "one_peak_precision": self.reference,
                "one_peak_tflops": self.reference_tflops}

    def text(self, run: str, seconds: float) -> str:
        """Run ``run``'s MFU beside its precision's dense peak, its share of achievable, and its share of the one peak."""
        return f"{self.of(run, seconds)}; {self.one_peak_text(run, seconds)}"

    def __str__(self) -> str:
        lines = []
        for run, p in self.ran_in.items():
            c = self.ceilings[p]
            peak = (f"MFU over the dense {p} datasheet peak of {c.datasheet_tflops:g} TFLOP/s" if c.datasheet_tflops
                    else f"no vendor {p} peak for this device, so no MFU")
            lines.append(f"  the {run} step: {peak}; of achievable over the measured {c}")
        lines.append("Compared side by side, every step is also divided by one peak, the fastest precision's: " +
                     (f"the dense {self.reference} datasheet peak, {self.reference_tflops:g} TFLOP/s." if self.from_sheet
                      else f"the {self.reference} ceiling measured here, {self.reference_tflops:.3g} TFLOP/s (no vendor "
                      "peak for this device)."))
        return "\n".join(lines)
