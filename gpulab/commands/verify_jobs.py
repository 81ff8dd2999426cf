"""Running the parts of `make verify-gpu` under time limits: a lesson in a fresh kernel (in ``execute``'s contained
worker), a command in a session of its own, several of them at once; and the warnings a learner would see.

A lesson past its limit has its kernel and everything the kernel started killed; its worker then hands back the
executed notebook with the cells that ran, and ``execute`` ends what is left of its group. A part whose processes
cannot be ended (a process stuck in the driver) is left behind, and said so: the run goes on without waiting.
"""

import queue
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import nbformat
import psutil

from ..grader.execute import notebook_problem, run_contained
from ..processes import end_tree

PART_TOKEN = "GPULAB_VERIFY_PART"  # in the environment of a lesson's worker and kernel: finds them at its limit
GRACE_S = 20.0  # after a lesson's kernel is killed at its limit: for its worker to hand back the executed notebook
END_S = 15.0  # then for its processes to end; a part still running after that is left behind
MIN_START_S = 20.0  # no part starts with less time than this before its deadline
POLL_S = 1.0
_WARNING = re.compile(r"^(?:\S.*?:\d+: )?([A-Z]\w*Warning): (.+)$")


@dataclass
class Outcome:
    """How a part ended: "passed", "FAILED", "timed out" or "not run"; the executed notebook of a lesson."""
    status: str
    seconds: float
    detail: str = ""
    notebook: str | None = None
    warnings: tuple[str, ...] = ()


@dataclass
class Job:
    """A part to run: ``run(limit_s)`` runs it, stopped at that limit; ``alone``: nothing else runs beside it."""
    name: str
    run: Callable[[float], Outcome]
    limit: float
    alone: bool = False


def run_many(jobs: list[Job], slots: int, deadline: float, on_done: Callable, *,
             on_change: Callable = lambda names: None, clock: Callable[[], float] = time.monotonic) -> None:
    """Run ``jobs`` in their order, up to ``slots`` at once, those ``alone`` by themselves after the others, each
    stopped early enough to have ended (or been left behind) by ``deadline``; none starts with less than
    ``MIN_START_S`` seconds of its own.

    ``on_done(job, outcome, at_once)`` is called in this thread as each ends (``job.limit``: the limit it ran
    under; ``at_once``: the most jobs that ran at the same time during it), also for jobs not run;
    ``on_change(names)`` whenever the running set changes. A job still running ``GRACE_S + END_S`` after its limit
    is left behind. Ctrl-C kills every process this one started."""
    waiting = sorted(jobs, key=lambda job: job.alone)
    running: dict[str, list] = {}  # name: [job, started, limit, at_once]
    ended: queue.Queue = queue.Queue()

    def finish(name: str, outcome: Outcome) -> None:
        job, _, _, at_once = running.pop(name)
        on_done(job, outcome, at_once)
        on_change(sorted(running))

    try:
        while waiting or running:
            while waiting and _may_start(waiting[0], running, slots):
                job, now = waiting.pop(0), clock()
                time_left = deadline - now - GRACE_S - END_S
                if time_left < MIN_START_S:
                    on_done(job, Outcome("not run", 0.0, "no time left to start it"), 0)
                    continue
                job = replace(job, limit=min(job.limit, time_left))  # the limit it runs under, for on_done
                running[job.name] = [job, now, job.limit, 0]
                for entry in running.values():
                    entry[3] = max(entry[3], len(running))
                _start(job, job.limit, ended)
                on_change(sorted(running))
            if not running:
                continue
            try:
                name, outcome = ended.get(timeout=POLL_S)
            except queue.Empty:
                for name, (_, started, limit, _) in list(running.items()):
                    if clock() > started + limit + GRACE_S + END_S:
                        finish(name, Outcome("timed out", clock() - started,
                                             f"still running {GRACE_S + END_S:g} s after its {limit / 60:.1f}-minute "
                                             "limit: left behind (a process stuck in the driver?)"))
                continue
            if name in running:
                finish(name, outcome)
    except BaseException:
        end_tree(psutil.Process(), keep_root=True)
        raise


def _may_start(job: Job, running: dict, slots: int) -> bool:
    if job.alone:
        return not running
    return len(running) < slots and not any(entry[0].alone for entry in running.values())


def _start(job: Job, limit: float, ended: queue.Queue) -> None:
    def work():
        try:
            outcome = job.run(limit)
        except Exception as err:  # a part that cannot start must not stop the others
            outcome = Outcome("FAILED", 0.0, f"could not run: {type(err).__name__}: {err}")
        ended.put((job.name, outcome))

    threading.Thread(target=work, name=f"gpulab-verify-{job.name}", daemon=True).start()


def run_lesson(notebook: Path, env: dict, limit: float, kernel_log: Path) -> Outcome:
    """``notebook`` in a fresh kernel (started in its folder, with ``env``), in a contained worker; at ``limit``
    seconds the kernel and all it started are killed and the executed notebook keeps the cells that ran."""
    start = time.monotonic()
    try:
        text = Path(notebook).read_text(encoding="utf-8")
        problem = notebook_problem(text.encode())
    except (OSError, UnicodeDecodeError) as err:
        problem = str(err)
    if problem:
        return Outcome("FAILED", 0.0, f"could not run: not a readable notebook ({problem})")
    token = secrets.token_hex(8)
    stopped = threading.Event()

    def stop():
        stopped.set()
        for worker in _children_with(token):
            end_tree(worker, keep_root=True)

    timer = threading.Timer(limit, stop)
    timer.daemon = True
    timer.start()
    job = {"notebook": text, "cell_timeout": int(limit) + 60, "kernel_log": str(kernel_log)}
    try:
        answer, failure = run_contained(job, cwd=Path(notebook).parent.resolve(), env={**env, PART_TOKEN: token},
                                        time_limit=limit + GRACE_S)
    finally:
        timer.cancel()
    seconds, executed = time.monotonic() - start, answer.get("notebook")
    error = failure or answer.get("error")
    warnings = learner_warnings(executed) if executed else ()
    if stopped.is_set():  # its kernel was killed here: whatever the worker said of that is not the lesson's error
        return Outcome("timed out", seconds, stopped_at(limit, executed), executed, warnings)
    return Outcome("FAILED" if error else "passed", seconds, error or "", executed, warnings)


def stopped_at(limit: float, notebook: str | None) -> str:
    """What a lesson stopped at its limit says: the limit, and where the executed ``notebook`` shows them, the code
    cell it was running and that cell's last line of output (lesson 08 prints each race as it starts: the step that
    was running)."""
    said = f"stopped at its {limit / 60:.1f}-minute limit"
    found = _running(nbformat.reads(notebook, as_version=4)) if notebook else None
    if found is None:
        return said
    number, cell = found
    last = last_output_line(cell)
    return f"{said} while code cell {number} ran" + (f" (its last output: {last})" if last else "")


def running_cell(notebook: str) -> int | None:
    """The number of the code cell that had started and not ended in an executed notebook (by nbclient's timing
    metadata: its input went to the kernel, no reply came back), as "code cell N" counts; None if none."""
    found = _running(nbformat.reads(notebook, as_version=4))
    return found[0] if found else None


def _running(nb) -> tuple[int, dict] | None:
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code_cells, 1):
        timing = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in timing and "shell.execute_reply" not in timing:
            return number, cell
    return None


def last_output_line(cell: dict, width: int = 100) -> str:
    """The last non-blank line a cell printed or displayed as text (a progress bar's last state), cut to ``width``."""
    texts = [out.get("text", "") if out.get("output_type") == "stream" else out.get("data", {}).get("text/plain", "")
             for out in cell.get("outputs", [])]
    lines = [line.strip() for text in texts for line in text.splitlines()]  # a progress bar's \r ends a line too
    last = next((line for line in reversed(lines) if line), "")
    return last if len(last) <= width else last[:width - 3] + "..."


def run_command(argv: list[str], env: dict, limit: float, log_path: Path) -> Outcome:
    """``argv`` in a session of its own, its output to ``log_path``; at ``limit`` seconds it and everything it
    started are killed. The detail: pytest's summary line, or the last line of its output when it failed."""
    start = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            ended = end_tree(psutil.Process(proc.pid))
            return Outcome("timed out", time.monotonic() - start, f"stopped at its {limit / 60:.1f}-minute limit"
                           + ("" if ended else "; some of its processes could not be ended"))
    tail = log_path.read_text(errors="replace").strip().splitlines()
    summary = next((line.strip("= ") for line in reversed(tail) if re.search(r"\d+ (passed|failed|error)", line)), "")
    seconds = time.monotonic() - start
    if code == 0:
        return Outcome("passed", seconds, summary)
    return Outcome("FAILED", seconds, f"exit status {code}: {summary or (tail[-1] if tail else 'no output')}")


def learner_warnings(notebook: str) -> tuple[str, ...]:
    """The warnings a learner sees in the executed notebook (its cells' stderr), as "code cell N: Category:
    message", each message once, in the order they first appear."""
    nb = nbformat.reads(notebook, as_version=4)
    found: dict[str, str] = {}
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code_cells, 1):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                for line in out.get("text", "").splitlines():
                    match = _WARNING.match(line.strip())
                    if match:
                        message = f"{match[1]}: {match[2].strip()[:200]}"
                        found.setdefault(message, f"code cell {number}: {message}")
    return tuple(found.values())


def _children_with(token: str) -> list[psutil.Process]:
    """This process's children whose environment carries ``token`` (a lesson's worker)."""
    found = []
    for child in psutil.Process().children():
        try:
            if child.environ().get(PART_TOKEN) == token:
                found.append(child)
        except psutil.Error:
            continue
    return found
