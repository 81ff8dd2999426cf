"""`make verify-gpu` (gpulab.record.verify): its plan on a CPU, and its runner on small parts: each part stopped at
its limit (a lesson's kernel, a command's whole process group), the budget, shipping after each part, the bundle."""

import json
import sys
import tarfile
import time
from pathlib import Path

import nbformat
import pandas as pd
import psutil
import pytest

from gpulab import record, results
from gpulab.record import EXPECTED_MIN, PART_LIMIT_S, Part

from .conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.fixture
def on_a_gpu(tmp_path, monkeypatch):
    """verify() as on a GPU: no GPU check, rows that say "Some GPU", reference results into tmp_path, and ship()
    recording what it was asked to ship. Returns that record."""
    monkeypatch.setattr(record, "require_gpu", lambda: None)
    monkeypatch.setattr(results, "REFERENCE_DIR", tmp_path / "reference")
    monkeypatch.setattr(results, "environment", lambda device=None: {
        "schema": 1, "host": "h", "device": "cuda:0", "device_name": "Some GPU", "driver": "1.0",
        "torch": "2.x", "cuda": "12", "quick": False})
    shipped = []

    def ship(folder, passed, command=record.COMMAND):
        shipped.append((passed, command, Path(folder).name))
        return pd.DataFrame({"results": [], "shipped": []})

    monkeypatch.setattr(record, "ship", ship)
    return shipped


# --------------------------------------------------------------------------------------------- the plan


def test_the_dry_run_lists_every_part_with_its_minutes_and_runs_nothing(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(record, "verify", lambda *a, **k: pytest.fail("a dry run ran the parts"))
    assert record.main(["verify", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.name} in full mode" in out
    assert "GPU-marked tests" in out and "gpulab bench" in out
    assert "each stopped at 8 min, the whole at 25 min" in out and "estimates for one H100" in out
    assert "gpulab/reference/" in out


def test_every_lesson_and_part_is_expected_to_fit_its_limit():
    parts = record.verify_parts(NOTEBOOKS, tests=ROOT / "tests")
    assert [p.key for p in parts] == ["tests", *[nb.stem[:2] for nb in NOTEBOOKS], "bench"]
    assert {nb.stem[:2] for nb in NOTEBOOKS} <= set(EXPECTED_MIN), "a new lesson needs its expected minutes"
    assert all(0 < minutes < PART_LIMIT_S / 60 for minutes in EXPECTED_MIN.values())
    table = record.plan_table(parts)
    assert table.loc[table["part"] == "08", "expected_min"].item() == EXPECTED_MIN["08"]


def test_the_plan_says_when_the_estimates_exceed_the_budget():
    parts = record.verify_parts(NOTEBOOKS, ["00", "tests"], tests=ROOT / "tests")
    assert "exceed" not in record.verify_plan(parts, Path("out"))
    assert "exceed the budget" in record.verify_plan(parts, Path("out"), budget_s=60)


def test_parts_are_picked_by_number_and_run_in_the_course_order(monkeypatch, capsys):
    parts = record.verify_parts(NOTEBOOKS, ["05", "tests", "bench"], tests=ROOT / "tests")
    assert [p.key for p in parts] == ["tests", "05", "bench"]
    assert parts[1].name == "05_memory" and parts[1].notebook == ROOT / "notebooks" / "05_memory.ipynb"
    with pytest.raises(ValueError, match="no part 42"):
        record.verify_parts(NOTEBOOKS, ["42"])
    monkeypatch.chdir(ROOT)
    assert record.main(["verify", "--dry-run", "05", "tests"]) == 0  # parts after the options too (make's order)
    assert "05_memory.ipynb" in capsys.readouterr().out
    assert record.main(["verify", "42", "--dry-run"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as stop:
        record.main(["verify", "--no-such-option"])
    assert stop.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_refuses_without_a_gpu_in_one_line(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(record.torch.cuda, "is_available", lambda: False)
    assert record.main(["verify"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err


def test_the_gpu_tests_are_the_files_with_gpu_marks():
    files = record.gpu_test_files(ROOT / "tests")
    assert files and all("pytest.mark.gpu" in Path(f).read_text() for f in files)
    assert not any("browser" in f for f in files)
    tests = record.verify_parts(NOTEBOOKS, ["tests"], tests=ROOT / "tests")[0]
    assert tests.command[1:5] == ("-m", "pytest", "-m", "gpu") and dict(tests.env)["GPULAB_QUICK"] == "1"


# --------------------------------------------------------------------------------------------- the runner


def test_parts_run_in_turn_each_stopped_at_its_limit_and_shipped_as_they_pass(tmp_path, on_a_gpu):
    fast = _notebook(tmp_path / "01_fast.ipynb", "print('measured')")
    slow = _notebook(tmp_path / "02_slow.ipynb", "print('started')", "import time\ntime.sleep(300)", "print('never')")
    parts = [Part("tests", "the tests", 1.0, command=(sys.executable, "-c", "print('== 3 passed in 0.10s ==')")),
             Part("01_fast", "a lesson", 1.0, notebook=fast), Part("02_slow", "a slow lesson", 2.0, notebook=slow)]
    out = tmp_path / "verify"
    table = record.verify(parts, out, part_limit_s=45, budget_s=600, bundle=tmp_path / "bundle.tar.gz", log=lambda *a: None)

    assert table["status"].tolist() == ["passed", "passed", "timed out"]
    assert table.loc[0, "detail"] == "3 passed in 0.10s"
    assert table.loc[2, "seconds"] >= 45  # stopped at its limit, not before: the cells below show it never finished
    assert "0.8-minute limit" in table.loc[2, "detail"]
    executed = nbformat.read(out / "lessons" / "02_slow.ipynb", as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "started\n" and not executed.cells[2].get("outputs")
    assert on_a_gpu == [({"01"}, "make verify-gpu PARTS=01", "01_fast")]  # only the lesson that passed

    assert pd.read_csv(out / "verify.csv")["part"].tolist() == ["tests", "01_fast", "02_slow"]
    shipped = results.reference(record.VERIFY_NAME)
    assert shipped["part"].tolist() == ["tests", "01_fast", "02_slow"] and set(shipped["device_name"]) == {"Some GPU"}
    assert results.reference_provenance(record.VERIFY_NAME)["command"] == "make verify-gpu"

    with tarfile.open(tmp_path / "bundle.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpulab/reference/verify_gpu.csv", "gpulab/reference/verify_gpu.json", "build/verify-gpu/verify.csv",
            "build/verify-gpu/logs/tests.log", "build/verify-gpu/lessons/02_slow.ipynb"} <= names
    assert "build/verify-gpu/lessons/01_fast.ipynb" not in names  # passed: not needed to see what broke

    # a later run of one part replaces that part's row for this GPU and keeps the others
    again = record.verify(parts[:1], out, part_limit_s=45, budget_s=600, log=lambda *a: None)
    assert again["status"].tolist() == ["passed"]
    shipped = results.reference(record.VERIFY_NAME)
    assert sorted(shipped["part"]) == ["01_fast", "02_slow", "tests"]


def test_no_part_starts_once_the_budget_is_spent(tmp_path, on_a_gpu):
    parts = [Part("tests", "the tests", 1.0, command=(sys.executable, "-c", "raise SystemExit('ran')")),
             Part("bench", "bench", 0.5, command=(sys.executable, "-c", "raise SystemExit('ran')"))]
    table = record.verify(parts, tmp_path / "verify", budget_s=0, log=lambda *a: None)
    assert table["status"].tolist() == ["not run", "not run"]
    assert table["detail"].str.contains("budget was spent").all()
    assert results.reference(record.VERIFY_NAME).empty  # nothing measured, nothing shipped


def test_a_command_is_stopped_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(120)\n")
    part = Part("bench", "bench", 0.5, command=(sys.executable, "-c", script))
    status, detail = record._run_command(part, 10, tmp_path / "logs", env=dict(__import__("os").environ))
    assert status == "timed out"  # the command sleeps 120 s: it was stopped
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # a killed process runs until the scheduler next lets it exit
    while _running(grandchild):
        assert time.monotonic() < deadline, "the command's grandchild is still running"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("name, code, says", [("tests", 5, "no GPU-marked test ran"),
                                               ("tests", 1, "exit status 1: 1 failed, 2 passed in 1s"),
                                               ("bench", 3, "exit status 3")])
def test_a_failing_command_says_why(tmp_path, name, code, says):
    script = f"print('== 1 failed, 2 passed in 1s =='); raise SystemExit({code})"
    status, detail = record._run_command(Part(name, name, 1.0, command=(sys.executable, "-c", script)), 60,
                                         tmp_path, env=dict(__import__("os").environ))
    assert status == "FAILED" and says in detail


def test_the_shipped_minutes_show_in_the_plan(on_a_gpu, tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    pd.DataFrame([{"part": "00_setup_and_diagnostics", "status": "passed", "seconds": 90.0,
                   "device_name": "NVIDIA H100 80GB HBM3"}]).to_csv(reference / f"{record.VERIFY_NAME}.csv", index=False)
    table = record.plan_table(record.verify_parts(NOTEBOOKS, ["00"], tests=ROOT / "tests"))
    assert table.loc[0, "measured"] == "1.5 min on NVIDIA H100 80GB HBM3"
    assert json.loads(json.dumps(table.to_dict("records")))  # plain values


def test_results_that_cannot_ship_do_not_stop_the_parts_after_them(tmp_path, on_a_gpu, monkeypatch):
    def refuse(folder, passed, command=record.COMMAND):
        raise results.ResultsFileError("bench.csv holds quick-mode rows")

    monkeypatch.setattr(record, "ship", refuse)
    broken = _notebook(tmp_path / "03_unreadable.ipynb", "x = 1")
    broken.write_text("not a notebook")
    parts = [Part("bench", "bench", 0.5, command=(sys.executable, "-c", "print('measured')")),
             Part("03_unreadable", "a lesson", 1.0, notebook=broken),
             Part("tests", "the tests", 1.0, command=(sys.executable, "-c", "print('1 passed in 0.1s')"))]
    table = record.verify(parts, tmp_path / "verify", log=lambda *a: None)
    assert table["status"].tolist() == ["passed", "FAILED", "passed"]
    assert "not shipped: ResultsFileError: bench.csv holds quick-mode rows" in table.loc[0, "detail"]
    assert table.loc[1, "detail"].startswith("could not run:")
