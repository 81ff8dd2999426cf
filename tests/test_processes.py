"""Ending a process and everything it started (gpulab.processes): one helper for torchrun's ranks, a timed check's
sides, a notebook's kernel and a verification part. Real processes; the waits are generous and polled."""

import subprocess
import sys
import time

import psutil

from gpulab import processes

# A parent that starts a child in its own session (as a rank or a daemon is) and a plain child, then waits.
FAMILY = """
import subprocess, time
subprocess.Popen(["sleep", "600"], start_new_session=True)
subprocess.Popen(["sleep", "600"])
time.sleep(600)
"""


def family() -> tuple[subprocess.Popen, list[psutil.Process]]:
    parent = subprocess.Popen([sys.executable, "-c", FAMILY])
    deadline = time.monotonic() + 120
    while len(processes.tree(parent)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = processes.tree(parent)
    assert len(members) == 3, members
    return parent, members


def eventually(condition, seconds: float = 60.0) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (a signal takes effect when the process is next scheduled)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def zombie_or_gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_ending_a_tree_ends_its_members_in_other_sessions_too():
    parent, members = family()
    assert processes.end_tree(parent, wait_s=60)
    parent.wait(timeout=60)
    assert not [p for p in members[1:] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_keep_root_ends_only_what_the_root_started():
    parent, members = family()
    try:
        assert processes.end_tree(parent, keep_root=True, wait_s=60)
        assert parent.poll() is None and all(zombie_or_gone(p) for p in members[1:])  # the sleeping root reaps none
    finally:
        processes.end_tree(parent, wait_s=60)
        parent.wait(timeout=60)


def test_a_tree_can_be_suspended_and_resumed_and_a_gone_one_is_empty():
    parent, members = family()
    try:
        processes.each(members, "suspend")
        assert eventually(lambda: all(p.status() == psutil.STATUS_STOPPED for p in members))
        processes.each(members, "resume")
        assert eventually(lambda: all(p.status() != psutil.STATUS_STOPPED for p in members))
    finally:
        processes.end_tree(parent, wait_s=60)
        parent.wait(timeout=60)
    assert processes.tree(parent.pid) == []
