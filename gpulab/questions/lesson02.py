"""Lesson 02 exercises: bandwidth, a loop that waits for the GPU, measuring a loader, settings that feed the GPU."""

import copy
import math
import numbers
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..check import Question, Wrong
from ..device import PCIE_LANE_GBPS, get_device
from ..observe import observe, simulated_gpu

# ---------------------------------------------------------------- q1: bandwidth, and the PCIe link's share

PER_LANE_GBS = {g: PCIE_LANE_GBPS[g] for g in (3, 4, 5)}  # usable GB/s per lane and direction
_BANDWIDTH_CASES = ((2**28, 0.0107), (4096, 9.5e-6), (10**9, 0.04), (64 * 2**20, 0.0031))
_LINK_CASES = ((3, 16), (4, 16), (5, 16), (4, 8))


def _number(value, call: str, unit: str = "GB/s") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real | torch.Tensor):
        raise Wrong(f"{call} returned {value!r}: return a number" + (f" of {unit}" if unit else ""))
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
    return batches, model


class _Batches(list):
    """The loop's batches; remembers how often the host had waited when the last batch was handed out."""

    def __init__(self, batches, waited):
        super().__init__(batches)
        self.waited, self.waits_before_last = waited, 0

    def _hand_out(self, index):
        if index == len(self) - 1:
            self.waits_before_last = self.waited()
        return list.__getitem__(self, index)

    def __iter__(self):
        return (self._hand_out(i) for i in range(len(self)))

    def __getitem__(self, index):
        return self._hand_out(index % len(self)) if isinstance(index, int) else list.__getitem__(self, index)


def _run_loop(fast_loop, batches, model, device):
    """``fast_loop`` with the model on ``device``, observed: (result, what observe saw, waits while batches remained)."""
    if device.type == "cuda":
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]  # as a DataLoader with pin_memory=True
    model = copy.deepcopy(model).to(device)
    with torch.no_grad(), observe(fake_meta_reads=True) as seen:
        watched = _Batches(batches, lambda: len(seen.syncs) + len(seen.to_host))
        try:
            result = fast_loop(watched, model, device)
        except NotImplementedError as err:
            if "meta" in str(err):
                raise Wrong(f"on the check's stand-in device your loop failed: {err}") from None
            raise
        except (RuntimeError, TypeError) as err:
            raise Wrong(f"with the model on {device} your loop raised {type(err).__name__}: {err}") from None
    return result, seen, watched.waits_before_last


def _check_loop(fast_loop) -> str:
    if not callable(fast_loop):
        raise Wrong("fast_loop should be a function of (batches, model, device)")
    batches, model = _loop_inputs()
    expected = slow_loop(batches, model, torch.device("cpu"))
    here = get_device()
    got, seen, stalls = _run_loop(fast_loop, batches, model, here)
    if isinstance(got, torch.Tensor) or isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise Wrong(f"fast_loop returned {type(got).__name__}: return the mean loss as a Python float "
                    "(one .item() at the very end)")
    if not math.isclose(got, expected, rel_tol=1e-4):
        raise Wrong(f"fast_loop returned a mean loss of {got:.6g}, the original loop gives {expected:.6g}: "
                    "it must still compute the same thing")
    device = here
    if here.type != "cuda":  # no GPU: "meta" stands in for it, so copies and reads back to the host show
        device = torch.device("meta")
        _, seen, stalls = _run_loop(fast_loop, batches, model, device)
    if stalls:
        kinds = "; ".join(filter(None, [", ".join(dict.fromkeys(seen.syncs)), seen.to_host_kinds()]))
        raise Wrong(f"the host waited for the GPU {stalls} times while batches were still to come ({kinds}), for "
                    f"{len(batches)} batches: each wait leaves the GPU idle. Keep the running total on the device "
                    "(`total += loss.detach()`, with `total` made on `device`) and read it once, after the loop")
    copies = [c for c in seen.copies if c.target == device.type and c.source == "cpu"]
    if not copies:
        raise Wrong("the batches are never copied to `device`: use x.to(device, non_blocking=True)")
    blocking = [c for c in copies if not c.non_blocking]
    if blocking:
        raise Wrong(f"{len(blocking)} of {len(copies)} copies to the device are blocking: pass non_blocking=True "
                    "so the host can queue the next step while the copy runs")
    where = f"on {device}" if device.type == "cuda" else "on a stand-in device: this machine has no GPU"
    return f"non-blocking copies and no wait before the end ({where}): the host no longer waits for the GPU every step."


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

# ---------------------------------------------------------------- q3: measuring a loader in steady state


class _PacedLoader:
    """A stand-in for a DataLoader: the first batch after ``startup_s`` (workers starting), ``ready`` batches at
    once (what they prepared meanwhile), then one every ``every_s`` seconds."""

    def __init__(self, batches: int, batch_size: int, startup_s: float, ready: int, every_s: float):
        self.batches, self.batch_size = batches, batch_size
        self.startup_s, self.ready, self.every_s = startup_s, ready, every_s

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        start = time.perf_counter()
        x, y = torch.zeros(self.batch_size, 3, 8, 8, dtype=torch.uint8), torch.zeros(self.batch_size, dtype=torch.long)
        for i in range(self.batches):
            due = start + self.startup_s + max(0, i - self.ready + 1) * self.every_s
            if due > time.perf_counter():
                time.sleep(due - time.perf_counter())
            yield x, y


# Two loaders, each with its trap: one the GPU waits for, whose batches prepared during start-up make a rate
# measured too early look too good; and one the GPU cannot keep up with, where a clock read without waiting
# for the GPU measures the loader instead of the training.
_SCENARIOS = {
    "loader-bound": dict(loader=dict(batches=40, batch_size=16, startup_s=0.3, ready=12, every_s=0.010),
                         step_s=0.001, skip=12),
    "GPU-bound": dict(loader=dict(batches=40, batch_size=16, startup_s=0.3, ready=4, every_s=0.002),
                      step_s=0.008, skip=4),
}


def _check_measure(measure) -> str:
    if not callable(measure):
        raise Wrong("pass your function itself: `q3.check(measure)`")
    found = []
    for name, case in _SCENARIOS.items():
        loader, step_s, skip = _PacedLoader(**case["loader"]), case["step_s"], case["skip"]
        # A simulated GPU (on every machine): its training step takes exactly step_s, so the truth is known.
        with simulated_gpu() as gpu:
            try:
                got = measure(loader, lambda x, y, s=step_s: gpu.launch(s), torch.device("cuda"), skip)
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
                raise Wrong(f"your function raised {type(err).__name__}: {err} (train_step(x, y) copies the batch "
                            "and trains by itself: do not move tensors to `device`)") from None
            gpu.wait()
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise Wrong(f"return two numbers, (startup_s, samples_per_s); got {got!r}")
        startup, rate = (_number(v, "measure", unit="") for v in got)
        batch_size, first = loader.batch_size, loader.startup_s
        expected = batch_size / max(loader.every_s, step_s)
        if not 0.8 * first <= startup <= first + (skip + 2) * max(loader.every_s, step_s) + 0.1:
            raise Wrong(f"{name} loader: the first batch arrives after {first:g} s, your start-up is {startup:.3g} s. "
                        "Time from the start of the loop to the first batch (the workers starting), on its own")
        if math.isclose(rate * batch_size, expected, rel_tol=0.15):
            raise Wrong(f"{name} loader: {rate:.4g} per second counts batches, not samples: add up len(y)")
        if rate > 1.15 * expected:
            why = ("the batches prepared during start-up were waiting: skip them before starting the clock"
                   if step_s < loader.every_s else
                   "the clock stopped while the GPU was still running queued steps: wait for it "
                   "(gpulab.sync(device) or torch.cuda.synchronize()) before reading the clock")
            raise Wrong(f"{name} loader: you measured {rate:.4g} samples/s, the steady state is {expected:.4g}: {why}")
        if rate < expected / 1.15:
            raise Wrong(f"{name} loader: you measured {rate:.4g} samples/s, the steady state is {expected:.4g}: time "
                        "only the loop after the start-up and the skipped batches")
        found.append(f"{name}: {rate:.0f} samples/s after {startup:.2f} s of start-up")
    return "; ".join(found) + ", as expected."


q3 = Question(
    lesson="02", number=3, title="measure a loader in steady state", checker=_check_measure,
    hint_text="Time `next(batches)` on a fresh `iter(loader)`: that is the start-up. Train on that batch and on "
              "`skip` more, wait for the GPU, then start the clock; add up len(y) of every batch after that, and "
              "wait for the GPU again before you read the clock.",
    solution_text="""
def measure(loader, train_step, device, skip):
    start = time.perf_counter()
    batches = iter(loader)
    x, y = next(batches)
    startup_s = time.perf_counter() - start
    train_step(x, y)
    for _ in range(skip):
        train_step(*next(batches))
    gpulab.sync(device)
    seen, start = 0, time.perf_counter()
    for x, y in batches:
        train_step(x, y)
        seen += len(y)
    gpulab.sync(device)
    return startup_s, seen / (time.perf_counter() - start)
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
    need = math.ceil(SCENARIO["sample_ms"] * SCENARIO["batch_size"] / SCENARIO["step_ms"])
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
    hint_text="One worker builds a whole batch (sample_ms × batch_size); the GPU wants one every step_ms: round "
              "their ratio up for num_workers, within the CPU cores. Pinned batches make the copy fast and "
              "asynchronous; many short epochs call for workers that stay alive.",
    solution_text="""
loader_kwargs = dict(num_workers=6, pin_memory=True, persistent_workers=True, prefetch_factor=2)
""",
)
