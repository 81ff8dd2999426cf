"""`gpulab reference record` and `make verify-gpu`: every lesson in full mode on this GPU, its results shipped as
reference results.

Anyone with a GPU the course has no rows for (a T4, an L4, an A100, ...) runs this once: each lesson runs in a
fresh kernel with ``GPULAB_QUICK=0`` and its own results folder, then every results CSV a lesson wrote goes into
``gpulab/reference/`` through ``add_reference`` (other GPUs' rows stay) and lesson 06's GPU trace through
``traces.record``. Commit ``gpulab/reference/`` to share them.

``verify`` (``make verify-gpu``, ``python -m gpulab.record verify``) is the same run cut into parts that each fit a
time limit: the GPU-marked tests, then each lesson, then ``gpulab bench``; each part is stopped at its limit (8
minutes) and the whole at its budget (25 minutes), and each part's results ship as soon as it passed, with the
minutes it took (``verify_gpu``), so that a run cut short keeps what it measured. ``PARTS`` picks some of them,
for machines lent by the call.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
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


# --------------------------------------------------------------------------------------------- make verify-gpu

VERIFY_COMMAND = "make verify-gpu"
VERIFY_NAME = "verify_gpu"  # the reference results that hold the minutes each part took, per GPU
PART_LIMIT_S = 8 * 60  # one part; a lent GPU machine runs one command for at most 10 minutes
BUDGET_S = 25 * 60  # the whole verification
MIN_PART_S = 30  # a part is not started with less of the budget left

# Minutes each part is expected to take on one H100 (80 GB, 16 CPU cores): ESTIMATES, not measurements. Lessons
# 00-04: the span of their H100 rows in gpulab/reference/ (measured 2026-11-22, torch 2.11) plus what the rows leave
# out (kernel start, compilation, plots); the others from their full-mode sizes (by_mode(full=...)). A run records
# what each part took in gpulab/reference/verify_gpu.csv, and the plan shows it beside these.
EXPECTED_MIN = {
    "tests": 2.0,  # the ~18 GPU-marked tests in one pytest process, quick sizes (a torchrun launch, a matmul peak)
    "00": 1.0,  # matmul sweep 16..8192 on the CPU and the GPU, 0.3 s of timing each: its rows span 7 s
    "01": 3.0,  # rows span 68 s; the CUDA C kernel's build (cpp_extension.load_inline) takes about a minute
    "02": 2.5,  # transfer sweep to 1 GiB and loaders (rows span 52 s); ResNet-50 fed by 4 loader set-ups, 30 steps each;
                # comparisons of about 1 s
    "03": 2.5,  # batch sweep 8..16384 of two models (rows span 9 s), batch finder to 2^18, 5 convergence runs of 6 s
    "04": 2.0,  # matmuls to 8192 per precision, 400-step trainings per precision (rows span 33 s), 300 scaler steps
    "05": 2.5,  # 4096-wide MLP steps, checkpointing 1..16 segments, 60 leak steps, a snapshot, an OOM in a subprocess
    "06": 3.5,  # 20-step profiles, six fixes each compared in about 1 s, torch.compile and CUDA graphs, HTA
    "07": 3.0,  # one GPU: torchrun launches of gloo ranks (CPU-sized work) and of one NCCL rank (GPU-sized), FSDP bytes
    "08": 4.0,  # 16k images: 3 baseline seeds x 6 epochs (~2 s each, per-sample CPU augmentation), 11 steps raced
                # 6 epochs a side (most under 0.5 s an epoch once the data is on the GPU), torch.compile twice
    "09": 7.0,  # a GPT (8 layers, 768 wide, 1024 tokens): 100 steps, attention to 8192 tokens per backend, a
                # waterfall raced 5 pairs a step, torch.compile of the GPT several times: the likeliest to overrun
    "bench": 0.5,  # gpulab bench
}


@dataclass(frozen=True)
class Part:
    """One part of the verification: a lesson notebook in a fresh kernel, or a command in its own process group."""
    name: str  # "tests", a lesson's stem ("05_memory"), "bench"
    what: str
    expected_min: float | None
    notebook: Path | None = None
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # set for this part (lessons and bench also get their results folder)

    @property
    def key(self) -> str:
        """What ``PARTS`` names it by: "tests", "bench", or the lesson's number."""
        return self.name[:2] if self.notebook else self.name


def gpu_test_files(tests: Path = Path("tests")) -> list[str]:
    """The test files that hold GPU-marked tests (pytest then imports only those: no browser or HTA-only files)."""
    return sorted(str(p) for p in tests.glob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def verify_parts(notebooks: list[Path], selected: list[str] | None = None, tests: Path = Path("tests")) -> list[Part]:
    """The verification's parts in the order they run (``selected``: "tests", "bench", lesson numbers or stems)."""
    files = gpu_test_files(tests)
    parts = [Part("tests", f"the GPU-marked tests ({len(files)} files), quick sizes", EXPECTED_MIN["tests"],
                  command=(sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *files),
                  env=(("GPULAB_QUICK", "1"), ("GPULAB_STRICT_WARNINGS", "1")))]
    parts += [Part(nb.stem, f"{nb} in full mode", EXPECTED_MIN.get(nb.stem[:2]), notebook=nb) for nb in notebooks]
    parts.append(Part("bench", "gpulab bench", EXPECTED_MIN["bench"], command=(sys.executable, "-m", "gpulab.cli", "bench")))
    if not selected:
        return parts
    known = {p.key: p for p in parts} | {p.name: p for p in parts}
    unknown = [s for s in selected if s not in known]
    if unknown:
        raise ValueError(f"no part {', '.join(unknown)}: choose from {', '.join(p.key for p in parts)}")
    chosen = {known[s].name for s in selected}
    return [p for p in parts if p.name in chosen]


def plan_table(parts: list[Part], part_limit_s: float = PART_LIMIT_S) -> pd.DataFrame:
    """One row per part: what it runs, the minutes expected on an H100 (an estimate), its limit, and the minutes
    it took on the GPUs in the shipped ``verify_gpu`` results."""
    from .results import reference

    measured = reference(VERIFY_NAME)
    rows = []
    for part in parts:
        done = measured[(measured["part"] == part.name) & (measured["status"] == "passed")] if not measured.empty else measured
        rows.append({"part": part.key, "runs": part.what,
                     "expected_min": part.expected_min, "limit_min": part_limit_s / 60,
                     "measured": "; ".join(f"{r.seconds / 60:.1f} min on {r.device_name}" for r in done.itertuples())})
    return pd.DataFrame(rows, columns=["part", "runs", "expected_min", "limit_min", "measured"])


def verify_plan(parts: list[Part], out_dir: Path, part_limit_s: float = PART_LIMIT_S, budget_s: float = BUDGET_S) -> str:
    """What ``verify`` would do, in words and a table."""
    table = plan_table(parts, part_limit_s)
    expected = table["expected_min"].fillna(part_limit_s / 60).sum()
    shown = table.assign(expected_min=table["expected_min"].map(lambda m: f"{m:g}" if pd.notna(m) else "?"),
                         limit_min=table["limit_min"].map(lambda m: f"{m:g}"))
    if not shown["measured"].str.len().any():
        shown = shown.drop(columns="measured")
    lines = [f"GPU verification: {len(parts)} part(s) in turn, each stopped at {part_limit_s / 60:g} min, the whole at "
             f"{budget_s / 60:g} min. Expected minutes are estimates for one H100, not measurements.",
             shown.to_string(index=False),
             f"expected in all: {expected:g} min of the {budget_s / 60:g}-minute budget"]
    if expected > budget_s / 60:
        lines.append("The estimates exceed the budget: parts left when it is spent are not run; run them in "
                     "several calls (make verify-gpu PARTS=\"...\"), each part's minutes are kept per GPU.")
    lines.append(f"Lessons run in full mode (GPULAB_QUICK=0), each in a fresh kernel; the tests in quick mode. Executed "
                 f"notebooks, logs and verify.csv go to {out_dir}/; each passed part's results, and the minutes every "
                 f"part took ({VERIFY_NAME}), ship to gpulab/reference/ with provenance: commit it.")
    return "\n".join(lines)


def verify(parts: list[Part], out_dir: Path = Path("build/verify-gpu"), part_limit_s: float = PART_LIMIT_S,
           budget_s: float = BUDGET_S, bundle: Path | None = None, log=print) -> pd.DataFrame:
    """Run ``parts`` in turn on this GPU, each stopped at ``part_limit_s``, none started once ``budget_s`` is spent.

    After each part: its results ship to gpulab/reference/ if it passed, its row (status, seconds, limit) goes to
    ``out_dir/verify.csv`` and to the shipped ``verify_gpu`` results, and ``bundle`` (a .tar.gz of every file
    this run shipped, the summary and the logs, to unpack at the repository's root) is rewritten. Returns the table.
    """
    from .results import ResultLog, environment

    require_gpu()
    out_dir = Path(out_dir)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    results_root = (out_dir / "results" / stamp).resolve()
    results_root.mkdir(parents=True)
    deadline = time.monotonic() + budget_s
    rows, shipped = [], []
    forget = getattr(environment, "cache_clear", lambda: None)  # its rows say "quick": work it out again
    with patch.dict(os.environ, {"GPULAB_QUICK": "0"}):
        os.environ.pop("CI", None)  # restored on leaving: full mode here too (ResultLog rows, traces.record)
        forget()
        summary = ResultLog(VERIFY_NAME, directory=results_root)
        for part in parts:
            left = deadline - time.monotonic()
            if left < MIN_PART_S:
                rows.append(_row(part, "not run", 0.0, 0.0, f"the {budget_s / 60:g}-minute budget was spent"))
            else:
                limit = min(part_limit_s, left)
                log(f"{part.key}: {part.what}, stopped at {limit / 60:.1f} min (expected "
                    f"{part.expected_min if part.expected_min is not None else '?'} min on an H100) ...")
                row, files = _run_part(part, limit, out_dir, results_root / part.name)
                rows.append(row)
                shipped += files
                summary.add(**{k: v for k, v in row.items() if k != "shipped"})
                shipped.append(_ship_summary(summary.path))
                log(f"{part.key}: {row['status']} in {row['seconds'] / 60:.1f} min {row['detail']}".rstrip())
            table = pd.DataFrame(rows)
            table.to_csv(out_dir / "verify.csv", index=False)
            if bundle:
                write_bundle(bundle, out_dir, table, sorted(set(shipped)))
    forget()
    return table


def _row(part: Part, status: str, seconds: float, limit: float, detail: str, shipped: int = 0) -> dict:
    return {"part": part.name, "status": status, "seconds": round(seconds, 1), "limit_s": round(limit),
            "expected_min": part.expected_min, "detail": detail, "shipped": shipped}


def _run_part(part: Part, limit: float, out_dir: Path, results: Path) -> tuple[dict, list[Path]]:
    """Run one part under ``limit`` seconds; ship its results if it passed. Returns its row and the shipped files."""
    results.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update({"GPULAB_QUICK": "0", "GPULAB_RESULTS": str(results)}, **dict(part.env))
    start = time.perf_counter()
    if part.notebook:
        status, detail = _run_lesson(part.notebook, limit, out_dir / "lessons", env)
    else:
        status, detail = _run_command(part, limit, out_dir / "logs", env)
    seconds = time.perf_counter() - start
    files = []
    if status == "passed" and part.name != "tests":
        lesson = "bench" if part.name == "bench" else part.name[:2]
        try:
            table = ship(results, {lesson}, command=f"{VERIFY_COMMAND} PARTS={part.key}")
            files = [Path(p) for p in table["shipped"] if not str(p).startswith("not shipped")]
        except Exception as err:  # a results file that cannot ship must not stop the parts after it
            detail = f"{detail}; not shipped: {type(err).__name__}: {err}".lstrip("; ")
    return _row(part, status, seconds, limit, detail, len(files)), files


def _run_lesson(notebook: Path, limit: float, folder: Path, env: dict) -> tuple[str, str]:
    """The lesson in a fresh kernel; at ``limit`` seconds the kernel and all it started are killed, and the executed
    notebook keeps the cells that ran."""
    import nbformat

    from .execute import run_notebook

    folder.mkdir(parents=True, exist_ok=True)
    stopped = threading.Event()

    def stop():
        stopped.set()
        _kill_children()

    timer = threading.Timer(limit, stop)
    timer.daemon = True
    timer.start()
    try:
        run = run_notebook(notebook, cell_timeout=int(limit) + 60, env=env,
                           kernel_log=folder / f"{notebook.stem}.kernel.log")
    except Exception as err:  # no kernel to start (ipykernel missing), an unreadable notebook, ...
        return "FAILED", f"could not run: {type(err).__name__}: {err}"
    finally:
        timer.cancel()
    (folder / notebook.name).write_text(nbformat.writes(run.notebook))
    if stopped.is_set():
        return "timed out", f"stopped at its {limit / 60:.1f}-minute limit ({run.error or 'at its last cell'})"
    return ("passed", "") if run.ok else ("FAILED", run.error or "")


def _kill_children() -> None:
    """Kill every process this one started (the lesson's kernel, its DataLoader workers, torchrun, ...)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def _run_command(part: Part, limit: float, folder: Path, env: dict) -> tuple[str, str]:
    """The part's command in a process group of its own, output to ``folder/NAME.log``, killed at ``limit``."""
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"{part.name}.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(part.command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return "timed out", f"stopped at its {limit / 60:.1f}-minute limit (its output: {log_path})"
    tail = log_path.read_text(errors="replace").strip().splitlines()
    summary = next((line.strip("= ") for line in reversed(tail) if re.search(r"\d+ (passed|failed|error)", line)), "")
    if code == 0:
        return "passed", summary
    if part.name == "tests" and code == 5:
        return "FAILED", "no GPU-marked test ran (pytest exit 5)"
    return "FAILED", f"exit status {code}: {summary or (tail[-1] if tail else 'no output')} (its output: {log_path})"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _ship_summary(csv_path: Path) -> Path:
    """Ship this run's part rows as ``verify_gpu``: this GPU's rows of parts that did not run now stay."""
    from .results import load, reference

    rows = load(csv_path)
    shipped = reference(VERIFY_NAME)
    if not shipped.empty:
        kept = shipped[shipped["device_name"].isin(rows["device_name"]) & ~shipped["part"].isin(rows["part"])]
        rows = pd.concat([kept, rows], ignore_index=True)
    merged = csv_path.with_name(f"{VERIFY_NAME}.shipped.csv")
    rows.to_csv(merged, index=False)
    return add_reference(merged, VERIFY_COMMAND, name=VERIFY_NAME)


def write_bundle(bundle: Path, out_dir: Path, table: pd.DataFrame, shipped: list[Path]) -> Path:
    """A .tar.gz to unpack at the repository's root: the shipped files (gpulab/reference/...), and under
    build/verify-gpu/ the summary, the logs, and the executed notebooks of lessons that did not pass (up to 4 MiB
    each). Written whole, then moved into place."""
    bundle = Path(bundle)
    bundle.parent.mkdir(parents=True, exist_ok=True)
    failed = set(table.loc[~table["status"].isin(["passed", "not run"]), "part"])
    extra = [out_dir / "verify.csv", *sorted((out_dir / "logs").glob("*.log")),
             *sorted((out_dir / "lessons").glob("*.kernel.log")),
             *[p for p in sorted((out_dir / "lessons").glob("*.ipynb")) if p.stem in failed and p.stat().st_size < 4 << 20]]
    partial = bundle.with_name(bundle.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for path in map(Path, shipped):  # each results CSV with its provenance beside it
            for file in (path, path.with_suffix(".json")) if path.suffix == ".csv" else (path,):
                if file.exists():
                    tar.add(file, arcname=f"gpulab/reference/{file.name}")
        for path in extra:
            if path.exists():
                tar.add(path, arcname=f"build/verify-gpu/{path.relative_to(out_dir)}")
    partial.replace(bundle)
    return bundle


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m gpulab.record verify [PARTS ...]``: the command behind ``make verify-gpu``."""
    parser = _Parser(prog="python -m gpulab.record", description="The course verified on this GPU, "
                     "part by part: GPU-marked tests, each lesson in full mode, gpulab bench.")
    parser.add_argument("action", choices=["verify"])
    parser.add_argument("parts", nargs="*", help="tests, bench, lesson numbers (00, 01, ...); default: all, in order")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (parts, expected minutes), run nothing")
    parser.add_argument("--out", type=Path, default=Path("build/verify-gpu"))
    parser.add_argument("--bundle", type=Path, help="also write a .tar.gz of what was shipped and the logs after "
                        "each part (to carry off a machine that is given back)")
    parser.add_argument("--part-limit-min", type=float, default=PART_LIMIT_S / 60)
    parser.add_argument("--budget-min", type=float, default=BUDGET_S / 60)
    args = parser.parse_intermixed_args(argv)  # parts before or after the options
    notebooks = sorted(Path("notebooks").glob("*.ipynb"))
    if not notebooks:
        print("python -m gpulab.record: error: no notebooks/*.ipynb here: run it from the course's folder", file=sys.stderr)
        return 2
    try:
        parts = verify_parts(notebooks, args.parts)
        if not args.dry_run:
            require_gpu()
    except (ValueError, DeviceError) as err:
        print(f"python -m gpulab.record: error: {err}", file=sys.stderr)
        return 2
    print(verify_plan(parts, args.out, args.part_limit_min * 60, args.budget_min * 60))
    if args.dry_run:
        return 0
    table = verify(parts, args.out, args.part_limit_min * 60, args.budget_min * 60, bundle=args.bundle)
    print("\n" + table.to_string(index=False))
    print(f"\n{(table['status'] == 'passed').sum()} of {len(table)} parts passed in "
          f"{table['seconds'].sum() / 60:.1f} min. Commit gpulab/reference/ to ship what they measured.")
    return 0 if (table["status"] == "passed").all() else 1


if __name__ == "__main__":
    sys.exit(main())
