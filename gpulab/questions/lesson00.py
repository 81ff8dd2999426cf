"""Lesson 00 (setup and diagnostics): devices, matmul throughput, the CPU/GPU crossover, bf16."""

import copy
import numbers

import numpy as np
import torch

from ..check import Question, Wrong, expect_close
from ..device import device_info, get_device
from ..observe import observe
from ..timing import Measurement


def _positive(value, what: str) -> float:
    """``value`` as a positive number (a Measurement counts as its median), else Wrong."""
    if isinstance(value, Measurement):
        value = value.median
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise Wrong(f"{what} should be a positive number, got {value!r}")
    return float(value)


def _check_predict(predict) -> str:
    if not callable(predict):
        raise Wrong("pass your function itself: `q1.check(predict)`")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    batch = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(batch)
    here = get_device()
    # "meta" exists on every machine: a model moved there and a CPU batch fail like cuda and cpu do, and the
    # products the model computes say on which device it really ran.
    for target in (here, torch.device("meta")):
        try:
            with observe(fake_meta_reads=True) as seen:
                out = predict(copy.deepcopy(model), batch.clone(), target)
        except NotImplementedError:
            raise
        except RuntimeError as err:
            raise Wrong(f"with device={str(target)!r} your function raised: {err}. Move the model *and* the batch "
                        "to `device`, and keep the moved batch (`batch = batch.to(device)`).") from None
        if not isinstance(out, torch.Tensor):
            raise Wrong(f"return the model's output (a tensor), got {type(out).__name__}")
        elsewhere = sorted(set(seen.product_devices) - {target.type})
        if elsewhere:
            raise Wrong(f"with device={str(target)!r} the model computed on {', '.join(elsewhere)}, and only its "
                        "output was moved: move the model and the batch first, then call the model")
        if out.device.type != target.type:
            raise Wrong(f"with device={str(target)!r} the output is on {out.device}: run the model on `device` "
                        "and return its output there (no `.cpu()`)")
        if out.shape != expected.shape:
            raise Wrong(f"the output has shape {tuple(out.shape)}, the model's output has {tuple(expected.shape)}")
        if target.type != "meta" and not torch.allclose(out.detach().cpu(), expected, rtol=1e-2, atol=1e-2):
            raise Wrong("the values differ from the model's own output: just move model and batch, then call the model")
    return f"model and batch meet on the device (checked on {here} and on 'meta', a device every machine has)."


def _check_tflops(n, seconds, tflops) -> str:
    n, seconds = _positive(n, "n"), _positive(seconds, "seconds")
    expected = 2 * n**3 / seconds / 1e12
    if isinstance(tflops, numbers.Real) and not isinstance(tflops, bool) and expected > 0:
        for ratio, why in ((0.5, "you counted n³ operations: each of the n³ multiply-adds is 2 FLOPs"),
                           (1e3, "that looks like GFLOP/s: divide by 1e12 for TFLOP/s"),
                           (1e12, "that is FLOP/s: divide by 1e12 for TFLOP/s")):
            if abs(tflops / expected - ratio) <= 0.02 * ratio:
                raise Wrong(f"expected {expected:.4g} TFLOP/s, got {tflops:.4g}: {why}")
    return expect_close(tflops, expected, rel=0.02, what="the throughput", unit="TFLOP/s") + f" (n = {n:.0f})"


def _reference_crossover(sizes, baseline, candidate):
    """The smallest size from which candidate < baseline at that size and every larger one (or None)."""
    answer = None
    for size, b, c in reversed(list(zip(sizes, baseline, candidate, strict=True))):
        if not c < b:
            break
        answer = size
    return answer


# (sizes, baseline seconds, candidate seconds): a clean crossover, never, always, and noise at small sizes.
_CROSSOVER_CASES = [
    ([16, 32, 64, 128, 256], [1, 2, 4, 8, 16], [5, 5, 5, 5, 5]),
    ([16, 32, 64, 128], [1, 2, 3, 4], [9, 9, 9, 9]),
    ([16, 32, 64], [5, 6, 7], [1, 1, 1]),
    ([16, 32, 64, 128, 256], [1, 2, 4, 8, 16], [5, 1, 5, 6, 7]),
    ([16, 32, 64, 128], [4, 4, 4, 4], [5, 4, 3, 4]),
]


def _check_crossover(crossover, sizes=None, baseline=None, candidate=None) -> str:
    if not callable(crossover):
        raise Wrong("pass your function itself: `q3.check(crossover, sizes, baseline_s, candidate_s)`")
    for case in _CROSSOVER_CASES:
        expected, got = _reference_crossover(*case), crossover(*(list(c) for c in case))
        if got != expected:
            sizes_, base_, cand_ = case
            raise Wrong(f"for sizes={sizes_}, baseline={base_}, candidate={cand_} the answer is {expected}, your "
                        f"function returned {got!r}. The candidate must be faster at that size *and every larger one*"
                        "; None when it is not faster at the largest size")
    if sizes is None:
        return "your function finds the crossover."
    measured = [np.asarray(v).tolist() for v in (sizes, baseline, candidate)]
    if len({len(v) for v in measured}) != 1:
        raise Wrong("sizes, baseline and candidate times must have one entry per size")
    expected, got = _reference_crossover(*measured), crossover(*measured)
    if got != expected:
        raise Wrong(f"on your measurements the answer is {expected}, your function returned {got!r}")
    found = f"from size {expected:g}" if expected is not None else "at none of the sizes measured"
    return f"your function finds the crossover: on your measurements the candidate wins {found}."


def _check_bf16(bf16_native) -> str:
    if not isinstance(bf16_native, (bool, np.bool_)):
        raise Wrong(f"answer True or False, got {bf16_native!r}")
    info = device_info()
    if bool(bf16_native) == info.bf16_native:
        return f"{info.name}: native bf16 {'yes' if info.bf16_native else 'no'}."
    if info.compute_capability is None:
        raise Wrong("there is no GPU here: `gpulab.device_info(device).bf16_native` is False on the CPU")
    cc = ".".join(map(str, info.compute_capability))
    raise Wrong(f"this GPU has compute capability {cc}; native bf16 needs 8.0 (Ampere) or newer. "
                "(`torch.cuda.is_bf16_supported()` can say True where bf16 is only emulated.)")


q1 = Question(
    lesson="00", number=1, title="Model and batch on the same device", checker=_check_predict,
    hint_text="`module.to(device)` moves a model in place, but `tensor.to(device)` returns a *new* tensor: "
              "keep it (`batch = batch.to(device)`).",
    solution_text="""
def predict(model, batch, device):
    model = model.to(device)
    batch = batch.to(device)
    return model(batch)
""",
)

q2 = Question(
    lesson="00", number=2, title="Matmul throughput in TFLOP/s", checker=_check_tflops,
    hint_text="An n×n @ n×n matmul does n³ multiply-adds, and each is 2 floating-point operations. "
              "1 TFLOP/s = 1e12 FLOP/s.",
    solution_text="tflops = 2 * n**3 / seconds / 1e12",
)

q3 = Question(
    lesson="00", number=3, title="Where does the faster side start to win?", checker=_check_crossover,
    hint_text="Walk from the largest size down, and stop at the first size where the candidate is not faster. "
              "A single lucky point at a small size is noise, not a crossover.",
    solution_text="""
def crossover(sizes, baseline_s, candidate_s):
    answer = None
    for size, base, cand in reversed(list(zip(sizes, baseline_s, candidate_s))):
        if not cand < base:
            break
        answer = size
    return answer
""",
)

q4 = Question(
    lesson="00", number=4, title="Native bf16 on this device?", checker=_check_bf16,
    hint_text="`gpulab.device_info(device)` has a `bf16_native` field; native bf16 needs compute capability 8.0 "
              "or newer, and the CPU has none.",
    solution_text="bf16_native = gpulab.device_info(device).bf16_native",
)
