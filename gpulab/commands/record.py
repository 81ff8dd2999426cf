"""`gpulab reference record`: every lesson in full mode on this GPU, its results shipped as reference results; and
the shipping (``ship``) and the GPU check (``require_gpu``) that `make verify-gpu` (``commands.verify``) uses.

Anyone with a GPU the course has no rows for (a T4, an L4, an A100, ...) runs this once: each lesson runs in a
fresh kernel with ``GPULAB_QUICK=0`` and its own results folder, then every results CSV a lesson wrote goes into
``gpulab/reference/`` through ``add_reference`` (other GPUs' rows stay) and lesson 06's GPU trace through
``traces.record``. Commit ``gpulab/reference/`` to share them.

``python -m gpulab.commands.verify verify|smoke`` (``make verify-gpu``, ``make verify-gpu-smoke``) is the same check for a
GPU held for minutes: a smoke run of every lesson in quick mode, then full-mode parts that fit a budget, each
shipped as it ends (``gpulab.commands.verify``).
"""

import os
from datetime import datetime, timezone
from pathlib import Path
from unittest.mock import patch

import pandas as pd
import torch

from ..device import DeviceError
from ..results import add_reference
from .bench import run_benchmarks
from .course import run_course

COMMAND = "gpulab reference record"
TRACE = ("profiles/06_slow.json", "06_trace")  # the trace lesson 06 writes in its results folder, and its name


def plan(notebooks: list[Path], out_dir: Path) -> str:
    """What ``record`` would do, in words."""
    lessons = "\n".join(f"  {path}" for path in notebooks)
    return (f"Runs in full mode (GPULAB_QUICK=0), each in a fresh kernel:\n{lessons}\n"
            f"Executed notebooks go to {out_dir}/, results to {out_dir}/results/; then every results CSV of a "
            f"lesson that ran to its end, and lesson 06's GPU trace, ship to gpulab/reference/ with provenance.")


def require_gpu() -> None:
    """Raise DeviceError where there is no CUDA GPU: reference results come only from real GPUs."""
    if not torch.cuda.is_available():
        raise DeviceError("no CUDA GPU here: reference results come from full runs on a real GPU")


def record(notebooks: list[Path], out_dir: Path, cell_timeout: int = 1800) -> pd.DataFrame:
    """Run ``notebooks`` in full mode on this machine's GPU and ship what they measured; one row per shipped file."""
    require_gpu()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    results = (out_dir / "results" / stamp).resolve()
    results.mkdir(parents=True)
    with patch.dict(os.environ, {"GPULAB_QUICK": "0", "GPULAB_RESULTS": str(results)}):  # kernels and traces.record
        env = {key: value for key, value in os.environ.items() if key != "CI"}
        lessons = run_course(notebooks, out_dir, cell_timeout, env=env)
        print("gpulab bench ...")
        run_benchmarks()  # results/bench.csv: the rows `gpulab bench` shows beside its own
        passed = {lesson[:2] for lesson in lessons.loc[lessons["status"] == "passed", "lesson"]}
        return ship(results, passed | {"bench"})


def ship(results: Path, passed: set[str], command: str = COMMAND) -> pd.DataFrame:
    """Ship the results CSVs in ``results`` whose lesson ran to its end (``passed`` holds "NN" lesson numbers,
    and "bench"), and lesson 06's trace, with ``command`` as their provenance; one row per file."""
    from ..traces import record as record_trace

    shipped = []
    for csv in sorted(results.glob("*.csv")):
        if csv.name[:2] in passed or csv.stem in passed:
            shipped.append({"results": csv.name, "shipped": str(add_reference(csv, command))})
        else:
            shipped.append({"results": csv.name, "shipped": "not shipped: its lesson did not run to its end"})
    trace, name = results / TRACE[0], TRACE[1]
    if trace.exists() and "06" in passed:
        shipped.append({"results": TRACE[0], "shipped": str(record_trace(trace, name, command=command))})
    return pd.DataFrame(shipped, columns=["results", "shipped"])
