"""More than one process: launching ``torchrun`` from a notebook, collective bandwidth, and how DDP scales.

- ``torchrun(script, nproc=2)`` starts a script written with ``%%writefile`` under torchrun, shows each rank's
  output as it comes, stops every process it started at a time limit (or when the cell is interrupted) and
  says which rank failed and why, instead of hanging.
- ``bus_bandwidth`` follows nccl-tests' conventions; ``fit_link`` reads a link's latency and bandwidth off
  measured all-reduce times.
- ``ddp_step_seconds`` and ``scaling_table`` are the scaling model: a step is its compute time plus a ring
  all-reduce of the gradients, minus the part of it hidden behind the backward pass.
"""

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import psutil

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
        return [json.loads(line[len(RESULT):]) for r in ranks for line in self.stdout.get(r, "").splitlines()
                if line.startswith(RESULT)]

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
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    groups = set()
    for p in procs:
        with suppress(psutil.Error, ProcessLookupError):
            groups.add(os.getpgid(p.pid))
    groups.discard(os.getpgrp())  # never our own group
    for group in groups:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for p in procs:
        with suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=5)
    proc.wait()


# ----- collectives: algorithm and bus bandwidth, the way nccl-tests reports them ----------------------

BUS_FACTORS = {  # nccl-tests, doc/PERFORMANCE.md: bus bandwidth = algorithm bandwidth × factor(n)
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_bandwidth(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bytes/s each rank's link carried: ``nbytes / seconds`` (the algorithm bandwidth) × nccl-tests' factor.

    ``nbytes`` is the size of the collective's largest buffer: the tensor for all_reduce and broadcast, the
    gathered output for all_gather, the input for reduce_scatter. It is comparable with the link's speed.
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}: use one of {', '.join(BUS_FACTORS)}")
    return nbytes / seconds * BUS_FACTORS[op](n)


@dataclass(frozen=True)
class Link:
    """A link between GPUs (or processes), as the scaling model sees it."""

    name: str
    bandwidth: float  # bytes/s each way, per GPU
    latency: float  # seconds per step of a ring
    source: str = ""  # where the figures come from

    def crossover_bytes(self, n: int) -> float:
        """The all-reduce size at which latency and bandwidth cost the same: below it, latency dominates."""
        return n * self.latency * self.bandwidth


# Nominal figures: bandwidth from the vendors' specifications; latency per ring step is an assumed order of
# magnitude (vendors do not publish it): it only matters for small gradients.
VENDOR_LINKS = (
    Link("PCIe 4.0 x16", 31.5e9, 5e-6, "vendor spec: 16 GT/s × 16 lanes = 31.5 GB/s each way; latency assumed"),
    Link("NVLink 4 (H100 SXM)", 450e9, 5e-6, "vendor spec: 900 GB/s per GPU, both ways together; latency assumed"),
    Link("InfiniBand NDR, one 400 Gb/s port per GPU", 50e9, 10e-6,
         "vendor spec: 400 Gb/s = 50 GB/s each way; latency assumed"),
)


def ring_allreduce_seconds(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n−1) steps, each sending nbytes/n over ``link``."""
    if n < 2:
        return 0.0
    steps = 2 * (n - 1)
    return steps * link.latency + steps / n * nbytes / link.bandwidth


def fit_link(nbytes, seconds, n: int, name: str = "measured") -> Link:
    """The Link whose ring all-reduce times best match measured ones (least squares on relative error)."""
    nbytes, seconds = np.asarray(nbytes, float), np.asarray(seconds, float)
    if n < 2 or len(nbytes) < 2:
        raise ValueError("fitting a link needs all-reduce times at two sizes or more, on two ranks or more")
    steps = 2 * (n - 1)
    design = np.column_stack([np.full_like(nbytes, steps), steps / n * nbytes]) / seconds[:, None]
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    if latency < 0:  # noise on a latency too small to see: refit the bandwidth alone
        latency, inverse_bandwidth = 0.0, float(np.sum(design[:, 1]) / np.sum(design[:, 1] ** 2))
    return Link(name, 1 / inverse_bandwidth, float(latency), f"fitted to {len(nbytes)} all-reduce timings, {n} ranks")


# ----- the scaling model ------------------------------------------------------------------------------


def ddp_step_seconds(compute_s: float, grad_bytes: float, n: int, link: Link, overlap: float = 0.0) -> float:
    """One data-parallel training step on ``n`` GPUs: compute + ring all-reduce of the gradients − what is hidden.

    ``overlap`` is the fraction of the compute time the all-reduce can run alongside: 0 when it starts after
    the backward pass; DDP all-reduces each bucket as soon as its gradients are ready, so up to the backward
    pass's share of a step (about 2/3).
    """
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap is a fraction of the compute time, from 0 to 1; got {overlap}")
    comm = ring_allreduce_seconds(grad_bytes, n, link)
    return compute_s + comm - min(comm, overlap * compute_s)


def scaling_table(compute_s: float, grad_bytes: float, gpus, links=VENDOR_LINKS, overlap: float = 0.0) -> pd.DataFrame:
    """Predicted step time, communication time, speed-up and scaling efficiency for each link and GPU count."""
    rows = []
    for link in links:
        for n in gpus:
            step = ddp_step_seconds(compute_s, grad_bytes, n, link, overlap)
            rows.append({"link": link.name, "gpus": n, "compute_s": compute_s,
                         "comm_s": ring_allreduce_seconds(grad_bytes, n, link), "step_s": step,
                         "speedup": n * compute_s / step, "efficiency": compute_s / step, "overlap": overlap})
    return pd.DataFrame(rows)
