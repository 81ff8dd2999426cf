"""Lesson 02 exercises: bandwidth, a loop that waits for the GPU, measuring a loader, settings that feed the GPU."""

import math
import numbers
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..check import Question, Wrong
from ..device import PCIE_LANE_GBPS
from .observe import Observed, simulated_gpu
from .stand_in import (
    GPU,
    NotJudged,
    StampedSyncs,
    as_on_gpu,
    gpu_run,
    on_gpu_side,
    shape_reads,
    simulated,
    unwaited_reads,
    virtual_clock,
    where,
)

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
        got = _number(bandwidth_gbs(nbytes, seconds), call)
        expected = nbytes / seconds / 1e9
        if not math.isclose(got, expected, rel_tol=0.01):
            raise Wrong(f"{call} = {got:.4g}, expected {expected:.4g} GB/s" + _why(got, expected, _BANDWIDTH_MISTAKES))
    for generation, lanes in _LINK_CASES:
        call = f"link_gbs({generation}, {lanes})"
        got = _number(link_gbs(generation, lanes), call)
        expected = PER_LANE_GBS[generation] * lanes
        if not math.isclose(got, expected, rel_tol=0.01):
            mistakes = ((1 / lanes, "per lane and direction, times the number of lanes"),
                        (16 / lanes, "use the `lanes` you are given, not 16"), *_LINK_MISTAKES)
            raise Wrong(f"{call} = {got:.4g}, expected {expected:.4g} GB/s" + _why(got, expected, mistakes))
    share = bandwidth_gbs(2**30, 0.04) / link_gbs(4, 16)
    return (f"e.g. 1 GiB in 40 ms is {bandwidth_gbs(2**30, 0.04):.1f} GB/s, {share:.0%} of a Gen4 x16 link "
            f"({link_gbs(4, 16):.1f} GB/s).")


_BANDWIDTH_MISTAKES = ((1e9, "that is bytes/s: divide by 1e9 for GB/s"),
                       (1e9 / 2**30, "that is GiB/s (1024³ bytes): link speeds are quoted in GB = 1e9 bytes"),
                       (8, "that is gigabits per second: GB/s counts bytes"),
                       (1e-3, "the time is given in seconds, not ms"),
                       (1e3, "the time is given in seconds, not ms"))
_LINK_MISTAKES = ((2, "that counts both directions: a link carries this much in *each* direction"),
                  (8, "that is gigabits per second: GB/s counts bytes"))


def _why(got: float, expected: float, mistakes) -> str:
    """``: why`` for the first mistake whose factor turns ``expected`` into ``got``, else nothing."""
    return next((f": {why}" for factor, why in mistakes if math.isclose(got, expected * factor, rel_tol=0.01)), "")


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
    """The loop's batches; when the last one is handed out, keeps the waits ``seen`` had recorded until then."""

    def __init__(self, batches, seen):
        super().__init__(batches)
        self.seen, self.waits = seen, Observed()

    def _hand_out(self, index):
        if index == len(self) - 1:
            self.waits = Observed(syncs=list(self.seen.syncs), to_host=list(self.seen.to_host),
                                  host_reads=shape_reads(self.seen.host_reads))
        return list.__getitem__(self, index)

    def __iter__(self):
        return (self._hand_out(i) for i in range(len(self)))

    def __getitem__(self, index):
        return self._hand_out(index % len(self)) if isinstance(index, int) else list.__getitem__(self, index)


def _run_loop(fast_loop, device: torch.device):
    """``fast_loop`` with fresh batches and the model on ``device`` (the GPU: observed, maybe on a stand-in):
    (its result, what observe saw or None, the waits observed before the last batch was handed out)."""
    batches, model = _loop_inputs()
    if device.type == "cpu":
        with torch.no_grad():
            return fast_loop(batches, model, device), None, None
    if not simulated():
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]  # as a DataLoader with pin_memory=True
    model = model.to("meta" if simulated() else device)  # already on the device, as the exercise says
    with torch.no_grad(), gpu_run() as seen:
        seen.syncs = StampedSyncs(seen.copies)
        watched = _Batches(batches, seen)
        return fast_loop(watched, model, device), seen, watched.waits


def _loop_failed(err: Exception, device: torch.device) -> str:
    words = as_on_gpu(err)
    if device.type == "cpu" and any(gpu in words.lower() for gpu in ("cuda", "nvidia")):
        first = words.split(". ")[0].rstrip(".!")
        return (f"with the model on the CPU your loop asked for a GPU ({type(err).__name__}: {first}): use the "
                "`device` you are given, not a fixed 'cuda'")
    return f"with the model on {device} your loop raised {type(err).__name__}: {words}"


def _check_loop(fast_loop) -> str:
    if not callable(fast_loop):
        raise Wrong("fast_loop should be a function of (batches, model, device)")
    got, _, _ = _run_observed(fast_loop, torch.device("cpu"))  # the values on the CPU
    if isinstance(got, torch.Tensor) or isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise Wrong(f"fast_loop returned {type(got).__name__}: return the mean loss as a Python float "
                    "(one .item() at the very end)")
    expected = slow_loop(*_loop_inputs(), torch.device("cpu"))  # computed only now: nothing to find before
    if not math.isclose(got, expected, rel_tol=1e-4):
        raise Wrong(f"fast_loop returned a mean loss of {got:.6g}, the original loop gives {expected:.6g}: "
                    "it must still compute the same thing")
    try:
        _, seen, early = _run_observed(fast_loop, GPU)  # the copies and waits on the GPU (or a stand-in for one)
    except NotJudged:
        return "the mean loss is right; how your loop behaves on a GPU could not be judged on this machine."
    _judge_loop(seen, early)
    return f"non-blocking copies and no wait before the end ({where(GPU)}): the host no longer waits for the GPU every step."


def _run_observed(fast_loop, device: torch.device):
    """``_run_loop``, with a failure of the learner's code said as Wrong."""
    try:
        return _run_loop(fast_loop, device)
    except (NotImplementedError, NotJudged):
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
        raise Wrong(_loop_failed(err, device)) from None


def _judge_loop(seen, early) -> None:
    """Judge what the loop did on the GPU; ``early``: the waits before its last batch."""
    batches, stalls = len(_loop_inputs()[0]), len(early.syncs) + len(early.to_host) + len(early.host_reads)
    if stalls:
        shapes = "a result whose shape depends on the values (a boolean mask, `nonzero`)" if early.host_reads else ""
        kinds = "; ".join(filter(None, [", ".join(dict.fromkeys(early.syncs)), early.to_host_kinds(), shapes]))
        raise Wrong(f"the host waited for the GPU {stalls} times while batches were still to come ({kinds}), for "
                    f"{batches} batches: each wait leaves the GPU idle. Keep the running total on the device "
                    "(`total += loss.detach()`, with `total` made on `device`) and read it once, after the loop")
    copies = [c for c in seen.copies if on_gpu_side(c.target) and c.source == "cpu"]
    if not copies:
        raise Wrong("the batches are never copied to `device`: use x.to(device, non_blocking=True)")
    blocking = [c for c in copies if not c.non_blocking]
    if blocking:
        raise Wrong(f"{len(blocking)} of {len(copies)} copies to the device are blocking: pass non_blocking=True "
                    "so the host can queue the next step while the copy runs")
    if unwaited_reads(seen):
        raise Wrong("you read the total through a non-blocking copy to the host (`non_blocking=True`) that nothing "
                    "waited for: on a GPU its value may not have arrived yet. Read it with `.item()`, which waits")


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
    """A stand-in for a DataLoader: the first ``ready`` batches after ``startup_s`` (workers starting, preparing
    them meanwhile), then one every ``every_s`` seconds while its buffer of ``ready`` batches has room."""

    def __init__(self, batches: int, batch_size: int, startup_s: float, ready: int, every_s: float):
        self.batches, self.batch_size = batches, batch_size
        self.startup_s, self.ready, self.every_s = startup_s, ready, every_s

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        done, taken = time.perf_counter() + self.startup_s, []  # when the latest batch was made; each was taken
        x, y = torch.zeros(self.batch_size, 3, 8, 8, dtype=torch.uint8), torch.zeros(self.batch_size, dtype=torch.long)
        for i in range(self.batches):
            if i >= self.ready:  # made once the batch `ready` places earlier has left the buffer
                done = max(done, taken[i - self.ready]) + self.every_s
            if done > time.perf_counter():
                time.sleep(done - time.perf_counter())
            taken.append(time.perf_counter())
            yield x, y


# Two loaders, each with its trap, timed on a virtual clock (exact on any machine, however loaded): one the GPU
# waits for, whose batches prepared during start-up make a rate measured too early look too good; and one the GPU
# cannot keep up with, where a clock read without waiting for the GPU measures the loader instead of the training,
# and a clock started before the skipped batches counts their training too.
_SCENARIOS = {
    "loader-bound": dict(loader=dict(batches=24, batch_size=16, startup_s=0.3, ready=12, every_s=0.010),
                         step_s=0.0002, skip=11),
    "GPU-bound": dict(loader=dict(batches=32, batch_size=16, startup_s=0.3, ready=9, every_s=0.002),
                      step_s=0.008, skip=8),
}
_SAMPLE_NUMEL = 3 * 8 * 8  # the elements of one sample of the paced loader's images
_TOLERANCE = 0.05  # the virtual clock is exact: the right answer lands within 2 %, each mistake 10 % or more away


def _check_measure(measure) -> str:
    if not callable(measure):
        raise Wrong("pass your function itself: `q3.check(measure)`")
    found = []
    for name, case in _SCENARIOS.items():
        startup, rate = _measured(measure, case)
        found.append(_judge_measure(name, case, startup, rate))
    return "; ".join(found) + ", as expected."


def _measured(measure, case: dict) -> tuple[float, float]:
    """``measure`` on a paced loader and a simulated GPU, on a virtual clock: its (startup_s, samples_per_s)."""
    loader, step_s = _PacedLoader(**case["loader"]), case["step_s"]
    with virtual_clock(measure), simulated_gpu() as gpu:
        try:
            got = measure(loader, lambda x, y: gpu.launch(step_s), GPU, case["skip"])
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of the learner's code is reported
            raise Wrong(f"your function raised {type(err).__name__}: {err} (train_step(x, y) copies the batch "
                        "and trains by itself: do not move tensors to `device`)") from None
        gpu.wait()
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise Wrong(f"return two numbers, (startup_s, samples_per_s); got {got!r}")
    startup, rate = (_number(v, "measure", unit="") for v in got)
    return startup, rate


def _judge_measure(name: str, case: dict, startup: float, rate: float) -> str:
    """Raise Wrong unless (startup, rate) is what the paced loader of ``case`` gives; exact on the virtual clock."""
    loader = case["loader"]
    first, batch_size, per_batch = loader["startup_s"], loader["batch_size"], max(loader["every_s"], case["step_s"])
    expected = batch_size / per_batch
    close = lambda got, want: math.isclose(got, want, rel_tol=_TOLERANCE)
    if close(startup, expected) and close(rate, first):
        raise Wrong("return (startup_s, samples_per_s), in that order")
    if not close(startup, first):
        why = ("that is milliseconds: return seconds" if close(startup, first * 1e3) else
               "the first batch comes from `next()` on the iterator, not from `iter(loader)`" if startup < 0.5 * first
               else "time from the start of the loop to the first batch (the workers starting), on its own")
        raise Wrong(f"{name} loader: the first batch arrives after {first:g} s, your start-up is {startup:.3g} s: {why}")
    for factor, why in ((1 / batch_size, "counts batches, not samples: add up len(y)"),
                        (_SAMPLE_NUMEL, "counts elements, not samples: add up len(y)")):
        if close(rate, expected * factor):
            raise Wrong(f"{name} loader: {rate:.4g} per second {why}")
    if rate > (1 + _TOLERANCE) * expected:
        why = ("the batches prepared during start-up were waiting: skip them before starting the clock"
               if case["step_s"] < loader["every_s"] else
               "the clock stopped while the GPU was still running queued steps: wait for it "
               "(gpulab.sync(device) or torch.cuda.synchronize()) before reading the clock")
        raise Wrong(f"{name} loader: you measured {rate:.4g} samples/s, the steady state is {expected:.4g}: {why}")
    if rate < (1 - _TOLERANCE) * expected:
        raise Wrong(f"{name} loader: you measured {rate:.4g} samples/s, the steady state is {expected:.4g}: start "
                    "the clock after the first batch, the skipped ones and a wait for the GPU, and count only the "
                    "batches after them")
    return f"{name}: {rate:.0f} samples/s after {startup:.2f} s of start-up"


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
    samples_per_s = seen / (time.perf_counter() - start)
    return startup_s, samples_per_s
""",
)

# ---------------------------------------------------------------- q4: loader settings that stop the GPU starving

SCENARIO = {"sample_ms": 3.0, "batch_size": 64, "step_ms": 40.0, "cpu_cores": 8}


def _check_loader(loader_kwargs) -> str:
    if not isinstance(loader_kwargs, dict):
        raise Wrong(f"loader_kwargs should be a dict of DataLoader arguments, got {type(loader_kwargs).__name__}")
    if loader_kwargs.get("batch_size", SCENARIO["batch_size"]) != SCENARIO["batch_size"]:
        raise Wrong(f"keep the batch size of the scenario, {SCENARIO['batch_size']}: the question is how to feed it")
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
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise Wrong(f"num_workers is a whole number of processes, got {workers!r}")
    if workers < need:
        raise Wrong(f"num_workers={workers} makes batches too slowly: the GPU wants one every "
                    f"{SCENARIO['step_ms']:g} ms and one worker needs {batch_ms:g} ms; at least {need} workers keep up")
    if workers > SCENARIO["cpu_cores"]:
        raise Wrong(f"num_workers={workers} is more than the {SCENARIO['cpu_cores']} CPU cores: the extra workers only "
                    "compete for the same cores (and with the main process that launches the GPU work)")
    if kwargs.get("pin_memory") is not True:
        raise Wrong("without pin_memory=True every batch is copied from pageable memory: slower, and "
                    "x.to(device, non_blocking=True) cannot be asynchronous")
    if kwargs.get("persistent_workers") is not True:
        raise Wrong("with 100 short epochs, workers that are started again every epoch cost real time: "
                    "set persistent_workers=True")
    prefetch = kwargs.get("prefetch_factor")
    if prefetch is not None and prefetch < 2:
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
