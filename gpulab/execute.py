"""Running a notebook headless in a fresh kernel (for `gpulab course` and `gpulab grade`)."""

import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
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


def run_notebook(path: Path, *, cell_timeout: int = 900, env: dict | None = None) -> Run:
    """Execute ``path`` top to bottom in a new kernel started in the notebook's folder; stop at the first error."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(Path(path).parent)}})
    start = time.perf_counter()
    try:
        client.execute(**({"env": env} if env else {}))
        error = None
    except CellExecutionError:
        error = first_error(nb) or "a cell raised an error"
    except CellTimeoutError:
        error = f"a cell ran longer than {cell_timeout} s"
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
