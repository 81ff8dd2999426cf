import sys
import types

import pandas as pd
import pytest

from gpulab import Comparison, ResultLog, bench, reference
from gpulab.conditions import Conditions
from gpulab.results import CONDITION_COLUMNS, ResultsFileError, add_reference, caveat_note, caveats, reference_provenance

from . import fake_libnvml
from .fake_libnvml import HW_THERMAL, SW_POWER_CAP
from .test_monitor_and_conditions import machine


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Rows record the load average: the tests set it, whatever this machine is doing."""
    machine(monkeypatch, 0.5, 4)


def test_each_point_is_on_disk_at_once(results_dir):
    log = ResultLog("sweep")
    log.add(size=1, seconds=0.5)
    assert len(pd.read_csv(results_dir / "sweep.csv")) == 1  # an interrupted sweep keeps it
    log.add(size=2, seconds=0.7)
    frame = ResultLog("sweep").frame()
    assert list(frame["size"]) == [1, 2]
    assert {"device", "torch", "recorded_at", "schema", "quick"} <= set(frame.columns)


def test_new_columns_keep_old_rows(results_dir):
    log = ResultLog("grow")
    log.add(size=1)
    log.add(size=2, extra="x")
    frame = log.frame()
    assert list(frame["size"]) == [1, 2] and frame["extra"].isna().tolist() == [True, False]


def test_measurements_are_recorded_with_parameters(results_dir):
    row = ResultLog("m").add_measurement(bench(lambda: None, repeats=3), n=7)
    assert row["n"] == 7 and row["runs"] == 3 and row["median_s"] >= 0


def test_corrupt_file_is_a_clear_error_and_left_untouched(results_dir):
    results_dir.mkdir(parents=True)
    bad = results_dir / "broken.csv"
    bad.write_bytes(b"\xff\xfe\x00garbage\x00\n\x01")
    with pytest.raises(ResultsFileError, match="move it aside"):
        ResultLog("broken").add(size=1)
    assert bad.read_bytes() == b"\xff\xfe\x00garbage\x00\n\x01"


def test_older_schema_is_refused_and_kept(results_dir):
    results_dir.mkdir(parents=True)
    old = results_dir / "old.csv"
    old.write_text("size,seconds\n1,0.5\n")
    with pytest.raises(ResultsFileError, match="not written by this version"):
        ResultLog("old")
    assert old.read_text() == "size,seconds\n1,0.5\n"


def test_future_schema_is_refused(results_dir):
    log = ResultLog("future")
    log.add(size=1)
    text = log.path.read_text().replace("\n1,", "\n9,", 1)
    log.path.write_text(text)
    with pytest.raises(ResultsFileError, match="schema 9"):
        ResultLog("future")


def test_missing_reference_is_an_empty_frame():
    assert reference("no_such_experiment").empty
    assert reference_provenance("no_such_experiment") == {}


def test_reference_refuses_quick_rows(results_dir, monkeypatch):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    log = ResultLog("q")
    log.add(size=1)
    with pytest.raises(ResultsFileError, match="quick-mode"):
        add_reference(log.path, command="make course")


def test_reference_round_trip_with_provenance(results_dir, monkeypatch, tmp_path):
    import gpulab.results as results

    monkeypatch.setattr(results, "REFERENCE_DIR", tmp_path / "reference")
    monkeypatch.setattr(results, "environment", lambda device=None: {
        "schema": 1, "host": "h", "device": "cuda:0", "device_name": "Some GPU", "driver": "1.0",
        "torch": "2.x", "cuda": "12", "quick": False})
    log = ResultLog("full")
    log.add(size=1, seconds=0.1)
    add_reference(log.path, command="gpulab course notebooks/00.ipynb")
    assert reference("full")["device_name"].tolist() == ["Some GPU"]
    provenance = reference_provenance("full")
    assert provenance["devices"] == ["Some GPU"] and provenance["command"].startswith("gpulab course")


def test_cli_reference_add(results_dir, monkeypatch, tmp_path, capsys):
    import gpulab.results as results
    from gpulab.commands import cli

    monkeypatch.setattr(results, "REFERENCE_DIR", tmp_path / "reference")
    monkeypatch.setenv("GPULAB_QUICK", "1")
    log = ResultLog("quick_rows")
    log.add(size=1)
    assert cli.main(["reference", "add", str(log.path), "--command", "make course"]) == 2
    assert "quick-mode" in capsys.readouterr().err


def test_reference_for_says_where_the_results_come_from(capsys):
    from gpulab import reference_for

    ref = reference_for("01_copy_bandwidth")
    out = capsys.readouterr().out
    assert not ref.empty and "H100" in out and "torch 2.11" in out and "gpulab course" in out


def _gpu_environment(monkeypatch, tmp_path, **changes):
    import gpulab.results as results

    monkeypatch.setattr(results, "REFERENCE_DIR", tmp_path / "reference")
    monkeypatch.setattr(results, "environment", lambda device=None: {
        "schema": 1, "host": "h", "device": "cuda:0", "device_name": "Some GPU", "driver": "1.0",
        "torch": "2.x", "cuda": "12", "quick": False, **changes})


@pytest.mark.parametrize("changes", [{"device": "cpu", "device_name": "CPU"}, {"device": "mps"}, {"quick": True}])
def test_reference_refuses_rows_not_measured_on_a_gpu_in_full_mode(results_dir, monkeypatch, tmp_path, changes):
    _gpu_environment(monkeypatch, tmp_path)
    log = ResultLog("mixed")
    log.add(size=1)
    _gpu_environment(monkeypatch, tmp_path, **changes)
    log.add(size=2)
    with pytest.raises(ResultsFileError, match="not measured on a GPU|quick-mode"):
        add_reference(log.path, command="make course")
    assert not (tmp_path / "reference").exists()


def test_provenance_is_valid_json_when_cells_are_empty(results_dir, monkeypatch, tmp_path):
    import json

    _gpu_environment(monkeypatch, tmp_path, driver="")
    log = ResultLog("nodriver")
    log.add(size=1)
    add_reference(log.path, command="make course")
    text = (tmp_path / "reference" / "nodriver.json").read_text()
    assert "NaN" not in text and json.loads(text)["drivers"] == []


@pytest.mark.parametrize("name", ["../../x", "a/b", "/tmp/x", "..", "", "a\\b"])
def test_result_names_are_plain_names(results_dir, name):
    with pytest.raises(ValueError, match="plain name"):
        ResultLog(name)
    assert not results_dir.exists()


def test_a_name_with_dots_and_dashes_is_fine(results_dir):
    assert ResultLog("lesson-01.v2").add(size=1) and (results_dir / "lesson-01.v2.csv").exists()


def test_a_writer_killed_mid_row_leaves_a_torn_row_that_is_set_aside(results_dir, capsys):
    import signal
    import subprocess

    log = ResultLog("torn")
    log.add(size=1, note="x")
    writer = ("import os, sys, time\nf = open(sys.argv[1], 'a')\nf.write('1,2026-01-01,host,cpu,CP')\n"
              "f.flush()\nprint('written', flush=True)\ntime.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", writer, str(log.path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "written"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not log.path.read_text().endswith("\n")
    log.add(size=2, note="y")
    assert "cut-off row" in capsys.readouterr().err
    frame = ResultLog("torn").frame()
    assert frame["size"].tolist() == [1, 2] and frame["note"].tolist() == ["x", "y"]
    assert (results_dir / "torn.csv.torn").read_text() == "1,2026-01-01,host,cpu,CP\n"


def test_a_torn_header_is_set_aside_and_a_new_file_starts(results_dir, capsys):
    results_dir.mkdir(parents=True)
    (results_dir / "cut.csv").write_text("schema,recorded_at,ho")
    ResultLog("cut").add(size=3)
    assert ResultLog("cut").frame()["size"].tolist() == [3]
    assert (results_dir / "cut.csv.torn").read_text() == "schema,recorded_at,ho\n"


def test_reference_add_keeps_other_gpus_rows_and_replaces_its_own(results_dir, monkeypatch, tmp_path):
    for gpu, sizes in [("GPU A", [1, 2]), ("GPU B", [3]), ("GPU A", [4])]:
        _gpu_environment(monkeypatch, tmp_path, device_name=gpu)
        log = ResultLog(f"sweep_{gpu[-1]}_{sizes[0]}")
        for size in sizes:
            log.add(size=size)
        add_reference(log.path, command=f"run on {gpu}", name="sweep")
    shipped = reference("sweep")
    assert sorted(zip(shipped["device_name"], shipped["size"])) == [("GPU A", 4), ("GPU B", 3)]
    assert reference_provenance("sweep")["devices"] == ["GPU A", "GPU B"]


# ---------------------------------------------------------------- the machine's state beside each row


def test_each_row_records_the_load_and_cores_and_an_empty_caveat(results_dir, capsys):
    log = ResultLog("quiet")
    row = log.add(size=1, seconds=0.5)
    assert (row["load_avg"], row["cpu_cores"], row["caveat"]) == (0.5, 4, "")
    assert "sm_clock_mhz" not in row and "throttle" not in row  # a CPU row has no GPU readings
    frame = log.frame()
    assert frame["load_avg"].tolist() == [0.5] and frame["caveat"].isna().all()
    assert capsys.readouterr().err == ""


def test_a_row_measured_on_an_oversubscribed_cpu_says_so_once(results_dir, monkeypatch, capsys):
    machine(monkeypatch, 3.1, 2)
    log = ResultLog("busy")
    first, second = log.add(size=1), log.add(size=2)
    expected = "the CPU was oversubscribed (load average 3.1 on 2 cores)"
    assert first["caveat"] == second["caveat"] == expected
    assert log.frame()["caveat"].tolist() == [expected, expected]
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and expected in err and "busy.csv" in err


def test_a_row_records_the_gpu_state_of_its_measurement_not_of_the_moment_it_is_written(results_dir, monkeypatch,
                                                                                        tmp_path):
    """All 18 rows of lesson 08's path on the H200 carried one snapshot, taken as each row was written: a row without
    the state of its measurement records the CPU's load and no GPU state at all."""
    _gpu_environment(monkeypatch, tmp_path)
    with fake_libnvml.installed(fake_libnvml.h200(reasons=SW_POWER_CAP | HW_THERMAL)) as library:
        row = ResultLog("gpu", device="cuda:0").add(size=1)
        measured = Conditions(load_avg=0.5, cpu_cores=4, gpu=True, sm_clock_mhz=1700, sm_clock_low_mhz=1515,
                              sm_clock_high_mhz=1980, sm_clock_max_mhz=1980, throttle=("SW power cap",))
        watched = ResultLog("gpu", device="cuda:0").add(conditions=measured, size=2)
    assert library.calls == []  # the row's own measurement's state, not NVML's at the moment it was written
    assert "throttle" not in row and "sm_clock_mhz" not in row and row["caveat"] == ""
    assert set(CONDITION_COLUMNS) <= set(watched) and watched["throttle"] == "SW power cap"
    assert (watched["sm_clock_low_mhz"], watched["sm_clock_high_mhz"]) == (1515, 1980)
    assert watched["caveat"] == ("the GPU ran at its power limit (SW power cap; SM clock 1515–1980 MHz of 1980), as "
                                 "long, dense work does")
    frame = ResultLog("gpu").frame()
    assert frame["throttle"].fillna("").tolist() == ["", "SW power cap"]


def test_a_comparison_row_carries_the_state_over_its_pairs(results_dir):
    measured = Conditions(load_avg=3.0, cpu_cores=2, gpu=True, sm_clock_low_mhz=1400, sm_clock_high_mhz=1900,
                          throttle=("SW power cap",))
    c = Comparison.of([2.0] * 6, [1.0] * 6, conditions=measured, caveats=("a note of the caller's",))
    row = ResultLog("compared").add(**c.row())
    assert row["sm_clock_low_mhz"] == 1400 and row["throttle"] == "SW power cap" and row["speedup"] == 2.0
    assert row["caveat"].split("; ")[0] == "a note of the caller's" and "oversubscribed" in row["caveat"]
    assert c.advice == "rerun on a quiet machine before trusting it"


def test_a_measurement_carrying_its_conditions_is_recorded_with_them(results_dir):
    measured = Conditions(load_avg=7.0, cpu_cores=2, gpu=True, sm_clock_mhz=1400, sm_clock_low_mhz=1400,
                          sm_clock_high_mhz=1400, throttle=("SW power cap",))
    m = types.SimpleNamespace(label="x", median=0.1, iqr=0.01, runs=5, threads=1, cache="warm", conditions=measured)
    row = ResultLog("carried").add_measurement(m, n=3)
    assert row["n"] == 3 and row["load_avg"] == 7.0 and row["sm_clock_mhz"] == 1400
    assert row["caveat"] == ("the CPU was oversubscribed (load average 7.0 on 2 cores); "
                             "the GPU ran at its power limit (SW power cap; SM clock 1400 MHz), as long, dense work does")
    plain = ResultLog("plain").add_measurement(bench(lambda: None, repeats=2), n=3)  # no conditions: the state now
    assert plain["load_avg"] == 0.5 and plain["caveat"] == ""


def test_a_field_named_like_a_condition_wins(results_dir):
    assert ResultLog("own").add(load_avg="mine")["load_avg"] == "mine"


def test_a_file_from_before_the_conditions_gains_their_columns(results_dir):
    results_dir.mkdir(parents=True)
    old = results_dir / "old_style.csv"
    old.write_text("schema,recorded_at,host,device,device_name,driver,torch,cuda,quick,size\n"
                   "1,2026-01-01T00:00:00+00:00,h,cpu,CPU,,2.x,,True,1\n")
    log = ResultLog("old_style")
    log.add(size=2)
    frame = log.frame()
    assert frame["size"].tolist() == [1, 2] and frame["load_avg"].isna().tolist() == [True, False]
    assert caveat_note(frame) == ""


def test_shipped_rows_keep_their_caveat_and_reference_for_points_at_it(results_dir, monkeypatch, tmp_path, capsys):
    from gpulab import reference_for

    _gpu_environment(monkeypatch, tmp_path)
    log = ResultLog("caveated")
    log.add(size=1)
    machine(monkeypatch, 9.0, 4)
    log.add(size=2)
    add_reference(log.path, command="make course")
    err = capsys.readouterr().err
    assert "1 of 2 rows were measured while the CPU was oversubscribed" in err and "Re-record them on an idle" in err
    shipped = reference("caveated")
    assert caveats(shipped).tolist() == ["", "the CPU was oversubscribed (load average 9.0 on 4 cores)"]
    reference_for("caveated")
    out = capsys.readouterr().out
    assert "Reference results for 'caveated'" in out and "1 of 2 rows were measured while the CPU was oversubscribed" in out


def test_rows_at_the_power_limit_ship_without_advice_to_record_them_again(results_dir, monkeypatch, tmp_path, capsys):
    """A long GEMM holds a card at its power limit: that is the card's normal state, not a machine to avoid."""
    _gpu_environment(monkeypatch, tmp_path)
    machine(monkeypatch, 0.5, 4)
    log = ResultLog("at_the_limit")
    log.add(size=1, conditions=Conditions(load_avg=0.5, cpu_cores=4, gpu=True, sm_clock_low_mhz=1500,
                                          sm_clock_high_mhz=1500, sm_clock_max_mhz=1980, gpu_power_w=695,
                                          gpu_power_limit_w=700, throttle=("SW power cap",)))
    add_reference(log.path, command="make course")
    err = capsys.readouterr().err
    assert "ran at its power limit" in err and "nothing to re-record" in err and "idle, cool" not in err


def test_reference_for_says_nothing_of_caveats_where_rows_have_none(capsys):
    from gpulab import reference_for

    reference_for("01_copy_bandwidth")  # shipped before rows carried a caveat
    assert "measured while" not in capsys.readouterr().out


def test_the_caveat_note_names_each_kind_once():
    frame = pd.DataFrame({"caveat": ["", None, "the GPU was throttled (SW power cap)",
                                     "the CPU was oversubscribed (load average 3.0 on 2 cores); "
                                     "the GPU was throttled (HW slowdown)"]})
    assert caveat_note(frame) == ("2 of 4 rows were measured while the CPU was oversubscribed or the GPU was "
                                  "throttled: read them with care (their 'caveat' column says more).")
    assert caveat_note(pd.DataFrame({"size": [1]})) == ""
