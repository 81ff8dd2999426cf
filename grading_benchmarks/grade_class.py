"""Grade a mixed class with `gpulab grade`, as a workshop would, and check what the grader left behind.

For each lesson asked (default 05 to 08) the class holds: the solution (full marks), the blank exercise (zero,
"not attempted"), the solution with q1 answered wrong afterwards (all but q1's points), a blank that rewrites the
grader's report through sys.stdout (zero), the solution plus a double-forked `setsid` daemon (zero, "detached"),
and a file that is not a notebook (zero). One `gpulab grade` runs them all; then this script compares every
notebook's total with what it should be, looks for any process the class started (`ps`) and any temporary folder
of the grader, and prints the time grading took and the share spent checking the installation.

    python grading_benchmarks/grade_class.py                 # 24 notebooks, lessons 05-08 (about 20 minutes on 2 cores)
    python grading_benchmarks/grade_class.py --lessons 05    # 6 notebooks

Exit status 0 when every grade is as expected and nothing was left, 1 otherwise.
"""

import argparse
import re
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pandas as pd
import psutil

ROOT = Path(__file__).resolve().parents[1]
TOKEN = f"gpulab-class-{secrets.token_hex(4)}"  # in the command line of every process a hostile notebook starts

WRONG_Q1 = "q1.check(lambda *args, **kwargs: None)  # a wrong answer, checked after the right one"
FORGE_STDOUT = r'''
import json, re, sys
class Rewrite:
    def __init__(self, out):
        self.out = out
    def write(self, text):
        match = re.match(r"(GPULAB-GRADE-\w+:)(.*)", text)
        if match:
            report = json.loads(match.group(2))
            for result in report["report"]["results"].values():
                result["status"] = "correct"
            text = match.group(1) + json.dumps(report)
        return self.out.write(text)
    def __getattr__(self, name):
        return getattr(self.out, name)
sys.stdout = Rewrite(sys.stdout)
'''
ESCAPE = f'''
import subprocess, sys
launcher = "import os, subprocess, sys; os.setsid(); subprocess.Popen(sys.argv[1:], start_new_session=True)"
subprocess.run([sys.executable, "-c", launcher, sys.executable, "-c", "import time; time.sleep(900)", {TOKEN!r}],
               check=True)
'''


def build_class(lessons: list[str], folder: Path) -> pd.DataFrame:
    """Write the class's notebooks under ``folder``; a table of notebook, lesson, kind and the expected reason."""
    import importlib

    from gpulab import check

    rows = []
    for lesson in lessons:
        importlib.import_module(f"gpulab.questions.lesson{lesson}")  # registers the lesson's questions
        solution = next(ROOT.glob(f"solutions/{lesson}_*.ipynb"))
        blank = ROOT / "exercises" / solution.name
        points = {q.name: q.points for q in check.questions(lesson)}
        kinds = {
            "good": (solution, [], sum(points.values()), "correct"),
            "blank": (blank, [], 0, "not attempted"),
            "wrong q1": (solution, [WRONG_Q1], sum(points.values()) - points["q1"], "wrong"),
            "forged stdout": (blank, [FORGE_STDOUT], 0, "not attempted"),
            "setsid daemon": (solution, [ESCAPE], 0, "the notebook left processes running detached"),
            "not a notebook": (None, [], 0, "not a readable notebook"),
        }
        for kind, (base, cells, expected, reason) in kinds.items():
            path = folder / f"{lesson}-{kind.replace(' ', '-')}" / solution.name
            path.parent.mkdir(parents=True)
            if base is None:
                path.write_text("{ this is not JSON")
            else:
                nb = nbformat.read(base, as_version=4)
                nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
                nbformat.write(nb, path)
            rows.append({"notebook": str(path), "lesson": lesson, "kind": kind, "expected": expected,
                         "max": sum(points.values()), "reason": reason})
    return pd.DataFrame(rows)


def leftovers(pid: int) -> list[str]:
    """Processes the class started, and folders or cgroups of the grader (process ``pid``), still there."""
    found = [f"process {p.pid}: {' '.join(p.info['cmdline'] or [])[:80]}"
             for p in psutil.process_iter(["cmdline"]) if TOKEN in " ".join(p.info["cmdline"] or [])]
    for where in {tempfile.gettempdir(), "/tmp"}:
        found += [f"folder {f}" for f in Path(where).glob(f"gpulab-*-{pid}-*")]
    from gpulab.grader.execute import _cgroup_home

    home = _cgroup_home()
    return found + [f"cgroup {f}" for f in (home.glob(f"gpulab-{pid}-*") if home else [])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lessons", nargs="+", default=["05", "06", "07", "08"])
    parser.add_argument("--time-limit", type=float, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpulab-class-") as scratch:
        table = build_class(args.lessons, Path(scratch))
        out = Path(scratch) / "grades"
        grader = subprocess.Popen([sys.executable, "-m", "gpulab.commands.cli", "grade", *table["notebook"], "--out", str(out),
                                   "--time-limit", str(args.time_limit)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        stdout, stderr = grader.communicate()
        left = leftovers(grader.pid)
        grades = pd.read_csv(out / "grades.csv")
    earned = grades.groupby("notebook")["points"].sum()
    reasons = grades.groupby("notebook")["message"].apply(list)
    table["points"] = table["notebook"].map(earned)
    table["as_expected"] = [row.points == row.expected and any(m.startswith(row.reason) for m in reasons[row.notebook])
                            for row in table.itertuples()]
    print(table[["lesson", "kind", "points", "max", "expected", "as_expected"]].to_string(index=False))
    timing = re.search(r"graded \d+ notebooks in .*", stdout)
    print(f"\n{len(table)} notebooks, grader exit status {grader.returncode}; {timing.group(0) if timing else stderr[-500:]}")
    print(f"left behind: {left or 'nothing'}")
    return 0 if table["as_expected"].all() and not left else 1


if __name__ == "__main__":
    sys.exit(main())
