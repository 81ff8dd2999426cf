"""`gpulab grade`: run submitted exercise notebooks and score every question.

Each notebook runs in its own process (and fresh kernel) under a time limit. Its checks report to
a file named by ``$GPULAB_GRADE_FILE``. A notebook that raises, hangs, exits or is not a notebook
gets zero points and the reason; the others are graded all the same.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from . import check

COLUMNS = ["notebook", "question", "points", "max_points", "passed", "message"]


def lesson_of(path: Path) -> str | None:
    """The lesson number of an exercise notebook, from its name (``01_cuda_basics.ipynb`` → "01")."""
    match = re.match(r"(\d\d)_", Path(path).name)
    return match.group(1) if match else None


def grade_notebook(path: Path, time_limit: float = 600) -> list[dict]:
    """One row per question of the notebook's lesson (one row only when the lesson can't be told)."""
    path = Path(path)
    lesson = lesson_of(path)
    try:
        expected = check.questions(lesson) if lesson else []
    except ImportError:
        expected = []
    if not expected:
        return [_row(path, "-", 0, 0, f"cannot tell which lesson this is: name it NN_topic.ipynb "
                     f"after one of the lessons (got {path.name!r})")]
    checks, failure = _run(path, time_limit)
    rows = []
    for q in expected:
        result = checks.get(q.name)
        if failure:
            rows.append(_row(path, q.name, 0, q.points, failure))
        elif result is None:
            rows.append(_row(path, q.name, 0, q.points, f"not checked: the notebook never ran {q.name}.check()"))
        else:
            earned = q.points if result["status"] == check.CORRECT else 0
            rows.append(_row(path, q.name, earned, q.points, f"{result['status']}: {result['message']}"))
    return rows


def grade(paths: list[Path], time_limit: float = 600, progress=None) -> pd.DataFrame:
    """Grade many notebooks; ``progress`` wraps the list (e.g. tqdm)."""
    rows = []
    for path in (progress or (lambda x: x))(list(paths)):
        rows += grade_notebook(Path(path), time_limit)
    return pd.DataFrame(rows, columns=COLUMNS)


def totals(grades: pd.DataFrame) -> pd.DataFrame:
    """Points per notebook."""
    return grades.groupby("notebook", sort=False)[["points", "max_points"]].sum()


def write(grades: pd.DataFrame, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / "grades.csv", out_dir / "grades.json"
    grades.to_csv(csv_path, index=False)
    json_path.write_text(json.dumps(grades.to_dict(orient="records"), indent=2) + "\n")
    return [csv_path, json_path]


def _row(path, question, points, max_points, message) -> dict:
    return {"notebook": str(path), "question": question, "points": points, "max_points": max_points,
            "passed": bool(max_points) and points == max_points, "message": message}


def _run(path: Path, time_limit: float) -> tuple[dict, str | None]:
    """Run the notebook in a worker process; returns (latest check per question, failure reason or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        env = {**os.environ, "GPULAB_GRADE_FILE": str(report)}
        worker = subprocess.Popen([sys.executable, "-m", "gpulab.grading", str(path)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = worker.communicate(timeout=time_limit)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)  # the worker and its kernel
            worker.communicate()
            return {}, f"ran past the time limit of {time_limit:g} s"
        events = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    checks = {e["question"]: e for e in events if e["event"] == "check"}
    errors = [e["message"] for e in events if e["event"] == "error"]
    if errors:
        return checks, errors[0]
    if worker.returncode != 0:
        tail = output.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return checks, f"the grader's worker failed (exit {worker.returncode}): {tail[0]}"
    return checks, None


def _worker(path: Path) -> int:
    """Run one notebook; report a failure to $GPULAB_GRADE_FILE (the checks report themselves)."""
    import nbformat

    from .execute import run_notebook

    try:
        nbformat.read(path, as_version=4)
        error = run_notebook(path).error
    except (OSError, ValueError, nbformat.reader.NotJSONError) as err:
        error = f"not a readable notebook: {err}"
    if error and "SystemExit" in error:
        error = f"the notebook called sys.exit ({error})"
    if error:
        with open(os.environ["GPULAB_GRADE_FILE"], "a") as f:
            f.write(json.dumps({"event": "error", "message": error}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_worker(Path(sys.argv[1])))
