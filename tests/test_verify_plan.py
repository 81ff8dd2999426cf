"""The planning of `make verify-gpu` (gpulab.commands.verify_plan): where each part's minutes come from, the order of need,
the budget rule, and `make verify-gpu-plan`'s output for a 9-minute command on an H100."""

from pathlib import Path

import pandas as pd
import pytest

from gpulab import plans, results
from gpulab.commands import record, verify
from gpulab.commands import verify_plan as planning
from gpulab.commands.notebook_upkeep import lessons
from gpulab.commands.verify_plan import H100, PLANNED, RESERVE_S, TARGET_MIN, estimate

from .conftest import ROOT

NOTEBOOKS = lessons(ROOT)  # a page has no full-mode part: tests/test_measuring_page.py
H200 = "NVIDIA H200"
H200_RUN = ROOT / "tests" / "data" / "verify" / "2026-11-28-h200"  # the verification's own rows of that run


def _h200_rows() -> pd.DataFrame:
    """The verify_gpu rows the 2026-11-28 H200 run wrote: 08 timed out (361 s), 09 failed (129 s: its waterfall, lesson
    10 since the split)."""
    return pd.concat([results.load(H200_RUN / part / "verify_gpu.csv") for part in ("full-08", "full-09")],
                     ignore_index=True)


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
    # the H200 run's measurement (its log.txt): the smoke run 119 s + 37 s; lesson 08 never finished a full run (its
    # own plan: 3.0 min at most, its budget's end)
    assert PLANNED["smoke"].measured and PLANNED["smoke"].minutes == 2.6
    assert not PLANNED["08"].measured and "3.0 min" in PLANNED["08"].basis and not PLANNED["09"].measured
    h100 = plans.Card.named(H100)
    for key in ("05", "06", "07", "08", "09", "10", "11"):  # the entries that quote the lesson's own plan
        assert PLANNED[key].minutes == round(plans.plan_for(key, h100).minutes, 1), key


def test_a_run_of_this_gpu_class_replaces_the_planning_number():
    shipped = _shipped(("08_capstone", "passed", 150.0, H100, "2026-12-01T10:00:00+00:00"),
                       ("08_capstone", "passed", 96.0, H100, "2026-12-02T10:00:00+00:00"),
                       ("08_capstone", "passed", 30.0, "NVIDIA A100-SXM4-80GB", "2026-12-03T10:00:00+00:00"))
    minutes = planning.expected("08", "08_capstone", H100, shipped)
    assert minutes.minutes == 1.6 and minutes.measured  # the latest run on this class, not the A100's
    assert minutes.source() == f"measured on {H100}, 2026-12-02: make verify-gpu"
    assert planning.expected("08", "08_capstone", "NVIDIA L4", shipped) == PLANNED["08"]


def test_a_part_that_failed_or_was_stopped_keeps_its_planned_minutes_and_may_run_past_where_it_got():
    # the H200 run of 2026-11-28: 08 stopped at its 6-minute limit after 361 s, 09 failed after 129 s at the CUDA graphs
    # step of its waterfall, which is lesson 10 since lesson 09 was split: 10 inherits the failure, the new 09 nothing
    h200 = _h200_rows()
    stopped = planning.expected("08", "08_capstone", H200, h200)
    assert stopped.minutes == PLANNED["08"].minutes and not stopped.measured and stopped.ran == 6.0
    assert stopped.stop_s() == planning.PART_CAP_S  # twice the 6 minutes it ran, at most the cap; not 6 minutes again
    assert stopped.source().startswith(f"estimate: {PLANNED['08'].basis}")
    assert stopped.source().endswith("its last run on NVIDIA H200 (2026-11-28) timed out after 6.0 min and measured "
                                     "nothing")
    failed = planning.expected("10", "10_gpt_made_fast", H200, h200)
    assert failed.minutes == PLANNED["10"].minutes and failed.ran == 2.1 and failed.stop_s() == 360  # twice 3.0 min
    assert "failed after 2.1 min" in failed.source()
    assert planning.expected("09", "09_mfu_and_attention", H200, h200) == PLANNED["09"]
    assert planning.expected("08", "08_capstone", H100, h200) == PLANNED["08"]  # another GPU class's run
    # a part that passed since is measured again
    fixed = pd.concat([h200, _shipped(("08_capstone", "passed", 150.0, H200, "2026-11-29T10:00:00+00:00"))])
    assert planning.expected("08", "08_capstone", H200, fixed).measured


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


def test_what_failed_or_timed_out_last_time_on_this_gpu_class_comes_first(reference):
    parts = verify.verify_parts(NOTEBOOKS, ["tests", "00", "05", "08", "10", "bench"], tests=ROOT / "tests")
    ordered = planning.order(parts, H200, _h200_rows(), {})
    assert [p.key for p, _ in ordered] == ["08", "10", "00", "05", "tests", "bench"]
    why = dict((p.key, why) for p, why in ordered)
    assert why["08"] == "timed out last time on NVIDIA H200 (2026-11-28: stopped at its 6.0-minute limit)"
    assert why["10"] == ("failed last time on NVIDIA H200 (2026-11-28, as 09_transformers: code cell 19: RuntimeError: "
                         "Error: accessing tensor output of...)")
    assert why["00"] == "no reference rows for this GPU class"
    # on another GPU class the H200's failures change nothing
    assert [p.key for p, _ in planning.order(parts, H100, _h200_rows(), {})] == ["00", "05", "08", "10", "tests", "bench"]
    # a stopped run's row names the cell it was running; one that failed in quick mode this time still goes last
    stopped = _h200_rows().assign(detail="stopped at its 6.0-minute limit while code cell 7 ran")
    ordered = planning.order(parts, H200, stopped, {}, failed_quick={"10"})
    assert [p.key for p, _ in ordered][:2] == ["08", "00"] and ordered[-1][0].key == "10"
    assert ordered[0][1].endswith("(2026-11-28: stopped at its 6.0-minute limit while code cell 7 ran)")
    # a part that passed after it failed is measured: no longer first
    fixed = pd.concat([_h200_rows(), _shipped(("08_capstone", "passed", 150.0, H200, "2026-11-29T10:00:00+00:00"))])
    assert [p.key for p, _ in planning.order(parts, H200, fixed, {})][:2] == ["10", "00"]


def test_make_verify_gpu_plan_on_the_h200_starts_with_what_broke_there_on_2026_11_28(reference, monkeypatch, capsys):
    _h200_rows().to_csv(reference / f"{planning.VERIFY_NAME}.csv", index=False)  # as shipped
    monkeypatch.chdir(ROOT)
    assert verify.main(["verify", "--dry-run", "--budget-min", "10", "--gpu", H200]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:15]]
    assert [row[0] for row in rows[:4]] == ["smoke", "08", "10", "00"]
    # 08 runs after the smoke run (2.6 + 3.0 min), stopped at 8 minutes at most; then 10, the failed waterfall (3.0 min
    # of the 4.4 left, less the 0.75 kept for the end), stopped at twice its minutes
    assert rows[1][1:6] == ["3.0", "8.0", "runs,", "ends", "by"] and rows[1][6] == "5.6"
    assert rows[2][1:7] == ["3.0", "6.0", "runs,", "ends", "by", "8.6"]
    assert "timed out last time on NVIDIA H200 (2026-11-28: stopped at its 6.0-minute limit)" in out
    assert "failed last time on NVIDIA H200 (2026-11-28, as 09_transformers: code cell 19: RuntimeError" in out
    assert "the kernel died" not in out  # the 08 row's detail, as the run wrote it, is not repeated


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
