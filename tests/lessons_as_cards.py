"""Run a whole lesson notebook in a fresh kernel on this CPU playing a named card (tests/cuda_stand_in.py), in quick
mode: the lesson's GPU branches for that card (a T4's fp16 and GradScaler, its refused SDPA backends, no FP8, no GPM)
run top to bottom. It proves the Python around torch.cuda's calls, never the GPU."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from .cuda_stand_in import CARDS

ROOT = Path(__file__).resolve().parents[1]


def first_cell(card: str) -> str:
    """The cell that makes the kernel play ``card`` before the lesson's own setup cell runs."""
    return (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.cuda_stand_in import install\n"
            f"install({card!r})")


def run_as(notebook: Path, card: str, *, timeout: int = 600) -> nbformat.NotebookNode:
    """Execute ``notebook`` whole as ``card``, in quick mode; the executed notebook, or an AssertionError naming the
    code cell that failed and its error, or saying that the lesson did not plan for ``card`` (``planned_for``)."""
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(first_cell(card)))
    env = {**os.environ, "GPULAB_QUICK": "1", "MPLBACKEND": "Agg"}
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}})
    try:
        client.execute(env=env)  # the kernel's environment (a keyword of the kernel manager's start, not the client's)
    except CellExecutionError as err:
        code = [c for c in nb.cells[1:] if c.cell_type == "code"]  # the lesson's own, without the stand-in's first cell
        failed = next((i for i, c in enumerate(code) if any(o.get("output_type") == "error" for o in c.get("outputs", []))),
                      None)
        raise AssertionError(f"{notebook.name} as {card}: code cell {failed} of the lesson failed:\n{err}") from None
    planned_for(nb, card)
    return nb


def planned_for(nb: nbformat.NotebookNode, card: str) -> str:
    """The card line the lesson's plan cell printed, asserted to name ``card`` and its architecture as the stand-in
    plays them, with the dense peaks of its datasheet's precisions (a bf16 peak only from sm_80: a T4's 16-bit
    precision is fp16). A stand-in that stopped taking effect in the kernel plans for the CPU, and fails here."""
    played = CARDS[card]
    cell = next(c for c in nb.cells if c.cell_type == "code" and "plans.lesson(" in c.source)
    printed = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    line = next((line for line in printed.splitlines() if "planned for " in line), "")
    assert f"planned for {card} (sm_{played.major}{played.minor}, " in line, f"the plan cell printed: {printed[:300]!r}"
    assert ("bf16 " in line) == (played.major >= 8) and "fp16 " in line, line
    return line
