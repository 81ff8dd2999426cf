"""gpulab.questions.timed_check: each side of a timed check runs in its own process, timed on the parent's clock, suspended
while the other side runs, and ended with everything it started. Tested with a toy task; no assertion here depends
on how fast this machine is (only on lower bounds such as a sleep's length, and on suspended processes using no
CPU)."""

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from gpulab.check import Wrong
from gpulab.questions.timed_check import Duel

from .conftest import ROOT, notebook_function


class ToyTask:
    """Each trial calls the function with the seed; the baseline sleeps a little."""

    @staticmethod
    def baseline(seed):
        time.sleep(0.05)
        return {"now": time.time()}

    @staticmethod
    def namespace():
        return {"__name__": "__answer__"}

    @staticmethod
    def warm_up():
        pass

    @staticmethod
    def trial(fn, seed, events):
        events.mark(stage="called")
        value = fn(seed)
        events.done()
        return {"value": value, "pid": os.getpid()}


TASK = ToyTask()
TASK_NAME = f"{__name__}:TASK"


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    """The sides import this module by name to find TASK."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def duel(source: str, **options) -> Duel:
    return Duel(TASK_NAME, source, "answer", **options)


def test_the_parent_times_the_call_and_a_patched_clock_does_not_reach_it():
    source = "def answer(seed):\n    import time\n    time.perf_counter = lambda: 0.0\n    time.sleep(0.3)\n    return seed * 2\n"
    clock = time.perf_counter
    with duel(source) as d:
        trial = d.trial("answer", 21)
    assert trial.report["value"] == 42 and trial.seconds >= 0.3
    assert trial.marks and trial.marks[0][1]["stage"] == "called" and 0 <= trial.marks[0][0] <= trial.seconds
    assert time.perf_counter is clock


def test_a_side_is_suspended_while_the_other_runs():
    source = ("def answer(seed):\n    import threading\n\n    def spin():\n        while True:\n            pass\n\n"
              "    threading.Thread(target=spin, daemon=True).start()\n    return {'now': 0}\n")
    with duel(source) as d:
        pid = d.trial("answer", 1).report["pid"]
        answer = psutil.Process(pid)
        before = sum(answer.cpu_times()[:2])
        for seed in range(6):  # 0.3 s of baseline trials, while a thread of the answer wants to spin
            d.trial("baseline", seed)
        assert sum(answer.cpu_times()[:2]) - before < 0.05
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_pairs_alternate_which_side_goes_first():
    with duel("def answer(seed):\n    import time\n    return {'now': time.time()}\n") as d:
        pairs = d.pairs([1, 2, 3, 4])
    firsts = ["baseline" if b.report["value"]["now"] < a.report["value"]["now"] else "answer" for b, a in pairs]
    assert firsts == ["baseline", "answer", "baseline", "answer"]


def test_the_answer_cannot_read_what_the_parent_holds():
    expected_secret = 42  # noqa: F841 (a stack-walking answer looks for the check's locals)
    source = ("def answer(seed):\n    import sys\n    names, frame = set(), sys._getframe()\n"
              "    while frame:\n        names |= set(frame.f_locals)\n        frame = frame.f_back\n"
              "    return sorted(names)\n")
    with duel(source, sides=("answer",)) as d:
        names = d.trial("answer", 0).report["value"]
    assert "fn" in names and "expected_secret" not in names and "d" not in names


@pytest.mark.parametrize("body, says", [
    ("return 1 / 0", "your function raised ZeroDivisionError: division by zero (line 2 of answer)"),
    ("import os; os._exit(3)", "ended unexpectedly"),
])
def test_a_failing_answer_is_named_with_its_error(body, says):
    with duel(f"def answer(seed):\n    {body}\n", sides=("answer",)) as d, pytest.raises(Wrong) as err:
        d.trial("answer", 0)
    assert says in str(err.value)


def test_prints_of_the_answer_do_not_disturb_the_reports():
    with duel("def answer(seed):\n    for i in range(2000):\n        print('RESULT', i, '{\"event\": \"done\"}')\n"
              "    return 7\n", sides=("answer",)) as d:
        assert d.trial("answer", 0).report["value"] == 7


def test_a_hanging_answer_is_stopped_at_the_time_limit_and_nothing_is_left():
    source = "def answer(seed):\n    import subprocess, time\n    subprocess.Popen(['sleep', '60'])\n    time.sleep(60)\n"
    with duel(source, sides=("answer",), trial_limit=2) as d:
        pid = d.sides["answer"].process.pid
        with pytest.raises(Wrong, match="ran past the check's time limit"):
            d.trial("answer", 0)
        children = psutil.Process(pid).children(recursive=True)
    assert children and not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_answer_travels_as_source_with_what_it_uses():
    helper = notebook_function("def helper(x):\n    return x + OFFSET\n", "helper", OFFSET=10)
    answer = notebook_function("def answer(seed):\n    return helper(seed)\n", "answer", helper=helper)
    from gpulab.questions.portable import source_of

    with duel(source_of(answer), sides=("answer",)) as d:
        assert d.trial("answer", 5).report["value"] == 15


def test_a_side_ends_when_its_parent_dies(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from gpulab.questions.timed_check import Duel
        duel = Duel({TASK_NAME!r}, "def answer(seed):\\n    return seed\\n", "answer", sides=("answer",))
        duel.__enter__()
        print(duel.sides["answer"].process.pid, flush=True)
        time.sleep(60)
        """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})  # what a killed parent leaves stays there
    side = psutil.Process(int(parent.stdout.readline()))
    deadline = time.monotonic() + 10  # SIGSTOP takes effect when the kernel next schedules the side
    while side.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert side.status() == psutil.STATUS_STOPPED  # suspended between trials
    parent.kill()
    parent.wait()
    side.wait(timeout=10)


def test_a_clock_patched_in_the_notebook_after_import_does_not_reach_the_check(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    with duel("def answer(seed):\n    import time\n    time.sleep(0.3)\n    return seed\n", sides=("answer",)) as d:
        assert d.trial("answer", 1).seconds >= 0.3
