"""`make verify-gpu` and `make verify-gpu-smoke` (gpulab.commands.verify) on a CPU, with a fake GPU: the budgeted run's order
and budget on injected times, a part that hangs and a monitor that never stops (the run still returns within its
budget), a lesson's kernel killed at its limit, a command killed with all it started, the output folder's and the
bundle's limits, and the smoke run of two small lessons at once."""

import re
import sys
import tarfile
import threading
import time
from pathlib import Path

import nbformat
import pandas as pd
import psutil
import pytest

from gpulab import monitor, plans, results
from gpulab.commands import record, verify, verify_jobs, verify_out
from gpulab.commands import verify_plan as planning
from gpulab.commands.verify_jobs import Outcome
from gpulab.commands.verify_plan import H100, estimate

from . import fake_libnvml
from .conftest import ROOT

WARNINGS_FIXTURE = ROOT / "tests" / "data" / "verify" / "h200_quick_warnings.ipynb"  # real outputs, H200 quick run
H200_RUN = ROOT / "tests" / "data" / "verify" / "2026-11-28-h200"  # lessons 08 and 09 in full mode on an H200
KERNEL_DIED = "the kernel died (os._exit, a crash, or out of memory)"  # what execute.run says of a dead kernel


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


class FakeClock:
    """A monotonic clock that moves only when told to (``advance``), and by ``tick`` on every reading."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick, self._lock = 1000.0, tick, threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += self.tick
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class FakeMonitor:
    """gpulab.monitor.Monitor's interface: a sample at each mark; ``stuck``: its stop() never returns."""

    def __init__(self, stuck: bool = False):
        self.rows, self.stuck, self.available, self.reason = [], stuck, True, ""
        self.released = threading.Event()

    def start(self):
        return self

    def mark(self, phase: str) -> None:
        self.rows.append((float(len(self.rows)), phase, 97.0, 40.0, 12.5, 512.0, 61.0, 1980.0, "SW power cap", 3.2))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(list(self.rows), columns=list(monitor.COLUMNS))

    def stop(self) -> None:
        if self.stuck:
            self.released.wait()


@pytest.fixture
def on_a_gpu(tmp_path, monkeypatch):
    """verify() as on an H100: no GPU check, rows that name the H100, reference results into tmp_path/reference,
    and ship() recording what it was asked to ship. Returns that record."""
    monkeypatch.setattr(record, "require_gpu", lambda: None)
    monkeypatch.setattr(results, "REFERENCE_DIR", tmp_path / "reference")
    monkeypatch.setattr(results, "environment", lambda device=None: {
        "schema": 1, "host": "h", "device": "cuda:0", "device_name": H100, "driver": "1.0",
        "torch": "2.x", "cuda": "12", "quick": False})
    shipped = []

    def ship(folder, passed, command=record.COMMAND):
        shipped.append((passed, command))
        return pd.DataFrame({"results": [], "shipped": []})

    monkeypatch.setattr(record, "ship", ship)
    return shipped


def _fake_runs(monkeypatch, clock: FakeClock, seconds: dict, calls: list, hang: threading.Event | None = None):
    """Lessons and commands that take ``seconds[(name, "quick"|"full")]`` on ``clock`` (None: hang until ``hang``
    is set) and pass; each call (name, mode, limit) goes to ``calls``."""

    def take(name: str, mode: str, limit: float) -> Outcome:
        calls.append((name, mode, round(limit)))
        took = seconds[name, mode]
        if took is None:
            hang.wait()
            return Outcome("passed", 0.0)
        clock.advance(took)
        return Outcome("passed", took, notebook=nbformat.writes(nbformat.v4.new_notebook()))

    monkeypatch.setattr(verify, "run_lesson", lambda notebook, env, limit, log: take(
        Path(notebook).stem, "quick" if env["GPULAB_QUICK"] == "1" else "full", limit))
    monkeypatch.setattr(verify, "run_command", lambda argv, env, limit, log: take(argv[-1], "full", limit))


def _parts(tmp_path: Path, keys: list[str]) -> list[verify.Part]:
    notebooks = [tmp_path / f"{stem}.ipynb" for stem in ("00_setup", "05_memory", "08_capstone")]
    parts = verify.verify_parts(notebooks, keys, tests=tmp_path)
    return [verify.Part(p.name, p.what, p.notebook, (sys.executable, "-c", p.name), p.env, p.lessons)
            if p.command else p for p in parts]  # commands end with their name: the fakes know them by it


def _check_output_folder(out: Path) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= verify_out.MAX_FILES
    assert {p.name for p in files} == {verify_out.BUNDLE, verify_out.SUMMARY, verify_out.MONITOR}
    assert all(p.stat().st_size <= verify_out.FILE_LIMIT for p in files)


# --------------------------------------------------------------------------------------------- the budgeted run


def test_the_smoke_run_then_the_parts_in_order_of_need_each_only_where_it_fits(tmp_path, on_a_gpu, monkeypatch):
    monkeypatch.setattr(planning, "WHOLE_CARD_QUICK", ("05",))  # as a lesson that takes the whole card would be listed
    monkeypatch.setattr(planning, "PLANNED", {"smoke": estimate(2.5, "s"), "tests": estimate(2.0, "t"),
                                              "00": estimate(1.0, "z"), "05": estimate(2.0, "m"),
                                              "08": estimate(3.0, "c"), "bench": estimate(0.5, "b")})
    reference = tmp_path / "reference"
    reference.mkdir()
    pd.DataFrame({"device_name": [H100]}).to_csv(reference / "00_matmul.csv", index=False)  # 00 has H100 rows
    pd.DataFrame([{"schema": 1, "device": "cuda:0", "device_name": H100, "quick": False, "part": "05_memory",
                   "status": "passed", "seconds": 90.0, "recorded_at": "2026-11-01T10:00:00+00:00"}]).to_csv(
        reference / "verify_gpu.csv", index=False)  # 05 was timed on an H100 before
    clock, calls = FakeClock(), []
    _fake_runs(monkeypatch, clock, {("00_setup", "quick"): 40, ("08_capstone", "quick"): 60,
                                    ("05_memory", "quick"): 50, ("08_capstone", "full"): 200, ("tests", "full"): 100,
                                    ("bench", "full"): 20, ("00_setup", "full"): 30}, calls)
    out = tmp_path / "out"
    parts = _parts(tmp_path, [])
    table = verify.verify(parts, out, budget_s=9 * 60, slots=2, monitor=FakeMonitor(), clock=clock, log=lambda *a: None)

    smoke, full = table[table["phase"] == "smoke"], table[table["phase"] == "full"]
    assert set(smoke["part"]) == {"00_setup", "05_memory", "08_capstone"} and (smoke["status"] == "passed").all()
    assert smoke.set_index("part").loc["05_memory", "at_once"] == 1  # 05 takes the whole card: alone
    assert calls[2] == ("05_memory", "quick", 165)  # after the two others (100 s): the smoke run's 300 s, less 35
    # after the smoke run (150 s): 08 has no H100 rows; tests, 00 and bench were never timed; 05 was
    assert full["part"].tolist() == ["08_capstone", "tests", "00_setup", "bench", "05_memory"]
    assert full["status"].tolist() == ["passed", "passed", "not run", "passed", "not run"]
    # each stopped early enough to end within the budget: 540 s less the 10 s for the last files, less 35 s
    assert calls[3:] == [("08_capstone", "full", 345), ("tests", "full", 145), ("bench", "full", 45)]
    assert full.set_index("part").loc["00_setup", "detail"] == "expected 1 min, 0.8 min of the budget left"
    assert on_a_gpu == [({"08"}, "make verify-gpu PARTS=08"), ({"bench"}, "make verify-gpu PARTS=bench")]
    timed = results.reference(planning.VERIFY_NAME)
    assert sorted(timed["part"]) == ["05_memory", "08_capstone", "bench", "tests"] and set(timed["device_name"]) == {H100}
    _check_output_folder(out)
    summary = (out / verify_out.SUMMARY).read_text()
    assert verify.CONTENDED in summary and "3 of 3 lessons passed" in summary
    assert "3 of 3 parts run passed, 2 not run" in summary
    samples = pd.read_csv(out / verify_out.MONITOR)
    assert {"smoke: 00_setup 08_capstone", "smoke: 05_memory", "08_capstone", "tests"} <= set(samples["phase"].dropna())
    assert {"utc", "sm_clock_mhz", "gpu_util_pct", "mem_used_gb", "power_w", "throttle"} <= set(samples.columns)

    # a later run on the same GPU class goes on with what was not measured: 00 first
    calls.clear()
    verify.verify(_parts(tmp_path, ["00", "05", "08", "tests", "bench"]), out, budget_s=4 * 60,
                  monitor=FakeMonitor(), clock=FakeClock(), log=lambda *a: None)
    assert calls[0][0] == "00_setup"


def test_the_next_run_on_the_h200_starts_with_what_broke_there_and_ships_what_it_found(tmp_path, on_a_gpu, monkeypatch):
    monkeypatch.setattr(results, "environment", lambda device=None: {
        "schema": 1, "host": "h", "device": "cuda:0", "device_name": "NVIDIA H200", "driver": "1.0", "torch": "2.x",
        "cuda": "12", "quick": False})
    reference = tmp_path / "reference"
    reference.mkdir()
    pd.concat([results.load(H200_RUN / part / "verify_gpu.csv") for part in ("full-08", "full-09")]).to_csv(
        reference / f"{planning.VERIFY_NAME}.csv", index=False)  # the rows shipped from 2026-11-28
    clock, calls = FakeClock(), []
    _fake_runs(monkeypatch, clock, {("00_setup", "quick"): 20, ("08_capstone", "quick"): 20,
                                    ("10_gpt_made_fast", "quick"): 20, ("08_capstone", "full"): 150,
                                    ("10_gpt_made_fast", "full"): 100, ("00_setup", "full"): 20}, calls)
    notebooks = [tmp_path / f"{stem}.ipynb" for stem in ("00_setup", "08_capstone", "10_gpt_made_fast")]
    parts = verify.verify_parts(notebooks, ["smoke", "00", "08", "10"], tests=tmp_path)
    verify.verify(parts, tmp_path / "out", budget_s=9 * 60, slots=3, monitor=FakeMonitor(), clock=clock,
                  log=lambda *a: None)
    # after the smoke run (60 s on this clock): 08, which timed out last time, then 10, which failed (as 09_transformers:
    # lesson 09's waterfall before the split), stopped by the budget's end (540 s less 10 s for the last files and 35 s
    # to end it) before its own 8 minutes, 10 there too (285 s left of twice its 3.0 minutes); then 00
    assert [call for call in calls if call[1] == "full"] == [("08_capstone", "full", 435),
                                                             ("10_gpt_made_fast", "full", 285), ("00_setup", "full", 90)]
    timed = results.reference(planning.VERIFY_NAME).set_index("part")
    assert timed["status"].to_dict() == {"08_capstone": "passed", "09_transformers": "FAILED",
                                         "10_gpt_made_fast": "passed", "00_setup": "passed"}
    assert planning.expected("08", "08_capstone", "NVIDIA H200", results.reference(planning.VERIFY_NAME)).measured


def test_a_part_that_hangs_and_a_monitor_that_never_stops_do_not_hold_the_run_past_its_budget(tmp_path, on_a_gpu,
                                                                                               monkeypatch):
    monkeypatch.setattr(planning, "PLANNED", {"08": estimate(2.0, "c"), "bench": estimate(0.5, "b")})
    monkeypatch.setattr(verify_jobs, "POLL_S", 0.01)
    monkeypatch.setattr(verify_out, "STOP_S", 0.2)
    clock, calls, hang = FakeClock(tick=2.0), [], threading.Event()
    _fake_runs(monkeypatch, clock, {("08_capstone", "full"): None, ("bench", "full"): 20}, calls, hang)
    stuck = FakeMonitor(stuck=True)
    try:
        start = clock.now
        table = verify.verify(_parts(tmp_path, ["08", "bench"]), tmp_path / "out", budget_s=9 * 60, monitor=stuck,
                              clock=clock, log=lambda *a: None)
        ended = clock.now
    finally:
        hang.set()
        stuck.released.set()
    rows = table.set_index("part")
    assert rows.loc["08_capstone", "status"] == "timed out" and "left behind" in rows.loc["08_capstone", "detail"]
    assert rows.loc["bench", "status"] == "passed"  # the run went on after the part it left behind
    assert ended - start <= 9 * 60
    summary = (tmp_path / "out" / verify_out.SUMMARY).read_text()
    assert "the monitor did not stop within 0.2 s" in summary
    _check_output_folder(tmp_path / "out")


def test_results_that_cannot_ship_do_not_stop_the_parts_after_them(tmp_path, on_a_gpu, monkeypatch):
    def refuse(folder, passed, command=record.COMMAND):
        raise results.ResultsFileError("bench.csv holds quick-mode rows")

    monkeypatch.setattr(record, "ship", refuse)
    clock, calls = FakeClock(), []
    _fake_runs(monkeypatch, clock, {("bench", "full"): 10, ("05_memory", "full"): 10}, calls)
    table = verify.verify(_parts(tmp_path, ["bench", "05"]), tmp_path / "out", clock=clock, monitor=FakeMonitor(),
                          log=lambda *a: None).set_index("part")
    assert (table["status"] == "passed").all() and len(calls) == 2
    assert "not shipped: ResultsFileError: bench.csv holds quick-mode rows" in table.loc["bench", "detail"]


def test_minutes_that_cannot_be_kept_do_not_stop_the_parts_after_them(tmp_path, on_a_gpu, monkeypatch):
    def read_only(path):
        raise PermissionError(f"{path} is read-only")

    monkeypatch.setattr(verify, "_ship_timings", read_only)
    clock, calls = FakeClock(), []
    _fake_runs(monkeypatch, clock, {("bench", "full"): 10, ("05_memory", "full"): 10}, calls)
    table = verify.verify(_parts(tmp_path, ["bench", "05"]), tmp_path / "out", clock=clock, monitor=FakeMonitor(),
                          log=lambda *a: None).set_index("part")
    assert (table["status"] == "passed").all() and len(calls) == 2
    assert "minutes not kept: PermissionError" in table.loc["bench", "detail"]


# --------------------------------------------------------------------------------------------- real kernels


def test_the_smoke_run_runs_two_lessons_at_once_then_the_whole_card_lesson_alone(tmp_path, on_a_gpu, monkeypatch):
    monkeypatch.setattr(planning, "WHOLE_CARD_QUICK", ("05",))  # as a lesson that takes the whole card would be listed
    flags = tmp_path / "flags"
    flags.mkdir()

    def waits_for(me: str, other: str) -> str:  # passes only if the other lesson runs at the same time
        return (f"import os, time\nfrom pathlib import Path\nassert os.environ['GPULAB_QUICK'] == '1'\n"
                f"Path({str(flags)!r}, {me!r}).touch()\nfor _ in range(1200):\n"
                f"    if Path({str(flags)!r}, {other!r}).exists(): break\n    time.sleep(0.1)\n"
                f"else:\n    raise RuntimeError('ran alone')")

    a = _notebook(tmp_path / "01_a.ipynb", waits_for("a", "b"),
                  "import warnings\nwarnings.warn('tensor cores are idle')",
                  "Path(os.environ['GPULAB_RESULTS'], '01_a.csv').write_text('x\\n1\\n')\n"
                  f"Path({str(flags)!r}, 'a-done').touch()")
    b = _notebook(tmp_path / "02_b.ipynb", waits_for("b", "a"), f"Path({str(flags)!r}, 'b-done').touch()")
    alone = _notebook(tmp_path / "05_alone.ipynb", f"from pathlib import Path\nflags = Path({str(flags)!r})\n"
                      "assert (flags / 'a-done').exists() and (flags / 'b-done').exists(), 'ran beside the others'")
    smoke = verify.verify_parts([a, b, alone], ["smoke"])
    out = tmp_path / "out"
    table = verify.verify(smoke, out, slots=2, monitor=FakeMonitor(), log=lambda *a: None).set_index("part")

    assert (table["status"] == "passed").all(), table["detail"].to_dict()
    assert table["at_once"].to_dict() == {"01_a": 2, "02_b": 2, "05_alone": 1}
    assert table.loc["01_a", "warnings"] == 1 and table.loc["02_b", "warnings"] == 0
    assert on_a_gpu == [] and not (tmp_path / "reference").exists()  # quick mode ships nothing
    _check_output_folder(out)
    summary = (out / verify_out.SUMMARY).read_text()
    assert verify.CONTENDED in summary and "up to 2 at once" in summary and "then 05_alone alone" in summary
    assert "01_a (quick): code cell 2: UserWarning: tensor cores are idle" in summary
    with tarfile.open(out / verify_out.BUNDLE) as tar:
        names = set(tar.getnames())
        executed = nbformat.reads(tar.extractfile("build/verify-gpu-smoke/smoke/01_a.ipynb").read().decode(), as_version=4)
    # a smoke run's bundle unpacks beside a full run's (build/verify-gpu-smoke/), not over its summary
    assert {"build/verify-gpu-smoke/smoke/02_b.ipynb", "build/verify-gpu-smoke/smoke/05_alone.ipynb",
            "build/verify-gpu-smoke/smoke/results/01_a/01_a.csv", "build/verify-gpu-smoke/summary.txt",
            "build/verify-gpu-smoke/monitor.csv"} <= names
    assert "tensor cores are idle" in executed.cells[1].outputs[0]["text"]


def test_a_lesson_past_its_limit_is_stopped_and_keeps_the_cells_that_ran(tmp_path, on_a_gpu):
    slow = _notebook(tmp_path / "02_slow.ipynb", "print('started')", "import time\ntime.sleep(600)", "print('never')")
    out = tmp_path / "out"
    table = verify.verify(verify.verify_parts([slow], ["02"]), out, part_cap_s=45, monitor=FakeMonitor(),
                          log=lambda *a: None)
    assert table["status"].tolist() == ["timed out"]  # the cell sleeps 600 s: it was stopped, its kernel did not die
    assert table.loc[0, "detail"] == "stopped at its 0.8-minute limit while code cell 2 ran"
    with tarfile.open(out / verify_out.BUNDLE) as tar:
        executed = nbformat.reads(tar.extractfile("build/verify-gpu/full/02_slow.ipynb").read().decode(), as_version=4)
        assert "build/verify-gpu/full/02_slow.kernel.log" in tar.getnames()
    assert executed.cells[0].outputs[0]["text"] == "started\n" and not executed.cells[2].get("outputs")
    assert results.reference(planning.VERIFY_NAME)["status"].tolist() == ["timed out"]  # its minutes, for the plan


@pytest.mark.parametrize("stopped", [True, False])
def test_a_lesson_stopped_at_its_limit_says_so_and_a_kernel_that_died_on_its_own_says_that(tmp_path, monkeypatch,
                                                                                          stopped):
    """At its limit a lesson's kernel is killed, so the worker reports a dead kernel: that is the stop, not a crash
    (lesson 08 on the H200, 2026-11-28, read "stopped at its 6.0-minute limit (the kernel died ...)")."""
    executed = (H200_RUN / "full-08" / "08_capstone.ipynb").read_text()  # as the worker handed it back

    def worker(job, *, cwd, env, time_limit):
        if stopped:
            time.sleep(1.0)  # past the lesson's limit: its kernel is killed
        return {"error": KERNEL_DIED, "notebook": executed}, None

    monkeypatch.setattr(verify_jobs, "run_contained", worker)
    lesson = _notebook(tmp_path / "08_capstone.ipynb", "print('x')")
    outcome = verify_jobs.run_lesson(lesson, {}, 0.3 if stopped else 60, tmp_path / "kernel.log")
    if stopped:
        assert outcome.status == "timed out"
        assert outcome.detail == ("stopped at its 0.0-minute limit while code cell 7 ran (its last output: "
                                  "optimisation path:   0%|          | 0/7 [00:00<?, ?it/s])")
    else:
        assert outcome.status == "FAILED" and outcome.detail == KERNEL_DIED
    assert outcome.notebook == executed


def test_the_h200_run_of_lesson_08_was_stopped_while_code_cell_7_ran():
    executed = (H200_RUN / "full-08" / "08_capstone.ipynb").read_text()
    assert verify_jobs.running_cell(executed) == 7  # the optimisation path: sent to the kernel, no reply came
    progress = "optimisation path:   0%|          | 0/7 [00:00<?, ?it/s]"  # the cell's progress bar
    assert verify_jobs.stopped_at(360, executed) == ("stopped at its 6.0-minute limit while code cell 7 ran (its last "
                                                     f"output: {progress})")
    finished = nbformat.writes(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]))
    assert verify_jobs.stopped_at(90, finished) == verify_jobs.stopped_at(90, None) == "stopped at its 1.5-minute limit"
    shipped = pd.read_csv(H200_RUN / "full-08" / "verify_gpu.csv")  # as the run wrote it, before this was fixed
    assert shipped.loc[0, "detail"] == f"stopped at its 6.0-minute limit ({KERNEL_DIED})"


def test_a_lesson_stopped_mid_path_names_the_step_it_was_running_from_its_last_output():
    """Lesson 08 prints each race as it starts: stopped at its limit, the summary names the step, not only the cell."""
    started = {"execution": {"iopub.execute_input": "2026-11-28T04:45:00Z"}}
    ran = {"execution": {**started["execution"], "shell.execute_reply": "2026-11-28T04:45:01Z"}}
    printed = "racing fused SGD: planned 7 s, 60 s left\nracing torch.compile: planned 32 s, 40 s left\n"
    cells = [nbformat.v4.new_code_cell("print(1)", metadata=ran, outputs=[nbformat.v4.new_output("stream", text="1\n")]),
             nbformat.v4.new_code_cell("path.step(...)", metadata=started, outputs=[
                 nbformat.v4.new_output("stream", name="stdout", text=printed),
                 nbformat.v4.new_output("stream", name="stderr", text="\n")]),
             nbformat.v4.new_code_cell("print(3)")]
    executed = nbformat.writes(nbformat.v4.new_notebook(cells=cells))
    assert verify_jobs.stopped_at(360, executed) == ("stopped at its 6.0-minute limit while code cell 2 ran (its last "
                                                     "output: racing torch.compile: planned 32 s, 40 s left)")
    assert verify_jobs.last_output_line(cells[1], width=20) == "racing torch.comp..."


def test_a_command_is_stopped_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = ("import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(120)\n")
    outcome = verify_jobs.run_command([sys.executable, "-c", script], dict(__import__("os").environ), 10,
                                      tmp_path / "bench.log")
    assert outcome.status == "timed out"  # the command sleeps 120 s: it was stopped
    grandchild = int(pid_file.read_text())  # in a session of its own, outside the command's process group
    deadline = time.monotonic() + 10  # a killed process runs until the scheduler next lets it exit
    while _running(grandchild):
        assert time.monotonic() < deadline, "the command's grandchild is still running"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("code, says", [(1, "exit status 1: 1 failed, 2 passed in 1s"), (3, "exit status 3")])
def test_a_failing_command_says_why(tmp_path, code, says):
    script = f"print('== 1 failed, 2 passed in 1s =='); raise SystemExit({code})"
    outcome = verify_jobs.run_command([sys.executable, "-c", script], dict(__import__("os").environ), 60,
                                      tmp_path / "tests.log")
    assert outcome.status == "FAILED" and says in outcome.detail


# --------------------------------------------------------------------------------------------- the output


def test_the_bundle_leaves_out_what_would_take_it_past_its_limit(tmp_path):
    import os

    big = tmp_path / "big.ipynb"
    big.write_bytes(os.urandom(600 * 1024))  # incompressible: the bound must hold for any content
    log = tmp_path / "kernel.log"
    log.write_bytes(b"x" * (3 * 2**20) + b"the error at the end\n")
    members = [("gpulab/reference/08_capstone.csv", b"a,b\n1,2\n"), ("first.ipynb", os.urandom(600 * 1024)),
               ("build/verify-gpu/big.ipynb", big), ("build/verify-gpu/kernel.log", verify_out.log_tail(log, 64 * 1024)),
               ("gone.csv", tmp_path / "no-such-file.csv")]
    bundle = tmp_path / "b.tar.gz"
    left_out = verify_out.write_bundle(bundle, members, limit=2**20)

    assert bundle.stat().st_size <= 2**20 and not (tmp_path / "b.tar.gz.partial").exists()
    assert left_out == ["build/verify-gpu/big.ipynb (0.6 MiB)"]
    with tarfile.open(bundle) as tar:
        assert tar.getnames() == ["gpulab/reference/08_capstone.csv", "first.ipynb", "build/verify-gpu/kernel.log",
                                  "build/verify-gpu/left-out.txt"]
        tail = tar.extractfile("build/verify-gpu/kernel.log").read()
        assert "big.ipynb" in tar.extractfile("build/verify-gpu/left-out.txt").read().decode()
    assert tail.startswith(b"[the first ") and tail.endswith(b"the error at the end\n") and len(tail) < 65 * 1024


def test_the_monitor_log_takes_gpulabs_monitor_and_says_why_it_has_no_samples(tmp_path):
    with fake_libnvml.absent():  # no libnvidia-ml.so.1: no NVIDIA driver on this machine
        log = verify_out.MonitorLog(tmp_path / "monitor.csv", verify._monitor()).start()
        assert log.stop() == "no GPU samples: NVML could not start (NVML Shared Library Not Found)"
    assert (tmp_path / "monitor.csv").read_text() == "utc," + ",".join(monitor.COLUMNS) + "\n"


def test_the_free_memory_is_nvmls_for_gpu_0_in_gib():
    with fake_libnvml.installed(fake_libnvml.h200(memory_used_bytes=23 * 2**30)):  # 143771 MiB in all
        assert verify._free_gib() == (143771 * 2**20 - 23 * 2**30) / 2**30
    with fake_libnvml.absent():
        assert verify._free_gib() is None


def test_the_warnings_a_learner_sees_are_read_from_the_executed_notebook():
    found = verify_jobs.learner_warnings(WARNINGS_FIXTURE.read_text())
    assert [w.split(": ", 2)[:2] for w in found] == [["code cell 1", "UserWarning"], ["code cell 2", "UserWarning"],
                                                     ["code cell 3", "UserWarning"]]
    assert "Synchronization debug mode is a prototype" in found[0] and "TensorFloat32" in found[1]
    assert "Dynamo does not know how to trace the builtin" in found[2]  # once, though cells 3 and 5 both show it
    assert not any("__graph_breaks" in w or "/opt/" in w for w in found)  # torch's logs and file paths are not warnings


def test_the_smoke_run_takes_one_lesson_per_two_cores_and_four_gib_and_starts_the_longest_first():
    assert verify.smoke_slots(cores=16, free_gib=79.0, lessons=9) == 8
    assert verify.smoke_slots(cores=16, free_gib=14.0, lessons=9) == 3
    assert verify.smoke_slots(cores=2, free_gib=None, lessons=9) == 1
    assert verify.smoke_slots(cores=64, free_gib=None, lessons=9) == 9
    order = verify.smoke_order([Path(f"{n}_x.ipynb") for n in ("00", "01", "03", "10")])
    assert [p.stem[:2] for p in order] == ["10", "01", "03", "00"]  # a lesson without a measurement first


def test_no_lesson_takes_the_whole_card_in_quick_mode():
    """The smoke run runs every lesson beside the others: 03's quick mode searches within a budget, and 05's OOM demo
    runs inside a memory-fraction cap. If either changes, that lesson must join WHOLE_CARD_QUICK."""
    def source(name):
        return "".join(c.source for c in nbformat.read(ROOT / "notebooks" / name, as_version=4).cells)

    assert re.search(r"budget = None if on_gpu and plan\.cap_gb else", source("03_batching.ipynb"))
    assert not plans.plan_for("03", plans.Card.named("NVIDIA H200"), quick=True).cap_gb  # no cap: a budget
    assert "torch.cuda.set_per_process_memory_fraction(" in source("05_memory.ipynb")
    assert planning.WHOLE_CARD_QUICK == ()
