"""`gpulab grade`: run a class's exercise notebooks and score every question, safely.

Learner code runs in the same kernel as the checks (as in nbgrader and otter), so the grader trusts that
kernel as little as it can. For each submission it:

1. copies the notebook into a fresh temporary folder and runs it there in a new kernel (working folder,
   HOME, TMPDIR and results inside that folder) under a time limit, through a worker process whose
   process group (worker, kernel and whatever they started) is killed afterwards;
2. appends a cell of its own that checks again, with the installed checkers, every answer the notebook
   gave to ``qN.check``, and prints the results with a fingerprint of gpulab's code
   (``integrity.fingerprint``), behind a tag made for this run that no cell of the learner can read
   before it runs; only lines carrying that tag count;
3. compares that fingerprint with the one a fresh Python process computes, and hashes the installed files
   before and after.

A check replaced, a result recorded without a check, a malformed report: that submission gets zero
points and the reason. A submission that changed the installed files gets zero, and the ones after it are
not graded: what the grader would run for them can no longer be trusted (reinstall gpulab and grade them
again). Grades are written after every submission, so an interrupted run keeps every finished grade.
"""

import inspect
import json
import math
import os
import re
import secrets
import shutil
import signal
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pandas as pd

from .check import CORRECT, NOT_ATTEMPTED, WRONG
from .integrity import digest_files, fingerprint

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
    rewritten after each notebook."""
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 < time_limit < math.inf:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    submissions = [(Path(p), _read(Path(p))) for p in paths]  # all read first: no notebook can change another's
    with tempfile.TemporaryDirectory(prefix="gpulab-grade-") as scratch:
        reference = _reference(Path(scratch))
    installed = lambda: digest_files(Path(reference["package"]), reference["path"])  # noqa: E731
    baseline, spoiled_by, rows = installed(), None, []
    for path, data in (progress or (lambda x: x))(submissions):
        questions = reference["lessons"].get(lesson_of(path) or "", [])
        if spoiled_by:
            found = _zero(path, questions, f"not graded: installed files changed while {spoiled_by} ran; "
                                           "reinstall gpulab and grade this notebook again")
        else:
            found = _grade_one(path, data, questions, time_limit, reference)
            now = installed()
            changed = [p for p in sorted(set(baseline) | set(now)) if baseline.get(p) != now.get(p)]
            if changed:
                spoiled_by = str(path)
                found = _zero(path, questions, f"installed files changed while this notebook ran ({_few(changed)}): "
                                               "zero points, and the notebooks after it were not graded")
        rows += found
        if out_dir is not None:
            write(pd.DataFrame(rows, columns=COLUMNS), out_dir)
    return pd.DataFrame(rows, columns=COLUMNS)


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
    problem = data if isinstance(data, str) else _not_a_notebook(data)
    if problem:
        return _zero(path, questions, f"not a readable notebook: {problem}")
    results, failure = _run(path, data, lesson_of(path), time_limit, reference)
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


def _run(path: Path, data: bytes, lesson: str, time_limit: float, reference: dict) -> tuple[dict, str | None]:
    """Run the notebook in its own folder; returns (results per question, failure reason or None)."""
    root = Path(tempfile.mkdtemp(prefix="gpulab-submission-"))
    tag, answer_tag = f"GPULAB-GRADE-{secrets.token_hex(16)}:", f"{secrets.token_hex(16)}:"
    try:
        (root / "work").mkdir()
        notebook = root / "work" / path.name
        notebook.write_bytes(data)
        job = {"notebook": str(notebook), "cell": _last_cell(tag, lesson, reference["modules"]), "tag": tag,
               "answer_tag": answer_tag, "cell_timeout": time_limit}
        worker = subprocess.Popen([sys.executable, str(Path(__file__).with_name("grade_worker.py"))],
                                  cwd=root, env=_kernel_env(root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)
        try:
            output, errors = worker.communicate(json.dumps(job).encode(), timeout=time_limit)
        except subprocess.TimeoutExpired:
            return {}, f"ran past the time limit of {time_limit:g} s"
        finally:
            _kill_group(worker)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    answers = [line[len(answer_tag):] for line in output.decode(errors="replace").splitlines()
               if line.startswith(answer_tag)]
    if len(answers) != 1:
        tail = errors.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {}, f"the grader's worker failed (exit {worker.returncode}): {tail[0]}"
    try:
        answer = json.loads(answers[0])
        answer["lines"] = [line for line in answer["lines"] if isinstance(line, str)]
    except (ValueError, KeyError, TypeError):
        return {}, "the grader's worker sent an answer it could not read: zero points"
    if answer.get("error"):
        error = answer["error"]
        return {}, f"the notebook called sys.exit ({error})" if "SystemExit" in error else error
    return _read_report(answer["lines"], tag, lesson, reference)


def _read_report(lines: list[str], tag: str, lesson: str, reference: dict) -> tuple[dict, str | None]:
    """The results in the grader's report, or the reason the submission gets zero."""
    if len(lines) != 1:
        return {}, (f"the grader's last cell printed {len(lines) or 'no'} report{'s' * (len(lines) != 1)}: the "
                    "notebook changed how Python runs or prints (zero points)")
    try:
        report = json.loads(lines[0][len(tag):])
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


def _last_cell(tag: str, lesson: str, modules: list[str]) -> str:
    """The grader's own cell: checks every recorded answer again and reports, tagged, with a fingerprint."""
    return inspect.getsource(fingerprint) + f'''

def _gpulab_grade(tag, lesson, modules):
    import importlib
    import json

    from gpulab import check

    module = importlib.import_module("gpulab.questions.lesson" + lesson)
    before = fingerprint(modules)
    results, unchecked = {{}}, []
    for q in sorted((q for q in vars(module).values() if type(q) is check.Question), key=lambda q: q.number):
        answers = vars(q).get("_answers")
        if answers is None:
            if q.last is not None or (lesson, q.name) in check._results:
                unchecked.append(q.name)
            continue
        status, message = check.Question._judge(q, answers)
        results[q.name] = {{"status": status, "message": str(message)}}
    after = fingerprint(modules)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    print(tag + json.dumps({{"fingerprint": before, "changed": changed, "results": results, "unchecked": unchecked}}))


_gpulab_grade({tag!r}, {lesson!r}, {modules!r})
'''


def _reference(scratch: Path) -> dict:
    """``integrity.reference()`` from a fresh Python process started as a kernel would be."""
    (scratch / "work").mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "gpulab.integrity"], cwd=scratch / "work", env=_kernel_env(scratch),
                          capture_output=True, text=True)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GradingError(f"cannot start grading: a fresh Python could not import gpulab ({tail})") from None


def _kernel_env(root: Path) -> dict:
    """The environment of a submission's worker and kernel: home, temporary files and results inside ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV)}
    for name in ("home", "tmp", "results"):
        (root / name).mkdir(exist_ok=True)
    env.update(HOME=str(root / "home"), TMPDIR=str(root / "tmp"), TEMP=str(root / "tmp"), TMP=str(root / "tmp"),
               GPULAB_RESULTS=str(root / "results"))
    env.setdefault("PYTHONUSERBASE", site.getuserbase())  # packages installed with `pip install --user` stay visible
    return env


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _read(path: Path) -> bytes | str:
    """The file's bytes, or why it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as err:
        return err.strerror or str(err)


def _not_a_notebook(data: bytes) -> str | None:
    """Why ``data`` is not a notebook nbformat can run, in one line (None when it is one)."""
    try:
        text = data.decode("utf-8")
        json.loads(text)
    except UnicodeDecodeError:
        return "the file is not UTF-8 text"
    except ValueError as err:
        return f"the file is not JSON ({err})"[:_MESSAGE_LIMIT]
    try:
        nbformat.validate(nbformat.reads(text, as_version=4))
    except Exception as err:  # nbformat raises many kinds (schema, version, missing keys)
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"the file is JSON but not a Jupyter notebook ({detail})"[:_MESSAGE_LIMIT]
    return None


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
