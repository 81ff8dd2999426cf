"""The planning of `make verify-gpu` (gpulab.commands.verify_plan): where each part's minutes come from, the order of need,
the budget rule, and `make verify-gpu-plan`'s output for a 9-minute command on an H100."""

from pathlib import Path

import pandas as pd
import pytest

from gpulab import results
from gpulab.commands import record, verify
from gpulab.commands import verify_plan as planning
from gpulab.commands.verify_plan import H100, PLANNED, RESERVE_S, TARGET_MIN, estimate

from .conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _shipped(*rows) -> pd.DataFrame:
    """verify_gpu rows: (part, status, seconds, device_name, recorded_at)."""
    return pd.DataFrame(rows, columns=["part", "status", "seconds", "device_name", "recorded_at"])


@pytest.fixture
def reference(tmp_path, monkeypatch):
    """An empty gpulab/reference/ in tmp_path."""
    folder = tmp_path / "reference"
    folder.mkdir()
    monkeypatch.setattr(results, "REFERENCE_DIR", folder)
    return folder


def test_every_part_has_a_planning_number_measured_with_its_gpu_and_date_or_marked_as_an_estimate():
    keys = {p.key for p in verify.verify_parts(NOTEBOOKS, tests=ROOT / "tests")}
    assert keys <= set(PLANNED), "a new part needs its planning number"
    assert {nb.stem[:2] for nb in NOTEBOOKS} <= set(TARGET_MIN)
    for key, minutes in PLANNED.items():
        assert 0 < minutes.minutes < planning.PART_CAP_S / 60
        if minutes.measured:
            assert minutes.gpu.startswith("NVIDIA") and len(minutes.date) == 10, key
            assert minutes.source().startswith(f"measured on {minutes.gpu}, {minutes.date}")
        else:
            assert minutes.source().startswith("estimate: ")
    # the H200 run's measurement (its log.txt): the smoke run 119 s + 37 s; lesson 08 was rewritten since its 246 s
    assert PLANNED["smoke"].measured and PLANNED["smoke"].minutes == 2.6
    assert not PLANNED["08"].measured and "246 s" in PLANNED["08"].basis and not PLANNED["09"].measured


def test_a_run_of_this_gpu_class_replaces_the_planning_number():
    shipped = _shipped(("08_capstone", "passed", 150.0, H100, "2026-12-01T10:00:00+00:00"),
                       ("08_capstone", "passed", 96.0, H100, "2026-12-02T10:00:00+00:00"),
                       ("08_capstone", "passed", 30.0, "NVIDIA A100-SXM4-80GB", "2026-12-03T10:00:00+00:00"))
    minutes = planning.expected("08", "08_capstone", H100, shipped)
    assert minutes.minutes == 1.6 and minutes.measured  # the latest run on this class, not the A100's
    assert minutes.source() == f"measured on {H100}, 2026-12-02: make verify-gpu"
    assert planning.expected("08", "08_capstone", "NVIDIA L4", shipped) == PLANNED["08"]


def test_a_part_stopped_at_its_limit_is_planned_longer_than_it_ran():
    shipped = _shipped(("09_transformers", "timed out", 400.0, H100, "2026-12-01T10:00:00+00:00"))
    minutes = planning.expected("09", "09_transformers", H100, shipped)
    assert minutes.minutes == 10.0 and not minutes.measured and "stopped at its 6.7-minute limit" in minutes.source()
    failed = _shipped(("09_transformers", "FAILED", 5.0, H100, "2026-12-01T10:00:00+00:00"))
    assert planning.expected("09", "09_transformers", H100, failed) == PLANNED["09"]


def test_a_part_starts_only_where_its_minutes_fit_what_is_left():
    assert planning.fits(2.0, 120 + RESERVE_S)
    assert not planning.fits(2.0, 119 + RESERVE_S)
    assert planning.stop_limit_s(2.0) == 240 and planning.stop_limit_s(0.5) == 90
    assert planning.stop_limit_s(7.0) == planning.PART_CAP_S


def test_lessons_without_reference_rows_for_this_gpu_class_come_first(reference):
    pd.DataFrame({"device_name": [H100], "x": [1]}).to_csv(reference / "00_matmul.csv", index=False)
    pd.DataFrame({"device_name": ["NVIDIA A100"], "x": [1]}).to_csv(reference / "01_sync.csv", index=False)
    pd.DataFrame({"device_name": [H100]}).to_csv(reference / "bench.csv", index=False)
    gpus = planning.reference_gpus(reference)
    assert gpus == {"00": {H100}, "01": {"NVIDIA A100"}, "bench": {H100}}
    parts = verify.verify_parts(NOTEBOOKS, ["tests", "00", "01", "05", "bench"], tests=ROOT / "tests")
    shipped = _shipped(("05_memory", "passed", 90.0, H100, "2026-12-01T10:00:00+00:00"))
    ordered = planning.order(parts, H100, shipped, gpus)
    assert [p.key for p, _ in ordered] == ["01", "tests", "00", "bench", "05"]
    assert dict((p.key, why) for p, why in ordered) == {
        "01": "no reference rows for this GPU class", "tests": "not timed on this GPU class yet",
        "00": "not timed on this GPU class yet", "bench": "not timed on this GPU class yet",
        "05": "measured on this GPU class 2026-12-01"}
    # a lesson that failed in quick mode goes last; the oldest measurement before a newer one
    shipped = _shipped(("05_memory", "passed", 90.0, H100, "2026-12-02T10:00:00+00:00"),
                       ("00_setup_and_diagnostics", "passed", 60.0, H100, "2026-12-01T10:00:00+00:00"))
    ordered = planning.order(parts, H100, shipped, gpus, failed_quick={"01"})
    assert [p.key for p, _ in ordered] == ["tests", "bench", "00", "05", "01"]
    assert ordered[-1][1].endswith("last: it failed in quick mode")


def test_the_plan_runs_the_smoke_run_then_what_fits_in_order_of_need(reference, monkeypatch):
    monkeypatch.setattr(planning, "PLANNED", {"smoke": estimate(2.5, "s"), "tests": estimate(2.0, "t"),
                                              "05": estimate(3.0, "f"), "08": estimate(4.0, "e"),
                                              "bench": estimate(0.5, "b")})
    parts = verify.verify_parts(NOTEBOOKS, ["smoke", "tests", "05", "08", "bench"], tests=ROOT / "tests")
    table = planning.plan_rows(parts, H100, 9 * 60, pd.DataFrame(), {}).set_index("part")
    # 9 min: smoke 2.5, then 05 (3.0) ends at 5.5; 08 (4.0) does not fit the 3.5 - 0.75 left; tests (2.0) does, and
    # bench (0.5) in the 0.75 left after it
    assert table.loc["smoke", "decision"] == "runs, ends by 2.5 min"
    assert table.loc["05", "decision"] == "runs, ends by 5.5 min"
    assert table.loc["08", "decision"] == "not run: 2.8 min left"
    assert table.loc["tests", "decision"] == "runs, ends by 7.5 min"
    assert table.loc["bench", "decision"] == "runs, ends by 8.0 min"
    assert list(table.index) == ["smoke", "05", "08", "tests", "bench"]
    everything = planning.plan_rows(parts, H100, None, pd.DataFrame(), {})
    assert (everything["decision"] == "runs").all()
    assert "over its 3-minute target" in everything.set_index("part").loc["08", "source"]


def test_make_verify_gpu_plan_shows_one_9_minute_command_on_an_h100(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(record.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(verify, "verify", lambda *a, **k: pytest.fail("a dry run ran the parts"))
    assert verify.main(["verify", "--dry-run", "--budget-min", "9"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"GPU verification plan for {H100}, a budget of 9 min")
    lines = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in
             {"smoke", "tests", "bench", *[nb.stem[:2] for nb in NOTEBOOKS]}}
    assert set(lines) == {"smoke", "tests", "bench", *[nb.stem[:2] for nb in NOTEBOOKS]}
    assert "runs" in lines["smoke"]
    assert "smoke: measured on NVIDIA H200, 2026-11-27" in out and "08: estimate: " in out and "09: estimate: " in out
    assert "wait for a later run" in out


def test_parts_are_picked_by_name_and_errors_are_one_line(monkeypatch, capsys):
    parts = verify.verify_parts(NOTEBOOKS, ["05", "tests", "bench", "smoke"], tests=ROOT / "tests")
    assert [p.key for p in parts] == ["smoke", "tests", "05", "bench"]
    assert parts[2].name == "05_memory" and parts[2].notebook == ROOT / "notebooks" / "05_memory.ipynb"
    assert parts[0].lessons == tuple(NOTEBOOKS)
    with pytest.raises(ValueError, match="no part 42"):
        verify.verify_parts(NOTEBOOKS, ["42"])
    monkeypatch.chdir(ROOT)
    assert verify.main(["verify", "--dry-run", "05", "tests"]) == 0  # parts after the options too (make's order)
    table = capsys.readouterr().out.splitlines()[1:4]  # the table's header, then one row per part
    assert [line.split()[0] for line in table] == ["part", "05", "tests"]
    assert verify.main(["verify", "42", "--dry-run"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as stop:
        verify.main(["verify", "--no-such-option"])
    assert stop.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    for limit in ("--budget-min", "--part-limit-min"):  # no minutes would time out every part
        with pytest.raises(SystemExit) as stop:
            verify.main(["verify", "--dry-run", limit, "0"])
        assert stop.value.code == 2 and "must be a positive number" in capsys.readouterr().err


def test_refuses_to_run_without_a_gpu_in_one_line(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(record.torch.cuda, "is_available", lambda: False)
    for action in ("verify", "smoke"):
        assert verify.main([action]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no CUDA GPU" in err


def test_the_gpu_tests_are_the_files_with_gpu_marks():
    files = verify.gpu_test_files(ROOT / "tests")
    assert files and all("pytest.mark.gpu" in Path(f).read_text() for f in files)
    assert not any("browser" in f for f in files)
    tests = verify.verify_parts(NOTEBOOKS, ["tests"], tests=ROOT / "tests")[0]
    assert tests.command[1:5] == ("-m", "pytest", "-m", "gpu") and dict(tests.env)["GPULAB_QUICK"] == "1"
