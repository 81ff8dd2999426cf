"""`gpulab grade`: run a class's exercise notebooks and score every question, safely.

Learner code runs in the same kernel as the checks (as in nbgrader and otter), so the grader trusts that
kernel as little as it can. For each submission it:

1. runs the notebook, whose bytes reach the worker through a pipe, in a new kernel in a fresh temporary folder
   (working folder, HOME, TMPDIR and results inside it) under a time limit, in a group with every process it
   starts (``execute.Group``: a cgroup of its own where the machine allows), which is ended as a whole
   afterwards; the grader removes the folder and the kernel's folder itself, also on Ctrl-C or SIGTERM;
2. has the kernel, started before any cell of the notebook, check again with the installed checkers every answer
   the notebook gave to ``qN.check``, and write the results with a fingerprint of gpulab's code to a socket that
   only the kernel inherited, behind a tag made for this run (``integrity.serve_report``); only lines carrying
   that tag count;
3. compares that fingerprint with the one a fresh Python process computes, zeroes a notebook that left
   processes running detached from its kernel, and watches the installation (``integrity.Installation``).

A check replaced, a result recorded without a check, a malformed report, a detached process: that submission
gets zero points and the reason. A submission that changed the installed files gets zero, and the ones after it
are not graded: what the grader would run for them can no longer be trusted (reinstall and grade them again).
Grades are written after every submission, so an interrupted run keeps every finished grade.
"""

import json
import math
import os
import re
import secrets
import shutil
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from ..check import CORRECT, NOT_ATTEMPTED, WRONG
from .execute import Stopped, clear_leftovers, notebook_problem, run_contained, shielded, temp_folder
from .integrity import Installation, InstallationChanged

COLUMNS = ["notebook", "question", "points", "max_points", "passed", "message"]
_PRIVATE_ENV = ("GPULAB_GRADE", "JUPYTER_", "IPYTHONDIR", "XDG_", "MPLCONFIGDIR", "PYTHONPYCACHEPREFIX",
                "PYTHONSTARTUP", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
_MESSAGE_LIMIT = 500


class GradingError(RuntimeError):
    """The grader itself cannot start (e.g. gpulab cannot be imported); the message says why."""


def lesson_of(path: Path) -> str | None:
    """The lesson number of an exercise notebook, from its name (``01_cuda_basics.ipynb`` → "01")."""
    match = re.match(r"(\d\d)_", Path(path).name)
    return match.group(1) if match else None


def grade(paths: list[Path], time_limit: float = 600, progress=None, out_dir: Path | None = None) -> pd.DataFrame:
    """Grade many notebooks; ``progress`` wraps the list (e.g. tqdm); ``out_dir`` gets grades.csv and grades.json
    rewritten after each notebook. The table's ``attrs`` say how long it took ("seconds") and how much of that went
    to checking the installation ("installation_seconds"). Ctrl-C (or SIGTERM, raised as KeyboardInterrupt) ends
    the notebook that runs and raises ``Stopped`` with the grades so far."""
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 < time_limit < math.inf:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    start, rows = time.perf_counter(), []
    try:
        clear_leftovers()
        submissions = [(Path(p), _read(Path(p))) for p in paths]  # all read first: no notebook can change another's
        with tempfile.TemporaryDirectory(prefix=f"gpulab-grade-{os.getpid()}-") as scratch:
            reference = _reference(Path(scratch))
        installation = _installation(reference)
        spoiled_by = None
        for path, data in (progress or (lambda x: x))(submissions):
            questions = reference["lessons"].get(lesson_of(path) or "", [])
            if spoiled_by:
                found = _zero(path, questions, f"not graded: installed files changed while {spoiled_by} ran; "
                                               "reinstall them and grade this notebook again")
            else:
                found = _grade_one(path, data, questions, time_limit, reference)
                changed = installation.changes()
                if changed:
                    spoiled_by = str(path)
                    found = _zero(path, questions, f"installed files changed while this notebook ran "
                                                   f"({_few(changed)}): zero points, and the notebooks after it "
                                                   "were not graded")
            rows += found
            if out_dir is not None:
                write(pd.DataFrame(rows, columns=COLUMNS), out_dir)
    except KeyboardInterrupt as stop:
        raise Stopped(pd.DataFrame(rows, columns=COLUMNS), str(stop) or "Ctrl-C") from None
    grades = pd.DataFrame(rows, columns=COLUMNS)
    grades.attrs.update(seconds=time.perf_counter() - start, installation_seconds=installation.seconds)
    return grades


def totals(grades: pd.DataFrame) -> pd.DataFrame:
    """Points per notebook."""
    return grades.groupby("notebook", sort=False)[["points", "max_points"]].sum()


def write(grades: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Write grades.csv and grades.json in ``out_dir``, each replaced in one step (never half written)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / "grades.csv", out_dir / "grades.json"
    _replace(csv_path, grades.to_csv(index=False))
    _replace(json_path, json.dumps(grades.to_dict(orient="records"), indent=2) + "\n")
    return [csv_path, json_path]


def _grade_one(path: Path, data: bytes | str, questions: list, time_limit: float, reference: dict) -> list[dict]:
    """One row per question of the notebook's lesson (one row only when the lesson can't be told)."""
    if not questions:
        return [_row(path, "-", 0, 0, f"cannot tell which lesson this is: name it NN_topic.ipynb after one of "
                                      f"the lessons (got {path.name!r})")]
    problem = data if isinstance(data, str) else notebook_problem(data)
    if problem:
        return _zero(path, questions, f"not a readable notebook: {problem}")
    results, failure = _run(data.decode("utf-8"), lesson_of(path), time_limit, reference)
    if failure:
        return _zero(path, questions, failure)
    rows = []
    for name, points in questions:
        result = results.get(name)
        if result is None:
            rows.append(_row(path, name, 0, points, f"not checked: the notebook never ran {name}.check()"))
        else:
            earned = points if result["status"] == CORRECT else 0
            rows.append(_row(path, name, earned, points, f"{result['status']}: {result['message']}"))
    return rows


def _run(text: str, lesson: str, time_limit: float, reference: dict) -> tuple[dict, str | None]:
    """Run the notebook in a folder of its own; returns (results per question, failure reason or None)."""
    root = Path(temp_folder("submission"))
    tag = f"GPULAB-GRADE-{secrets.token_hex(16)}:"
    job = {"notebook": text, "cell_timeout": time_limit, "kernel_log": None,
           "report": {"tag": tag, "lesson": lesson, "modules": reference["modules"],
                      "integrity": str(Path(reference["package"], "grader", "integrity.py"))}}
    try:
        (root / "work").mkdir()
        answer, failure = run_contained(job, cwd=root / "work", env=_kernel_env(root), time_limit=time_limit)
    finally:
        with shielded():
            shutil.rmtree(root, ignore_errors=True)
    if failure:
        return {}, failure
    if answer.get("error"):
        error = str(answer["error"])
        return {}, f"the notebook called sys.exit ({error})" if "SystemExit" in error else error
    if answer.get("escaped"):
        return {}, (f"the notebook left processes running detached from its kernel ({_few(map(str, answer['escaped']))})"
                    ": zero points")
    lines = [line for line in answer.get("lines", []) if isinstance(line, str)]
    return _read_report(lines, tag, lesson, reference)


def _read_report(lines: list[str], tag: str, lesson: str, reference: dict) -> tuple[dict, str | None]:
    """The results in the grader's report, or the reason the submission gets zero."""
    if len(lines) != 1:
        return {}, (f"the grader's report came {len(lines)} times from this notebook's kernel: the notebook "
                    "changed how the kernel runs (zero points)" if lines else
                    "the grader's report never came from this notebook's kernel: the notebook changed how the kernel "
                    "runs, or closed the grader's channel (zero points)")
    try:
        body = json.loads(lines[0][len(tag):])
        if "error" in body:
            return {}, (f"the grader's check failed in this notebook's kernel ({str(body['error'])[:_MESSAGE_LIMIT]}): "
                        "did the notebook change gpulab or Python itself? (zero points)")
        report = body["report"]
        kernel, changed, unchecked = report["fingerprint"], report["changed"], report["unchecked"]
        results = {name: {"status": r["status"], "message": str(r["message"])[:_MESSAGE_LIMIT]}
                   for name, r in report["results"].items()}
        if not (isinstance(kernel, dict) and isinstance(changed, list) and isinstance(unchecked, list)) or any(
                r["status"] not in (CORRECT, WRONG, NOT_ATTEMPTED) for r in results.values()):
            raise ValueError("unexpected values")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return {}, f"the grader's report from this notebook was malformed ({type(err).__name__}): zero points"
    loaded = {key.split(":")[0] for key in kernel if key.endswith(":__file__")}
    required = {"gpulab.check", f"gpulab.questions.lesson{lesson}"}
    modified = sorted({k for k, v in reference["fingerprint"].items() if k.split(":")[0] in loaded and kernel.get(k) != v}
                      | {f"{m}:__file__" for m in required - loaded} | set(map(str, changed)))
    if modified:
        return {}, f"the notebook modified the checks ({_few(modified)}): zero points"
    if unchecked:
        return {}, f"the notebook recorded results without running the checks ({_few(map(str, unchecked))}): zero points"
    return results, None


def _reference(scratch: Path) -> dict:
    """``integrity.reference()`` from a fresh Python process started as a kernel would be."""
    (scratch / "work").mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "gpulab.grader.integrity"], cwd=scratch / "work", env=_kernel_env(scratch),
                          capture_output=True, text=True)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GradingError(f"cannot start grading: a fresh Python could not import gpulab ({tail})") from None


def _installation(reference: dict) -> Installation:
    """The installation, watched from now on; GradingError when it already differs from what was installed."""
    try:
        return Installation(reference["watched"])
    except InstallationChanged as err:
        raise GradingError(f"cannot start grading: {err}") from None


def _kernel_env(root: Path) -> dict:
    """The environment of a submission's worker and kernel: home, temporary files and results inside ``root``,
    and no bytecode written into the installation."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV)}
    for name in ("home", "tmp", "results"):
        (root / name).mkdir(exist_ok=True)
    env.update(HOME=str(root / "home"), TMPDIR=str(root / "tmp"), TEMP=str(root / "tmp"), TMP=str(root / "tmp"),
               GPULAB_RESULTS=str(root / "results"), PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("PYTHONUSERBASE", site.getuserbase())  # packages installed with `pip install --user` stay visible
    return env


def _read(path: Path) -> bytes | str:
    """The file's bytes, or why it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as err:
        return err.strerror or str(err)


def _row(path, question, points, max_points, message) -> dict:
    return {"notebook": str(path), "question": question, "points": points, "max_points": max_points,
            "passed": bool(max_points) and points == max_points, "message": message}


def _zero(path: Path, questions: list, reason: str) -> list[dict]:
    if not questions:
        return [_row(path, "-", 0, 0, reason)]
    return [_row(path, name, 0, points, reason) for name, points in questions]


def _few(names, shown: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
