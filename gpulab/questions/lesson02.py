"""Lesson 02 exercises: bandwidth, a loop that waits for the GPU, and loader settings that feed it."""

import math
import numbers
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from ..check import Question, Wrong
from ..device import PCIE_LANE_GBPS

# ---------------------------------------------------------------- q1: bandwidth, and the PCIe link's share

PER_LANE_GBS = {g: PCIE_LANE_GBPS[g] for g in (3, 4, 5)}  # usable GB/s per lane and direction
_BANDWIDTH_CASES = ((2**28, 0.0107), (4096, 9.5e-6), (10**9, 0.04), (64 * 2**20, 0.0031))
_LINK_CASES = ((3, 16), (4, 16), (5, 16), (4, 8))


def _number(value, call: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real | torch.Tensor):
        raise Wrong(f"{call} returned {value!r}: return a number of GB/s")
    return float(value)


def _check_bandwidth(bandwidth_gbs, link_gbs) -> str:
    if not callable(bandwidth_gbs) or not callable(link_gbs):
        raise Wrong("pass your two functions: q1.check(bandwidth_gbs, link_gbs)")
    for nbytes, seconds in _BANDWIDTH_CASES:
        call = f"bandwidth_gbs({nbytes}, {seconds})"
        expected, got = nbytes / seconds / 1e9, _number(bandwidth_gbs(nbytes, seconds), call)
        if math.isclose(got, expected, rel_tol=0.01):
            continue
        where = f"{call} = {got:.4g}, expected {expected:.4g} GB/s"
        for factor, why in ((1e9, "that is bytes/s: divide by 1e9 for GB/s"),
                            (1e9 / 2**30, "that is GiB/s (1024³ bytes): link speeds are quoted in GB = 1e9 bytes"),
                            (1e-3, "the time is given in seconds, not ms"),
                            (1e3, "the time is given in seconds, not ms")):
            if math.isclose(got, expected * factor, rel_tol=0.01):
                raise Wrong(f"{where}: {why}")
        raise Wrong(where)
    for generation, lanes in _LINK_CASES:
        call = f"link_gbs({generation}, {lanes})"
        expected, got = PER_LANE_GBS[generation] * lanes, _number(link_gbs(generation, lanes), call)
        if not math.isclose(got, expected, rel_tol=0.01):
            why = " (per lane and direction, times the number of lanes)" if math.isclose(got * lanes, expected) else ""
            raise Wrong(f"{call} = {got:.4g}, expected {expected:.4g} GB/s{why}")
    fraction = bandwidth_gbs(2**30, 0.04) / link_gbs(4, 16)
    return (f"e.g. 1 GiB in 40 ms is {bandwidth_gbs(2**30, 0.04):.1f} GB/s, {fraction:.0%} of a Gen4 x16 link "
            f"({link_gbs(4, 16):.1f} GB/s).")


q1 = Question(
    lesson="02", number=1, title="bandwidth, and the PCIe link's share", checker=_check_bandwidth,
    hint_text="Bandwidth is bytes per second; 1 GB/s is 1e9 bytes per second (not 1024³). A PCIe link carries "
              "PER_LANE_GBS[generation] GB/s per lane in each direction, and has `lanes` lanes.",
    solution_text="""
def bandwidth_gbs(nbytes, seconds):
    return nbytes / seconds / 1e9

def link_gbs(generation, lanes):
    return PER_LANE_GBS[generation] * lanes
""",
)

# ---------------------------------------------------------------- q2: a loop that waits for the GPU every step

_HOST_READS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__format__",
               "__repr__", "__str__"}
_COPIES = {"to", "cuda"}


class _Recorder(TorchFunctionMode):
    """Records the tensor methods a loop calls: host reads (each one waits for the GPU) and copies."""

    def __init__(self):
        super().__init__()
        self.host_reads: list[str] = []
        self.blocking_copies = 0
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.host_reads.append(name)
        elif name in _COPIES and args and isinstance(args[0], torch.Tensor):
            self.copies += 1
            self.blocking_copies += not kwargs.get("non_blocking", False)
        return func(*args, **kwargs)


def slow_loop(batches, model, device):
    """The loop of the exercise: two synchronous copies and one host read per batch."""
    total = 0.0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        total += loss.item()
    return total / len(batches)


def _loop_inputs():
    generator = torch.Generator().manual_seed(2)
    model = torch.nn.Linear(8, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 8, generator=generator))
        model.bias.zero_()
    batches = [(torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator)) for _ in range(6)]
    return batches, model, torch.device("cpu")


def _check_loop(fast_loop) -> str:
    if not callable(fast_loop):
        raise Wrong("fast_loop should be a function of (batches, model, device)")
    batches, model, device = _loop_inputs()
    expected = slow_loop(batches, model, device)
    recorder = _Recorder()
    with torch.no_grad(), recorder:
        got = fast_loop(batches, model, device)
    if isinstance(got, torch.Tensor) or isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise Wrong(f"fast_loop returned {type(got).__name__}: return the mean loss as a Python float "
                    "(one .item() at the very end)")
    if not math.isclose(got, expected, rel_tol=1e-4):
        raise Wrong(f"fast_loop returned a mean loss of {got:.6g}, the original loop gives {expected:.6g}: "
                    "it must still compute the same thing")
    if len(recorder.host_reads) > 1:
        raise Wrong(f"the loop read values back to the host {len(recorder.host_reads)} times "
                    f"({', '.join(sorted(set(recorder.host_reads)))}) for {len(batches)} batches: each read waits "
                    "for the GPU. Keep the running total on the device and read it once, after the loop")
    if recorder.copies == 0:
        raise Wrong("the batches are never copied to `device`: use x.to(device, non_blocking=True)")
    if recorder.blocking_copies:
        raise Wrong(f"{recorder.blocking_copies} of {recorder.copies} copies are blocking: pass non_blocking=True "
                    "so the host can queue the next step while the copy runs")
    return "non-blocking copies and one read at the end: the host no longer waits for the GPU every step."


q2 = Question(
    lesson="02", number=2, title="fix a loop that waits for the GPU", checker=_check_loop,
    hint_text="Two things stall the host every step: `.to(device)` without non_blocking=True, and `loss.item()`, "
              "which copies the loss back and waits for the GPU. Accumulate `loss.detach()` in a tensor on the "
              "device and call `.item()` once after the loop.",
    solution_text="""
def fast_loop(batches, model, device):
    total = torch.zeros((), device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total += torch.nn.functional.mse_loss(model(x), y).detach()
    return total.item() / len(batches)
""",
)

# ---------------------------------------------------------------- q3: how many workers feed the GPU

_WORKER_CASES = ((4.0, 64, 50.0), (2.0, 32, 64.0), (3.0, 100, 300.0), (10.0, 64, 20.0), (5.0, 20, 25.0),
                 (0.5, 256, 8.0))


def _workers(sample_ms: float, batch_size: int, step_ms: float) -> int:
    return max(1, math.ceil(sample_ms * batch_size / step_ms - 1e-9))


def _check_workers(workers_needed) -> str:
    if not callable(workers_needed):
        raise Wrong("workers_needed should be a function of (sample_ms, batch_size, step_ms)")
    for case in _WORKER_CASES:
        expected, got = _workers(*case), workers_needed(*case)
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            raise Wrong(f"workers_needed{case} returned {got!r}: num_workers is a whole number (use math.ceil)")
        if got != expected:
            sample_ms, batch_size, step_ms = case
            raise Wrong(f"workers_needed{case} = {got}, expected {expected}: one worker makes a batch in "
                        f"{sample_ms} ms × {batch_size} = {sample_ms * batch_size:g} ms, and the GPU wants one every "
                        f"{step_ms:g} ms; round up, and never fewer than 1 worker")
    return "each worker makes one batch at a time, so you need ceil(batch time on the CPU ÷ step time on the GPU)."


q3 = Question(
    lesson="02", number=3, title="how many workers feed the GPU", checker=_check_workers,
    hint_text="One worker builds a whole batch: sample_ms × batch_size milliseconds. N workers deliver N batches in "
              "that time; the GPU consumes one every step_ms. Round up (math.ceil); at least 1.",
    solution_text="""
import math

def workers_needed(sample_ms, batch_size, step_ms):
    return max(1, math.ceil(sample_ms * batch_size / step_ms))
""",
)

# ---------------------------------------------------------------- q4: loader settings that stop the GPU starving

SCENARIO = {"sample_ms": 3.0, "batch_size": 64, "step_ms": 40.0, "cpu_cores": 8}


def _check_loader(loader_kwargs) -> str:
    if not isinstance(loader_kwargs, dict):
        raise Wrong(f"loader_kwargs should be a dict of DataLoader arguments, got {type(loader_kwargs).__name__}")
    kwargs = {"batch_size": SCENARIO["batch_size"], **loader_kwargs}
    try:
        with warnings.catch_warnings():  # DataLoader warns when there are more workers than cores here
            warnings.simplefilter("ignore")
            DataLoader(TensorDataset(torch.zeros(4, 1)), **kwargs)
    except (TypeError, ValueError) as err:
        raise Wrong(f"a DataLoader with these arguments fails: {err}") from None
    need = _workers(SCENARIO["sample_ms"], SCENARIO["batch_size"], SCENARIO["step_ms"])
    batch_ms = SCENARIO["sample_ms"] * SCENARIO["batch_size"]
    workers = kwargs.get("num_workers", 0)
    if workers < need:
        raise Wrong(f"num_workers={workers} makes batches too slowly: the GPU wants one every "
                    f"{SCENARIO['step_ms']:g} ms and one worker needs {batch_ms:g} ms; at least {need} workers keep up")
    if workers > SCENARIO["cpu_cores"]:
        raise Wrong(f"num_workers={workers} is more than the {SCENARIO['cpu_cores']} CPU cores: the extra workers only "
                    "compete for the same cores (and with the main process that launches the GPU work)")
    if not kwargs.get("pin_memory", False):
        raise Wrong("without pin_memory=True every batch is copied from pageable memory: slower, and "
                    "x.to(device, non_blocking=True) cannot be asynchronous")
    if not kwargs.get("persistent_workers", False):
        raise Wrong("with 100 short epochs, workers that are started again every epoch cost real time: "
                    "set persistent_workers=True")
    if (kwargs.get("prefetch_factor") or 2) < 2:
        raise Wrong("prefetch_factor below the default of 2 leaves no batch waiting when a worker is slow")
    return f"{workers} workers (≥ {need}), pinned, persistent: the GPU is fed."


q4 = Question(
    lesson="02", number=4, title="loader settings that stop the GPU starving", checker=_check_loader,
    hint_text="Use your workers_needed() on the scenario for num_workers (and stay within the CPU cores); pinned "
              "batches make the copy fast and asynchronous; many short epochs call for workers that stay alive.",
    solution_text="""
loader_kwargs = dict(num_workers=6, pin_memory=True, persistent_workers=True, prefetch_factor=2)
""",
)
