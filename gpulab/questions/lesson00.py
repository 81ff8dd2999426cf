"""Lesson 00 (setup and diagnostics): devices, matmul throughput, the CPU/GPU crossover, bf16.

What the checks of lessons 00, 01, 02 and 04 share (running a learner's code on a GPU, or on a stand-in for it where there is
none) is in ``stand_in``.
"""

import copy
import types
from contextlib import ExitStack, contextmanager, nullcontext
from unittest import mock

import numpy as np
import torch

from .. import device as device_module
from ..check import Question, Wrong, expect_close
from ..device import device_info, get_device
from .stand_in import GPU, NotJudged, as_on_gpu, gpu_run, on_gpu_side, positive, ratio_is, simulated, where

# ---------------------------------------------------------------- q1: model and batch on the same device


def _predict_inputs():
    """A small model and a batch on the CPU (the same every call)."""
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model, torch.randn(5, 8, generator=generator)


def _run_predict(predict, target: torch.device):
    """``predict`` with a fresh model and batch and ``target``: (its output, the device types its layers ran on)."""
    model, batch = _predict_inputs()
    ran = []
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_pre_hook(lambda layer, args: ran.append(layer.weight.device.type))
    try:
        with gpu_run() if target.type == "cuda" else nullcontext():
            out = predict(model, batch, target)
    except (NotImplementedError, NotJudged):
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
        raise Wrong(_predict_failed(err, target)) from None
    return out, ran


def _predict_failed(err: Exception, target: torch.device) -> str:
    words = as_on_gpu(err)
    first = words.split(". ")[0].rstrip(".!")
    if target.type == "cpu" and any(gpu in words.lower() for gpu in ("cuda", "nvidia")):
        return (f"with device='cpu' your function asked for a GPU ({type(err).__name__}: {first}): use the `device` "
                "you are given, not a fixed 'cuda'")
    said = f"with device={str(target)!r} your function raised {type(err).__name__}: {first}"
    if "device" in words:
        return f"{said}. Move the model *and* the batch to `device`, and keep the moved batch (`batch = batch.to(device)`)"
    return said


def _judge_predict(out, ran: list, target: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise Wrong(f"return the model's output (a tensor), got {type(out).__name__}")
    ran = set(ran)
    here = on_gpu_side if target.type == "cuda" else (lambda t: t == target.type)
    out_there = here(out.device.type)
    if not ran:
        raise Wrong(f"with device={str(target)!r} your function never ran the model: return `model(batch)`")
    elsewhere = ", ".join(sorted(t for t in ran if not here(t)))
    if elsewhere and out_there:
        raise Wrong(f"with device={str(target)!r} the model computed on {elsewhere}, and only its output was moved: "
                    "move the model and the batch first, then call the model")
    if elsewhere:
        raise Wrong(f"with device={str(target)!r} the model ran on {elsewhere}: move the model and the batch to "
                    "`device`, the argument you are given")
    if not out_there:
        raise Wrong(f"with device={str(target)!r} the output is on {out.device}: run the model on `device` "
                    "and return its output there (no `.cpu()`)")


def _check_predict(predict) -> str:
    if not callable(predict):
        raise Wrong("pass your function itself: `q1.check(predict)`")
    outputs = {}
    for target in (torch.device("cpu"), GPU):  # the GPU, or a stand-in for it: a mistake shows as it would on one
        try:
            out, ran = _run_predict(predict, target)
        except NotJudged:
            continue
        _judge_predict(out, ran, target)
        outputs[target] = out
    model, batch = _predict_inputs()
    with torch.no_grad():  # computed only now: nothing the learner's code could find while it ran
        expected = model(batch)
    for target, out in outputs.items():
        if out.shape != expected.shape:
            raise Wrong(f"the output has shape {tuple(out.shape)}, the model's output has {tuple(expected.shape)}")
        if (target.type == "cpu" or not simulated()) and not torch.allclose(
                out.detach().cpu().float(), expected, rtol=1e-2, atol=1e-2):
            raise Wrong("the values differ from the model's own output: just move model and batch, then call the model")
    if GPU not in outputs:
        return "model and batch meet on the CPU; how your function behaves on a GPU could not be judged on this machine."
    return f"model and batch meet on the device (checked on the CPU and {where(GPU)})."


# ---------------------------------------------------------------- q2: matmul throughput


def _check_tflops(n, seconds, tflops) -> str:
    n, seconds = positive(n, "n"), positive(seconds, "seconds")
    expected = 2 * n**3 / seconds / 1e12
    for ratio, why in ((0.5, "you counted n³ operations: each of the n³ multiply-adds is 2 FLOPs"),
                       (1 / n, "you counted n² operations: an n×n matmul does n³ multiply-adds"),
                       (1e3, "that looks like GFLOP/s: divide by 1e12 for TFLOP/s"),
                       (1e12, "that is FLOP/s: divide by 1e12 for TFLOP/s"),
                       (1e-3, "`seconds` is in seconds: do not divide it by 1000"),
                       (1e12 / 2**40, "1 TFLOP/s is 1e12 FLOP/s, not 2⁴⁰")):
        if ratio_is(tflops, expected, ratio):
            raise Wrong(f"expected {expected:.4g} TFLOP/s, got {tflops:.4g}: {why}")
    return expect_close(tflops, expected, rel=0.02, what="the throughput", unit="TFLOP/s") + f" (n = {n:.0f})"


# ---------------------------------------------------------------- q3: the crossover


def _reference_crossover(sizes, baseline, candidate):
    """The smallest size from which candidate < baseline at that size and every larger one (or None)."""
    answer = None
    for size, b, c in reversed(list(zip(sizes, baseline, candidate, strict=True))):
        if not c < b:
            break
        answer = size
    return answer


# (sizes, baseline seconds, candidate seconds): a clean crossover, never, always, noise at small sizes, a tie at the
# largest size, one slow point in the middle, and one size only.
_CROSSOVER_CASES = [
    ([16, 32, 64, 128, 256], [1, 2, 4, 8, 16], [5, 5, 5, 5, 5]),
    ([16, 32, 64, 128], [1, 2, 3, 4], [9, 9, 9, 9]),
    ([16, 32, 64], [5, 6, 7], [1, 1, 1]),
    ([16, 32, 64, 128, 256], [1, 2, 4, 8, 16], [5, 1, 5, 6, 7]),
    ([16, 32, 64, 128], [4, 4, 4, 4], [5, 4, 3, 4]),
    ([8, 16, 32, 64, 128, 256], [2, 4, 8, 16, 32, 64], [3, 3, 3, 20, 20, 20]),
    ([512], [2], [1]),
]


def _crossover_hint(got, sizes, expected) -> str:
    if expected is None and got is not None:
        return ": return None when the candidate is not faster at the largest size"
    if isinstance(got, int) and not isinstance(got, bool) and got not in sizes and 0 <= got < len(sizes) \
            and sizes[got] == expected:
        return ": that is the position in the list, return the size itself"
    return (": the candidate must be faster at that size *and every larger one*; None when it is not faster at the "
            "largest size")


def _check_crossover(crossover, sizes=None, baseline=None, candidate=None) -> str:
    if not callable(crossover):
        raise Wrong("pass your function itself: `q3.check(crossover, sizes, baseline_s, candidate_s)`")
    for case in _CROSSOVER_CASES:
        got = crossover(*copy.deepcopy(case))
        expected = _reference_crossover(*case)
        if got != expected:
            sizes_, base_, cand_ = case
            raise Wrong(f"for sizes={sizes_}, baseline={base_}, candidate={cand_} the answer is {expected}, your "
                        f"function returned {got!r}{_crossover_hint(got, sizes_, expected)}")
    if sizes is None:
        return "your function finds the crossover."
    measured = [np.asarray(v).tolist() for v in (sizes, baseline, candidate)]
    if len({len(v) for v in measured}) != 1:
        raise Wrong("sizes, baseline and candidate times must have one entry per size")
    got = crossover(*copy.deepcopy(measured))
    expected = _reference_crossover(*measured)
    if got != expected:
        raise Wrong(f"on your measurements the answer is {expected}, your function returned {got!r}")
    found = f"from size {expected:g}" if expected is not None else "at none of the sizes measured"
    return f"your function finds the crossover: on your measurements the candidate wins {found}."


# ---------------------------------------------------------------- q4: native bf16


# Devices the check asks about (name, compute capability; None: the CPU of a machine with an A100).
_BF16_DEVICES = [("Tesla T4", (7, 5)), ("NVIDIA A100-SXM4-80GB", (8, 0)), ("Tesla V100-SXM2-16GB", (7, 0)),
                 ("NVIDIA H100 80GB HBM3", (9, 0)), ("the CPU of a machine with an A100", None)]


@contextmanager
def _simulated_device(name: str, capability: tuple[int, int]):
    """For the block, ``torch.cuda`` (and ``gpulab.device_info``) describe one GPU, ``name``, of ``capability``."""
    major, minor = capability
    props = types.SimpleNamespace(name=name, major=major, minor=minor, total_memory=16 * 2**30,
                                  multi_processor_count=40, L2_cache_size=4 * 2**20)
    patches = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "get_device_properties": lambda device=None: props, "get_device_name": lambda device=None: name,
        "get_device_capability": lambda device=None: capability,
        "is_bf16_supported": lambda including_emulation=True: major >= 8 or including_emulation,
    }
    device_info.cache_clear()  # facts cached for this machine's devices must not answer for the simulated one
    try:
        with ExitStack() as stack:
            for attr, fake in patches.items():
                stack.enter_context(mock.patch.object(torch.cuda, attr, fake))
            stack.enter_context(mock.patch.object(device_module, "_nvml_facts", lambda index: (None, None)))
            yield
    finally:
        device_info.cache_clear()


def _ask_bf16(has_native_bf16, device: torch.device, what: str) -> bool:
    try:
        got = has_native_bf16(device)
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
        raise Wrong(f"for {what} your function raised {type(err).__name__}: {err}") from None
    if not isinstance(got, (bool, np.bool_)):
        raise Wrong(f"for {what} your function returned {got!r}: return True or False")
    return bool(got)


def _bf16_mistake(name, capability, got) -> str:
    if capability is None:
        return (f"asked about the CPU (of a machine with a GPU), your function says {got}: look at the `device` you are "
                "given, not at the machine's GPU. The CPU has no native bf16 in this course's sense")
    cc = ".".join(map(str, capability))
    if got:
        return (f"the {name} (compute capability {cc}) has no native bf16, yet your function says True: native bf16 "
                "needs 8.0 (Ampere) or newer. (`torch.cuda.is_bf16_supported()` says True where bf16 is only "
                "emulated, and having a GPU is not enough.)")
    return (f"the {name} (compute capability {cc}) computes in bf16 natively, yet your function says False: read it "
            "from the device's facts, `gpulab.device_info(device).bf16_native`, not a fixed answer")


def _check_bf16(has_native_bf16) -> str:
    if not callable(has_native_bf16):
        raise Wrong("pass your function itself: `q4.check(has_native_bf16)`")
    for name, capability in _BF16_DEVICES:
        device = GPU if capability else torch.device("cpu")
        with _simulated_device(name, capability or (8, 0)):
            got = _ask_bf16(has_native_bf16, device, f"a simulated {name}" if capability else name)
        if got != (capability is not None and capability >= (8, 0)):
            raise Wrong(_bf16_mistake(name, capability, got))
    here = get_device()
    got, info = _ask_bf16(has_native_bf16, here, "this machine's device"), device_info(here)
    if got != info.bf16_native:
        raise Wrong(f"on this machine ({info.name}) your function says {got}, the device's facts say "
                    f"{info.bf16_native}: use `gpulab.device_info(device).bf16_native`")
    return (f"right for a T4, a V100, an A100, an H100 and a CPU (simulated), and here: {info.name}, native bf16 "
            f"{'yes' if got else 'no'}.")


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
    lesson="00", number=4, title="Native bf16 on a device?", checker=_check_bf16,
    hint_text="`gpulab.device_info(device)` has a `bf16_native` field; native bf16 needs compute capability 8.0 "
              "or newer, and the CPU has none.",
    solution_text="""
def has_native_bf16(device):
    return gpulab.device_info(device).bf16_native
""",
)
