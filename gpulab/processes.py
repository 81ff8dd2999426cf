"""A process and everything it started, as one thing to suspend, resume or end.

torchrun's ranks, a timed check's sides, a notebook's kernel and a verification part each start processes of their
own, some in sessions of their own (a rank, a daemon): ending the one process leaves them running. ``end_tree`` ends
the whole tree, and the process groups its members lead (never this process's own), and waits until they are gone.
"""

import os
import signal
import subprocess
import time
from contextlib import suppress

import psutil


def tree(root: int | subprocess.Popen | psutil.Process) -> list[psutil.Process]:
    """``root`` and every process it started, children first in psutil's order; empty when ``root`` is gone."""
    try:
        process = root if isinstance(root, psutil.Process) else psutil.Process(getattr(root, "pid", root))
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def each(processes, action: str) -> None:
    """``action`` ("suspend", "resume", "kill") on each of ``processes``; one already gone is skipped."""
    for process in processes:
        with suppress(psutil.Error):
            getattr(process, action)()


def end_tree(root: int | subprocess.Popen | psutil.Process, *, keep_root: bool = False, wait_s: float = 5.0) -> bool:
    """Kill every process ``root`` started (and ``root``, unless ``keep_root``) and the process groups they lead, then
    wait up to ``wait_s`` seconds for them to go. True when all did (a zombie waiting for its parent counts as gone)."""
    doomed = tree(root)
    if keep_root:
        doomed = doomed[1:]
    own = os.getpgrp()
    for process in doomed:
        with suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) == process.pid != own:  # it leads a group: whatever stayed in it goes too
                os.killpg(process.pid, signal.SIGKILL)
    each(doomed, "kill")
    return wait_gone(doomed, wait_s)


def wait_gone(processes, wait_s: float = 5.0, own: subprocess.Popen | None = None) -> bool:
    """Wait up to ``wait_s`` seconds until ``processes`` are gone (a zombie waiting for its parent counts as gone;
    ``own``, this process's child among them, is reaped as it goes); True when they all are."""
    processes = list(processes)
    deadline = time.monotonic() + wait_s
    while True:
        if own is not None:
            own.poll()
        if not any(_running(p) for p in processes):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
