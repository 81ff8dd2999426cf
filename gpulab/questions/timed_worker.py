"""One side of a timed check, in a process of its own: ``python -m gpulab.questions.timed_worker``.

The parent (``gpulab.questions.timed_check``) sends a job as the first line of stdin: the task (``module:attribute``), the
side ("baseline" or "answer"), the answer's source and name, the CPU threads, and the number of the file
descriptor to report on. The worker builds the function, warms the device up, says "ready", then runs one
trial per ``{"seed": N}`` line, or the task's untimed ``probe`` per ``{"probe": name}`` line. Its reports are
JSON lines on that descriptor; whatever the answer prints goes to stderr, which the parent keeps for errors.
"""

import importlib
import json
import linecache
import os
import sys
import traceback

SOURCE_NAME = "<your function>"


class Events:
    """What a trial tells the parent while it runs; the parent reads the time of each on its own clock."""

    def __init__(self, channel):
        self._channel = channel

    def send(self, event: str, **info) -> None:
        self._channel.write(json.dumps({"event": event, **info}) + "\n")
        self._channel.flush()

    def mark(self, **info) -> None:
        """A moment inside the timed call (e.g. the start of an epoch)."""
        self.send("mark", **info)

    def done(self) -> None:
        """The timed call has returned and the device has finished its work: the clock stops here."""
        self.send("done")


def answer_function(source: str, name: str, namespace: dict):
    """Define the answer from its source in ``namespace`` (tracebacks show its lines) and return it."""
    linecache.cache[SOURCE_NAME] = (len(source), None, source.splitlines(True), SOURCE_NAME)
    exec(compile(source, SOURCE_NAME, "exec"), namespace)
    return namespace[name]


def where(err: BaseException) -> str:
    """``Error: message (line N of function)``, at the deepest frame of the answer's own code if any."""
    frames = traceback.extract_tb(err.__traceback__)
    own = [f for f in frames if f.filename == SOURCE_NAME] or frames[-1:]
    place = f" (line {own[-1].lineno} of {own[-1].name})" if own else ""
    return f"{type(err).__name__}: {err}{place}"


def end_with_parent() -> None:
    """Be killed when the parent dies (Linux), even while suspended: a check's side never outlives its check."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def main() -> int:
    end_with_parent()
    job = json.loads(sys.stdin.readline())
    channel = os.fdopen(job["fd"], "w")
    os.dup2(2, 1)  # the answer's prints must not reach the report channel
    sys.stdout = sys.stderr
    events = Events(channel)
    try:
        import torch

        torch.set_num_threads(job["threads"])
        module, attribute = job["task"].split(":")
        task = getattr(importlib.import_module(module), attribute)
        if job["side"] == "baseline":
            fn = task.baseline
        else:
            fn = answer_function(job["source"], job["name"], task.namespace())
        task.warm_up()
    except Exception as err:  # the answer's definition failed (or the task could not start)
        events.send("error", message=where(err), kind=type(err).__name__, during="start")
        return 1
    events.send("ready")
    for line in sys.stdin:
        order = json.loads(line)
        try:
            if "probe" in order:  # untimed: what the function does, observed (see the task's probe)
                report = task.probe(fn, order["probe"])
            else:
                report = task.trial(fn, order["seed"], events)
        except Exception as err:
            events.send("error", message=where(err), kind=type(err).__name__, during="trial")
            continue
        events.send("report", report=report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
