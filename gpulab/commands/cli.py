"""The `gpulab` command: doctor, bench, plan, course, grade, exercises, notebooks, claims, reference."""

import argparse
import json
import math
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from .stopping import signals_raise, stopped_status

DOCTOR_HELP = """exit status: 0 all OK; 1 warnings (the GPU works, something costs speed);
2 errors (no usable GPU: torch is CPU-only, no driver, driver too old, ...)"""
GRADE_HELP = """exit status: 0 every notebook ran to its end (whatever its score); 1 at least one
notebook could not be graded (raised, timed out, exited, not a notebook): it got zero points;
2 a mistake in the command (a missing notebook, --out naming a file, a bad --time-limit);
130 stopped by Ctrl-C, 143 by SIGTERM (the grades of the notebooks that finished are kept)"""


class UsageError(Exception):
    """A mistake in the command line: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive(kind):
    """An argparse type: a finite number > 0 of ``kind`` (int or float)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {'integer' if kind is int else 'number'}, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; a mistake in the command is one line on stderr and exit status 2; Ctrl-C or SIGTERM
    stops it with one line on stderr and exit status 130 or 143."""
    previous, name = signals_raise(), "gpulab"
    try:
        from ..device import DeviceError
        from ..grader.grading import GradingError
        from ..results import ResultsFileError

        args = _parser().parse_args(argv)
        name = f"gpulab {args.subcommand}"
        status = args.run(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return status
    except BrokenPipeError:  # the reader stopped reading (`gpulab plan | head`): end quietly, as a shell's tools do
        # Python's signal docs, "Note on SIGPIPE": stdout to devnull, so that the flush at exit cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as stop:  # first: the names below may not be imported yet
        print(f"{name}: stopped by {str(stop) or 'Ctrl-C'}", file=sys.stderr)
        return stopped_status(str(stop))
    except (UsageError, DeviceError, ResultsFileError, GradingError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpulab", description=__doc__)
    sub = parser.add_subparsers(dest="subcommand", required=True)

    p = sub.add_parser("doctor", help="diagnose why training is slow or not on the GPU", epilog=DOCTOR_HELP)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(run=_doctor)

    p = sub.add_parser("bench", help="measure matmul, memory and transfer speed of this machine")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the GPU if there is one)")
    p.add_argument("--timers", action="store_true",
                   help="instead, compare gpulab.bench with torch.utils.benchmark (and triton's do_bench on a GPU)")
    p.add_argument("--rounds", type=positive(int), help="with --timers: interleaved rounds (default: 5, quick mode 3)")
    p.add_argument("--threads", type=positive(int), default=1,
                   help="with --timers: CPU threads for every timer (default: 1)")
    p.set_defaults(run=_bench)

    p = sub.add_parser("plan", help="every lesson's plan for a card (sizes, minutes, what the card lacks), without a GPU")
    p.add_argument("--card", help="a card of gpulab.datasheets, by the name torch reports ('Tesla T4') or the sheet's "
                   "('T4'); default: this machine's GPU")
    p.add_argument("--cpus", type=positive(int), help="the host's CPU cores (default: this machine's for its own GPU, "
                   "else the card's typical host: 2 for Colab's T4)")
    p.add_argument("--gpus", type=positive(int), help="GPUs in the machine, with --card (default: 1)")
    p.add_argument("--json", action="store_true", help="a list with one object per lesson")
    p.add_argument("--markdown", action="store_true",
                   help="instead, every lesson's minutes on the six cards learners bring, as the README's table")
    p.set_defaults(run=_plan)

    p = sub.add_parser("course", help="run every lesson headless into build/ (executed notebooks and HTML)")
    p.add_argument("notebooks", nargs="*", type=Path,
                   help="default: every lesson (notebooks/NN_*.ipynb), then the pages (how the course measures)")
    p.add_argument("--out", type=Path, default=Path("build"))
    p.add_argument("--cell-timeout", type=positive(int), default=900, help="seconds one cell may run")
    p.set_defaults(run=_course)

    p = sub.add_parser("grade", help="grade exercise notebooks, write grades.csv and grades.json", epilog=GRADE_HELP)
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("grades"))
    p.add_argument("--time-limit", type=positive(float), default=600, help="seconds one notebook may run")
    p.set_defaults(run=_grade)

    p = sub.add_parser("exercises", help="generate exercises/ from solutions/, or check they are in sync")
    p.add_argument("action", choices=["build", "check"])
    p.set_defaults(run=_exercises)

    p = sub.add_parser("notebooks", help="strip outputs and rewrite the setup cell of every notebook")
    p.set_defaults(run=_notebooks)

    p = sub.add_parser("claims", help="what the course's sources claimed, and what the shipped reference results measured")
    p.add_argument("--markdown", action="store_true", help="as the Markdown table the README holds")
    p.set_defaults(run=_claims)

    p = sub.add_parser("reference", help="reference add CSV: ship a full-mode results CSV as reference results; "
                       "reference record: run every lesson in full mode on this GPU and ship all its results")
    p.add_argument("action", choices=["add", "record"])
    p.add_argument("csv", type=Path, nargs="?", help="with add: the results CSV to ship")
    p.add_argument("--command", help="with add: the command that produced it (kept as provenance)")
    p.add_argument("--name", help="with add: reference name (default: the file's stem)")
    p.add_argument("--out", type=Path, default=Path("build/reference"),
                   help="with record: where executed notebooks and results go (default: build/reference)")
    p.add_argument("--dry-run", action="store_true", help="with record: say what it would run, run nothing")
    p.set_defaults(run=_reference)
    return parser


def _doctor(args) -> int:
    from ..doctor import diagnose, exit_status, render

    findings = diagnose()
    if args.json:
        print(json.dumps({"status": exit_status(findings), "findings": [f.as_dict() for f in findings]}, indent=2))
    else:
        print(render(findings))
    return exit_status(findings)


def _bench(args) -> int:
    import pandas as pd

    from ..device import device_info
    from ..results import reference
    from .bench import run_benchmarks

    print(device_info(args.device), end="\n\n")
    if args.timers:
        from .timer_agreement import agreement, render

        print(render(agreement(args.device, args.rounds, args.threads)))
        return 0
    rows = run_benchmarks(args.device)
    table = pd.DataFrame(rows)
    columns = ["test", "value", "unit", "runs"] + (["of_limit"] if "of_limit" in table else []) + ["detail"]
    ref = reference("bench")
    if not ref.empty:  # the same tests measured on the GPUs the course ships results for
        for name, group in ref.groupby("device_name"):
            table[f"ref: {name}"] = table["test"].map(group.set_index("test")["value"])
            columns.append(f"ref: {name}")
    print(table[columns].astype(object).fillna("").to_string(index=False))
    return 0


def _plan(args) -> int:
    from ..device import on_gpu
    from ..plans import Card, course, minutes_markdown

    if args.markdown:
        if args.card or args.cpus or args.gpus or args.json:
            raise UsageError("--markdown prints the README's table for its six cards, each with its typical host: it "
                             "takes no --card, --cpus, --gpus or --json")
        print(minutes_markdown())
        return 0
    if args.gpus and not args.card:
        raise UsageError("--gpus goes with --card: this machine's plan counts its own GPUs")
    if args.card:
        try:
            card = Card.named(args.card, cpus=args.cpus, gpus=args.gpus or 1)
        except ValueError as err:
            raise UsageError(str(err)) from None
    elif on_gpu():
        card = Card.here()
        card = replace(card, cpu_cores=args.cpus) if args.cpus else card
    else:
        raise UsageError("no GPU here: name a card, e.g. --card 'Tesla T4' (gpulab.datasheets lists them)")
    plans = course(card)
    if args.json:
        print(json.dumps([plan.as_dict() for plan in plans], indent=2))
        return 0
    for plan in plans:
        print(plan.details(), end="\n\n")
    print(f"The course on {card.name}: about {sum(plan.minutes for plan in plans):.1f} minutes of running, "
          f"lesson by lesson: " + ", ".join(f"{plan.lesson} {plan.minutes:.1f}" for plan in plans))
    return 0


def _course(args) -> int:
    from ..grader.execute import Stopped
    from .course import run_course
    from .notebook_upkeep import course

    notebooks = args.notebooks or course()
    if not notebooks:
        raise UsageError("no notebooks found (run this from the repository's root)")
    _existing_files(notebooks)
    _writable_folder(args.out)
    try:
        table = run_course(notebooks, args.out, args.cell_timeout)
    except Stopped as stop:
        print("\n" + stop.done.to_string(index=False))
        print(f"gpulab course: stopped by {stop.signal_name} after {len(stop.done)} of {len(notebooks)} lessons; "
              f"their summary is in {args.out / 'summary.csv'}", file=sys.stderr)
        return stopped_status(stop.signal_name)
    print("\n" + table.to_string(index=False))
    failed = (table["status"] != "passed").sum()
    print(f"\n{len(table) - failed} of {len(table)} lessons passed; executed notebooks and HTML in {args.out}/")
    return 1 if failed else 0


def _grade(args) -> int:
    from tqdm.auto import tqdm

    from ..grader.execute import Stopped, containment
    from ..grader.grading import grade

    _existing_files(args.notebooks)
    _writable_folder(args.out)  # before grading: a bad --out must not cost a whole class's grading time
    print(f"gpulab grade: {containment()}", file=sys.stderr)
    try:
        grades = grade(args.notebooks, args.time_limit, out_dir=args.out,
                       progress=lambda xs: tqdm(xs, desc="grading", unit="notebook"))
    except Stopped as stop:
        if len(stop.done):
            _show_grades(stop.done, args.out)
        graded = stop.done["notebook"].nunique()
        print(f"gpulab grade: stopped by {stop.signal_name} after {graded} of {len(args.notebooks)} notebooks; their "
              f"grades are in {args.out}/: grade the others again", file=sys.stderr)
        return stopped_status(stop.signal_name)
    _show_grades(grades, args.out)
    seconds, checking = grades.attrs["seconds"], grades.attrs["installation_seconds"]
    print(f"graded {len(args.notebooks)} notebooks in {seconds:.0f} s, {checking:.1f} s of it "
          f"({checking / seconds:.0%}) checking the installation")
    skipped = grades.loc[grades["message"].str.startswith("not graded: installed files changed"), "notebook"].unique()
    if len(skipped):
        print(f"warning: installed files changed during grading; {len(skipped)} notebook(s) after that were not "
              "graded: reinstall the packages the grades name, and grade them again", file=sys.stderr)
    unrunnable = grades[(grades["points"] == 0) & ~grades["message"].str.match(r"(correct|wrong|not attempted|not checked)")]
    return 1 if len(unrunnable) else 0


def _show_grades(grades, out_dir: Path) -> None:
    """Print the grades and each notebook's total, and write them to ``out_dir``."""
    import pandas as pd

    from ..grader.grading import totals, write

    with pd.option_context("display.max_colwidth", 90, "display.width", 200):
        print(grades.drop(columns="max_points").to_string(index=False))
        print("\n" + totals(grades).to_string())
    for path in write(grades, out_dir):
        print(f"wrote {path}")


def _exercises(args) -> int:
    from .notebook_upkeep import build_exercises, stale_exercises

    if args.action == "build":
        for path in build_exercises():
            print(f"wrote {path}")
        return 0
    problems = stale_exercises()
    for problem in problems:
        print(problem)
    if problems:
        print("run `gpulab exercises build` (make exercises)")
    return 1 if problems else 0


def _notebooks(args) -> int:
    from .notebook_upkeep import tidy

    for path in tidy():
        print(f"tidied {path}")
    return 0


def _claims(args) -> int:
    from .claims import markdown, table

    claims = table()
    print(markdown(claims) if args.markdown else claims.to_string(index=False))
    return 0


def _reference(args) -> int:
    if args.action == "record":
        return _record(args)
    from ..results import add_reference

    if args.csv is None or args.command is None:
        raise UsageError("reference add needs a results CSV and --command (the command that produced it)")
    print(f"wrote {add_reference(args.csv, args.command, args.name)}")
    return 0


def _record(args) -> int:
    from .notebook_upkeep import lessons
    from .record import plan, record, require_gpu

    notebooks = lessons()  # the lessons only: a page (how the course measures) ships no results
    if not notebooks:
        raise UsageError("no lessons (notebooks/NN_*.ipynb) here: run it from the course's folder")
    if not args.dry_run:
        require_gpu()
    print(plan(notebooks, args.out))
    if args.dry_run:
        return 0
    print(record(notebooks, args.out).to_string(index=False))
    print("Commit gpulab/reference/ to ship these results with the course.")
    return 0


def _existing_files(paths: list[Path]) -> None:
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise UsageError(f"no such notebook: {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))


def _writable_folder(folder: Path) -> None:
    """Create ``folder`` now, or say why it cannot be the output folder."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} is a file, not a folder: name a folder (it is created if needed)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create the folder --out {folder}: {err.strerror}") from None


if __name__ == "__main__":
    sys.exit(main())
