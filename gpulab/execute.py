"""Running a notebook headless in a fresh kernel (for `gpulab course` and `gpulab grade`).

The kernel talks to us over local sockets (IPC) where the system has them: ipykernel warns on every start
when its connection is TCP without CurveZMQ keys, and a kernel on this machine needs neither. Elsewhere
(Windows) the connection stays TCP, encrypted with CurveZMQ where jupyter_client and pyzmq support it.
"""

import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nbformat
import zmq
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError


@dataclass
class Run:
    notebook: nbformat.NotebookNode
    seconds: float
    error: str | None  # None when every cell ran

    @property
    def ok(self) -> bool:
        return self.error is None


def run_notebook(path: Path, *, cell_timeout: int = 900, env: dict | None = None,
                 kernel_log: Path | None = None) -> Run:
    """Execute ``path`` top to bottom in a new kernel started in the notebook's folder; stop at the first error."""
    return run(nbformat.read(path, as_version=4), Path(path).parent, cell_timeout=cell_timeout, env=env,
               kernel_log=kernel_log)


def run(nb: nbformat.NotebookNode, cwd: Path, *, cell_timeout: float = 900, env: dict | None = None,
        quiet_kernel: bool = False, kernel_log: Path | None = None) -> Run:
    """Execute ``nb`` (in place) in a new kernel started in ``cwd``; stop at the first error.

    What the kernel process itself writes to its stdout/stderr (not the cells' output, which the notebook keeps:
    C++ libraries' messages, a crash) goes to the file ``kernel_log``, or to /dev/null with ``quiet_kernel``.
    """
    launch = {"cleanup_kc": True, **({"env": env} if env else {})}
    if quiet_kernel:
        launch.update(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.perf_counter()
    with _kernel_manager() as km, open(kernel_log or os.devnull, "w") as log:
        if kernel_log:
            launch.update(stdout=log, stderr=log)
        client = NotebookClient(nb, km=km, timeout=cell_timeout, resources={"metadata": {"path": str(cwd)}})
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


@contextmanager
def _kernel_manager():
    """A kernel manager for one kernel, connected over IPC sockets in a private folder where possible."""
    if os.name != "posix":
        km = AsyncKernelManager(kernel_name="python3")
        if km.has_trait("transport_encryption") and zmq.has("curve"):
            km.transport_encryption = "auto"
        yield km
        return
    folder = tempfile.mkdtemp(prefix="gpulab-kernel-")
    if len(folder) > 70 and os.path.isdir("/tmp"):  # socket paths are limited to ~100 bytes
        shutil.rmtree(folder)
        folder = tempfile.mkdtemp(prefix="gpulab-kernel-", dir="/tmp")
    try:
        yield AsyncKernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(folder, "kernel"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
