"""Graded speed-ups timed where the answer cannot reach the clock or the baseline.

A check that times a learner's function against a baseline runs each side in a fresh process of its own
(``gpulab.questions.timed_worker``), one thread each by default: the answer travels as source (``gpulab.questions.portable``),
never as an object of the notebook. The parent sends "run trial N" to one side at a time and times it on its
own clock, from the order to the side's "done" (and to any "mark" in between, such as an epoch's start). The
side that is not running is suspended, its children with it, so that nothing it left behind (a thread, a
process) competes with the other side's trial. What was computed comes back as a report that the check
verifies in this process: a timed trial that computed the wrong thing fails however fast it was.

    with Duel("gpulab.questions.lesson06:TASK", source_of(fast_epoch), "fast_epoch") as duel:
        trials = duel.pairs(seeds=[1, 2, 3])    # [(baseline trial, answer trial), ...], order alternated

Trust: the clock, the baseline and the expected values are out of the answer's reach. What a side reports
about its own run (samples counted by hooks, say) is written by the check's code in the answer's process:
it catches honest mistakes and casual cheats, not an answer that rewrites the check's code in its own
process; the README's trust model says so.
"""

import base64
import io
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .. import conditions, processes
from ..check import Wrong

SIDES = ("baseline", "answer")
_clock = time.perf_counter  # bound now: a notebook that later patches time.perf_counter does not reach it


@dataclass
class Trial:
    """One timed call on one side: seconds from the order to "done", the marks in between, and the report."""

    side: str
    seed: int
    seconds: float
    marks: list[tuple[float, dict]] = field(default_factory=list)  # (seconds after the order, what the side said)
    report: dict = field(default_factory=dict)


class Side:
    """One side's process: started suspended between trials, ended with all its children."""

    def __init__(self, task: str, side: str, source: str | None, name: str | None, threads: int, folder: str):
        read, write = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen([sys.executable, "-m", "gpulab.questions.timed_worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(write,),
                                        cwd=folder, env=env, start_new_session=True)
        os.close(write)
        self.side, self.messages, self.stderr = side, queue.Queue(), deque(maxlen=40)
        threading.Thread(target=self._read, args=(os.fdopen(read, "r"),), daemon=True).start()
        threading.Thread(target=self._keep_stderr, daemon=True).start()
        job = {"task": task, "side": side, "source": source, "name": name, "threads": threads, "fd": write}
        self._send(job)

    def wait_ready(self, time_limit: float) -> None:
        self._next(time_limit, "start", expect="ready")
        self.suspend()

    def trial(self, seed: int, time_limit: float) -> Trial:
        """Run one trial: resume, order it, time it until "done", read its report, suspend again."""
        self.resume()
        start = _clock()
        self._send({"seed": seed})
        marks, seconds = [], None
        while True:
            arrived, message = self._next(time_limit - (_clock() - start), f"trial {seed}")
            if message["event"] == "mark":
                marks.append((arrived - start, message))
            elif message["event"] == "done" and seconds is None:
                seconds = arrived - start
            elif message["event"] == "report":
                break
        self.suspend()
        if seconds is None:
            raise Wrong(f"the {self.side}'s trial reported without saying when its timed call ended")
        return Trial(self.side, seed, seconds, marks, message["report"])

    def probe(self, name: str, time_limit: float) -> dict:
        """The task's untimed report ``name`` on this side's function (what it does, observed there)."""
        self.resume()
        self._send({"probe": name})
        _, message = self._next(time_limit, f"probe {name}", expect="report")
        self.suspend()
        return message["report"]

    def _next(self, time_limit: float, during: str, expect: str | None = None) -> tuple[float, dict]:
        try:
            arrived, message = self.messages.get(timeout=max(time_limit, 0.01))
        except queue.Empty:
            raise Wrong(f"the {self.side} ran past the check's time limit ({during})") from None
        if message is None:
            tail = " | ".join(list(self.stderr)[-3:]) or "no output"
            raise Wrong(f"the {self.side}'s process ended unexpectedly ({during}): {tail}")
        if message.get("event") == "error":
            if message.get("kind") == "NotImplementedError" and self.side == "answer":
                raise NotImplementedError  # a blank exercise: "not attempted"
            raise Wrong(f"{'your function' if self.side == 'answer' else 'the baseline'} raised "
                        f"{message.get('message')}")
        if expect and message.get("event") != expect:
            raise Wrong(f"the {self.side}'s process said {message.get('event')!r} instead of {expect!r}")
        return arrived, message

    def _send(self, message: dict) -> None:
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the process has ended; its reader says so

    def _read(self, channel) -> None:
        for line in channel:
            arrived = _clock()
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self.messages.put((arrived, message))
        self.messages.put((_clock(), None))

    def _keep_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line.decode(errors="replace").rstrip()[:300])

    def suspend(self) -> None:
        processes.each(processes.tree(self.process), "suspend")

    def resume(self) -> None:
        processes.each(processes.tree(self.process), "resume")

    def close(self) -> None:
        """Kill the process and every process it started, and wait until they are gone (a killed child runs until
        the scheduler next lets it exit)."""
        processes.end_tree(self.process, wait_s=10)
        self.process.wait()


class Duel:
    """A baseline and an answer, each in its own process, timed by this one (a context manager)."""

    def __init__(self, task: str, source: str, name: str, *, threads: int = 1, start_limit: float = 300,
                 trial_limit: float = 300, sides=SIDES):
        self.task, self.source, self.name, self.threads = task, source, name, threads
        self.start_limit, self.trial_limit, self.wanted = start_limit, trial_limit, sides
        self.sides: dict[str, Side] = {}

    def __enter__(self) -> "Duel":
        self._folder = tempfile.mkdtemp(prefix="gpulab-timed-")
        try:
            for side in self.wanted:  # all start at once: importing torch takes seconds
                source, name = (self.source, self.name) if side == "answer" else (None, None)
                self.sides[side] = Side(self.task, side, source, name, self.threads, self._folder)
            for side in self.sides.values():
                side.wait_ready(self.start_limit)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for side in self.sides.values():
            side.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def trial(self, side: str, seed: int) -> Trial:
        return self.sides[side].trial(seed, self.trial_limit)

    def probe(self, side: str, name: str) -> dict:
        return self.sides[side].probe(name, self.trial_limit)

    def pairs(self, seeds) -> list[tuple[Trial, Trial]]:
        """One baseline and one answer trial per seed, alternating which goes first."""
        done = []
        for i, seed in enumerate(seeds):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            trials = {side: self.trial(side, seed) for side in order}
            done.append((trials["baseline"], trials["answer"]))
        return done


def loaded_machine() -> str | None:
    """A sentence when the machine was unfit to time on (an oversubscribed CPU, a throttled GPU), else None."""
    caveats = conditions.snapshot().caveats()
    if caveats:
        return (f"{'; '.join(caveats)} while the check ran: timings are less steady; if the verdict surprises you, "
                "run the check again on a quieter machine")
    return None


def pack_state(module: torch.nn.Module) -> str:
    """A module's state_dict on the CPU, as text a report can carry."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def unpack_state(text: str) -> dict:
    """The state_dict ``pack_state`` wrote (tensors only: nothing else is unpickled)."""
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
