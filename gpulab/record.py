"""`gpulab reference record` and `make verify-gpu`: every lesson in full mode on this GPU, its results shipped as
reference results.

Anyone with a GPU the course has no rows for (a T4, an L4, an A100, ...) runs this once: each lesson runs in a
fresh kernel with ``GPULAB_QUICK=0`` and its own results folder, then every results CSV a lesson wrote goes into
``gpulab/reference/`` through ``add_reference`` (other GPUs' rows stay) and lesson 06's GPU trace through
``traces.record``. Commit ``gpulab/reference/`` to share them.

``python -m gpulab.record verify|smoke`` (``make verify-gpu``, ``make verify-gpu-smoke``) is the same check for a
GPU held for minutes: a smoke run of every lesson in quick mode, then full-mode parts that fit a budget, each
shipped as it ends (``gpulab.verify``).
"""

import argparse
import os
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path
from unittest.mock import patch

import pandas as pd
import torch

from .benchmarks import run_benchmarks
from .course import run_course
from .device import DeviceError
from .results import add_reference

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
    from .traces import record as record_trace

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


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m gpulab.record verify|smoke [PARTS ...]``: the command behind ``make verify-gpu`` and
    ``make verify-gpu-smoke``."""
    from . import verify as v
    from .cli import _signals_raise
    from .verify_plan import H100, PART_CAP_S

    parser = _Parser(prog="python -m gpulab.record", description="The course checked on this GPU in one command: "
                     "smoke (every lesson in quick mode, several at once) or verify (the smoke run, then full-mode "
                     "parts in order of need while the budget lasts).")
    parser.add_argument("action", choices=["verify", "smoke"])
    parser.add_argument("parts", nargs="*", help="verify: smoke, tests, bench, lesson numbers (00, 01, ...); smoke: "
                        "lesson numbers; default: all")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (parts, expected minutes), run nothing")
    parser.add_argument("--out", type=Path, help="the output folder (default: build/verify-gpu, build/verify-gpu-smoke)")
    parser.add_argument("--budget-min", type=float, help="verify: stop starting parts that do not fit in these "
                        "minutes, and return before them (default: no budget, the whole course)")
    parser.add_argument("--part-limit-min", type=float, default=PART_CAP_S / 60, help="no part runs longer")
    parser.add_argument("--gpu", help="with --dry-run: the GPU class to plan for (default: this GPU, else an H100)")
    args = parser.parse_intermixed_args(argv)  # parts before or after the options
    notebooks = sorted(Path("notebooks").glob("*.ipynb"))
    if not notebooks:
        print("python -m gpulab.record: error: no notebooks/*.ipynb here: run it from the course's folder", file=sys.stderr)
        return 2
    try:
        if args.action == "smoke":
            lessons = [p.notebook for p in v.verify_parts(notebooks, args.parts) if p.notebook] if args.parts else notebooks
            if not lessons:
                raise ValueError("smoke runs lessons: name them by number (00, 01, ...), or none for all")
            parts = v.verify_parts(lessons, ["smoke"])
        else:
            parts = v.verify_parts(notebooks, args.parts)
        if not args.dry_run:
            require_gpu()
    except (ValueError, DeviceError) as err:
        print(f"python -m gpulab.record: error: {err}", file=sys.stderr)
        return 2
    out = args.out or Path("build/verify-gpu" + ("-smoke" if args.action == "smoke" else ""))
    budget_s = None if args.budget_min is None else args.budget_min * 60
    gpu = args.gpu or (torch.cuda.get_device_name(0) if torch.cuda.is_available() else H100)
    print(v.plan_text(parts, gpu, budget_s, args.part_limit_min * 60, out))
    if args.dry_run:
        return 0
    previous = _signals_raise()  # SIGTERM too ends the parts and writes what finished
    try:
        table = v.verify(parts, out, budget_s=budget_s, part_cap_s=args.part_limit_min * 60)
    except KeyboardInterrupt as stop:
        print(f"python -m gpulab.record: stopped by {str(stop) or 'Ctrl-C'}; what finished is in {out}/", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print("\n" + (out / "summary.txt").read_text())
    return 0 if table["status"].isin(["passed", "not run"]).all() else 1


if __name__ == "__main__":
    sys.exit(main())
