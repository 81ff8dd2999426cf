"""Launching a script under ``torchrun`` from a notebook: each rank's output as it comes, every process it
started stopped at a time limit (or when the cell is interrupted), and which rank failed and why, instead of a hang.
"""

import json
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

from ..processes import end_tree
from ..results import results_dir

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


def record(name: str, frame, **extra) -> None:
    """Append each row of ``frame`` (a launch's results) to the results log ``name`` (``gpulab.ResultLog``), with
    ``extra``: its empty cells and its lists (each timed block's seconds; log their median) left out."""
    from ..results import ResultLog

    log = ResultLog(name)
    for row in frame.to_dict("records"):
        log.add(**{k: v for k, v in row.items() if not isinstance(v, list) and v == v and v is not None}, **extra)
