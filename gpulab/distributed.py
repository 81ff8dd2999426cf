"""More than one process: launching ``torchrun`` from a notebook, collective bandwidth, and how DDP scales.

- ``torchrun(script, nproc=2)`` starts a script written with ``%%writefile`` under torchrun, shows each rank's
  output as it comes, stops every process it started at a time limit (or when the cell is interrupted) and
  says which rank failed and why, instead of hanging.
- ``rank_counts`` and ``work_size`` say how many ranks a lesson runs and how much work each gets: CPU-sized
  work for gloo processes on the CPU whatever GPU the machine has.
- ``interleaved`` times configurations in short blocks, in alternating order (A B B A ...), inside a launched
  script: its pairs go to ``gpulab.Comparison.of``.
- ``bus_bandwidth`` follows nccl-tests' conventions; ``fit_link`` reads a link's latency and bandwidth off
  measured all-reduce times.
- ``ddp_step_seconds`` and ``scaling_table`` are the scaling model: a step is its compute time, plus DDP's own
  work, plus an all-reduce of the gradients over a ``Link`` (a flat ring) or a ``Topology`` (NVLink inside a
  node, a network between nodes), minus the part of it hidden behind the backward pass. Its lines are estimates.
"""

import json
import math
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from .mode import quick_mode
from .processes import end_tree
from .results import results_dir

RESULT = "RESULT "  # a script prints `RESULT {json}` lines: the rows `Run.results()` returns
_RANK_PREFIX = re.compile(r"^\[[A-Za-z_]*(\d+)\]:(.*)$")  # torchrun --tee prefixes each line with [default<rank>]:
_RANK_TAG = re.compile(r"^\[rank\d+\]: ?")  # torch tags an uncaught exception's lines with [rank<N>]:
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b.*")
_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid: \d+\))?\s*(.*)")


def scratch_dir(name: str = "07_multi_gpu") -> Path:
    """A git-ignored folder for the scripts a notebook writes (``build/<name>`` next to ``results/``)."""
    path = results_dir().parent / "build" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    """A TCP port that is free on this machine right now (the operating system picks it)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextmanager
def child_stderr():
    """Within the block, what this process and its children write to file descriptor 2 goes to a file; the
    object yielded gets it as ``.text`` at the end. A notebook never shows its kernel's own stderr, where the
    children of ``mp.spawn`` write their errors."""
    captured = SimpleNamespace(text="")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            captured.text = file.read().decode(errors="replace")


class LaunchFailed(RuntimeError):
    """A torchrun launch failed or ran past its time limit; the message says which rank and why."""


class BadResult(ValueError):
    """A rank printed a ``RESULT`` line that is not a JSON object; the message says which rank and line."""


def _shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass
class Run:
    """One torchrun launch: what each rank printed, and how it ended."""

    script: Path
    command: list[str]
    nproc: int
    time_limit: float
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    lines: list[tuple[int | None, str]] = field(default_factory=list)  # (rank, or None for torchrun itself; text)
    stdout: dict[int, str] = field(default_factory=dict)  # each rank's whole stdout, from torchrun's log files

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def output(self, rank: int | None) -> str:
        """Everything rank ``rank`` printed (``None``: torchrun's own messages)."""
        return "\n".join(text for r, text in self.lines if r == rank)

    def results(self, rank: int | None = 0) -> list[dict]:
        """The rows a rank printed as ``RESULT {json}`` lines (all ranks' with ``rank=None``).

        Read from each rank's own stdout file: torchrun's merged output can split or join the lines of
        ranks printing at the same moment.
        """
        ranks = sorted(self.stdout) if rank is None else [rank]
        rows = []
        for r in ranks:
            for number, line in enumerate(self.stdout.get(r, "").splitlines(), 1):
                if not line.startswith(RESULT):
                    continue
                try:
                    row = json.loads(line[len(RESULT):])
                except json.JSONDecodeError as error:
                    raise BadResult(f"{self.script.name}: rank {r}'s line {number} starts with {RESULT.strip()!r} but "
                                    f"the rest is not JSON ({error.msg}): {_shorten(line)!r}. Print rows with "
                                    'print("RESULT", json.dumps(row)), one row per line.') from None
                if not isinstance(row, dict):
                    raise BadResult(f"{self.script.name}: rank {r}'s line {number} holds a JSON "
                                    f"{type(row).__name__}, not an object: {_shorten(line)!r}. A row is a dict: "
                                    'print("RESULT", json.dumps({"name": value, ...})).')
                rows.append(row)
        return rows

    def failed_rank(self) -> int | None:
        """The rank torchrun names as the root cause of a failure, else the first rank that printed an error."""
        launcher = self.output(None).splitlines()
        for i, line in enumerate(launcher):
            if "Root Cause" in line:
                for later in launcher[i:]:
                    match = _ROOT_CAUSE_RANK.match(later)
                    if match:
                        return int(match.group(1))
        return next((r for r in range(self.nproc) if self.error(r)), None)

    def error(self, rank: int) -> str | None:
        """The last exception line rank ``rank`` printed (``ValueError: ...``), if any."""
        errors = [text for r, text in self.lines if r == rank and _ERROR_LINE.match(text)]
        return errors[-1] if errors else None

    def failure(self) -> str | None:
        """One line on what went wrong, or None when every rank finished cleanly."""
        if self.timed_out:
            return (f"ran past its time limit of {self.time_limit:g} s: torchrun and all {self.nproc} ranks were "
                    "stopped. A rank waiting forever for a peer (a collective that not every rank calls) looks like this.")
        if self.returncode == 0:
            return None
        rank = self.failed_rank()
        if rank is None:
            tail = [line for line in self.output(None).splitlines() if line.strip()][-1:] or ["no output"]
            return f"torchrun exited with status {self.returncode}: {tail[0].strip()}"
        return f"rank {rank} failed: {self.error(rank) or self._crash(rank)}"

    def _crash(self, rank: int) -> str:
        """A rank that died without a Python exception: its exit code (a signal) and the last line it printed."""
        exits = [m for line in self.output(None).splitlines() if (m := _ROOT_CAUSE_EXIT.match(line))]
        said = [line for line in self.output(rank).splitlines() if line.strip()]
        how = f"exit code {exits[-1].group(1)} {exits[-1].group(2)}".strip() if exits else "no error message"
        return how + (f", after printing {said[-1].strip()!r}" if said else " (killed? out of memory?)")

    def raise_for_failure(self) -> "Run":
        """Raise LaunchFailed with ``failure()`` unless the run succeeded; returns the run."""
        if not self.ok:
            raise LaunchFailed(f"{self.script.name}: {self.failure()}")
        return self

    def __repr__(self) -> str:
        state = "ok" if self.ok else self.failure()
        return f"<Run of {self.script.name} on {self.nproc} ranks: {state} ({self.seconds:.1f} s)>"


def torchrun(script: str | Path, *args, nproc: int = 2, time_limit: float = 120.0, env: dict | None = None,
             echo: bool = True) -> Run:
    """Run ``torchrun --standalone --nproc-per-node=nproc script args...`` and wait for it, at most ``time_limit`` s.

    ``--standalone`` picks a free port for the rendezvous. Each rank's lines are printed as they arrive, as
    ``[rank N] ...`` (not the ``RESULT`` lines: ``Run.results()`` returns those, read from the ranks' log
    files). torchrun starts every rank in a session of its own, so at the time limit, or when the cell is
    interrupted, every process of the launch is killed, torchrun's children included. ``env`` adds environment
    variables (e.g. ``CUDA_VISIBLE_DEVICES``).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, (int, np.integer)) or nproc < 1:
        raise ValueError(f"nproc is how many processes (ranks) to start, a whole number of 1 or more; got {nproc!r}")
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float, np.number)) or not time_limit > 0:
        raise ValueError(f"time_limit is in seconds and must be positive; got {time_limit!r}")
    script = Path(script)
    if not script.exists():
        raise FileNotFoundError(f"{script} does not exist: run the %%writefile cell that writes it first")
    logs = Path(tempfile.mkdtemp(prefix="torchrun-"))  # each rank's stdout and stderr, whole
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--log-dir={logs}", "--redirects=3", "--tee=3", str(script), *map(str, args)]
    run = Run(script=script, command=command, nproc=nproc, time_limit=time_limit)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    start = time.perf_counter()
    try:
        while proc.poll() is None:
            if time.perf_counter() - start > time_limit:
                run.timed_out = True
                break
            _drain(lines, run, echo, wait=0.1)
    finally:
        if proc.poll() is None:  # the time limit, or the cell was interrupted
            _kill_tree(proc)
        run.seconds = time.perf_counter() - start
        reader.join(timeout=5)
        _drain(lines, run, echo, wait=0)
        run.returncode = None if run.timed_out else proc.returncode
        for path in logs.glob("*/attempt_*/*/stdout.log"):  # <run id>/attempt_<n>/<local rank>/
            run.stdout[int(path.parent.name)] = path.read_text(errors="replace")
        shutil.rmtree(logs, ignore_errors=True)
    if echo and not run.ok:
        print(f"✗ {script.name}: {run.failure()}")
    return run


# ----- how many ranks, how much work, and timing inside a launched script ----------------------------


def rank_counts(gpus: int) -> list[int]:
    """The rank counts a lesson runs: 1, 2, 4, 8, ... and every GPU of the machine (3, 5, 6 or 7 too), so that
    the largest run uses the GPUs DataParallel uses; ``[1, 2]`` (gloo processes on the CPU) below two GPUs."""
    if isinstance(gpus, bool) or not isinstance(gpus, (int, np.integer)) or gpus < 0:
        raise ValueError(f"gpus is a number of GPUs, a whole number of 0 or more; got {gpus!r}")
    gpus = int(gpus)
    if gpus < 2:
        return [1, 2]
    counts = [1]
    while counts[-1] * 2 <= gpus:
        counts.append(counts[-1] * 2)
    return counts if counts[-1] == gpus else [*counts, gpus]


@dataclass(frozen=True)
class WorkSize:
    """How much work each rank of a lesson's launches does."""

    width: int  # of the WideMLP trained
    batch: int  # samples per rank and step
    rounds: int  # interleaved rounds of a timing: the pairs of each comparison
    calls: int  # steps per timed block
    max_bytes: int  # the largest collective timed
    iters: int = 100  # the most calls of a collective per timed round (the smallest messages; fewer for larger ones)

    def args(self) -> list:
        """The command-line arguments of lesson 07's DDP script for these sizes."""
        return ["--width", self.width, "--batch", self.batch, "--rounds", self.rounds, "--calls", self.calls]


CPU_WORK = WorkSize(width=512, batch=64, rounds=8, calls=2, max_bytes=2**24)
GPU_WORK = WorkSize(width=4096, batch=256, rounds=16, calls=5, max_bytes=2**30)
# Quick mode (CI, a 2-core CPU): the CPU's sizes, timed in the fewest pairs whose 90 % interval can still support a
# verdict (5), one step per block, and at most 20 calls per round of a collective.
QUICK_WORK = WorkSize(width=512, batch=64, rounds=5, calls=1, max_bytes=2**24, iters=20)


def work_size(device) -> WorkSize:
    """The work of ranks on ``device``: GPU sizes for CUDA ranks in full mode, CPU sizes otherwise, and in quick mode
    the CPU's sizes timed in fewer, shorter blocks.

    Sized by the backend, not by the machine: gloo processes on the CPU get CPU-sized work in full mode too (on a
    one-GPU machine the multi-rank runs are gloo on the CPU, and a GPU's sizes there take longer than a launch's
    time limit).
    """
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    kind = kind.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"work_size is for 'cpu' (gloo) or 'cuda' (NCCL) ranks; got {device!r}")
    if quick_mode():
        return QUICK_WORK
    return GPU_WORK if kind == "cuda" else CPU_WORK


def interleaved(fns: dict, *, rounds: int, calls: int = 1, warmup: int = 1, before=None, sync=None,
                clock=time.perf_counter) -> dict:
    """Seconds per call of each function, timed in ``rounds`` blocks of ``calls`` calls each, interleaved.

    Round r times the functions in order, round r+1 in reverse order (A B C, C B A, A B C, ...), so that a
    change in the machine's load hits every configuration alike, and block i of one function and block i of
    another are a pair for ``gpulab.Comparison.of``. Each function is called ``warmup`` times first. Before each
    block: ``sync()`` (e.g. ``torch.cuda.synchronize``), then ``before()`` (e.g. a barrier, so that the ranks
    start together); after the block's calls, ``sync()`` again before the clock is read.
    """
    if not fns:
        raise ValueError("interleaved() needs at least one function to time")
    for name, value in (("rounds", rounds), ("calls", calls)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of 1 or more; got {value!r}")
    sync = sync or (lambda: None)
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            sync()
            if before is not None:
                before()
            start = clock()
            for _ in range(calls):
                fns[name]()
            sync()
            times[name].append((clock() - start) / calls)
    return times


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    stream.close()


def _drain(lines: queue.Queue, run: Run, echo: bool, wait: float) -> None:
    """Move the lines read so far into ``run`` (waiting up to ``wait`` s for the first), printing each rank's."""
    try:
        text = lines.get(timeout=wait) if wait else lines.get_nowait()
    except queue.Empty:
        return
    while True:
        match = _RANK_PREFIX.match(text)
        rank, text = (int(match.group(1)), _RANK_TAG.sub("", match.group(2))) if match else (None, text)
        run.lines.append((rank, text))
        if echo and rank is not None and not text.startswith(RESULT):
            print(f"[rank {rank}] {text}", flush=True)
        try:
            text = lines.get_nowait()
        except queue.Empty:
            return


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun, every process it started (each rank leads a session of its own) and their groups."""
    end_tree(proc)
    proc.wait()


# ----- collectives: algorithm and bus bandwidth, the way nccl-tests reports them ----------------------

BUS_FACTORS = {  # nccl-tests, doc/PERFORMANCE.md: bus bandwidth = algorithm bandwidth × factor(n)
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _positive(name: str, value, *, zero: bool = False) -> float:
    """``value`` as a float, or a ValueError that names it: a finite number above 0 (or 0 with ``zero``)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number; got {value!r}") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero):
        raise ValueError(f"{name} must be a finite number {'of 0 or more' if zero else 'above 0'}; got {value!r}")
    return number


def _ranks(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n is the number of ranks, a whole number of 1 or more; got {n!r}")
    return int(n)


def bus_bandwidth(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bytes/s each rank's link carried: ``nbytes / seconds`` (the algorithm bandwidth) × nccl-tests' factor.

    ``nbytes`` is the size of the collective's largest buffer: the tensor for all_reduce and broadcast, the
    gathered output for all_gather, the input for reduce_scatter. It is comparable with the link's speed.
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}: use one of {', '.join(BUS_FACTORS)}")
    nbytes = _positive("nbytes", nbytes, zero=True)
    seconds = _positive("seconds (the time of one call)", seconds)
    return nbytes / seconds * BUS_FACTORS[op](_ranks(n))


@dataclass(frozen=True)
class Link:
    """A link between GPUs (or processes), as the scaling model sees it: every rank in one flat ring over it."""

    name: str
    bandwidth: float  # bytes/s each way, per GPU
    latency: float  # seconds per step of a ring
    source: str = ""  # where the figures come from

    def crossover_bytes(self, n: int) -> float:
        """The all-reduce size at which latency and bandwidth cost the same: below it, latency dominates."""
        return n * self.latency * self.bandwidth

    def allreduce_seconds(self, nbytes: float, n: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``n`` ranks on this link (``ring_allreduce_seconds``)."""
        return ring_allreduce_seconds(nbytes, n, self)

    def max_gpus(self) -> int | None:
        return None


# Nominal figures: bandwidth from the vendors' specifications; latency per ring step is an assumed order of
# magnitude (vendors do not publish it): it only matters for small gradients.
PCIE4 = Link("PCIe 4.0 x16", 31.5e9, 5e-6, "vendor spec: 16 GT/s × 16 lanes = 31.5 GB/s each way; latency assumed")
NVLINK4 = Link("NVLink 4 (H100 SXM)", 450e9, 5e-6,
               "vendor spec: 900 GB/s per GPU, both ways together; latency assumed")
INFINIBAND_NDR = Link("InfiniBand NDR, one 400 Gb/s port per GPU", 50e9, 10e-6,
                      "vendor spec: 400 Gb/s = 50 GB/s each way; latency assumed")
ETHERNET_100G_PER_8 = Link("100 Gb/s Ethernet, one port per node of 8 GPUs", 12.5e9 / 8, 30e-6,
                           "vendor spec: 100 Gb/s = 12.5 GB/s each way, shared by the node's 8 GPUs; latency "
                           "assumed (TCP sockets)")
VENDOR_LINKS = (PCIE4, NVLINK4, INFINIBAND_NDR)


@dataclass(frozen=True)
class Topology:
    """GPUs in nodes: ``gpus_per_node`` of them joined by ``intra`` (NVLink, PCIe), nodes joined by ``inter`` (each
    GPU's share of the network: one InfiniBand port per GPU, or a node's Ethernet shared by its GPUs); ``inter``
    None: one node only, and no more GPUs than it holds.

    An all-reduce across nodes is estimated hierarchically, the way NCCL's rings and trees avoid sending every
    byte over the slow link: a reduce-scatter inside each node, an all-reduce of each GPU's 1/``gpus_per_node``
    share between the nodes (every GPU over its own share of the network, at once), an all-gather inside each
    node. The reduce-scatter and the all-gather together cost a ring all-reduce inside the node.
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link | None = None
    source: str = ""

    def __post_init__(self):
        _ranks(self.gpus_per_node)

    def max_gpus(self) -> int | None:
        """The most GPUs this topology has: one node's without a network between nodes, else no limit."""
        return self.gpus_per_node if self.inter is None else None

    def fits(self, n: int) -> bool:
        """Whether ``n`` GPUs is a configuration of this topology: one node's or fewer, else whole nodes."""
        n = _ranks(n)
        if n <= self.gpus_per_node:
            return True
        return self.inter is not None and n % self.gpus_per_node == 0

    def allreduce_seconds(self, nbytes: float, n: int) -> float:
        """An all-reduce of ``nbytes`` over ``n`` GPUs: a ring inside one node, hierarchical across nodes."""
        n, g = _ranks(n), self.gpus_per_node
        if n <= g:
            return ring_allreduce_seconds(nbytes, n, self.intra)
        if self.inter is None:
            raise ValueError(f"{self.name}: one node of {g} GPUs and no network between nodes; {n} GPUs is not one "
                             "of its configurations")
        if n % g:
            raise ValueError(f"{self.name}: {n} GPUs is not a whole number of nodes of {g}")
        return ring_allreduce_seconds(nbytes, g, self.intra) + ring_allreduce_seconds(nbytes / g, n // g, self.inter)


TOPOLOGIES = (
    Topology("H100 SXM nodes: NVLink 4 inside 8, InfiniBand NDR between", 8, NVLINK4, INFINIBAND_NDR,
             "an H100 SXM NVLink domain is one node of 8 GPUs (DGX/HGX H100), one 400 Gb/s port per GPU"),
    Topology("PCIe 4.0 nodes of 8 GPUs, 100 Gb/s Ethernet between", 8, PCIE4, ETHERNET_100G_PER_8,
             "8 GPUs on PCIe 4.0 x16 without NVLink, one 100 Gb/s port per node"),
    Topology("a workstation: 4 GPUs on PCIe 4.0, no network", 4, PCIE4, None, "one machine, nothing between machines"),
)


def ring_allreduce_seconds(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n−1) steps, each sending nbytes/n over ``link``."""
    nbytes, n = _positive("nbytes", nbytes, zero=True), _ranks(n)
    if n < 2:
        return 0.0
    steps = 2 * (n - 1)
    return steps * link.latency + steps / n * nbytes / link.bandwidth


def fit_link(nbytes, seconds, n: int, name: str = "measured") -> Link:
    """The Link whose ring all-reduce times best match measured ones (least squares on relative error)."""
    try:
        nbytes, seconds = np.asarray(nbytes, float).ravel(), np.asarray(seconds, float).ravel()
    except (TypeError, ValueError):
        raise ValueError("fit_link needs numbers: message sizes in bytes and their times in seconds") from None
    n = _ranks(n)
    if len(nbytes) != len(seconds):
        raise ValueError(f"fit_link needs one time per message size; got {len(nbytes)} sizes and {len(seconds)} times")
    if n < 2 or len(nbytes) < 2:
        raise ValueError("fitting a link needs all-reduce times at two sizes or more, on two ranks or more")
    if not (np.isfinite(seconds).all() and (seconds > 0).all()):
        raise ValueError(f"every all-reduce time must be a finite number of seconds above 0; got {seconds.tolist()}")
    if not (np.isfinite(nbytes).all() and (nbytes > 0).all()) or len(set(nbytes.tolist())) < 2:
        raise ValueError("fit_link needs message sizes above 0 bytes, at least two different ones; got "
                         f"{nbytes.tolist()}")
    steps = 2 * (n - 1)
    design = np.column_stack([np.full_like(nbytes, steps), steps / n * nbytes]) / seconds[:, None]
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    if latency < 0:  # noise on a latency too small to see: refit the bandwidth alone
        latency, inverse_bandwidth = 0.0, float(np.sum(design[:, 1]) / np.sum(design[:, 1] ** 2))
    if inverse_bandwidth <= 0:
        raise ValueError("the all-reduce times do not grow with the message size, so no bandwidth can be read off "
                         "them: time larger messages (MiB and up), where the bytes cost more than the latency")
    return Link(name, 1 / inverse_bandwidth, float(latency), f"fitted to {len(nbytes)} all-reduce timings, {n} ranks")


# ----- the scaling model ------------------------------------------------------------------------------


def ddp_step_seconds(compute_s: float, grad_bytes: float, n: int, link, overlap: float = 0.0,
                     overhead_s: float = 0.0) -> float:
    """An estimate of one data-parallel training step on ``n`` GPUs: compute + DDP's own work + the all-reduce of
    the gradients over ``link`` (a ``Link``: one flat ring; a ``Topology``: nodes) − what of it is hidden.

    ``overlap`` is the fraction of the compute time the all-reduce can run alongside: 0 when it starts after
    the backward pass; DDP all-reduces each bucket as soon as its gradients are ready, so up to the backward
    pass's share of a step (about 2/3). ``overhead_s`` is DDP's own work per step (copying gradients into its
    buckets and back, hooks), measured on one rank as its step time less the same step inside ``no_sync()``.
    """
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap is a fraction of the compute time, from 0 to 1; got {overlap}")
    compute_s = _positive("compute_s", compute_s, zero=True)
    overhead_s = _positive("overhead_s", overhead_s, zero=True)
    comm = link.allreduce_seconds(grad_bytes, n)
    return compute_s + overhead_s + comm - min(comm, overlap * compute_s)


def scaling_table(compute_s: float, grad_bytes: float, gpus, links=TOPOLOGIES, overlap: float = 0.0,
                  overhead_s: float = 0.0) -> pd.DataFrame:
    """Estimated step time, communication time, speed-up and scaling efficiency for each link or topology and GPU
    count (a topology's rows only for the counts it has: whole nodes, no more than one node without a network).

    Weak scaling, each GPU with the same batch: efficiency = step(1) / step(n), speed-up = n × efficiency.
    """
    rows = []
    for link in links:
        one = ddp_step_seconds(compute_s, grad_bytes, 1, link, overlap, overhead_s)
        for n in gpus:
            if isinstance(link, Topology) and not link.fits(n):
                continue
            step = ddp_step_seconds(compute_s, grad_bytes, n, link, overlap, overhead_s)
            rows.append({"link": link.name, "gpus": n, "compute_s": compute_s, "overhead_s": overhead_s,
                         "comm_s": link.allreduce_seconds(grad_bytes, n), "step_s": step,
                         "speedup": n * one / step, "efficiency": one / step, "overlap": overlap})
    return pd.DataFrame(rows)
