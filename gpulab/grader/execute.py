"""Running a notebook headless in a fresh kernel (for `gpulab course` and `gpulab grade`).

``run`` executes a notebook in this process. ``run_contained`` runs one in a worker process of its own
(``grade_worker.py``) inside a ``Group`` with every process the worker, its kernel and the notebook start, in any
session: a cgroup v2 folder of its own where this machine lets us make one, else the worker's process tree and
every process carrying the group's environment marker. When the notebook is done (or its time limit, Ctrl-C or
SIGTERM comes) the group is ended as a whole and the kernel's folder removed.

The kernel talks to us over local sockets (IPC) where the system has them: ipykernel warns on every start
when its connection is TCP without CurveZMQ keys, and a kernel on this machine needs neither. Elsewhere
(Windows) the connection stays TCP, encrypted with CurveZMQ where jupyter_client and pyzmq support it.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
import zmq
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

MARKER = "GPULAB_GROUP"  # environment variable that every process of a group inherits (unless it clears it)
WORKER = Path(__file__).with_name("grade_worker.py")
_MESSAGE_LIMIT = 500


@dataclass
class Run:
    notebook: nbformat.NotebookNode
    seconds: float
    error: str | None  # None when every cell ran

    @property
    def ok(self) -> bool:
        return self.error is None


class Stopped(Exception):
    """A run of several notebooks was stopped by Ctrl-C or SIGTERM; ``done`` is the table of those that finished."""

    def __init__(self, done, signal_name: str):
        super().__init__(f"stopped by {signal_name}")
        self.done, self.signal_name = done, signal_name


def run_notebook(path: Path, *, cell_timeout: int = 900, env: dict | None = None,
                 kernel_log: Path | None = None) -> Run:
    """Execute ``path`` top to bottom in a new kernel started in the notebook's folder; stop at the first error."""
    return run(nbformat.read(path, as_version=4), Path(path).parent, cell_timeout=cell_timeout, env=env,
               kernel_log=kernel_log)


def run(nb: nbformat.NotebookNode, cwd: Path, *, cell_timeout: float = 900, env: dict | None = None,
        quiet_kernel: bool = False, kernel_log: Path | None = None, kernel_folder: str | None = None,
        extra_arguments: list[str] = (), pass_fds: tuple[int, ...] = (), at_end: Callable | None = None) -> Run:
    """Execute ``nb`` (in place) in a new kernel started in ``cwd``; stop at the first error.

    What the kernel process itself writes to its stdout/stderr (not the cells' output, which the notebook keeps:
    C++ libraries' messages, a crash) goes to the file ``kernel_log``, or to /dev/null with ``quiet_kernel``.
    ``kernel_folder`` holds the kernel's sockets (default: a new folder, removed afterwards); ``extra_arguments``
    and ``pass_fds`` go to the kernel's command and process; ``at_end`` is called after the last cell, while the
    kernel still runs.
    """
    launch = {"cleanup_kc": True, **({"env": env} if env else {}), **({"pass_fds": pass_fds} if pass_fds else {})}
    if quiet_kernel:
        launch.update(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = len(nb.cells) - 1
    hook = (lambda cell, cell_index, **_: at_end() if cell_index == last else None) if at_end else None
    start = time.perf_counter()
    with _kernel_manager(kernel_folder) as km, open(kernel_log or os.devnull, "w") as log:
        if kernel_log:
            launch.update(stdout=log, stderr=log)
        client = NotebookClient(nb, km=km, timeout=cell_timeout, resources={"metadata": {"path": str(cwd)}},
                                extra_arguments=list(extra_arguments), on_cell_executed=hook)
        try:
            client.execute(**launch)
            error = None
        except CellExecutionError:
            error = first_error(nb) or "a cell raised an error"
        except CellTimeoutError:
            error = f"a cell ran longer than {cell_timeout:g} s"
        except DeadKernelError:
            error = "the kernel died (os._exit, a crash, or out of memory)"
    return Run(nb, time.perf_counter() - start, error)


def first_error(nb: nbformat.NotebookNode) -> str | None:
    """'cell N: Name: value' for the first cell whose output is an error, if any."""
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    for number, cell in enumerate(code_cells, 1):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"code cell {number}: {out.get('ename')}: {out.get('evalue')}".rstrip(": ")
    return None


def notebook_problem(data: bytes) -> str | None:
    """Why ``data`` is not a notebook nbformat can run, in one line (None when it is one)."""
    try:
        text = data.decode("utf-8")
        json.loads(text)
    except UnicodeDecodeError:
        return "the file is not UTF-8 text"
    except ValueError as err:
        return f"the file is not JSON ({err})"[:_MESSAGE_LIMIT]
    try:
        nbformat.validate(nbformat.reads(text, as_version=4))
    except Exception as err:  # nbformat raises many kinds (schema, version, missing keys)
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"the file is JSON but not a Jupyter notebook ({detail})"[:_MESSAGE_LIMIT]
    return None


def run_contained(job: dict, *, cwd: Path, env: dict, time_limit: float | None = None) -> tuple[dict, str | None]:
    """Run ``job`` (see grade_worker.py) in a worker process in a ``Group`` of its own; end the group and remove
    the kernel's folder afterwards, also on a time limit, Ctrl-C or SIGTERM. Returns (the worker's answer, None),
    or ({}, why there is none)."""
    answer_tag = f"{secrets.token_hex(16)}:"
    folder, group = kernel_folder(), Group()
    try:
        worker = group.start([sys.executable, str(WORKER)], cwd=cwd, env=env)
        job = {**job, "cwd": str(cwd), "kernel_folder": folder, "answer_tag": answer_tag, "group": group.where()}
        try:
            output, errors = worker.communicate(json.dumps(job).encode(), timeout=time_limit)
        except subprocess.TimeoutExpired:
            return {}, f"ran past the time limit of {time_limit:g} s"
    finally:
        with shielded():
            group.end()
            shutil.rmtree(folder, ignore_errors=True)
    answers = [line[len(answer_tag):] for line in output.decode(errors="replace").splitlines()
               if line.startswith(answer_tag)]
    try:
        return json.loads(answers[0]), None
    except (IndexError, ValueError):
        tail = errors.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {}, f"the worker that runs the notebook failed (exit {worker.returncode}): {tail[0][:_MESSAGE_LIMIT]}"


# ----- process groups ----------------------------------------------------------------------------------


class Group:
    """Processes started together and ended together, whichever session they moved to.

    In a cgroup v2 folder of its own (under this process's cgroup) where the machine allows it: every process
    started inside stays inside, and ``cgroup.kill`` ends them all at once. Elsewhere the group is the started
    process's tree plus every process whose environment carries the group's marker (``MARKER``): a process that
    clears its environment and leaves its parent's tree escapes that sweep.
    """

    def __init__(self):
        self.marker = secrets.token_hex(12)
        self.cgroup = _new_cgroup()
        self.process: subprocess.Popen | None = None

    def where(self) -> dict:
        """How a process of the group finds the others (``members``)."""
        return {"cgroup": str(self.cgroup) if self.cgroup else None, "marker": self.marker}

    def start(self, argv: list[str], *, cwd: Path, env: dict) -> subprocess.Popen:
        """Start the group's process (in a session of its own), with pipes for stdin, stdout and stderr."""
        self.process = subprocess.Popen(argv, cwd=cwd, env={**env, MARKER: self.marker}, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        if self.cgroup:
            try:  # before it reads its job, so before it can start anything
                (self.cgroup / "cgroup.procs").write_text(str(self.process.pid))
            except OSError:
                self.cgroup.rmdir()
                self.cgroup = None
        return self.process

    def end(self) -> None:
        """Kill every process of the group and remove its cgroup folder."""
        if not (self.cgroup and _kill_cgroup(self.cgroup, self.process)):
            self._sweep()
        if self.process:
            self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
                pipe.close()

    def _sweep(self) -> None:
        """Stop, then kill, the process's tree and the marked processes, until a pass finds none."""
        from .. import processes  # here, not above: the grade worker loads this file by path, without the package

        for _ in range(20):
            found = {p.pid: p for p in [*self._tree(), *members(None, self.marker)] if p.pid != os.getpid()}
            if not found:
                return
            processes.each(found.values(), "suspend")
            processes.each(found.values(), "kill")
            processes.wait_gone(found.values(), own=self.process)

    def _tree(self) -> list[psutil.Process]:
        from .. import processes

        if self.process is None or self.process.returncode is not None:
            return []
        return processes.tree(self.process)


def members(cgroup: str | None, marker: str) -> list[psutil.Process]:
    """The live processes of a group (see ``Group.where``): those in its cgroup, or those carrying its marker."""
    if cgroup:
        try:
            found = [psutil.Process(int(pid)) for pid in Path(cgroup, "cgroup.procs").read_text().split()]
        except (OSError, psutil.Error):
            found = []
    else:
        found = [p for p in psutil.process_iter() if _marked(p, marker)]
    return [p for p in found if _alive(p)]


def detached(cgroup: str | None, marker: str) -> list[str]:
    """The processes of this process's group that are not its descendants: started below it, then detached (a
    double fork, ``setsid``, a daemon). As "name (pid N)"."""
    me, found = os.getpid(), []
    for process in members(cgroup, marker):
        try:
            if process.pid != me and me not in {p.pid for p in process.parents()}:
                found.append(f"{process.name()} (pid {process.pid})")
        except psutil.Error:
            continue
    return found


def kernel_folder() -> str:
    """A new folder for a kernel's sockets, on a path short enough for them (~100 bytes at most)."""
    folder = temp_folder("kernel")
    if len(folder) > 70 and os.path.isdir("/tmp"):
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix=f"gpulab-kernel-{os.getpid()}-", dir="/tmp")
    return folder


def temp_folder(kind: str) -> str:
    """A new temporary folder named after ``kind`` and this process (``clear_leftovers`` knows it by that)."""
    return tempfile.mkdtemp(prefix=f"gpulab-{kind}-{os.getpid()}-")


def clear_leftovers() -> None:
    """Remove what runs killed outright (SIGKILL) left behind: their groups' processes and cgroup folders, and
    their temporary folders. A leftover is known by the id of the process that made it, which no longer runs."""
    home = _cgroup_home()
    for folder in home.glob("gpulab-*-*") if home else []:
        if _dead(folder.name.split("-")[1]):
            _kill_cgroup(folder, None)
    for where in {tempfile.gettempdir(), "/tmp"}:
        for kind in ("kernel", "submission", "grade"):
            for folder in Path(where).glob(f"gpulab-{kind}-*-*"):
                if _dead(folder.name.split("-")[2]):
                    shutil.rmtree(folder, ignore_errors=True)


def containment() -> str:
    """How this machine contains a notebook's processes, in one line for instructors."""
    group = Group()
    how = ("each notebook runs in a cgroup of its own, ended whole when it is graded" if group.cgroup else
           "no cgroup can be made here: a notebook's processes are found by parent and by an environment marker "
           "(a process that clears its environment and detaches escapes; see the README)")
    group.end()
    return how


@contextmanager
def shielded():
    """Hold Ctrl-C and SIGTERM until the block is done (a clean-up must not be cut short), then raise
    KeyboardInterrupt for them. Only in the main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {s: signal.signal(s, lambda number, _: caught.append(number)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        if caught:
            raise KeyboardInterrupt("SIGTERM" if caught[0] == signal.SIGTERM else "")


def _cgroup_home() -> Path | None:
    """This process's cgroup v2 folder, where groups go; None without cgroup v2 (or outside its mount)."""
    try:
        mounts = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        path = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    for fields in mounts:
        if fields[fields.index("-") + 1] == "cgroup2" and path.startswith(fields[3]):
            home = Path(fields[4], path[len(fields[3]):].lstrip("/"))
            return home if home.is_dir() else None
    return None


def _new_cgroup() -> Path | None:
    """A new cgroup folder under this process's, if this process may create one, move processes into it and kill
    them (cgroup.kill: Linux 5.14 and later); else None."""
    home = _cgroup_home()
    if home is None or not os.access(home / "cgroup.procs", os.W_OK):
        return None
    folder = home / f"gpulab-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        folder.mkdir()
    except OSError:
        return None
    if not (folder / "cgroup.kill").exists():
        folder.rmdir()
        return None
    return folder


def _kill_cgroup(folder: Path, process: subprocess.Popen | None) -> bool:
    """Kill every process in the cgroup ``folder``, wait until it is empty, and remove it; False if it can't (not
    allowed, or not empty after 10 s)."""
    try:
        (folder / "cgroup.kill").write_text("1")
    except OSError:
        return False
    if process:
        process.wait()  # our own child: reaped at once
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            folder.rmdir()
            return True
        except OSError:  # still busy: a process takes a moment to die
            time.sleep(0.02)
    return False  # not empty after 10 s: the caller sweeps what is left


def _marked(process: psutil.Process, marker: str) -> bool:
    try:
        return process.environ().get(MARKER) == marker
    except psutil.Error:
        return False


def _alive(process: psutil.Process) -> bool:
    # processes._running's twin: members() runs in the grade worker, which loads this file without the package
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _dead(pid: str) -> bool:
    return pid.isdigit() and not psutil.pid_exists(int(pid))


@contextmanager
def _kernel_manager(folder: str | None = None):
    """A kernel manager for one kernel, connected over IPC sockets in a private folder where possible (``folder``,
    or a new one removed afterwards)."""
    if os.name != "posix":
        km = AsyncKernelManager(kernel_name="python3")
        if km.has_trait("transport_encryption") and zmq.has("curve"):
            km.transport_encryption = "auto"
        yield km
        return
    own = folder is None
    folder = kernel_folder() if own else folder
    try:
        yield AsyncKernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(folder, "kernel"))
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
