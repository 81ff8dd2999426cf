"""`make verify-gpu` and `make verify-gpu-smoke` (``python -m gpulab.commands.verify verify|smoke``): the course checked on
this GPU in one command of a few minutes.

1. The smoke run: every lesson in quick mode, as many at once as the card and the cores allow, the lessons that
   take the whole card alone after them; per lesson its status, seconds, error and the warnings a learner would
   see, and the executed notebook. Its timings are contended: it ships no reference results.
2. Then the full-mode parts (the GPU-marked tests, each lesson, gpulab bench) in order of need (``verify_plan``),
   each started only where its expected minutes fit what is left of the budget and stopped at its limit. A part
   that passed ships its results to gpulab/reference/ at once; the minutes every part took go to the shipped
   ``verify_gpu`` results, per GPU class, so that the next run on that class starts with what failed and goes on
   with what is not measured yet.

gpulab's NVML monitor samples the GPU every second throughout. Everything goes to one output folder
(``verify_out``), rewritten as each part ends; the run returns before its budget, whatever is still running.
"""

import argparse
import importlib.util
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from unittest.mock import patch

import nbformat
import pandas as pd
import torch

from .. import results
from ..conditions import cpu_cores
from ..device import DeviceError
from ..grader.execute import clear_leftovers
from . import record
from . import verify_plan as planning
from .cli import positive
from .notebook_upkeep import is_lesson
from .stopping import signals_raise, stopped_status
from .verify_jobs import Job, Outcome, run_command, run_lesson, run_many
from .verify_out import BUNDLE, MONITOR, ROOT, SUMMARY, MonitorLog, log_tail, write_bundle, write_text
from .verify_plan import H100, PART_CAP_S, RESERVE_S, VERIFY_NAME

VERIFY_COMMAND = "make verify-gpu"
TIMINGS = "timings"  # the scratch folder of this run's verify_gpu rows (the bundle has them as shipped)
FINAL_S = 10.0  # at the end of a budget, after every part has ended or been left behind: the last files written
GIB_PER_LESSON = 4  # GPU memory a lesson in quick mode is given in the smoke run (nine took 10 GB at most, H200)
CONTENDED = ("Smoke-run timings are contended (several lessons at once on one GPU): read them for crashes, warnings "
             "and logic, not as measurements. The smoke run ships no reference results.")
COLUMNS = ["phase", "part", "status", "seconds", "at_once", "limit_s", "expected_min", "detail", "warnings", "shipped"]


@dataclass(frozen=True)
class Part:
    """One part of the verification: the smoke run, a lesson in full mode, or a command (the tests, bench)."""
    name: str  # "smoke", "tests", a lesson's stem ("05_memory"), "bench"
    what: str
    notebook: Path | None = None
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    lessons: tuple[Path, ...] = ()  # the smoke run's

    @property
    def key(self) -> str:
        """What ``PARTS`` names it by: "smoke", "tests", "bench", or the lesson's number."""
        return self.name[:2] if self.notebook else self.name


def gpu_test_files(tests: Path = Path("tests")) -> list[str]:
    """The test files that hold GPU-marked tests (pytest then imports only those: no browser or HTA-only files)."""
    return sorted(str(p) for p in Path(tests).glob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def verify_parts(notebooks: list[Path], selected: list[str] | None = None, tests: Path = Path("tests")) -> list[Part]:
    """The parts, in the course's order (``selected``: "smoke", "tests", "bench", lesson numbers or stems)."""
    files = gpu_test_files(tests)
    parts = [Part("smoke", f"every lesson in quick mode ({len(notebooks)}), several at once", lessons=tuple(notebooks)),
             Part("tests", f"the GPU-marked tests ({len(files)} files), quick sizes",
                  command=(sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *files),
                  env=(("GPULAB_QUICK", "1"), ("GPULAB_STRICT_WARNINGS", "1")))]
    # a page (how the course measures) runs in the smoke run on this GPU; it ships no results, so no full-mode part
    parts += [Part(nb.stem, f"{nb} in full mode", notebook=nb) for nb in notebooks if is_lesson(nb)]
    parts.append(Part("bench", "gpulab bench", command=(sys.executable, "-m", "gpulab.commands.cli", "bench")))
    if not selected:
        return parts
    known = {p.key: p for p in parts} | {p.name: p for p in parts}
    unknown = [s for s in selected if s not in known]
    if unknown:
        raise ValueError(f"no part {', '.join(unknown)}: choose from {', '.join(p.key for p in parts)}")
    chosen = {known[s].name for s in selected}
    return [p for p in parts if p.name in chosen]


def smoke_slots(cores: int, free_gib: float | None, lessons: int) -> int:
    """How many lessons the smoke run runs at once: one per two CPU cores and per ``GIB_PER_LESSON`` of free GPU
    memory (``None``: unknown, not a limit)."""
    by_memory = lessons if free_gib is None else int(free_gib // GIB_PER_LESSON)
    return max(1, min(lessons, cores // 2, by_memory))


def smoke_order(lessons) -> list[Path]:
    """Longest first (by their quick-mode seconds on the H200; a lesson without them first of all)."""
    return sorted(lessons, key=lambda nb: -planning.SMOKE_SECONDS.get(Path(nb).stem[:2], math.inf))


def plan_text(parts: list[Part], gpu: str, budget_s: float | None, cap_s: float = PART_CAP_S,
              out: Path = Path("build/verify-gpu")) -> str:
    """What one command would run on ``gpu`` within ``budget_s``, had each part taken its expected minutes."""
    gpus = planning.reference_gpus(results.REFERENCE_DIR)
    table = planning.plan_rows(parts, gpu, budget_s, results.reference(VERIFY_NAME), gpus, cap_s)
    runs = table[table["decision"].str.startswith("runs")]
    budget = "no budget (the whole course)" if budget_s is None else f"a budget of {budget_s / 60:g} min"
    full = any(p.key != "smoke" for p in parts)
    how = (f"the smoke run first, then full-mode parts in order of need, each started only where its expected minutes "
           f"fit what is left ({RESERVE_S:g} s kept for the end) and stopped at its stop limit." if full else
           f"the smoke run. {CONTENDED}")
    lines = [f"GPU verification plan for {gpu}, {budget}: {how}",
             table[["part", "minutes", "stop_min", "decision", "why"]].to_string(index=False),
             f"Expected: {runs['minutes'].sum():.1f} min for the {len(runs)} part(s) that run"
             + (f"; {len(table) - len(runs)} wait for a later run (it goes on with them)." if len(runs) < len(table)
                else "."),
             "Where the minutes come from (measured where a run measured them, else estimates):"]
    lines += [f"  {row.part}: {row.source}" for row in table.itertuples()]
    lines.append(f"Everything goes to {out}/: {BUNDLE} (unpack it at the repository's root), {SUMMARY}, {MONITOR}"
                 + ("; each passed part's results also ship to gpulab/reference/ at once." if full else "."))
    return "\n".join(lines)


def verify(parts: list[Part], out: Path = Path("build/verify-gpu"), *, budget_s: float | None = None,
           part_cap_s: float = PART_CAP_S, slots: int | None = None, monitor=None, clock=time.monotonic,
           log=print) -> pd.DataFrame:
    """Run ``parts`` on this GPU: the smoke run first if chosen, then the full-mode parts in order of need, each
    only where its expected minutes fit what is left of ``budget_s`` (None: no budget). Writes ``out``/ after each
    part (see ``verify_out``); returns one row per part (and per lesson of the smoke run)."""
    from ..results import environment

    record.require_gpu()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = clock()
    end = math.inf if budget_s is None else start + budget_s
    forget = getattr(environment, "cache_clear", lambda: None)  # its rows say "quick": work it out again
    with patch.dict(os.environ, {"GPULAB_QUICK": "0"}):
        os.environ.pop("CI", None)  # restored on leaving: full mode here too (ResultLog rows, traces.record)
        forget()
        smoke_only = all(p.name == "smoke" for p in parts)  # its bundle unpacks beside a full run's, not over it
        run = _Run(out, environment()["device_name"], budget_s, log, ROOT + ("-smoke" if smoke_only else ""))
        mon = MonitorLog(out / MONITOR, monitor if monitor is not None else _monitor())
        try:
            clear_leftovers()
            mon.start()
            smoke = [p for p in parts if p.key == "smoke"]
            if smoke:
                _smoke(run, smoke[0], min(end - FINAL_S, clock() + planning.SMOKE_LIMIT_S), slots, mon, clock)
            _full(run, [p for p in parts if p.key != "smoke"], end, part_cap_s, mon, clock)
        finally:
            mon.mark("")
            note = mon.stop()
            run.finish(note, clock() - start)
    forget()
    return run.table()


def _smoke(run: "_Run", part: Part, deadline: float, slots: int | None, mon: MonitorLog, clock) -> None:
    lessons = smoke_order(part.lessons)
    alone = [nb.stem for nb in lessons if nb.stem[:2] in planning.WHOLE_CARD_QUICK]
    slots = slots or smoke_slots(cpu_cores(), _free_gib(), max(1, len(lessons) - len(alone)))
    threads = max(1, cpu_cores() // slots)
    run.smoke_note = (f"every lesson in quick mode, up to {slots} at once ({threads} CPU thread"
                      f"{'s' if threads > 1 else ''} each)"
                      + (f", then {', '.join(alone)} alone (it takes the whole card)" if alone else ""))
    run.log(f"smoke: {run.smoke_note} ...")
    jobs = [run.lesson_job(nb, "smoke", planning.SMOKE_LESSON_LIMIT_S, nb.stem in alone, threads) for nb in lessons]
    run_many(jobs, slots, deadline, lambda job, outcome, at_once: run.done("smoke", job, outcome, at_once),
             on_change=lambda names: mon.mark(f"smoke: {' '.join(names)}" if names else ""), clock=clock)


def _full(run: "_Run", parts: list[Part], end: float, cap_s: float, mon: MonitorLog, clock) -> None:
    shipped = results.reference(VERIFY_NAME)
    failed = {row["part"][:2] for row in run.rows if row["phase"] == "smoke" and row["status"] not in ("passed", "not run")}
    for part, why in planning.order(parts, run.gpu, shipped, planning.reference_gpus(results.REFERENCE_DIR), failed):
        minutes = planning.expected(part.key, part.name, run.gpu, shipped)
        left = end - clock()
        job = run.part_job(part, minutes.stop_s(cap_s))
        if part.key == "tests" and importlib.util.find_spec("pytest") is None:
            run.done("full", job, Outcome("not run", 0.0, "pytest is not installed here (the headless set has no "
                                          "test tools)"), 0, minutes.minutes)
            continue
        if not planning.fits(minutes.minutes, left):
            run.done("full", job, Outcome("not run", 0.0, f"expected {minutes.minutes:g} min, "
                                          f"{max(0.0, (left - RESERVE_S) / 60):.1f} min of the budget left"),
                     0, minutes.minutes)
            continue
        run.log(f"{part.key}: {part.what} ({why}; expected {minutes.minutes:g} min, {minutes.source()}) ...")
        mon.mark(part.name)
        run_many([job], 1, end - FINAL_S,
                 lambda job, outcome, at_once, planned=minutes.minutes: run.done("full", job, outcome, at_once, planned),
                 clock=clock)
        mon.mark("")


class _Run:
    """One verification's state: its rows, the files its parts wrote (in a scratch folder), what it shipped; writes
    the output folder after each part."""

    def __init__(self, out: Path, gpu: str, budget_s: float | None, log, root: str = ROOT):
        self.out, self.gpu, self.budget_s, self.log, self.root = out, gpu, budget_s, log, root
        self.scratch = Path(tempfile.mkdtemp(prefix="gpulab-verify-"))
        self.started = datetime.now(timezone.utc)
        self.rows: list[dict] = []
        self.warnings: dict[str, tuple[str, ...]] = {}
        self.shipped: list[Path] = []
        self.parts: dict[str, Part] = {}
        self.smoke_note, self.notes, self.left_out = "", [], []
        self.timings = results.ResultLog(VERIFY_NAME, directory=self.scratch / TIMINGS)

    def lesson_job(self, notebook: Path, phase: str, limit: float, alone: bool = False, threads: int | None = None) -> Job:
        folder = self.scratch / phase
        env = self._env(phase == "smoke", folder / "results" / notebook.stem)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        (folder / "results" / notebook.stem).mkdir(parents=True, exist_ok=True)
        log = folder / f"{notebook.stem}.kernel.log"
        return Job(notebook.stem, lambda limit_s: run_lesson(notebook, env, limit_s, log), limit, alone)

    def part_job(self, part: Part, limit: float) -> Job:
        self.parts[part.name] = part
        if part.notebook:
            return self.lesson_job(part.notebook, "full", limit)
        folder = self.scratch / "full"
        env = {**self._env(False, folder / "results" / part.name), **dict(part.env)}
        (folder / "results" / part.name).mkdir(parents=True, exist_ok=True)

        def run(limit_s: float) -> Outcome:
            outcome = run_command(list(part.command), env, limit_s, folder / f"{part.name}.log")
            if part.name == "tests" and outcome.detail.startswith("exit status 5"):
                outcome.detail = "no GPU-marked test ran (pytest exit 5)"
            return outcome

        return Job(part.name, run, limit)

    def done(self, phase: str, job: Job, outcome: Outcome, at_once: int, expected_min: float | None = None) -> None:
        """Keep a part's outcome: its executed notebook, its row, its results shipped (a full-mode part that
        passed) and its minutes (verify_gpu); then rewrite the output folder."""
        folder = self.scratch / phase
        if outcome.notebook:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{job.name}.ipynb").write_text(nbformat.writes(nbformat.reads(outcome.notebook, as_version=4)))
        self.warnings[f"{job.name} ({'quick' if phase == 'smoke' else 'full'})"] = outcome.warnings
        row = {"phase": phase, "part": job.name, "status": outcome.status, "seconds": round(outcome.seconds, 1),
               "at_once": at_once, "limit_s": round(job.limit), "expected_min": expected_min,
               "detail": outcome.detail, "warnings": len(outcome.warnings), "shipped": 0}
        if phase == "full" and outcome.status != "not run":
            row["shipped"] = self._ship(job.name, row)
        self.rows.append(row)
        self.log(f"{phase} {job.name}: {outcome.status} in {outcome.seconds:.0f} s"
                 + (f" ({at_once} at once)" if phase == "smoke" else "") + f" {outcome.detail}".rstrip())
        self.write()

    def _ship(self, name: str, row: dict) -> int:
        """Ship a full-mode part's results if it passed, and its minutes; the number of results files shipped."""
        part, files = self.parts[name], []
        if row["status"] == "passed" and part.name != "tests":
            lesson = part.key if part.notebook else part.name
            try:
                table = record.ship(self.scratch / "full" / "results" / name, {lesson},
                                    command=f"{VERIFY_COMMAND} PARTS={part.key}")
                files = [Path(p) for p in table["shipped"] if not str(p).startswith("not shipped")]
            except Exception as err:  # a results file that cannot ship must not stop the parts after it
                row["detail"] = f"{row['detail']}; not shipped: {type(err).__name__}: {err}".lstrip("; ")
        self.shipped += files
        try:  # nor may its minutes
            self.timings.add(**{k: row[k] for k in ("part", "status", "seconds", "limit_s", "expected_min", "detail")})
            self.shipped.append(_ship_timings(self.timings.path))
        except Exception as err:
            row["detail"] = f"{row['detail']}; minutes not kept: {type(err).__name__}: {err}".lstrip("; ")
        return len(files)

    def _env(self, quick: bool, results_dir: Path) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "CI"}
        env.update(GPULAB_QUICK="1" if quick else "0", GPULAB_RESULTS=str(results_dir))
        return env

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=COLUMNS)

    def write(self, seconds: float | None = None) -> None:
        """Rewrite the summary and the bundle (then the summary again, naming what the bundle left out)."""
        text = self.summary(seconds)
        write_text(self.out / SUMMARY, text)
        self.left_out = write_bundle(self.out / BUNDLE, self._members(text), root=self.root)
        if self.left_out:
            write_text(self.out / SUMMARY, self.summary(seconds))

    def finish(self, monitor_note: str, seconds: float) -> None:
        if monitor_note:
            self.notes.append(monitor_note)
        self.write(seconds)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _members(self, summary: str) -> list[tuple[str, Path | bytes]]:
        """What the bundle holds, most needed first: the shipped results, the summary and the monitor log, the
        notebooks and logs of parts that did not pass, the other notebooks, the results the lessons wrote."""
        members: list[tuple[str, Path | bytes]] = []
        for path in dict.fromkeys(self.shipped):
            for file in (path, path.with_suffix(".json")) if path.suffix == ".csv" else (path,):
                members.append((f"gpulab/reference/{file.name}", file))
        members += [(f"{self.root}/{SUMMARY}", summary.encode()),
                    (f"{self.root}/summary.csv", self.table().to_csv(index=False).encode()),
                    (f"{self.root}/{MONITOR}", self.out / MONITOR)]
        failed = {f"{r['phase']}/{r['part']}" for r in self.rows if r["status"] not in ("passed", "not run")}

        def rank(path: Path) -> int:
            relative = path.relative_to(self.scratch)
            if path.suffix not in (".ipynb", ".log"):
                return 2
            return 0 if f"{relative.parts[0]}/{path.name.split('.')[0]}" in failed else 1

        kept = (p for p in sorted(self.scratch.rglob("*")) if p.is_file() and p.relative_to(self.scratch).parts[0] != TIMINGS)
        for path in sorted(kept, key=rank):
            try:
                source = log_tail(path) if path.suffix == ".log" else path
            except OSError:  # gone since it was listed
                continue
            members.append((f"{self.root}/{path.relative_to(self.scratch)}", source))
        return members

    def summary(self, seconds: float | None = None) -> str:
        table = self.table()
        smoke, full = table[table["phase"] == "smoke"], table[table["phase"] == "full"]
        budget = "no budget (the whole course)" if self.budget_s is None else f"a budget of {self.budget_s / 60:g} min"
        lines = [f"GPU verification on {self.gpu}, started {self.started:%Y-%m-%d %H:%M} UTC, {budget}"
                 + (f"; it took {seconds / 60:.1f} min." if seconds is not None else "; still running.")]
        if len(smoke):
            lines.append(f"Smoke run ({self.smoke_note}): {(smoke['status'] == 'passed').sum()} of {len(smoke)} "
                         f"lessons passed. {CONTENDED}")
        if len(full):
            ran = full[full["status"] != "not run"]
            lines.append(f"Full mode: {(ran['status'] == 'passed').sum()} of {len(ran)} parts run passed, "
                         f"{len(full) - len(ran)} not run. Results shipped: {int(full['shipped'].sum())} file(s) to "
                         f"gpulab/reference/, and every part's minutes to {VERIFY_NAME}: unpack {BUNDLE} at the "
                         "repository's root and commit gpulab/reference/.")
        shown = table.assign(detail=table["detail"].astype(str).str.slice(0, 110))
        lines += ["", shown.to_string(index=False) if len(table) else "(no part has ended yet)"]
        seen = {name: found for name, found in self.warnings.items() if found}
        if seen:
            lines += ["", "Warnings a learner would see (each once per lesson):"]
            lines += [f"  {name}: {warning}" for name, found in seen.items() for warning in found]
        lines += ["", f"{MONITOR}: the GPU every second (SM clock, utilisation, memory, power, throttle reasons); its "
                  "phase column names the part(s) running."]
        lines += [f"Note: {note}" for note in self.notes]
        if self.left_out:
            lines.append(f"Left out of {BUNDLE} (over its size limit): {', '.join(self.left_out)}")
        return "\n".join(lines) + "\n"


def _ship_timings(csv_path: Path) -> Path:
    """Ship this run's part rows as ``verify_gpu``: this GPU's rows of parts that did not run now stay."""
    rows = results.load(csv_path)
    shipped = results.reference(VERIFY_NAME)
    if not shipped.empty:
        kept = shipped[shipped["device_name"].isin(rows["device_name"]) & ~shipped["part"].isin(rows["part"])]
        rows = pd.concat([kept, rows], ignore_index=True)  # add_reference keeps the other GPUs' rows
    merged = csv_path.with_name(f"{VERIFY_NAME}.shipped.csv")
    rows.to_csv(merged, index=False)
    return results.add_reference(merged, VERIFY_COMMAND, name=VERIFY_NAME)


def _monitor():
    from ..monitor import Monitor

    return Monitor(interval=1.0, device=0)


def _free_gib() -> float | None:
    """Free memory of GPU 0 by NVML, in GiB (None where NVML cannot say): no CUDA context in this process."""
    from .. import nvml

    try:
        nv, handle = nvml.shared(0)
    except nvml.NvmlUnavailable:
        return None
    info = nvml.query(nv, nv.nvmlDeviceGetMemoryInfo, handle)
    return None if info is None else info.free / 2**30


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m gpulab.commands.verify verify|smoke [PARTS ...]``: the command behind ``make verify-gpu`` and
    ``make verify-gpu-smoke``."""
    parser = _Parser(prog="python -m gpulab.commands.verify", description="The course checked on this GPU in one command: "
                     "smoke (every lesson in quick mode, several at once) or verify (the smoke run, then full-mode "
                     "parts in order of need while the budget lasts).")
    parser.add_argument("action", choices=["verify", "smoke"])
    parser.add_argument("parts", nargs="*", help="verify: smoke, tests, bench, lesson numbers (00, 01, ...); smoke: "
                        "lesson numbers; default: all")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (parts, expected minutes), run nothing")
    parser.add_argument("--out", type=Path, help="the output folder (default: build/verify-gpu, build/verify-gpu-smoke)")
    parser.add_argument("--budget-min", type=positive(float), help="verify: stop starting parts that do not fit in these "
                        "minutes, and return before them (default: no budget, the whole course)")
    parser.add_argument("--part-limit-min", type=positive(float), default=PART_CAP_S / 60, help="no part runs longer")
    parser.add_argument("--gpu", help="with --dry-run: the GPU class to plan for (default: this GPU, else an H100)")
    args = parser.parse_intermixed_args(argv)  # parts before or after the options
    notebooks = sorted(Path("notebooks").glob("*.ipynb"))
    if not notebooks:
        print("python -m gpulab.commands.verify: error: no notebooks/*.ipynb here: run it from the course's folder",
              file=sys.stderr)
        return 2
    try:
        if args.action == "smoke":
            lessons = [p.notebook for p in verify_parts(notebooks, args.parts) if p.notebook] if args.parts else notebooks
            if not lessons:
                raise ValueError("smoke runs lessons: name them by number (00, 01, ...), or none for all")
            parts = verify_parts(lessons, ["smoke"])
        else:
            parts = verify_parts(notebooks, args.parts)
        if not args.dry_run:
            record.require_gpu()
    except (ValueError, DeviceError) as err:
        print(f"python -m gpulab.commands.verify: error: {err}", file=sys.stderr)
        return 2
    out = args.out or Path("build/verify-gpu" + ("-smoke" if args.action == "smoke" else ""))
    budget_s = None if args.budget_min is None else args.budget_min * 60
    gpu = args.gpu or (torch.cuda.get_device_name(0) if torch.cuda.is_available() else H100)
    print(plan_text(parts, gpu, budget_s, args.part_limit_min * 60, out))
    if args.dry_run:
        return 0
    previous = signals_raise()  # SIGTERM too ends the parts and writes what finished
    try:
        table = verify(parts, out, budget_s=budget_s, part_cap_s=args.part_limit_min * 60)
    except KeyboardInterrupt as stop:
        print(f"python -m gpulab.commands.verify: stopped by {str(stop) or 'Ctrl-C'}; what finished is in {out}/",
              file=sys.stderr)
        return stopped_status(str(stop))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print("\n" + (out / "summary.txt").read_text())
    return 0 if table["status"].isin(["passed", "not run"]).all() else 1


if __name__ == "__main__":
    sys.exit(main())
