"""`gpulab reference record`: refuses without a GPU, says its plan, ships only what finished lessons measured."""

import json

import pandas as pd
import pytest

from gpulab import results
from gpulab.commands import cli, record
from gpulab.results import ResultLog, reference, reference_provenance


def test_refuses_without_a_gpu_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(record.torch.cuda, "is_available", lambda: False)
    assert cli.main(["reference", "record"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err


def test_dry_run_lists_every_lesson_and_runs_nothing(monkeypatch, capsys):
    monkeypatch.setattr(record, "record", lambda *a, **k: pytest.fail("a dry run ran the lessons"))
    assert cli.main(["reference", "record", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "notebooks/00_setup_and_diagnostics.ipynb" in out and "GPULAB_QUICK=0" in out


def test_ships_the_results_of_finished_lessons_and_the_trace(results_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(results, "REFERENCE_DIR", tmp_path / "reference")
    monkeypatch.setattr(results, "environment", lambda device=None: {
        "schema": 1, "host": "h", "device": "cuda:0", "device_name": "Some GPU", "driver": "1.0",
        "torch": "2.x", "cuda": "12", "quick": False})
    for name in ["01_sweep", "02_loader", "bench"]:
        ResultLog(name).add(size=1)
    shipped_trace = []
    monkeypatch.setattr("gpulab.traces.record", lambda path, name, command: shipped_trace.append(name) or path)
    (results_dir / "profiles").mkdir()
    (results_dir / "profiles" / "06_slow.json").write_text(json.dumps({"traceEvents": []}))

    table = record.ship(results_dir, passed={"01", "06", "bench"})

    assert isinstance(table, pd.DataFrame)
    assert not reference("01_sweep").empty and not reference("bench").empty
    assert reference("02_loader").empty  # lesson 02 did not run to its end
    assert "did not run to its end" in table.set_index("results").loc["02_loader.csv", "shipped"]
    assert shipped_trace == ["06_trace"]
    assert reference_provenance("01_sweep")["command"] == record.COMMAND
