"""The stability benchmark runs: one run of lesson 06's check per answer, its table and its CSV (no timing asserted)."""

import importlib.util

import pandas as pd

from .conftest import ROOT


def test_the_benchmark_counts_passes_per_answer(results_dir, capsys, monkeypatch):
    from gpulab.questions import lesson06

    monkeypatch.setattr(lesson06, "SPEEDUP", 0.5)  # this checks the benchmark's plumbing, not this machine's speed
    spec = importlib.util.spec_from_file_location("check_stability", ROOT / "grading_benchmarks" / "check_stability.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--runs", "1", "--checks", "06q3"]) == 0
    rows = pd.read_csv(results_dir / "check_stability.csv")
    assert list(rows.answer) == ["shown solution", "baseline"] and list(rows.passed) == [True, False]
    out = capsys.readouterr().out
    assert "1/1" in out and "0/1" in out and "median speed-up" in out
